"""Which plans: a hash of `plan_step`'s lockstep plans over many regimes, to show that a change
meant to be faster left every plan as it was (or which regimes it changed).

    python benchmarks/plan_hashes.py [--save PREFIX]

Regimes (lockstep): "agent" (140 steps of dp 8 x 128 log-normal samples, median 6,000, sigma 0.6 ... 1.2,
as `lockstep.py`), "synth" (5 steps of dp 8 x 1,024 from `synth_lengths`), "mixed" (200 steps:
dp 2-16, 4-256 samples per rank, caps 4,096-32,768, log-normal lengths of random spread, FLOPs
or token costs); then the mixed steps and 40 edge cases (dp 1, fewer samples than ranks, equal
and zero lengths) with each of `SETTINGS` (lockstep, equal counts, ``align="total"``, fixed
size). Prints one hash per run (of every step's micro-batches, costs, tokens and report, in
order); with ``--save PREFIX`` also writes each step's own hash to PREFIX.<regime>.<setting>, one
per line, so two runs can be compared step by step (``paste a.mixed+edge.total
b.mixed+edge.total | awk '$1 != $2 {print NR - 1}'``).
Run it from the benchmarks folder, or with ``PYTHONPATH`` naming another checkout (from a
folder outside both) to compare two trees.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

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


SETTINGS: dict[str, dict[str, Any]] = {  # the plan_step settings a regime runs with
    "lockstep": {},
    "equal": {"equal_count": True},
    "total": {"align": "total"},
    "fixed": {"micro_batch_size": 4},
}
"""Lockstep for every regime; the mixed one also with equal counts, ``align="total"`` and fixed
micro-batches of 4 (with the edge cases: dp 1, fewer samples than ranks)."""


def edge_cases() -> list[Case]:
    """Small steps the regimes miss: dp 1, fewer samples than ranks, equal and zero lengths."""
    flops = make_workload("flops")
    out = []
    for s in range(40):
        rng = np.random.default_rng(1000 + s)
        dp, n = int(rng.choice([1, 3, 8])), int(rng.integers(0, 12))
        length = rng.choice([0, 1, 8, 32, 64], n) if s % 2 else np.full(n, 16)
        out.append((length.astype(np.int64), dp, 64, flops))
    return out


def step_hash(plan: StepPlan) -> str:
    """Of every micro-batch (indices and dtype), the recorded costs and tokens (their bytes: an
    ulp counts), and the report."""
    h = hashlib.sha256()
    for row in plan.micro_batches:
        for mb in row:
            h.update(mb.tobytes() + str(mb.dtype).encode() + b"|")
    h.update(plan.costs.tobytes() + plan.tokens.tobytes() + plan.empty.tobytes())
    h.update(repr(plan.to_dict()).encode())
    return h.hexdigest()[:8]


def _plan(length: np.ndarray, dp: int, cap: int, wl: Workload, how: str) -> StepPlan:
    kw = dict(SETTINGS[how])
    if how == "equal":
        length = length[: len(length) // dp * dp]
    if how != "fixed":
        kw["max_tokens"] = cap
    return plan_step(length, dp=dp, workload=wl, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write each step's hash to SAVE.<regime>")
    args = ap.parse_args()
    every = regimes()
    runs = [(name, cases, "lockstep") for name, cases in every.items()]
    runs += [("mixed+edge", every["mixed"] + edge_cases(), how) for how in SETTINGS]
    for name, cases, how in runs:
        hashes = [step_hash(_plan(length, dp, cap, wl, how)) for length, dp, cap, wl in cases]
        digest = hashlib.sha256("".join(hashes).encode()).hexdigest()[:12]
        print(f"{name:<10} {how:<8} {len(hashes):>4} steps  {digest}", flush=True)
        if args.save:
            with open(f"{args.save}.{name}.{how}", "w") as f:
                f.write("\n".join(hashes) + "\n")


if __name__ == "__main__":
    main()
