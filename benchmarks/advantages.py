"""Benchmark: `rolltool advantages` against the I/O floor, in time and in peak memory.

    python benchmarks/advantages.py [--groups 4000] [--repeats 3]

Generates synth datasets of N and 2N groups (``rolltool synth --groups N --seed 1``, samples of
up to 32,768 tokens, row groups of 4,096 rows; cached under /tmp) and, on each, runs in a fresh
process per repeat:
  floor      pyarrow.parquet.read_table + write_table (zstd): the whole input in memory
  api        rolltool.jobs.advantages.run_advantages (deferred scan: light columns and loss_mask; compute
             grpo; copy row group by row group, checking input_ids and logprobs as it goes)
  workers2   the same with the row groups scanned by 2 forked processes (``--workers 2``)
  unbounded  the same with ``ROW_GROUP_BYTES`` unbounded: output row groups of 65,536 rows
             whatever their bytes, as the job wrote them before issue 12 (below 65,536 rows the
             whole input is one output row group, held in memory)
  cli        `rolltool advantages` (adds interpreter start-up and the CLI's imports)
  scan       the full scan alone (every rule, token columns decoded), as the job ran it
             before the scan was deferred
  deferred   the deferred scan alone (what the job's first pass now reads)
and prints the median seconds (floor and api timed inside their process, cli as the process's
wall time), the ratio to the floor, and the largest peak resident memory of the process
(``ru_maxrss`` from ``wait4``), next to that of a process that only imports rolltool. The job
streams the input: its peak should grow with the light columns only (a few numbers per sample,
plus the scan's id tables) and the size of one row group, not with the input's bytes as the
floor's and the unbounded variant's do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from _data import synth_dataset

FLOOR = """
import pyarrow.parquet as pq
pq.write_table(pq.read_table(IN), OUT, compression="zstd", row_group_size=65_536)
"""

API = """
from rolltool.plan.advantages import AdvantageConfig
from rolltool.jobs.advantages import run_advantages
run_advantages([IN], OUT, AdvantageConfig(estimator="grpo"), force=True)
"""

WORKERS = """
from rolltool.plan.advantages import AdvantageConfig
from rolltool.jobs.advantages import run_advantages
from rolltool.engine.local import local_mapper
run_advantages([IN], OUT, AdvantageConfig(estimator="grpo"), force=True, mapper=local_mapper(2))
"""

SCAN = """
from rolltool.jobs.advantages import ADVANTAGE_COLUMNS
from rolltool.schema import scan
from rolltool.input.resolve import resolve_inputs
scan(resolve_inputs([IN]), ignore=ADVANTAGE_COLUMNS)
"""

DEFERRED = """
from rolltool.jobs.advantages import ADVANTAGE_COLUMNS
from rolltool.schema import scan_deferred
from rolltool.input.resolve import resolve_inputs
scan_deferred(resolve_inputs([IN]), ignore=ADVANTAGE_COLUMNS)
"""

UNBOUNDED = (
    """
import rolltool.jobs.advantages
rolltool.jobs.advantages.ROW_GROUP_BYTES = 1 << 62
"""
    + API
)

TIMED = """
import json, sys, time
IN, OUT = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
{body}
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""


def _run(argv: list[str]) -> tuple[float, float, float]:
    """(seconds it reports, else its wall time; wall seconds; peak RSS in MB) of one process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            said = err.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{said}")
    inside = json.loads(out)["seconds"] if out.startswith(b'{"seconds"') else wall
    return inside, wall, usage.ru_maxrss / 1024  # Linux: kilobytes


def _measure(path: Path, folder: Path, repeats: int) -> dict[str, tuple[float, float]]:
    """Per variant: (median seconds, max peak RSS MB) over ``repeats`` fresh processes. The
    floor writes a file of its own (``--force`` replaces only files rolltool wrote)."""
    floor, out = folder / "floor.parquet", folder / "out.parquet"
    variants = {
        "floor": [sys.executable, "-c", TIMED.format(body=FLOOR), str(path), str(floor)],
        "api": [sys.executable, "-c", TIMED.format(body=API), str(path), str(out)],
        "workers2": [sys.executable, "-c", TIMED.format(body=WORKERS), str(path), str(out)],
        "unbounded": [sys.executable, "-c", TIMED.format(body=UNBOUNDED), str(path), str(out)],
        "scan": [sys.executable, "-c", TIMED.format(body=SCAN), str(path), str(out)],
        "deferred": [sys.executable, "-c", TIMED.format(body=DEFERRED), str(path), str(out)],
        "cli": [
            sys.executable,
            "-m",
            "rolltool",
            "advantages",
            str(path),
            "-o",
            str(out),
            "--force",
            "--json",
        ],
    }
    result = {}
    for name, argv in variants.items():
        runs = [_run(argv) for _ in range(repeats)]
        result[name] = (statistics.median(r[0] for r in runs), max(r[2] for r in runs))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp())
    _, _, base = _run([sys.executable, "-c", "import rolltool.jobs"])
    print(f"a process that only imports rolltool.jobs: {base:,.0f} MB peak RSS")
    print(f"{'input':<30}{'what':<11}{'median s':>10}{'x floor':>9}{'peak RSS MB':>13}")
    for groups in (args.groups, 2 * args.groups):
        path = synth_dataset(groups)
        meta = pq.ParquetFile(path).metadata
        label = f"{meta.num_rows:,} rows, {path.stat().st_size / 1e6:,.0f} MB"
        figures = _measure(path, folder, args.repeats)
        floor = figures["floor"][0]
        for name, (seconds, rss) in figures.items():
            print(f"{label:<30}{name:<11}{seconds:>10.3f}{seconds / floor:>9.2f}{rss:>13,.0f}")
            label = ""


if __name__ == "__main__":
    main()
