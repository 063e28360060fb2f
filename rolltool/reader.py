"""The consumer contract: open a packed directory and read a rank's micro-batches.

>>> ds = rolltool.open_packed("packed")          # doctest: +SKIP
>>> ds.num_steps, ds.dp
>>> for mb in ds.micro_batches(step=0, rank=3):  # one dict per micro-batch (= packed row)
...     mb["input_ids"], mb["position_ids"], mb["loss_mask"], mb["advantages"], mb["logprobs"]
...     mb["loss_weight"]     # per token; loss = sum(loss_weight * token_loss), see manifest "loss"
...     mb["cu_seqlens"]      # int32 segment boundaries, first 0, last = row length
...     mb["sample_index"]    # int64 per segment, -1 for padding

Arrays are read-only NumPy views of memory-mapped shard files; ``torch=True`` gives torch
tensors (copies). ``ds.rank_iter(rank)`` walks a rank's whole run, step by step, and
``ds.torch_dataset(rank)`` wraps it as a ``torch.utils.data.IterableDataset``. A rank opens
only its own files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import MANIFEST, Manifest, StepRecord
from rolltool.layout import check_rows, unpack_row
from rolltool.shards import read_shard


class PackedDataset:
    """A packed directory written by `rolltool pack` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            aside = sorted(self.path.parent.glob(f".{glob_escape(self.path.name)}.old-*"))
            raise RolltoolError(
                f"{self.path}: no such directory"
                + (
                    f" ({aside[0].name} is an output a killed --force run moved aside)"
                    if aside
                    else ""
                ),
                hint="the next `rolltool pack` to this path restores it" if aside else None,
            )
        if not (self.path / MANIFEST).is_file():
            raise RolltoolError(
                f"{self.path}: not a rolltool packed directory (no {MANIFEST})",
                hint="an interrupted `rolltool pack` leaves no manifest; run it again",
            )
        self.manifest: Manifest = Manifest.load(self.path)

    @property
    def num_steps(self) -> int:
        return self.manifest.num_steps

    @property
    def dp(self) -> int:
        return self.manifest.dp

    def step_meta(self, step: int) -> StepRecord:
        """The step's record: counts overall (its own fields) and per env (``envs``), loss
        ``denominators``, the partition ``plan`` and its ``ranks``."""
        self._check(step, 0)
        return self.manifest.steps[step]

    def _check(self, step: int, rank: int) -> None:
        if not 0 <= step < self.num_steps:
            raise RolltoolError(f"step {step} out of range (the run has {self.num_steps} steps)")
        if not 0 <= rank < self.dp:
            raise RolltoolError(f"rank {rank} out of range (dp = {self.dp})")

    def micro_batches(self, step: int, rank: int, *, torch: bool = False) -> list[dict[str, Any]]:
        """Rank `rank`'s micro-batches of step `step`, in order (one dict per packed row)."""
        self._check(step, rank)
        rows: list[dict[str, Any]] = []
        for f in self.manifest.steps[step].ranks[rank].files:
            arrays = read_shard(self.path / f.path)
            broken = check_rows(arrays)
            if broken is None and len(arrays["row_offsets"]) - 1 != f.rows:
                broken = f"{len(arrays['row_offsets']) - 1} rows, the manifest says {f.rows}"
            if broken is not None:
                raise RolltoolError(
                    f"{self.path / f.path}: corrupt shard ({broken})",
                    hint="run `rolltool verify` on the directory; pack again if files changed",
                )
            rows.extend(unpack_row(arrays, r) for r in range(f.rows))
        if torch:
            import torch as _torch

            return [{k: _torch.from_numpy(np.array(v)) for k, v in row.items()} for row in rows]
        return rows

    def rank_iter(
        self, rank: int, *, torch: bool = False
    ) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(step, micro_batch, row) for every row of `rank`, step after step."""
        for step in range(self.num_steps):
            for j, row in enumerate(self.micro_batches(step, rank, torch=torch)):
                yield step, j, row

    def torch_dataset(self, rank: int) -> Any:
        """A torch IterableDataset over `rank`'s rows (dicts of tensors plus step/micro_batch)."""
        from torch.utils.data import IterableDataset

        ds = self

        class _RankRows(IterableDataset):
            def __iter__(self) -> Iterator[dict[str, Any]]:
                for step, j, row in ds.rank_iter(rank, torch=True):
                    yield {"step": step, "micro_batch": j, **row}

        return _RankRows()


def open_packed(path: str | os.PathLike[str]) -> PackedDataset:
    """Open a packed directory (see PackedDataset)."""
    return PackedDataset(path)
