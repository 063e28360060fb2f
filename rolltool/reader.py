"""The consumer contract: open a packed directory and read a rank's micro-batches.

>>> ds = rolltool.open_packed("packed")          # doctest: +SKIP
>>> ds.num_steps, ds.dp
>>> for mb in ds.micro_batches(step=0, rank=3):  # one dict per micro-batch (= packed row)
...     mb["input_ids"], mb["position_ids"], mb["loss_mask"], mb["advantages"], mb["logprobs"]
...     mb["loss_weight"]     # per token; loss = sum(loss_weight * token_loss), see manifest "loss"
...     mb["cu_seqlens"]      # int32 segment boundaries, first 0, last = row length
...     mb["sample_index"]    # int64 per segment, -1 for padding

Arrays are read-only NumPy views of memory-mapped shard files; ``torch=True`` gives torch
tensors (each stored array copied once, derived ones wrapped). ``ds.rank_iter(rank)`` walks a
rank's whole run, step by step, from any (step, micro-batch); ``ds.torch_dataset(rank)`` wraps
it as a resumable ``torch.utils.data.IterableDataset`` (`rolltool.torch_data`). A rank opens
only its own files: ``ds.rank_rows(rank)`` lists where each of its rows lies.

The rank's *stream* is its rows in (step, micro_batch) order; ``stream_position(rank, step,
micro_batch)`` is an index into it, e.g. with 3 micro-batches per step, (2, 1) is index 7.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import MANIFEST, Manifest, ShardRef, StepRecord
from rolltool.layout import check_rows, unpack_row
from rolltool.shards import read_shard


@dataclass(frozen=True)
class RowRef:
    """Where one micro-batch (a packed row) of a rank lies: row `row` of shard `file`."""

    step: int
    micro_batch: int
    file: ShardRef
    row: int


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
        self._rank_rows: dict[int, tuple[RowRef, ...]] = {}

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
        self._check_rank(rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise RolltoolError(f"rank {rank} out of range (dp = {self.dp})")

    def step_rows(self, step: int, rank: int) -> tuple[RowRef, ...]:
        """Where each of rank `rank`'s micro-batches of step `step` lies, in order."""
        self._check(step, rank)
        rec = self.manifest.steps[step].ranks[rank]
        refs: list[RowRef] = []
        for f in rec.files:
            if f.first_row != len(refs):
                break
            refs.extend(RowRef(step, f.first_row + r, f, r) for r in range(f.rows))
        if len(refs) != rec.micro_batches or sum(f.rows for f in rec.files) != len(refs):
            raise RolltoolError(
                f"{self.path / MANIFEST}: step {step} rank {rank}: its files do not hold rows "
                f"0..{rec.micro_batches - 1} in order",
                hint="the manifest was changed; pack again",
            )
        return tuple(refs)

    def rank_rows(self, rank: int) -> tuple[RowRef, ...]:
        """Every micro-batch of rank `rank`, step after step: the rank's stream (cached)."""
        self._check_rank(rank)
        if rank not in self._rank_rows:
            refs = [ref for step in range(self.num_steps) for ref in self.step_rows(step, rank)]
            self._rank_rows[rank] = tuple(refs)
        return self._rank_rows[rank]

    def stream_position(self, rank: int, step: int, micro_batch: int = 0) -> int:
        """Index in `rank_rows(rank)` of (step, micro_batch); the stream's length for
        (num_steps, 0), the end. ``micro_batch`` may equal the step's count (= the next step)."""
        if step == self.num_steps and micro_batch == 0:
            return len(self.rank_rows(rank))
        self._check(step, rank)
        count = self.manifest.steps[step].ranks[rank].micro_batches
        if not 0 <= micro_batch <= count:
            raise RolltoolError(
                f"micro-batch {micro_batch} out of range (rank {rank} has {count} in step {step})"
            )
        before = sum(self.manifest.steps[s].ranks[rank].micro_batches for s in range(step))
        return before + micro_batch

    def read_rows(self, refs: Iterable[RowRef], *, torch: bool = False) -> Iterator[dict[str, Any]]:
        """The rows `refs` point to, in order; a shard is mapped (and checked) once while
        consecutive refs stay in it. ``torch=True``: tensors (see `rolltool.torch_data`)."""
        to_tensors: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None
        if torch:
            from rolltool.torch_data import to_tensors
        path, arrays = None, None
        for ref in refs:
            if ref.file.path != path:
                path, arrays = ref.file.path, self._open_shard(ref.file)
            assert arrays is not None
            row = unpack_row(arrays, ref.row)
            yield to_tensors(row) if to_tensors is not None else row

    def _open_shard(self, f: ShardRef) -> dict[str, np.ndarray]:
        arrays = read_shard(self.path / f.path)
        broken = check_rows(arrays)
        if broken is None and len(arrays["row_offsets"]) - 1 != f.rows:
            broken = f"{len(arrays['row_offsets']) - 1} rows, the manifest says {f.rows}"
        if broken is not None:
            raise RolltoolError(
                f"{self.path / f.path}: corrupt shard ({broken})",
                hint="run `rolltool verify` on the directory; pack again if files changed",
            )
        return arrays

    def micro_batches(self, step: int, rank: int, *, torch: bool = False) -> list[dict[str, Any]]:
        """Rank `rank`'s micro-batches of step `step`, in order (one dict per packed row)."""
        return list(self.read_rows(self.step_rows(step, rank), torch=torch))

    def rank_iter(
        self, rank: int, *, torch: bool = False, start_step: int = 0, start_micro_batch: int = 0
    ) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(step, micro_batch, row) for every row of `rank` from (start_step, start_micro_batch)
        on, step after step."""
        refs = self.rank_rows(rank)
        first = self.stream_position(rank, start_step, start_micro_batch)
        rows = self.read_rows(refs[first:], torch=torch)
        for ref, row in zip(refs[first:], rows, strict=True):
            yield ref.step, ref.micro_batch, row

    def torch_dataset(
        self,
        rank: int,
        *,
        start_step: int = 0,
        start_micro_batch: int = 0,
        pin_memory: bool = False,
    ) -> Any:
        """Rank `rank`'s rows from (start_step, start_micro_batch) on as a torch
        ``IterableDataset`` of `rolltool.torch_data.MicroBatch` dicts (tensors, plus ints
        ``step`` and ``micro_batch``): use ``DataLoader(..., batch_size=None)``; any
        ``num_workers`` gives the same order; ``state_dict``/``load_state_dict`` resume it
        (see `rolltool.torch_data.RankRows`)."""
        from rolltool.torch_data import RankRows

        return RankRows(
            self,
            rank,
            start_step=start_step,
            start_micro_batch=start_micro_batch,
            pin_memory=pin_memory,
        )


def open_packed(path: str | os.PathLike[str]) -> PackedDataset:
    """Open a packed directory (see PackedDataset)."""
    return PackedDataset(path)
