"""Benchmark: long samples split over context-parallel GPUs (--cp) against dropping them.

    python benchmarks/longctx.py [--groups 2048] [--budget 32768] [--dp 8] [--cp 2 4]
                                 [--drop-dp 32] [--batch-size 1024] [--envs agent]
                                 [--max-len 131072] [--hybrid]

On a heavy-tailed agent dataset (``rolltool synth --envs agent --max-len 131072 --groups N
--seed 1``, cached under /tmp), packs the same input at the same per-GPU budget B
(--micro-batch-tokens) and --dp, once without a split and ``--overlong drop`` (what a trainer
without CP can do with a sample over B: lose it), and once per --cp C (a sample may occupy up to
B x C tokens padded to a multiple of 2C; ``--overlong drop`` there too, so that any sample over
even that is counted, not an error); and once more dropping at --drop-dp ranks (default dp x
the largest C: as many GPUs as that CP run, each with its own micro-batches). ``--keep-last``
throughout, so every sample is either trained or lost to --overlong drop. With --hybrid, also
``--cp C --hybrid-cp`` for the largest C (a CP degree per sample, `rolltool.plan.hybrid`). Each pack runs in this
process (rolltool.jobs.pack.run_pack with PackConfig.from_options) into a temp folder, is read back
(manifest, samples.parquet, rolltool.stats.packed_stats) and deleted. Prints one markdown table,
a column per layout:

  GPUs                      dp x C
  steps                     optimizer steps written (--batch-size counts rollouts with a
                            trained sample: dropping samples can merge steps)
  samples / tokens trained  trained samples and their sampled tokens (share of the input's)
  lost to --overlong drop   samples and sampled tokens dropped as over-long, overall and per env
  over the per-GPU budget   trained samples longer than B: trainable only because CP split them
  micro-batches per rank    mean over steps (the plan's)
  lockstep overhead         mean over steps of the plan records' Σ_j max_r x(r, j) / (Σ x / dp),
                            in the workload's cost and in tokens (+0% when perfect)
  ... per GPU, ring         mean over steps of Σ_j max_g c(g, j) / (Σ c / GPUs) over every GPU g,
                            c the per-GPU cost with the ring's exposed communication
                            (`RingModel` defaults: 100 GB/s, 400 TFLOP/s): a hybrid plan's own
                            record; a --cp C pack's GPUs each 1/C of the micro-batch plus the
                            exposed ring of each of its samples over C GPUs
  step time vs lower bound  for the CP layouts: Σ over steps of Σ_j max_g c(g, j) (the row
                            above's) over Σ over steps of `rolltool.plan.hybrid_bound.lower_bound`
                            for dp groups of C GPUs: what no layout of those samples on those
                            GPUs, hybrid or not, beats (1.000)
  CP-split tokens           tokens of samples split over 2 or more GPUs (share of the input's)
  CP padding                the samples' padding to a multiple of 2C, share of the row tokens
  token fill                mean over steps of the plan's tokens / (dp · M · group budget)
  step time per GPU         Σ over steps of the modelled step time (Σ_j max_r per-GPU cost:
                            the plan's workload, 7B flops by default), relative to the first
                            column: more GPUs per rank share each micro-batch; "with the ring":
                            the same with the exposed ring communication (above)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from rolltool.format import Manifest
from rolltool.input.synth import SynthConfig
from rolltool.jobs.pack import run_pack
from rolltool.jobs.synth import run_synth
from rolltool.plan.config import PackConfig
from rolltool.plan.hybrid import gpu_tokens
from rolltool.plan.hybrid_bound import lower_bound
from rolltool.plan.partition import metrics
from rolltool.stats import packed_stats


def agent_dataset(groups: int, envs: tuple[str, ...], max_len: int) -> Path:
    """`rolltool synth --envs ENVS --max-len MAX_LEN --groups N --seed 1`, generated once."""
    name = f"rolltool-bench-longctx-{'-'.join(envs)}-{max_len}-{groups}.parquet"
    path = Path(tempfile.gettempdir()) / name
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        run_synth(SynthConfig(groups=groups, seed=1, envs=envs, max_len=max_len), path, force=True)
    return path


def measure(src: Path, out: Path, **options: Any) -> dict[str, Any]:
    """Pack `src` with `options` into `out`, read back what the table shows, delete `out`."""
    config = PackConfig.from_options(overlong="drop", keep_last=True, **options)
    manifest: Manifest = run_pack([str(src)], out, config, command=["benchmarks/longctx.py"])
    report = packed_stats(out, alternatives=False).report
    samples = pl.read_parquet(out / "samples.parquet", columns=["env", "status", "length"])
    ring = ring_figures(out, manifest, config, report)
    ring["bound"] = step_bounds(out, config) if config.cp > 1 else None
    shutil.rmtree(out)
    plans = [s.plan for s in manifest.steps]
    by_status = samples.group_by("env", "status").agg(n=pl.len(), tokens=pl.col("length").sum())

    def lost(env: str | None) -> tuple[int, int]:
        rows = by_status.filter(pl.col("status") == "overlong_dropped")
        if env is not None:
            rows = rows.filter(pl.col("env") == env)
        return int(rows["n"].sum()), int(rows["tokens"].sum())

    def mean(values: list[float | None]) -> float:
        xs = [x for x in values if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    envs = sorted(samples["env"].unique().to_list())
    return {
        "gpus": report["world"]["gpus"],
        "dp": report["world"]["dp"],
        "group_budget": report["world"]["group_budget"],
        "steps": manifest.num_steps,
        "samples": manifest.samples.trained,
        "input_samples": samples.height,
        "tokens": sum(s.sampled_tokens for s in manifest.steps),
        "input_tokens": int(samples["length"].sum()),
        "lost": lost(None),
        "lost_env": {env: lost(env) for env in envs},
        "over_gpu_budget": sum(s.over_gpu_budget for s in manifest.steps),
        "micro_batches": mean([p.micro_batches_per_rank for p in plans]),
        "lockstep_cost": mean([p.lockstep_overhead_cost for p in plans]),
        "lockstep_tokens": mean([p.lockstep_overhead_tokens for p in plans]),
        "cp_padding": report["totals"]["cp_padding_fraction"],
        "token_fill": mean([p.token_fill for p in plans]),
        "step_cost": report["totals"]["step_cost"],
        **ring,
    }


def step_bounds(out: Path, config: PackConfig) -> float:
    """Σ over steps of the hybrid lower bound of the step's trained samples on dp x cp GPUs."""
    t = pl.read_parquet(out / "samples.parquet", columns=["step", "status", "length"])
    t = t.filter(pl.col("status") == "trained")
    wl = config.workload()
    ring = PackConfig(dp=1, cp=config.cp, hybrid_cp=True).ring(wl)
    budget = config.micro_batch_tokens
    assert budget is not None
    return sum(
        lower_bound(part["length"].to_numpy(), dp=config.dp, cp=config.cp, max_tokens=budget,
                    workload=wl, ring=ring)
        for _, part in t.group_by("step", maintain_order=True)
    )  # fmt: skip


