"""Benchmark: `rolltool pack` end to end against the I/O floor, and its peak memory.

    python benchmarks/pack.py [--groups 2000 4000] [--repeats 3] [--dp 8] [--cache-mb 1024 0]

For each synth dataset (cached under /tmp), in one run and on the same file:
  floor  read the input Parquet (pyarrow.parquet.read_table) + write as many bytes as pack's
         output holds, as raw arrays (numpy tofile) - what any packer must at least do; in a
         subprocess like pack, so both pay interpreter start-up
  pack   `rolltool pack IN --dp 8 -o OUT --force --json` in a subprocess
Prints medians, tokens/s, the ratio to the floor, and the peak RSS of each pack process, with
the default --cache-mb 1024 (decoded input kept so that data that fits is read once) and with
--cache-mb 0: then memory is bounded by a step and does not grow with the dataset.

The memory bound (rolltool.packed.writer / rolltool.pack): beyond the imports and the light columns,
pack holds the token cache (--cache-mb), the decoded tokens of two steps (the one being laid out,
the next being read), the row group being decoded (Parquet reads whole row groups: Arrow and
NumPy copies) and the rows queued for writing (at most 256 MB plus one rank's rows).
``step MB`` is the largest step's decoded tokens (9 bytes per token), ``rg MB`` the largest
row group's; ``base MB`` the peak RSS of a process that only imports rolltool and scans the
input (light columns); ``bound MB`` = base + cache + 2 x step + 2 x rg + min(256, step) +
step / dp, which the peak should stay under.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
from _data import synth_dataset


def _pack(src: Path, out: Path, dp: int, cache_mb: float) -> tuple[float, int, dict]:
    """(seconds, peak RSS in MB of this child alone, manifest) of one pack run in a new process."""
    cmd = [sys.executable, "-m", "rolltool", "pack", str(src), "--dp", str(dp), "-o", str(out),
           "--batch-size", "256", "--cache-mb", str(cache_mb), "--json"]  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        dt = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"pack failed ({proc.returncode}): {' '.join(cmd)}")
        stdout.seek(0)
        manifest = json.loads(stdout.read())
    return dt, usage.ru_maxrss // 1024, manifest


BASE = """
import sys
from rolltool.schema import scan
from rolltool.input.resolve import resolve_inputs
scan(resolve_inputs([sys.argv[1]]), {})
"""


def _row_group_mb(src: Path) -> float:
    """Decoded size (9 bytes per token) of the input's largest row group, in MB."""
    f = pq.ParquetFile(src)
    tokens = [
        pc.sum(pc.list_value_length(f.read_row_group(i, columns=["input_ids"]).column(0))).as_py()
        for i in range(f.num_row_groups)
    ]
    return max(tokens) * 9 / 1e6


def _base_rss(src: Path) -> int:
    """Peak RSS (MB) of a process that imports rolltool and scans the input: pack's floor."""
    proc = subprocess.Popen([sys.executable, "-c", BASE, str(src)])
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss // 1024


FLOOR = """
import sys, numpy as np, pyarrow.parquet as pq
pq.read_table(sys.argv[1])
np.zeros(int(sys.argv[2]), dtype=np.uint8).tofile(sys.argv[3])
"""


def _floor(src: Path, nbytes: int, scratch: Path) -> float:
    """The floor in a fresh process too, so both sides pay interpreter start-up and imports."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR, str(src), str(nbytes), str(scratch)], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, nargs="+", default=[2000, 4000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[1024.0, 0.0])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    print(f"{'groups':>7}{'samples':>9}{'tokens':>13}{'steps':>7}{'cache MB':>9}{'floor s':>9}"
          f"{'pack s':>8}{'x floor':>9}{'Mtok/s':>8}{'step MB':>9}{'rg MB':>7}{'base MB':>9}{'bound MB':>9}"
          f"{'peak MB':>9}")  # fmt: skip
    for groups in args.groups:
        src = synth_dataset(groups)
        base, rg_mb = _base_rss(src), _row_group_mb(src)
        for cache_mb in args.cache_mb:
            # Runs alternate with the floor; each writes a fresh output (--force would add the
            # deletion of the old one).
            runs, floors = [], []
            for i in range(args.repeats):
                runs.append(_pack(src, work / f"packed-{groups}-{cache_mb}-{i}", args.dp, cache_mb))
                nbytes = sum(f["bytes"] for f in runs[-1][2]["files"].values())
                floors.append(_floor(src, nbytes, work / "floor.bin"))
            manifest = runs[-1][2]
            t_pack = statistics.median(r[0] for r in runs)
            t_floor = statistics.median(floors)
            tokens = sum(s["sampled_tokens"] for s in manifest["steps"])
            step_mb = max(s["sampled_tokens"] for s in manifest["steps"]) * 9 / 1e6
            bound = base + cache_mb + 2 * (step_mb + rg_mb) + min(256, step_mb) + step_mb / args.dp
            print(
                f"{groups:>7}{manifest['samples']['total']:>9,}{tokens:>13,}{manifest['num_steps']:>7}"
                f"{cache_mb:>9,.0f}{t_floor:>9.2f}{t_pack:>8.2f}{t_pack / t_floor:>9.2f}"
                f"{tokens / t_pack / 1e6:>8.1f}{step_mb:>9,.0f}{rg_mb:>7,.0f}{base:>9,}{bound:>9,.0f}"
                f"{max(r[1] for r in runs):>9,}"
            )
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()


if __name__ == "__main__":
    main()
