"""Benchmark: open a packed directory and read every rank's rows, against the raw safetensors floor.

    python benchmarks/open.py [--groups 2048] [--repeats 5] [--workers 2] [--only NAME ...]

Packs a synth dataset (cached under /tmp, shared with the other benchmarks) in the shape of
issue 25's pack: ``--dp 8 --batch-size 256``, one shard per (step, rank) (2,048 groups: 97 steps,
776 shards, 2,256 rows, 61 M tokens). Warms the page cache, then runs every variant once per pass,
the variants interleaved, ``--repeats`` passes; prints the median pass of each. Every pass opens
the directory anew and reads every micro-batch of every rank:

  raw floor          no rolltool: ``safetensors.numpy.load_file`` of each shard (sorted names)
                     and the reader's derived arrays computed per row by plain NumPy
                     (`floor_rows`: positions, advantages, loss weights, cu_seqlens, targets)
  numpy views        ``rolltool.open_packed(path)``, ``ds.rank_iter(rank)`` for every rank
  verify=hash        the same, each shard's sha256 checked on its first read
  torch dataset      ``ds.torch_dataset(rank)`` iterated itself for every rank (no DataLoader)
  torch W=0          ``DataLoader(ds.torch_dataset(rank), batch_size=None, collate_fn=as_is)``
                     for every rank (`rolltool.packed.torch_data.as_is`, the documented recipe)
  torch W=k          the same with ``num_workers=k`` (workers started for every rank)
  loader floor W=k   no rolltool in the loop: a ``DataLoader`` with k workers for every rank over
                     a dataset yielding a one-int dict per row (each row's token count): what
                     starting, feeding and stopping the workers costs alone

Columns: Mtok/s over the pass (open included), the time from the pass's start (before opening)
to rank 0's first row, and for the torch rows the time to the first row after resuming: a fresh
``open_packed`` + ``torch_dataset(0)`` + ``load_state_dict(state)`` of a state saved halfway
through rank 0 (W=0: the dataset's own `RankRows.state_dict`; W=k: torchdata's
``StatefulDataLoader``, when installed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _data import synth_dataset

import rolltool

IGNORE_INDEX = -100


def packed_dir(groups: int) -> Path:
    out = Path(tempfile.gettempdir()) / f"rolltool-bench-open-{groups}"
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "rolltool", "pack", str(synth_dataset(groups)), "-o", str(out),
               "--dp", "8", "--batch-size", "256", "--keep-last", "--force"]  # fmt: skip
        print(f"packing {out} ...", file=sys.stderr)
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def shard_paths(out: Path) -> list[list[Path]]:
    """Each rank's shard files in name order (= stream order), from the directory alone."""
    return [sorted(d.glob("*.safetensors")) for d in sorted(out.glob("rank-*"))]


def floor_rows(arrays: dict[str, np.ndarray]) -> Any:
    """The reader's row dicts from a shard's flat arrays, by plain NumPy (no checks)."""
    ro, rs, lens_all = arrays["row_offsets"], arrays["row_segments"], arrays["seq_lens"]
    for r in range(len(ro) - 1):
        a, b, s0, s1 = int(ro[r]), int(ro[r + 1]), int(rs[r]), int(rs[r + 1])
        lens = lens_all[s0:s1].astype(np.int64)
        cu = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        n = b - a
        pos = np.arange(n, dtype=np.int32) - np.repeat(cu[:-1], lens)
        mask = arrays["loss_mask"][a:b]
        adv = np.repeat(arrays["seg_advantage"][s0:s1], lens)
        weight = np.repeat(arrays["seg_weight"][s0:s1], lens) * mask
        ids, logp = arrays["input_ids"][a:b], arrays["logprobs"][a:b]
        index = arrays["sample_index"][s0:s1]
        none = np.concatenate([cu[1:] - 1, np.flatnonzero(np.repeat(index < 0, lens))])
        row = {"input_ids": ids, "position_ids": pos, "loss_mask": mask, "advantages": adv,
               "logprobs": logp, "loss_weight": weight}  # fmt: skip
        for key, src, fill in (("target_ids", ids, IGNORE_INDEX), ("target_loss_weight", weight, 0),
                               ("target_advantages", adv, 0), ("target_logprobs", logp, 0)):  # fmt: skip
            t = np.empty(n, dtype=src.dtype)
            t[:-1] = src[1:]
            t[none] = fill
            row[key] = t
        row["cu_seqlens"], row["sample_index"] = cu, index
        yield row