def ring_figures(
    out: Path, manifest: Manifest, config: PackConfig, report: dict[str, Any]
) -> dict[str, Any]:
    """Per-GPU lockstep overhead and step time with the ring's exposed communication, and the
    CP-split tokens: a hybrid pack's from its records and samples.parquet (`stats`), a --cp C
    pack's from samples.parquet (each GPU of a group: 1/C of every sample's padded cost plus
    its exposed ring over C GPUs), a pack without CP's as recorded (no ring)."""
    cols = ["step", "rank", "micro_batch", "length"]
    t = pl.read_parquet(out / "samples.parquet").filter(pl.col("status") == "trained")
    if config.hybrid_cp:
        split = int(t.filter(pl.col("cp_degree") > 1)["length"].sum())
        steps = report["steps"]
        return {"gpu_lockstep": float(np.mean([s["hybrid"]["gpu_lockstep_overhead"] for s in steps])),
                "ring_step_cost": report["totals"]["hybrid"]["gpu_step_cost"], "split_tokens": split}  # fmt: skip
    t = t.select(cols)
    wl = config.workload()
    if config.cp == 1:
        plans = [s.plan for s in manifest.steps]
        return {"gpu_lockstep": float(np.mean([p.lockstep_overhead_cost for p in plans])),
                "ring_step_cost": report["totals"]["step_cost"], "split_tokens": 0}  # fmt: skip
    cp = config.cp
    ring = PackConfig(dp=1, cp=cp, hybrid_cp=True).ring(wl)
    overheads, total = [], 0.0
    for (step,), part in t.group_by("step", maintain_order=True):
        m = manifest.steps[int(step)].plan.micro_batches_per_rank  # type: ignore[call-overload]
        length = part["length"].to_numpy()
        k = np.full(len(length), cp)
        c = wl.cost(gpu_tokens(length, k) * cp) / cp + ring.exposed(length, k, wl.b)
        grid = np.zeros((manifest.dp, m))
        np.add.at(grid, (part["rank"].to_numpy(), part["micro_batch"].to_numpy()), c)
        overheads.append(metrics.lockstep_overhead(grid))
        total += metrics.lockstep_cost(grid)
    return {"gpu_lockstep": float(np.mean(overheads)), "ring_step_cost": total,
            "split_tokens": int(t["length"].sum())}  # fmt: skip


def _share(part: int, whole: int) -> str:
    return f"{part:,} ({part / whole:.1%})" if whole else f"{part:,}"


