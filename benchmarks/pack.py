"""Benchmark: `rolltool pack` end to end against the I/O floor, and its peak memory.

    python benchmarks/pack.py [--groups 2000 4000] [--repeats 3] [--dp 8] [--cache-mb 1024 0]
                              [--workers 1 2] [--trees DIR ...]

For each synth dataset (cached under /tmp), in one run and on the same file:
  floor  in a fresh process (both sides pay interpreter start-up): read the token columns pack
         reads (pyarrow.parquet.read_table of input_ids, loss_mask, logprobs), then write as
         many files of as many bytes as pack's output holds and sha256 each (one thread) - what
         any packer must at least do
  pack   `rolltool pack IN --dp 8 --batch-size 256 --cache-mb C --workers W -o OUT --json`
         in a subprocess; with --trees, the same command run from each checkout too (its
         rolltool first on PYTHONPATH: e.g. a `git worktree` of an older commit), interleaved
Runs alternate (per repeat: every tree x workers x cache, each followed by a floor), so every
ratio compares runs made side by side on a shared machine: ``x floor`` is the median over
repeats of pack / the floor run right after it, ``x one`` of one worker's run / this one's in
the same repeat, ``x cpu`` the same as ``x floor`` in CPU seconds (user + system: steadier
than wall time when other jobs share the cores; the pack pool's workers not counted). Prints
medians, tokens/s, and the peak RSS of the pack process (its
workers not included: ru_maxrss is per process), with the default --cache-mb 1024 (decoded
input kept so that data that fits is read once) and with --cache-mb 0: then memory is bounded
by a step and does not grow with the dataset.

The memory bound (rolltool.packed.writer / rolltool.jobs.pack): beyond the imports and the
light columns, pack holds the token cache (--cache-mb), the decoded tokens of two steps (the one
being laid out, the next being read), the row group being decoded (Parquet reads whole row
groups: Arrow and NumPy copies) and the rows queued for writing (at most 256 MB plus one rank's
rows). ``step MB`` is the largest step's decoded tokens (9 bytes per token), ``rg MB`` the
largest row group's; ``base MB`` the peak RSS of a process that only imports rolltool and scans
the input (light columns); ``bound MB`` = base + cache + 2 x step + 2 x rg + min(256, step) +
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


def _pack(
    src: Path, out: Path, dp: int, cache_mb: float, workers: int = 1, tree: str = ""
) -> tuple[float, int, dict, float]:
    """(seconds, peak RSS in MB of this child alone, manifest, CPU seconds of the process) of
    one pack run in a new process, with the rolltool of checkout `tree` ("" = the installed
    one). The CPU time counts the process and the children it waited for (the planning pool),
    not the pack pool's workers (the forkserver's children)."""
    cmd = [sys.executable, "-m", "rolltool", "pack", str(src), "--dp", str(dp), "-o", str(out),
           "--batch-size", "256", "--cache-mb", str(cache_mb), "--workers", str(workers),
           "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        dt = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"pack failed ({proc.returncode}): {' '.join(cmd)}")
        stdout.seek(0)
        manifest = json.loads(stdout.read())
    return dt, usage.ru_maxrss // 1024, manifest, usage.ru_utime + usage.ru_stime


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
import hashlib, sys, numpy as np, pyarrow.parquet as pq
table = pq.read_table(sys.argv[1], columns=sys.argv[4].split(","))
sizes = [int(n) for n in sys.argv[2].split(",")]
data = np.zeros(max(sizes), dtype=np.uint8)
for i, n in enumerate(sizes):
    view = memoryview(data)[:n]
    with open(f"{sys.argv[3]}.{i}", "wb") as f:
        f.write(view)
    hashlib.sha256(view).hexdigest()
"""
TOKEN_COLUMNS = ("input_ids", "loss_mask", "logprobs")


