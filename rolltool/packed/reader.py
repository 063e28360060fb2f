"""The consumer contract: open a packed directory and read a rank's micro-batches.

>>> ds = rolltool.open_packed("packed")          # doctest: +SKIP
>>> ds.num_steps, ds.dp
>>> for mb in ds.micro_batches(step=0, rank=3):  # one dict per micro-batch (= packed row)
...     mb["input_ids"], mb["position_ids"], mb["loss_mask"], mb["advantages"], mb["logprobs"]
...     mb["loss_weight"]     # per token; loss = sum(loss_weight * token_loss), see manifest "loss"
...     mb["target_ids"]      # per token: the next token of its sample, -100 at its last / padding
...     mb["target_loss_weight"], mb["target_advantages"], mb["target_logprobs"]  # that target's
...     mb["cu_seqlens"]      # int32 segment boundaries, first 0, last = row length
...     mb["sample_index"]    # int64 per segment, -1 for padding
>>> ds.micro_batches(0, 3, cp_rank=1)             # one GPU's view (packed with --cp / --sp)

**Targets.** The stored arrays belong to the token they describe (``loss_weight[t]`` weighs the
prediction *of* ``input_ids[t]``); the logits at t predict t+1. The ``target_*`` arrays are that
shift, derived over the whole group row before any SP/CP split (`rolltool.format.targets`):
train the logits of a view against its ``target_ids`` with ``target_loss_weight`` and never
shift inside a view, whose last token of a CP chunk or SP slice has its target on another GPU.

Arrays are read-only NumPy views of the shard files, each held private to the process (read
whole, or over 2 MB memory-mapped copy-on-write); ``torch=True`` gives torch tensors without a
copy (stored arrays wrapped where they lie: a write to a tensor never reaches the file;
`rolltool.packed.tensors`). ``ds.rank_iter(rank)`` walks a
rank's whole run, step by step, from any (step, micro-batch); ``ds.torch_dataset(rank)`` wraps
it as a resumable ``torch.utils.data.IterableDataset`` (`rolltool.packed.torch_data`). A rank opens
only its own files: ``ds.rank_rows(rank)`` lists where each of its rows lies.

The rank's *stream* is its rows in (step, micro_batch) order; ``stream_position(rank, step,
micro_batch)`` is an index into it, e.g. with 3 micro-batches per step, (2, 1) is index 7.

The reader never serves a row it can tell is wrong: the checks on open and on every read, and
``verify="hash"``, are `rolltool.packed.core`'s.

**Layers.** This module is the top of `rolltool.packed`: `PackedDataset` is the core reader
(`rolltool.packed.core.PackedReader`: opening, checks, rows as arrays or tensors) plus
``torch_dataset``, which makes the torch adapter's `rolltool.packed.torch_data.RankRows`. The
adapter reads through the core and knows nothing of this class, so the dependency runs one way:
reader -> torch_data -> core -> tensors. ``torch_dataset`` imports the adapter when called (it
imports torch, which opening and NumPy reads never load).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rolltool.packed.core import VERIFY_MODES, PackedReader, RowRef, VerifyMode, value_problem

if TYPE_CHECKING:
    from rolltool.packed.torch_data import RankRows

__all__ = [
    "VERIFY_MODES",
    "PackedDataset",
    "PackedReader",
    "RowRef",
    "VerifyMode",
    "open_packed",
    "value_problem",
]


class PackedDataset(PackedReader):
    """A packed directory written by `rolltool pack` (see the module docstring): the core
    reader's rows (`PackedReader`) and `torch_dataset`.

    ``verify``: one of `VERIFY_MODES`; ``"checks"`` (default) the cheap checks on every shard,
    ``"hash"`` also each shard's sha256 on its first read."""

    def torch_dataset(
        self,
        rank: int,
        *,
        start_step: int = 0,
        start_micro_batch: int = 0,
        pin_memory: bool = False,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
    ) -> RankRows:
        """Rank `rank`'s rows from (start_step, start_micro_batch) on as a torch
        ``IterableDataset`` of `rolltool.packed.torch_data.MicroBatch` dicts (tensors, plus ints
        ``step`` and ``micro_batch``): use ``DataLoader(..., batch_size=None,
        collate_fn=rolltool.packed.torch_data.as_is)``; any ``num_workers`` gives the same
        order; ``state_dict``/``load_state_dict`` resume it (see
        `rolltool.packed.torch_data.RankRows`). ``sp_rank`` / ``cp_rank``: one GPU's view."""
        # below this module; imported here, not on top, because it imports torch
        from rolltool.packed.torch_data import RankRows

        self.gpu_view(sp_rank=sp_rank, cp_rank=cp_rank)  # refuse a wrong one now, not in a worker
        return RankRows(
            self,
            rank,
            start_step=start_step,
            start_micro_batch=start_micro_batch,
            pin_memory=pin_memory,
            sp_rank=sp_rank,
            cp_rank=cp_rank,
        )


def open_packed(path: str | os.PathLike[str], *, verify: VerifyMode = "checks") -> PackedDataset:
    """Open a packed directory (see PackedDataset). ``verify="hash"``: also check each shard's
    sha256 against the manifest on its first read (see `VERIFY_MODES`)."""
    return PackedDataset(path, verify=verify)