def warm(out: Path) -> None:
    """Every file read whole once (into the page cache). Reading ~1 MB blocks also raises glibc
    malloc's dynamic mmap and trim thresholds for the rest of the process (the floor's
    ``load_file`` does too): the readers are measured in a process whose heap is not trimmed
    after every row. Warmed through one 64 kB buffer instead, NumPy views read at ~0.8x the
    floor, not ~0.9x (session 9: ~130k page faults a pass instead of ~9k)."""
    for path in sorted(out.rglob("*")):
        if path.is_file():
            path.read_bytes()


Pass = Callable[[], tuple[float, int, int]]  # -> (s to the first row, rows, tokens)


def raw_floor(out: Path) -> Pass:
    from safetensors.numpy import load_file

    def run() -> tuple[float, int, int]:
        start, first, rows, tokens = time.perf_counter(), 0.0, 0, 0
        for paths in shard_paths(out):
            for path in paths:
                for row in floor_rows(load_file(path)):
                    first = first or time.perf_counter() - start
                    rows, tokens = rows + 1, tokens + len(row["input_ids"])
        return first, rows, tokens

    return run


def numpy_views(out: Path, verify: str = "checks") -> Pass:
    def run() -> tuple[float, int, int]:
        start, first, rows, tokens = time.perf_counter(), 0.0, 0, 0
        ds = rolltool.open_packed(out, verify=verify)  # type: ignore[arg-type]
        for rank in range(ds.dp):
            for _, _, row in ds.rank_iter(rank):
                first = first or time.perf_counter() - start
                rows, tokens = rows + 1, tokens + len(row["input_ids"])
        return first, rows, tokens

    return run


def torch_loader(out: Path, workers: int, recipe: bool = True) -> Pass:
    """`recipe`: the documented ``collate_fn=as_is`` (a checkout older than it: the default);
    else torch's default ``default_convert``."""
    from torch.utils.data import DataLoader

    import rolltool.packed.torch_data as torch_data

    as_is = getattr(torch_data, "as_is", None) if recipe else None

    def run() -> tuple[float, int, int]:
        start, first, rows, tokens = time.perf_counter(), 0.0, 0, 0
        ds = rolltool.open_packed(out)
        for rank in range(ds.dp):
            data = ds.torch_dataset(rank)
            loader = DataLoader(data, batch_size=None, num_workers=workers, collate_fn=as_is)
            for item in loader:
                first = first or time.perf_counter() - start
                rows, tokens = rows + 1, tokens + len(item["input_ids"])
        return first, rows, tokens

    return run


def torch_items(out: Path) -> Pass:
    """``ds.torch_dataset(rank)`` iterated itself, no DataLoader (0 workers need none)."""

    def run() -> tuple[float, int, int]:
        start, first, rows, tokens = time.perf_counter(), 0.0, 0, 0
        ds = rolltool.open_packed(out)
        for rank in range(ds.dp):
            for item in ds.torch_dataset(rank):
                first = first or time.perf_counter() - start
                rows, tokens = rows + 1, tokens + len(item["input_ids"])
        return first, rows, tokens

    return run


def loader_floor(out: Path, workers: int) -> Pass:
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    ds = rolltool.open_packed(out)
    lengths = [[len(row["input_ids"]) for _, _, row in ds.rank_iter(r)] for r in range(ds.dp)]

    class Counts(IterableDataset[dict[str, int]]):
        def __init__(self, counts: list[int]) -> None:
            self.counts = counts

        def __iter__(self) -> Any:
            info = get_worker_info()
            first, stride = (info.id, info.num_workers) if info is not None else (0, 1)
            return ({"tokens": n} for n in self.counts[first::stride])

    def run() -> tuple[float, int, int]:
        start, first, rows, tokens = time.perf_counter(), 0.0, 0, 0
        for counts in lengths:
            for item in DataLoader(Counts(counts), batch_size=None, num_workers=workers):
                first = first or time.perf_counter() - start
                rows, tokens = rows + 1, tokens + item["tokens"]
        return first, rows, tokens

    return run


