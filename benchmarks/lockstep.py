"""Lockstep benchmark: plan_step(align="lockstep") over many agent-like steps and synth steps.

Run:  python benchmarks/lockstep.py                 (a few minutes; --quick: 3 seeds, 3 sigmas)
      python benchmarks/lockstep.py --sigmas 0.6,0.9 --seeds 5
      python benchmarks/lockstep.py --save new.json --compare old.json   (step by step)
      python benchmarks/lockstep.py --mixed --save new.json --compare old.json

Two trees: run it on each (``PYTHONPATH=TREE``, from a folder outside both, or from each tree's
``benchmarks`` folder) and ``--compare`` the second with the first's ``--save``: how many steps
changed, and every step costlier under any of the three models or with another micro-batch
count (a changed plan must be neither).

Agent regime: dp 8 x 128 samples, log-normal lengths (median 6,000 tokens, sigma 0.6 ... 1.2),
rounded and clipped to [200, 32,768], max_tokens 32,768, costs flops(dense-7b). Synth regime:
dp 8 x 1,024 samples from synth_lengths. With ``--mixed``, also `plan_hashes.py`'s 200 mixed
steps (dp 2-16, 4-256 samples per rank, caps 4,096-32,768, FLOPs or token costs), each scored
on its own workload (no aim is set for them: a table, and the step-by-step comparison).
Lockstep overhead = Σ_j max_r cost(r, j) / (Σ cost / dp), scored on the planning model and on
the same model with its L² coefficient x0.5 and x2 (the plan is made on the planning model
only). Plan times are CPU-time medians (one core).

"lower bound": no plan can do better, whatever its micro-batch count
(`rolltool.plan.partition.bound.lockstep_bound`: the long samples' slots). With few samples near
the cap (sigma 0.6) it is above 1.003 on some seeds, and the aim cannot hold there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

from rolltool.input.synth import synth_lengths
from rolltool.plan.partition import metrics, plan_step
from rolltool.plan.workload import Workload, make_workload

DP, PER_RANK, CAP = 8, 128, 32768
SCALES = (1.0, 0.5, 2.0)
"""The planning model, then its L² coefficient halved and doubled."""


def agent_lengths(n: int, seed: int, sigma: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(6000), sigma, n)), 200, CAP).astype(np.int64)


def lower_bound(lengths: np.ndarray, wl: Workload, dp: int, cap: int) -> float:
    """overhead - 1 that no plan beats (`lockstep_bound`). Only for a workload without a
    per-sample constant (``c = 0``, as this benchmark's): a bin of many short samples pays ``c``
    for each, which the bound does not count."""
    # imported here: plan_hashes.py imports this module, and runs on trees older than the bound
    from rolltool.plan.partition.bound import lockstep_bound

    if wl.c:
        raise ValueError(f"lower_bound needs a workload with c = 0, got c = {wl.c}")
    return lockstep_bound(lengths, a=wl.a, b=wl.b, dp=dp, cap=cap)


def run(lengths: np.ndarray, wl: Workload, dp: int = DP, cap: int = CAP) -> dict[str, float]:
    """One step planned (lockstep, ``max_tokens=cap``): its plan CPU ms, micro-batches past
    FFD's (``dM``), and per model its lockstep overhead (``x1.0`` ...) and lower bound."""
    t = time.process_time()
    plan = plan_step(lengths, dp=dp, max_tokens=cap, workload=wl)
    ms = (time.process_time() - t) * 1e3
    out = {"ms": ms, "dM": plan.num_micro_batches - (plan.ffd_micro_batches or 0)}
    for f in SCALES:
        scored = dataclasses.replace(wl, b=wl.b * f)
        x = metrics.grid_costs(plan.micro_batches, scored.cost(lengths))
        out[f"x{f}"] = metrics.lockstep_overhead(x)
        out[f"lb{f}"] = 1.0 + lower_bound(lengths, scored, dp, cap)
    return out


def table(rows: dict[str, list[dict[str, float]]], what: str) -> list[dict[str, float]]:
    print(f"\n## {what}\n")
    head = ["regime", "steps", "worst", "median", "> 1.003", "lower bound (worst)",
            "worst x0.5 L²", "worst x2 L²", "> 1.008 (either)", "M - FFD (max)", "plan CPU ms"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    every = []
    for name, rs in rows.items():
        every += rs
        x1 = [r["x1.0"] for r in rs]
        misfit = sum(max(r["x0.5"], r["x2.0"]) > 1.008 for r in rs)
        print(f"| {name} | {len(rs)} | {max(x1):.4f} | {statistics.median(x1):.4f} | "
              f"{sum(v > 1.003 for v in x1)} | {max(r['lb1.0'] for r in rs):.4f} | "
              f"{max(r['x0.5'] for r in rs):.4f} | {max(r['x2.0'] for r in rs):.4f} | {misfit} | "
              f"{max(r['dM'] for r in rs):+.0f} | {statistics.median(r['ms'] for r in rs):.0f} |",
              flush=True)  # fmt: skip
    return every


def targets(every: list[dict[str, float]], what: str) -> None:
    over = sum(r["x1.0"] > 1.003 for r in every)
    bound = sum(r["lb1.0"] > 1.003 for r in every)
    reachable = [r for r in every if r["lb1.0"] <= 1.003]
    miss = sum(r["x1.0"] > 1.003 for r in reachable)
    misfit = sum(max(r["x0.5"], r["x2.0"]) > 1.008 for r in every)
    mb = max(r["dM"] for r in every)
    print(f"\n- {what}: lockstep <= 1.003 on {len(every) - over} of {len(every)} steps "
          f"({_met(not over)}); the lower bound is above 1.003 on {bound}; of the others "
          f"{miss} miss ({_met(not miss)})")  # fmt: skip
    print(f"- {what}: <= 1.008 with the L² coefficient x0.5 and x2: {len(every) - misfit} of "
          f"{len(every)} ({_met(not misfit)}); micro-batches at most FFD's + 1: worst "
          f"{mb:+.0f} ({_met(mb <= 1)})")  # fmt: skip


def compare(now: dict[str, list[dict[str, float]]], path: str) -> None:
    """Step by step against a ``--save``d run: how many steps were compared, changed, got
    costlier under any of the three models or changed micro-batch count; and the steps the saved
    run lacks (other sigmas, fewer seeds), named rather than silently left out."""
    with open(path) as f:
        before = json.load(f)
    changed = costlier = recounted = compared = 0
    unmatched = []  # steps of this run the saved one lacks (other sigmas or fewer seeds)
    for name, rs in now.items():
        old = before.get(name, [])
        if len(rs) > len(old):
            unmatched.append(f"{name} ({len(rs) - len(old)} of {len(rs)})")
        for seed, (r, o) in enumerate(zip(rs, old, strict=False)):
            compared += 1
            keys = [f"x{f}" for f in SCALES]
            changed += any(r[k] != o[k] for k in keys)
            worse = [k for k in keys if r[k] > o[k] * (1 + 1e-12)]
            costlier += bool(worse)
            recounted += r["dM"] != o["dM"]
            if worse:
                print(f"- {name} seed {seed}: costlier under {', '.join(worse)}")
            if r["dM"] != o["dM"]:
                print(f"- {name} seed {seed}: M - FFD {o['dM']:+.0f} -> {r['dM']:+.0f}, "
                      f"x1.0 {o['x1.0']:.5f} -> {r['x1.0']:.5f}")  # fmt: skip
    print(f"\n- against {path}: {compared} steps compared, {changed} changed, {costlier} costlier "
          f"under any model, {recounted} with another micro-batch count")  # fmt: skip
    if unmatched:
        print(f"- NOT compared (not in {path}): {', '.join(unmatched)}")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds, sigmas 0.6, 0.9, 1.2")
    parser.add_argument("--sigmas", default="0.6,0.7,0.8,0.9,1.0,1.1,1.2")
    parser.add_argument("--seeds", type=int, default=20, help="agent steps per sigma")
    parser.add_argument("--synth-seeds", type=int, default=5, help="synth steps (dp 8 x 1,024)")
    parser.add_argument("--mixed", action="store_true", help="also plan_hashes.py's mixed steps")
    parser.add_argument("--save", help="write every step's scores to this JSON file")
    parser.add_argument("--compare", help="compare step by step with a --save'd JSON file")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sigmas = [0.6, 0.9, 1.2] if args.quick else [float(s) for s in args.sigmas.split(",")]
    seeds = 3 if args.quick else args.seeds
    wl = make_workload("flops", model="dense-7b")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, one core; {wl.describe()}")
    rows = {
        f"agent sigma {s}": [
            run(agent_lengths(DP * PER_RANK, seed, s), wl) for seed in range(seeds)
        ]
        for s in sigmas
    }
    every = table(rows, f"agent steps (dp {DP} x {PER_RANK}, median 6,000, {seeds} seeds each)")
    synth = {
        "synth": [
            run(synth_lengths(DP * 1024, seed=100 + s, max_len=CAP), wl)
            for s in range(1 if args.quick else args.synth_seeds)
        ]
    }
    targets(every, "agent")
    if synth["synth"]:
        targets(table(synth, f"synth steps (dp {DP} x 1,024, synth_lengths)"), "synth")
    if args.mixed:
        from plan_hashes import regimes  # plan_hashes imports this module: not at the top

        mixed = {"mixed": [run(length, w, dp, cap) for length, dp, cap, w in regimes()["mixed"]]}
        table(mixed, "mixed steps (plan_hashes.py: dp 2-16, caps 4,096-32,768, FLOPs or tokens)")
        synth |= mixed
    if args.save:
        with open(args.save, "w") as f:
            json.dump({**rows, **synth}, f)
    if args.compare:
        compare({**rows, **synth}, args.compare)


if __name__ == "__main__":
    main()
