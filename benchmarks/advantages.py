"""Benchmark: `rolltool advantages` against the I/O floor (pyarrow read + write of the same file).

    python benchmarks/advantages.py [--groups 4000] [--repeats 3]

Generates a synth dataset (cached under /tmp), then times, in one run and on the same file:
  floor      pyarrow.parquet.read_table + write_table (zstd), nothing else
  api        rolltool.jobs.run_advantages (read, validate, compute grpo, write), in process
  cli        `rolltool advantages` as a subprocess (adds interpreter start-up)
and prints medians and the ratio to the floor.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from _data import synth_dataset

from rolltool.advantages import AdvantageConfig
from rolltool.jobs import run_advantages


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cache = synth_dataset(args.groups)
    meta = pq.ParquetFile(cache).metadata
    out = Path(tempfile.mkdtemp()) / "out.parquet"

    def floor() -> None:
        table = pq.read_table(cache)
        pq.write_table(table, out, compression="zstd", row_group_size=65_536)

    def api() -> None:
        run_advantages([cache], out, AdvantageConfig(estimator="grpo"), force=True)

    def cli() -> None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rolltool",
                "advantages",
                str(cache),
                "-o",
                str(out),
                "--force",
                "--json",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    t_floor = _time(floor, args.repeats)
    t_api = _time(api, args.repeats)
    t_cli = _time(cli, args.repeats)
    size = cache.stat().st_size / 1e6
    print(f"input: {meta.num_rows:,} samples, {size:,.0f} MB ({cache})")
    print(f"{'what':<8}{'median s':>10}{'x floor':>10}")
    for name, t in (("floor", t_floor), ("api", t_api), ("cli", t_cli)):
        print(f"{name:<8}{t:>10.3f}{t / t_floor:>10.2f}")


if __name__ == "__main__":
    main()
