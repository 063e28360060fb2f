"""Benchmark: reading a rank's packed rows from the page cache, as arrays and as torch tensors.

    python benchmarks/loading.py [--groups 512] [--repeats 3] [--workers 2]

Packs a synth dataset (cached under /tmp, shared with the other benchmarks) with --dp 2, warms
the page cache, then times one full pass over rank 0's rows per variant:
  numpy views        ds.rank_iter(0): stored arrays are views of the shard's bytes (read whole,
                     or mapped over 4 MB: no copy), derived ones (position_ids, advantages,
                     loss_weight, cu_seqlens, targets) computed
  copy every array   np.array(v) of every field, then torch.from_numpy (what a reader that
                     copies would cost)
  torch_dataset      iterating ds.torch_dataset(0) itself (0 workers need no DataLoader): every
                     array wrapped (stored ones where they lie in the shard's private bytes)
  DataLoader W=0     the same through DataLoader(batch_size=None, collate_fn=as_is), the
                     documented recipe (rolltool.packed.torch_data.as_is)
  default collate    DataLoader(batch_size=None) alone: torch's default_convert copies each item
  DataLoader W=k     k workers (the recipe): each item crosses by reference, the main process
                     makes its tensors again from the same shard
  pinned W=0         ds.torch_dataset(0, pin_memory=True): the one copy lands in pinned memory
  pinned W=k         DataLoader(pin_memory=True) pins the workers' tensors (a second copy)
  + prefetch cuda    rolltool.packed.torch_data.prefetch(loader, "cuda"): the next row's transfer in
                     flight while the current one is handed out (synchronised at the end)
The pinned and cuda rows need an accelerator and print "-" without one. Prints rows/s, tokens/s
GB/s of stored bytes (9 per token) for the median pass, and its time to the first row; the
passes are wall time (`read_cpu.py` measures CPU time, each reader in a fresh process).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _data import synth_dataset
from torch.utils.data import DataLoader

import rolltool
import rolltool.packed.torch_data as torch_data

STORED_BYTES_PER_TOKEN = 9


def packed_dir(groups: int) -> Path:
    out = Path(tempfile.gettempdir()) / f"rolltool-bench-loading-{groups}"
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "rolltool", "pack", str(synth_dataset(groups)), "-o", str(out),
               "--dp", "2", "--batch-size", "64", "--keep-last", "--force"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def warm(out: Path) -> None:
    for path in sorted(out.rglob("*.safetensors")):
        path.read_bytes()


def copy_every_array(ds: Any) -> Iterable[Any]:
    for _, _, row in ds.rank_iter(0):
        yield {k: torch.from_numpy(np.array(v)) for k, v in row.items()}


def variants(ds: Any, workers: int) -> dict[str, Callable[[], Iterable[Any]] | None]:
    cuda = torch.cuda.is_available()
    as_is = torch_data.as_is

    def loader(**kw: Any) -> Callable[[], Iterable[Any]]:
        pin = kw.pop("pin_dataset", False)
        kw.setdefault("collate_fn", as_is)
        return lambda: DataLoader(ds.torch_dataset(0, pin_memory=pin), batch_size=None, **kw)

    def prefetched() -> Iterable[Any]:
        yield from torch_data.prefetch(loader(pin_dataset=True)(), "cuda")
        torch.cuda.synchronize()

    return {
        "numpy views": lambda: (row for _, _, row in ds.rank_iter(0)),
        "copy every array": lambda: copy_every_array(ds),
        "torch_dataset": lambda: ds.torch_dataset(0),
        "DataLoader W=0": loader(),
        "default collate W=0": loader(collate_fn=None),
        f"DataLoader W={workers}": loader(num_workers=workers),
        "pinned W=0": loader(pin_dataset=True) if cuda else None,
        f"pinned W={workers}": loader(num_workers=workers, pin_memory=True) if cuda else None,
        "pinned W=0 + prefetch cuda": prefetched if cuda else None,
    }


def time_pass(make: Callable[[], Iterable[Any]]) -> tuple[float, float, int, int]:
    """Seconds for the pass, seconds to its first row (worker start-up), rows, tokens."""
    start = time.perf_counter()
    first, rows, tokens = 0.0, 0, 0
    for item in make():
        first = first or time.perf_counter() - start
        rows += 1
        tokens += len(item["input_ids"])
    return time.perf_counter() - start, first, rows, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    out = packed_dir(args.groups)
    warm(out)
    ds = rolltool.open_packed(out)
    refs = ds.rank_rows(0)
    print(f"{out}: rank 0 has {len(refs)} rows in {len({r.file.path for r in refs})} shard files "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")  # fmt: skip
    head = ("variant", "rows/s", "Mtok/s", "GB/s", "s/pass", "1st row s")
    print(f"{head[0]:28s} {head[1]:>8s} {head[2]:>8s} {head[3]:>6s} {head[4]:>7s} {head[5]:>9s}")
    for name, make in variants(ds, args.workers).items():
        if make is None:
            print(f"{name:28s} {'-':>8s} {'-':>8s} {'-':>6s} {'-':>7s} {'-':>9s}")
            continue
        runs = sorted(time_pass(make) for _ in range(args.repeats))
        secs, first, rows, tokens = runs[len(runs) // 2]  # the median pass
        assert rows == len(refs), (name, rows)
        gbs = tokens * STORED_BYTES_PER_TOKEN / secs / 1e9
        print(f"{name:28s} {rows / secs:8.0f} {tokens / secs / 1e6:8.1f} {gbs:6.2f} "
              f"{secs:7.3f} {first:9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