def resume(out: Path, workers: int) -> Callable[[], float] | None:
    """Seconds from a fresh open to the first row after loading a state saved halfway."""
    half = len(rolltool.open_packed(out).rank_rows(0)) // 2
    if workers == 0:
        data = rolltool.open_packed(out).torch_dataset(0)
        it = iter(data)
        for _ in range(half):
            next(it)
        state = data.state_dict()

        def run0() -> float:
            start = time.perf_counter()
            data = rolltool.open_packed(out).torch_dataset(0)
            data.load_state_dict(state)
            next(iter(data))
            return time.perf_counter() - start

        return run0
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    loader = StatefulDataLoader(rolltool.open_packed(out).torch_dataset(0), batch_size=None,
                                num_workers=workers)  # fmt: skip
    it = iter(loader)
    for _ in range(half):
        next(it)
    saved = loader.state_dict()
    del it

    def run() -> float:
        start = time.perf_counter()
        loader = StatefulDataLoader(rolltool.open_packed(out).torch_dataset(0), batch_size=None,
                                    num_workers=workers)  # fmt: skip
        loader.load_state_dict(saved)
        it = iter(loader)
        next(it)
        took = time.perf_counter() - start
        del it
        return took

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", nargs="*", help="variants whose name starts with one of these")
    args = p.parse_args()
    out = packed_dir(args.groups)
    warm(out)
    ds = rolltool.open_packed(out)
    n_shards = sum(len(x) for x in shard_paths(out))
    n_rows = sum(len(ds.rank_rows(r)) for r in range(ds.dp))
    print(f"{out}: {ds.num_steps} steps x {ds.dp} ranks, {n_rows} rows, {n_shards} shards")
    w = args.workers
    makers: dict[str, Callable[[], tuple[Pass, Callable[[], float] | None]]] = {
        "raw floor": lambda: (raw_floor(out), None),
        "numpy views": lambda: (numpy_views(out), None),
        "verify=hash": lambda: (numpy_views(out, "hash"), None),
        "torch dataset": lambda: (torch_items(out), None),
        "torch W=0": lambda: (torch_loader(out, 0), resume(out, 0)),
        f"torch W={w}": lambda: (torch_loader(out, w), resume(out, w)),
        f"loader floor W={w}": lambda: (loader_floor(out, w), None),
    }
    try:
        import torch  # noqa: F401
    except ImportError:
        print("(torch is not installed: no torch rows)")
        makers = {k: v for k, v in makers.items() if not k.startswith(("torch", "loader"))}
    if args.only:
        makers = {k: v for k, v in makers.items() if any(k.startswith(o) for o in args.only)}
    variants = {k: make() for k, make in makers.items()}
    results: dict[str, list[tuple[float, float, float | None]]] = {k: [] for k in variants}
    for _ in range(args.repeats):  # interleaved: every variant once per pass
        for name, (run, resumed) in variants.items():
            start = time.perf_counter()
            first, rows, tokens = run()
            secs = time.perf_counter() - start
            assert rows == n_rows, (name, rows, n_rows)
            results[name].append((tokens / secs / 1e6, first, resumed() if resumed else None))
    floor = statistics.median(r[0] for r in results.get("raw floor", [(float("nan"),)] * 1))
    print(f"{'reader':18s} {'Mtok/s':>8s} {'x floor':>8s} {'first row ms':>13s} {'resume ms':>10s}")
    for name, runs in results.items():
        mtok = statistics.median(r[0] for r in runs)
        first = statistics.median(r[1] for r in runs) * 1e3
        res = [r[2] for r in runs if r[2] is not None]
        shown = f"{statistics.median(res) * 1e3:10.1f}" if res else f"{'-':>10s}"
        print(f"{name:18s} {mtok:8.1f} {mtok / floor:8.2f} {first:13.1f} {shown}")


if __name__ == "__main__":
    main()