def table(names: list[str], runs: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one row per figure, one column per layout."""
    base = runs[0]["step_cost"]
    rows: list[tuple[str, list[str]]] = [
        ("GPUs (dp x cp)", [f"{r['gpus']:,}" for r in runs]),
        ("dp (data-parallel ranks)", [f"{r['dp']:,}" for r in runs]),
        ("group budget (tokens)", [f"{r['group_budget']:,}" for r in runs]),
        ("steps", [f"{r['steps']:,}" for r in runs]),
        ("samples trained", [_share(r["samples"], r["input_samples"]) for r in runs]),
        ("tokens trained", [_share(r["tokens"], r["input_tokens"]) for r in runs]),
        ("samples lost to --overlong drop", [_share(r["lost"][0], r["input_samples"]) for r in runs]),
        ("tokens lost to --overlong drop", [_share(r["lost"][1], r["input_tokens"]) for r in runs]),
    ]  # fmt: skip
    envs = list(runs[0]["lost_env"])
    if len(envs) > 1:
        for env in envs:
            cells = [f"{r['lost_env'][env][0]:,} / {r['lost_env'][env][1]:,}" for r in runs]
            rows.append((f"  {env}: samples / tokens lost", cells))
    rows += [
        ("trained over the per-GPU budget (split)", [f"{r['over_gpu_budget']:,}" for r in runs]),
        ("micro-batches per rank (mean)", [f"{r['micro_batches']:.1f}" for r in runs]),
        ("lockstep overhead, cost (mean)", [f"{r['lockstep_cost'] - 1:+.2%}" for r in runs]),
        ("lockstep overhead, tokens (mean)", [f"{r['lockstep_tokens'] - 1:+.2%}" for r in runs]),
        ("lockstep overhead per GPU, ring (mean)", [f"{r['gpu_lockstep'] - 1:+.2%}" for r in runs]),
        ("step time vs lower bound", [f"{r['ring_step_cost'] / r['bound']:.3f}" if r["bound"]
                                      else "—" for r in runs]),
        ("CP-split tokens", [_share(r["split_tokens"], r["input_tokens"]) for r in runs]),
        ("CP padding (of row tokens)", [f"{r['cp_padding']:.3%}" for r in runs]),
        ("token fill (mean)", [f"{r['token_fill']:.1%}" for r in runs]),
        ("step time per GPU (modelled, vs first)", [f"{r['step_cost'] / base:.2f}x" for r in runs]),
        ("... with the ring (vs first)", [f"{r['ring_step_cost'] / base:.2f}x" for r in runs]),
    ]  # fmt: skip
    out = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--envs", default="agent")
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=32768, help="--micro-batch-tokens (per GPU)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cp", type=int, nargs="*", default=[2, 4])
    ap.add_argument(
        "--drop-dp",
        type=int,
        nargs="*",
        default=None,
        help="also drop at these dp (default: dp x the largest --cp)",
    )
    ap.add_argument("--batch-size", type=int, default=1024, help="rollouts per step")
    ap.add_argument("--hybrid", action="store_true", help="also --cp C --hybrid-cp, C the largest")
    args = ap.parse_args()

    envs = tuple(args.envs.split(","))
    src = agent_dataset(args.groups, envs, args.max_len)
    common = {"micro_batch_tokens": args.budget, "batch_size": args.batch_size}
    drop_dp = args.drop_dp if args.drop_dp is not None else [args.dp * max(args.cp, default=1)]
    widest = max(args.cp, default=1)
    hybrid = [(f"--cp {widest} --hybrid-cp", {"dp": args.dp, "cp": widest, "hybrid_cp": True})]
    hybrid = hybrid if args.hybrid and widest > 1 else []
    layouts = [
        ("--overlong drop", {"dp": args.dp}),
        *((f"--cp {c}", {"dp": args.dp, "cp": c}) for c in args.cp),
        *hybrid,
        *((f"drop, --dp {d}", {"dp": d}) for d in drop_dp if d != args.dp),
    ]
    runs = []
    with tempfile.TemporaryDirectory(prefix="rolltool-longctx-") as tmp:
        for i, (name, extra) in enumerate(layouts):
            print(f"packing {name} ...", file=sys.stderr)
            runs.append(measure(src, Path(tmp) / f"out{i}", **common, **extra))
    print(f"\n## {args.groups:,} groups of synth {args.envs} (--max-len {args.max_len:,}, seed 1), "
          f"--dp {args.dp}, --micro-batch-tokens {args.budget:,} per GPU, --batch-size "
          f"{args.batch_size} rollouts, 7B flops balance, lockstep\n")  # fmt: skip
    print("\n".join(table([name for name, _ in layouts], runs)))


if __name__ == "__main__":
    main()
