"""Benchmark: `rolltool stats` on rollout Parquet against a plain polars scan of the same columns.

    python benchmarks/stats.py [--groups 2000] [--repeats 5]

Generates a synth dataset (cached under /tmp, shared with benchmarks/advantages.py), then times,
in one run and on the same file:
  polars     pl.scan_parquet(...).select(light columns, loss_mask.list.len(), .list.sum())
             .collect(engine="streaming"): reading what stats reads, computing nothing else
  api        rolltool.stats.rollout_stats: the same read plus every statistic
  cli        `rolltool stats FILE --json` as a subprocess (adds interpreter start-up)
  validate   rolltool.schema.scan, the full validation `rolltool pack` runs (reads input_ids
             too), for scale: what stats saves by reading only the columns it needs
and prints medians and the ratio to the polars floor.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import polars as pl
import pyarrow.parquet as pq
from _data import synth_dataset

from rolltool.input.resolve import resolve_inputs
from rolltool.schema import scan
from rolltool.stats import rollout_stats

LIGHT = ["group_id", "rollout_id", "env", "reward", "finished_at"]


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run round-robin so that load on a shared machine hits
    every contender alike; one warm-up round first (page cache, imports)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    cache = synth_dataset(args.groups)
    meta = pq.ParquetFile(cache).metadata

    def polars_scan() -> None:
        mask = pl.col("loss_mask")
        pl.scan_parquet(cache).select(
            *LIGHT, mask.list.len().alias("length"), mask.list.sum().alias("trainable")
        ).collect(engine="streaming")

    def api() -> None:
        rollout_stats([str(cache)])

    def cli() -> None:
        cmd = [sys.executable, "-m", "rolltool", "stats", str(cache), "--json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)

    def validate() -> None:
        scan(resolve_inputs([cache]))

    medians = _interleaved(
        {
            "polars scan (floor)": polars_scan,
            "rollout_stats (API)": api,
            "rolltool stats --json (CLI)": cli,
            "schema.scan (pack's validation)": validate,
        },
        args.repeats,
    )
    rows = list(medians.items())
    size = cache.stat().st_size / 1e6
    print(f"input: {meta.num_rows:,} samples, {size:,.0f} MB ({cache}), {args.repeats} repeats")
    print()
    print("| what | median s | x floor |")
    print("|---|---:|---:|")
    floor = rows[0][1]
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {t / floor:.2f} |")


if __name__ == "__main__":
    main()
