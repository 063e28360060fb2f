"""Benchmark: the CPU time of a pass over every rank's rows, each reader in a fresh process.

    python benchmarks/read_cpu.py [--groups 2048] [--passes 5] [--rounds 3]

`open.py`'s pack and readers (the raw floor, ``open_packed``'s NumPy views, the torch dataset
through a 0-worker DataLoader), each in its own process (page cache warmed as `open.py` does,
torch imported, one pass not counted), the readers alternated ``--rounds`` times. Prints per
reader the median CPU seconds of a pass (``time.process_time``: the process's own work, which
other jobs on a shared machine move less than wall time) in each round, Mtok per CPU second, and
the ratio to the floor of the same round. In one process the readers' order and glibc's heap
state move each other's figures (`open.py`'s notes); here each starts alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from open import packed_dir

HERE = Path(__file__).resolve().parent
READERS = ("floor", "numpy", "torch W=0")

_CHILD = """
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import open as bench
out = bench.packed_dir({groups})
bench.warm(out)
import torch  # noqa: F401  (as open.py's process has it)
run = {{"floor": lambda: bench.raw_floor(out), "numpy": lambda: bench.numpy_views(out),
       "torch W=0": lambda: bench.torch_loader(out, 0)}}[{reader!r}]()
run()
times, tokens = [], 0
for _ in range({passes}):
    t = time.process_time()
    _, _, tokens = run()
    times.append(time.process_time() - t)
print(json.dumps({{"cpu_s": statistics.median(times), "tokens": tokens}}))
"""


def measure(reader: str, groups: int, passes: int) -> dict[str, float]:
    code = _CHILD.format(here=str(HERE), groups=groups, reader=reader, passes=passes)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    packed_dir(args.groups)  # made once, before the timed children
    got: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
    for _ in range(args.rounds):
        for reader in READERS:
            got[reader].append(measure(reader, args.groups, args.passes))
    print(f"{'reader':10}  {'CPU s a pass (per round)':>26}  {'Mtok/CPU-s':>10}  {'x floor':>16}")
    for reader, rounds in got.items():
        cpu = " / ".join(f"{r['cpu_s']:.3f}" for r in rounds)
        rate = statistics.median(r["tokens"] / r["cpu_s"] / 1e6 for r in rounds)
        ratio = " / ".join(
            f"{f['cpu_s'] / r['cpu_s']:.2f}" for f, r in zip(got["floor"], rounds, strict=True)
        )
        print(f"{reader:10}  {cpu:>26}  {rate:>10.0f}  {ratio:>16}")


if __name__ == "__main__":
    main()
