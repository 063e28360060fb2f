"""Benchmark: a lockstep agent step's plan CPU time, and the share of it the re-split takes.

    python benchmarks/lockstep_time.py [--sigmas 0.6,0.7,...] [--seeds 20] [--cpu N]

The agent steps of `lockstep.py` (dp 8 x 128 log-normal lengths, cap 32,768, dense-7b FLOPs)
planned by this tree's `plan_step`, with `rolltool.plan.partition.resplit.resplit` timed inside
it (process CPU time). Per sigma, medians over the seeds: the whole plan, the re-split, the plan
without it, and the median of the per-step ratios plan / plan without the re-split. The rest of
the plan is the code that ran before the re-split existed, so "without" is the plan time before
it, measured in the same process on the same steps (two runs of `lockstep.py` on a loaded machine
are not comparable to a few percent). ``--cpu N`` pins the process to core N.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from lockstep import agent_lengths

import rolltool.plan.partition.plan as plan_module
from rolltool.plan.partition import plan_step
from rolltool.plan.workload import make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sigmas", default="0.6,0.7,0.8,0.9,1.0,1.1,1.2")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--cpu", type=int, default=None)
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    workload = make_workload("flops", model="dense-7b")
    spent = [0.0]
    resplit = plan_module.resplit

    def timed(*a: object, **k: object) -> object:
        t = time.process_time()
        out = resplit(*a, **k)  # type: ignore[arg-type]
        spent[0] += time.process_time() - t
        return out

    plan_module.resplit = timed  # type: ignore[assignment]
    print(f"{'sigma':>5}  {'plan ms':>8}  {'re-split ms':>11}  {'without ms':>10}  {'ratio':>6}")
    for sigma in (float(s) for s in args.sigmas.split(",")):
        whole, part = [], []
        for seed in range(args.seeds):
            lengths = agent_lengths(1024, seed, sigma)
            spent[0] = 0.0
            t = time.process_time()
            plan_step(lengths, dp=8, max_tokens=32768, workload=workload)
            whole.append((time.process_time() - t) * 1e3)
            part.append(spent[0] * 1e3)
        rest = [a - b for a, b in zip(whole, part, strict=True)]
        ratio = statistics.median(a / r for a, r in zip(whole, rest, strict=True))
        print(f"{sigma:>5.1f}  {statistics.median(whole):>8.0f}  {statistics.median(part):>11.0f}  "
              f"{statistics.median(rest):>10.0f}  {ratio:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
