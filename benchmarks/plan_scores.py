"""Benchmark check: each lockstep plan's overhead under three cost models, and a step-by-step comparison with a saved run.

    python benchmarks/plan_scores.py OUT.json [--regimes agent synth mixed] [--compare OLD.json]

The steps of `lockstep.py`'s agent regime (dp 8 x 128 log-normal lengths, sigma 0.6-1.2, 20 seeds)
and `plan_hashes.py`'s synth and mixed regimes, each planned by this tree's ``plan_step``; per
step: its micro-batch count, first-fit decreasing's, the plan's CPU ms and its lockstep overhead
under the planning model and with the L^2 coefficient x0.5 and x2 (`partition.metrics`). Run it on
two trees (``PYTHONPATH=TREE``, from that tree's ``benchmarks`` folder) and ``--compare`` the
second with the first's OUT.json: how many steps changed, and every step that is costlier under
any model or has another micro-batch count (a changed plan must be neither).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from lockstep import agent_lengths
from plan_hashes import regimes

from rolltool.plan.partition import metrics, plan_step
from rolltool.plan.workload import make_workload

MODELS = (1.0, 0.5, 2.0)


def cases(which: list[str]) -> list[tuple[str, Any, int, int, Any]]:
    workload = make_workload("flops", model="dense-7b")
    out: list[tuple[str, Any, int, int, Any]] = []
    if "agent" in which:
        for sigma in (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2):
            for seed in range(20):
                out.append((f"agent {sigma} {seed}", agent_lengths(1024, seed, sigma), 8, 32768,
                            workload))  # fmt: skip
    known = regimes()
    for name in ("synth", "mixed"):
        if name in which:
            out += [(f"{name} {i}", *case) for i, case in enumerate(known[name])]
    return out


def score(length: Any, dp: int, cap: int, workload: Any) -> dict[str, Any]:
    t = time.process_time()
    plan = plan_step(length, dp=dp, max_tokens=cap, workload=workload)
    out: dict[str, Any] = {"ms": (time.process_time() - t) * 1e3, "M": plan.num_micro_batches,
           "ffd": plan.ffd_micro_batches}  # fmt: skip
    for f in MODELS:
        model = dataclasses.replace(workload, b=workload.b * f)
        grid = metrics.grid_costs(plan.micro_batches, model.cost(length))
        out[f"x{f}"] = metrics.lockstep_overhead(grid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--regimes", nargs="+", default=["agent", "synth", "mixed"])
    ap.add_argument("--compare", help="a saved OUT.json of another tree")
    args = ap.parse_args()
    got = {name: score(*case) for name, *case in cases(args.regimes)}
    with open(args.out, "w") as f:
        json.dump(got, f)
    print(f"{len(got)} steps scored -> {args.out}")
    if not args.compare:
        return
    with open(args.compare) as f:
        old = json.load(f)
    both = [k for k in got if k in old]
    keys = [f"x{m}" for m in MODELS]
    changed = [k for k in both if any(got[k][x] != old[k][x] for x in keys)]
    worse = [k for k in changed if any(got[k][x] > old[k][x] for x in keys)]
    recount = [k for k in both if got[k]["M"] != old[k]["M"]]
    print(f"compared {len(both)} steps ({len(got) - len(both)} not in {args.compare}): "
          f"{len(changed)} changed, {len(worse)} costlier under some model, "
          f"{len(recount)} with another micro-batch count")  # fmt: skip
    for k in sorted(set(worse) | set(recount)):
        row = ", ".join(f"{x} {old[k][x]:.6f} -> {got[k][x]:.6f}" for x in keys)
        print(f"  {k}: {row}; M {old[k]['M']} -> {got[k]['M']}")
    if changed:
        gain = sum(old[k]["x1.0"] - got[k]["x1.0"] for k in changed) / len(changed)
        print(f"mean planning-model change over the changed steps: {-gain:+.2e}")


if __name__ == "__main__":
    main()
