"""Benchmark: `rolltool pack` end to end against the I/O floor, and its peak memory.

    python benchmarks/pack.py [--groups 2000 4000] [--repeats 3] [--dp 8]

For each synth dataset (cached under /tmp), in one run and on the same file:
  floor  read the input Parquet (pyarrow.parquet.read_table) + write as many bytes as pack's
         output holds, as raw arrays (numpy tofile) - what any packer must at least do; in a
         subprocess like pack, so both pay interpreter start-up
  pack   `rolltool pack IN --dp 8 -o OUT --force --json` in a subprocess
Prints medians, tokens/s, the ratio to the floor, and the peak RSS of the pack process: with the
same step size, a dataset twice as large should not need more memory (bounded by one step).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rolltool.jobs import run_synth
from rolltool.synth import SynthConfig


def _dataset(groups: int) -> Path:
    path = Path(tempfile.gettempdir()) / f"rolltool-bench-synth-{groups}.parquet"
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        run_synth(SynthConfig(groups=groups, seed=1), path, force=True)
    return path


def _pack(src: Path, out: Path, dp: int) -> tuple[float, int, dict]:
    """(seconds, peak RSS in MB of the child, manifest) of one pack run in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "rolltool", "pack", str(src), "--dp", str(dp), "-o", str(out),
         "--batch-size", "256", "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(peak, before) // 1024, json.loads(res.stdout)


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
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    print(f"{'groups':>7}{'samples':>9}{'tokens':>13}{'steps':>7}{'floor s':>9}{'pack s':>8}"
          f"{'x floor':>9}{'Mtok/s':>8}{'peak MB':>9}")  # fmt: skip
    for groups in args.groups:
        src = _dataset(groups)
        # A fresh output each time: replacing an old one (--force) would add its deletion.
        runs = [_pack(src, work / f"packed-{groups}-{i}", args.dp) for i in range(args.repeats)]
        manifest = runs[-1][2]
        nbytes = sum(f["bytes"] for f in manifest["files"].values())
        floors = [_floor(src, nbytes, work / "floor.bin") for _ in range(args.repeats)]
        t_pack = statistics.median(r[0] for r in runs)
        t_floor = statistics.median(floors)
        tokens = sum(s["sampled_tokens"] for s in manifest["steps"])
        print(
            f"{groups:>7}{manifest['samples']['total']:>9,}{tokens:>13,}{manifest['num_steps']:>7}"
            f"{t_floor:>9.2f}{t_pack:>8.2f}{t_pack / t_floor:>9.2f}{tokens / t_pack / 1e6:>8.1f}"
            f"{max(r[1] for r in runs):>9,}"
        )


if __name__ == "__main__":
    main()
