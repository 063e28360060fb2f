"""Which plans: a hash of `plan_step`'s lockstep plans over many regimes, to show that a change
meant to be faster left every plan as it was (or which regimes it changed).

    python benchmarks/plan_hashes.py [--save PREFIX]

Regimes: "agent" (140 steps of dp 8 x 128 log-normal samples, median 6,000, sigma 0.6 ... 1.2,
as `lockstep.py`), "synth" (5 steps of dp 8 x 1,024 from `synth_lengths`), "mixed" (200 steps:
dp 2-16, 4-256 samples per rank, caps 4,096-32,768, log-normal lengths of random spread, FLOPs
or token costs). Prints one hash per regime (of every step's micro-batches, in order); with
``--save PREFIX`` also writes each step's own hash to PREFIX.<regime>, one per line, so two runs
can be compared step by step (``paste a.mixed b.mixed | awk '$1 != $2 {print NR - 1}'``).
Run it from the benchmarks folder, or with ``PYTHONPATH`` naming another checkout (from a
folder outside both) to compare two trees.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
from lockstep import agent_lengths

from rolltool.input.synth import synth_lengths
from rolltool.plan.partition import StepPlan, plan_step
from rolltool.plan.workload import Workload, make_workload

Case = tuple[np.ndarray, int, int, Workload]


def regimes() -> dict[str, list[Case]]:
    flops, tokens = make_workload("flops"), make_workload("tokens")
    agent = [(agent_lengths(1024, s, 0.6 + 0.1 * (s % 7)), 8, 32768, flops) for s in range(140)]
    synth = [(synth_lengths(8 * 1024, seed=100 + s, max_len=32768), 8, 32768, flops)
             for s in range(5)]  # fmt: skip
    mixed = []
    for s in range(200):
        rng = np.random.default_rng(s)
        dp, per = int(rng.choice([2, 4, 8, 16])), int(rng.choice([4, 16, 64, 256]))
        cap = int(rng.choice([4096, 8192, 32768]))
        length = rng.lognormal(np.log(cap / 8), rng.uniform(0.3, 1.5), dp * per)
        mixed.append(
            (np.clip(length, 1, cap).astype(np.int64), dp, cap, flops if s % 2 else tokens)
        )
    return {"agent": agent, "synth": synth, "mixed": mixed}


def step_hash(plan: StepPlan) -> str:
    h = hashlib.sha256()
    for row in plan.micro_batches:
        for mb in row:
            h.update(mb.tobytes())
            h.update(b"|")
    return h.hexdigest()[:8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write each step's hash to SAVE.<regime>")
    args = ap.parse_args()
    for name, cases in regimes().items():
        hashes = [step_hash(plan_step(length, dp=dp, max_tokens=cap, workload=wl))
                  for length, dp, cap, wl in cases]  # fmt: skip
        print(
            f"{name:<6} {len(hashes):>4} steps  {hashlib.sha256(''.join(hashes).encode()).hexdigest()[:12]}"
        )
        if args.save:
            with open(f"{args.save}.{name}", "w") as f:
                f.write("\n".join(hashes) + "\n")


if __name__ == "__main__":
    main()