def _floor(
    src: Path, nbytes: int | list[int], scratch: Path, cpu: list[float] | None = None
) -> float:
    """Seconds of the floor in a fresh process (read the token columns, write and hash files
    of `nbytes`: one size, or each file's), its files removed afterwards; its CPU seconds
    appended to `cpu` where given."""
    sizes = [nbytes] if isinstance(nbytes, int) else list(nbytes)
    names = set(pq.ParquetFile(src).schema_arrow.names)
    cols = ",".join(c for c in TOKEN_COLUMNS if c in names)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", FLOOR, str(src), ",".join(map(str, sizes)),
                             str(scratch), cols])  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit("the floor failed")
    if cpu is not None:
        cpu.append(usage.ru_utime + usage.ru_stime)
    for i in range(len(sizes)):
        Path(f"{scratch}.{i}").unlink(missing_ok=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, nargs="+", default=[2000, 4000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[1024.0, 0.0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1])
    ap.add_argument("--trees", nargs="*", default=[], help="other checkouts, run interleaved")
    args = ap.parse_args()
    trees = ["", *args.trees]
    work = Path(tempfile.mkdtemp())
    print(f"{'tree':<10}{'groups':>7}{'samples':>9}{'tokens':>13}{'steps':>7}{'cache MB':>9}"
          f"{'workers':>8}{'floor s':>9}{'pack s':>8}{'x floor':>9}{'x one':>7}{'Mtok/s':>8}"
          f"{'floor cpu':>10}{'pack cpu':>9}{'x cpu':>7}"
          f"{'step MB':>9}{'rg MB':>7}{'base MB':>9}{'bound MB':>9}{'peak MB':>9}")  # fmt: skip
    for groups in args.groups:
        src = synth_dataset(groups)
        base, rg_mb = _base_rss(src), _row_group_mb(src)
        modes = [(t, c, w) for t in trees for c in args.cache_mb for w in args.workers]
        runs: dict[tuple[str, float, int], list[tuple[float, int, dict]]] = {m: [] for m in modes}
        floors: dict[tuple[str, float, int], list[float]] = {m: [] for m in modes}
        floor_cpu: dict[tuple[str, float, int], list[float]] = {m: [] for m in modes}
        # Every mode once per repeat, each run followed by a floor; each writes a fresh output
        # (--force would add the deletion of the old one).
        for i in range(args.repeats):
            for m in modes:
                tree, cache_mb, w = m
                out = work / f"packed-{i}"
                runs[m].append(_pack(src, out, args.dp, cache_mb, w, tree))
                sizes = [f["bytes"] for f in runs[m][-1][2]["files"].values()]
                floors[m].append(_floor(src, sizes, work / "floor.bin", floor_cpu[m]))
                shutil.rmtree(out, ignore_errors=True)
        for m in modes:
            tree, cache_mb, w = m
            manifest = runs[m][-1][2]
            t_pack = statistics.median(r[0] for r in runs[m])
            t_floor = statistics.median(floors[m])
            one = runs.get((tree, cache_mb, 1), runs[m])
            # Ratios of runs made side by side (repeat i of each), then their median.
            x_floor = statistics.median(r[0] / f for r, f in zip(runs[m], floors[m], strict=True))
            x_one = statistics.median(a[0] / b[0] for a, b in zip(one, runs[m], strict=True))
            c_pack = statistics.median(r[3] for r in runs[m])
            c_floor = statistics.median(floor_cpu[m])
            x_cpu = statistics.median(r[3] / f for r, f in zip(runs[m], floor_cpu[m], strict=True))
            tokens = sum(s["sampled_tokens"] for s in manifest["steps"])
            step_mb = max(s["sampled_tokens"] for s in manifest["steps"]) * 9 / 1e6
            bound = base + cache_mb + 2 * (step_mb + rg_mb) + min(256, step_mb) + step_mb / args.dp
            print(
                f"{Path(tree).name or 'this':<10}{groups:>7}{manifest['samples']['total']:>9,}"
                f"{tokens:>13,}{manifest['num_steps']:>7}{cache_mb:>9,.0f}{w:>8}{t_floor:>9.2f}"
                f"{t_pack:>8.2f}{x_floor:>9.2f}{x_one:>7.2f}"
                f"{tokens / t_pack / 1e6:>8.1f}{c_floor:>10.2f}{c_pack:>9.2f}{x_cpu:>7.2f}"
                f"{step_mb:>9,.0f}{rg_mb:>7,.0f}{base:>9,}"
                f"{bound:>9,.0f}{max(r[1] for r in runs[m]):>9,}"
            )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
