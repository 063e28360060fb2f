"""Benchmark: the CPU time of a pass over every rank's rows, each reader in a fresh process.

    python benchmarks/read_cpu.py [--groups 2048] [--passes 5] [--rounds 3] [--trees DIR ...]
                                  [--readers floor numpy "torch W=0" ...]

`open.py`'s pack and readers (the raw floor, ``open_packed``'s NumPy views, the torch dataset
through a 0-worker DataLoader, ...: `READERS`), each in its own process (page cache warmed as
`open.py` does, torch imported, one pass not counted), the readers alternated ``--rounds``
times. Prints per reader the median CPU seconds of a pass (``time.process_time``: the process's
own work, which other jobs on a shared machine move less than wall time, plus its DataLoader
workers', counted when they are joined) in each round, Mtok per CPU second, x floor: the floor's
CPU seconds over the reader's in the same round (above 1: faster than the floor), and the
median wall seconds of a pass over the rounds. In one process the readers' order and glibc's heap state move each
other's figures (`open.py`'s notes); here each starts alike. ``--trees A B`` reads with the
rolltool of each checkout (e.g. a ``git worktree`` of an older commit), alternated too; the floor
runs once a round, from the first tree.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _child import run_child
from open import packed_dir

HERE = Path(__file__).resolve().parent
READERS = {
    "floor": "bench.raw_floor(out)",
    "numpy": "bench.numpy_views(out)",
    "torch dataset": "bench.torch_items(out)",
    "torch W=0": "bench.torch_loader(out, 0)",
    "torch W=0 default": "bench.torch_loader(out, 0, recipe=False)",
    "torch W=2": "bench.torch_loader(out, 2)",
    "loader floor W=2": "bench.loader_floor(out, 2)",
}
"""Each reader's pass, made by `open.py` (``bench``) over its pack (``out``)."""

_CHILD = """
import json, statistics, sys, time
sys.path[:0] = [{tree!r}, {here!r}]
import open as bench
import rolltool
assert rolltool.__file__.startswith({tree!r}), rolltool.__file__
out = bench.packed_dir({groups})
bench.warm(out)
import torch  # noqa: F401  (as open.py's process has it)
run = {make}
run()
import resource

def children_s():  # DataLoader workers, counted once joined
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime

times, walls, tokens = [], [], 0
for _ in range({passes}):
    t, c, w = time.process_time(), children_s(), time.perf_counter()
    _, _, tokens = run()
    walls.append(time.perf_counter() - w)
    times.append(time.process_time() - t + children_s() - c)
print(json.dumps({{"cpu_s": statistics.median(times), "wall_s": statistics.median(walls),
                  "tokens": tokens}}))
"""


def measure(tree: Path, reader: str, groups: int, passes: int) -> dict[str, float]:
    """One fresh process's median CPU seconds a pass of `reader`, with `tree`'s rolltool."""
    code = _CHILD.format(
        tree=str(tree), here=str(HERE), groups=groups, make=READERS[reader], passes=passes
    )
    got: dict[str, float] = run_child(code)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent])
    ap.add_argument("--readers", nargs="+", choices=sorted(READERS), default=list(READERS)[:3])
    args = ap.parse_args()
    packed_dir(args.groups)  # made once, before the timed children
    trees = [t.resolve() for t in args.trees]
    others = [(r, t) for r in args.readers if r != "floor" for t in trees]
    runs = [("floor", trees[0]), *others]
    got: dict[tuple[str, Path], list[dict[str, float]]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for reader, tree in runs:
            got[reader, tree].append(measure(tree, reader, args.groups, args.passes))
    named = {t: t.name if len(trees) > 1 else "" for t in trees}
    width = max(len(f"{r} {named[t]}".strip()) for r, t in runs)
    print(f"{'reader':{width}}  {'CPU s a pass (per round)':>26}  {'Mtok/CPU-s':>10}  "
          f"{'x floor':>16}  {'wall s':>6}")  # fmt: skip
    for (reader, tree), rounds in got.items():
        cpu = " / ".join(f"{r['cpu_s']:.3f}" for r in rounds)
        rate = statistics.median(r["tokens"] / r["cpu_s"] / 1e6 for r in rounds)
        ratio = " / ".join(
            f"{f['cpu_s'] / r['cpu_s']:.2f}"
            for f, r in zip(got["floor", trees[0]], rounds, strict=True)
        )
        name = f"{reader} {named[tree]}".strip()
        wall = statistics.median(r["wall_s"] for r in rounds)
        print(f"{name:{width}}  {cpu:>26}  {rate:>10.0f}  {ratio:>16}  {wall:6.3f}")


if __name__ == "__main__":
    main()
