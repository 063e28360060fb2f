"""Benchmark: the CPU time from opening a packed directory to its first row, and what the manifest takes of it.

    python benchmarks/first_row.py [--groups 2048] [--repeats 31] [--rounds 3] [--trees DIR ...]

On issue 25's pack (`open.py`'s: ``--dp 8 --batch-size 256``, 776 shards, a manifest of ~3,100
records, made on first use), each tree (default: this checkout; ``--trees A B`` compares other
checkouts, e.g. a ``git worktree`` of an older commit) runs in a fresh process, the trees
alternated ``--rounds`` times, and prints per round the median over ``--repeats`` calls of:

  manifest ms     ``Manifest.loads`` of manifest.json's bytes (JSON parse and record decode)
  json ms         ``json.loads`` of the same bytes alone: the floor under the decode
  first row ms    ``rolltool.open_packed(path)`` and rank 0's first row (NumPy views, every
                  check on), warm page cache
  resume ms       a fresh ``open_packed(path).torch_dataset(0)``, ``load_state_dict`` of a state
                  saved halfway through rank 0, and its first item (no DataLoader; torch
                  imported after the columns above, which it would otherwise move)

CPU time of the process (``time.process_time``), not wall time: on a shared machine other jobs
move wall time more than the code does. ``open.py`` measures the same first row in wall time,
with the torch dataset and resuming.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _child import run_child
from open import packed_dir

HERE = Path(__file__).resolve().parent

_CHILD = """
import json, sys, time
sys.path.insert(0, {tree!r})
import rolltool
from rolltool.format.records import Manifest
assert rolltool.__file__.startswith({tree!r}), rolltool.__file__
path, repeats = {path!r}, {repeats}
raw = open(path + "/manifest.json", "rb").read()

def first_row():
    return next(iter(rolltool.open_packed(path).rank_iter(0)))

def median_ms(fn):
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return sorted(times)[len(times) // 2] * 1e3

got = {{"manifest": median_ms(lambda: Manifest.loads(raw)),
       "json": median_ms(lambda: json.loads(raw)),
       "first_row": median_ms(first_row)}}
import torch  # noqa: F401  (imported here, outside the timed calls)
data = rolltool.open_packed(path).torch_dataset(0)
it = iter(data)
for _ in range(len(data) // 2):
    next(it)
state = data.state_dict()

def resume():
    data = rolltool.open_packed(path).torch_dataset(0)
    data.load_state_dict(state)
    return next(iter(data))

got["resume"] = median_ms(resume)
print(json.dumps(got))
"""


def measure(tree: Path, path: Path, repeats: int) -> dict[str, float]:
    got: dict[str, float] = run_child(
        _CHILD.format(tree=str(tree), path=str(path), repeats=repeats)
    )
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent])
    args = ap.parse_args()
    path = packed_dir(args.groups)
    trees = [t.resolve() for t in args.trees]
    got: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            got[tree].append(measure(tree, path, args.repeats))
    width = max(len(str(t)) for t in trees)
    keys, heads = (
        ("manifest", "json", "first_row", "resume"),
        ("manifest", "json", "first row", "resume"),
    )
    print(f"{'tree':{width}}  " + "  ".join(f"{h + ' ms':>20}" for h in heads) + "  (per round)")
    for tree, rounds in got.items():
        cols = [" / ".join(f"{r[k]:.1f}" for r in rounds) for k in keys]
        print(f"{tree!s:{width}}  " + "  ".join(f"{c:>20}" for c in cols))
        mid = {k: statistics.median(r[k] for r in rounds) for k in keys}
        print(
            f"{'':{width}}  median: "
            + ", ".join(f"{h} {mid[k]:.1f}" for k, h in zip(keys, heads, strict=True))
            + " ms"
        )


if __name__ == "__main__":
    main()
