"""The torch side of the consumer contract: a resumable, worker-sharded dataset of packed rows.

Built on the reader's core (`rolltool.packed.core.PackedReader`: `RankRows` reads through it)
and on `rolltool.packed.tensors.to_tensors`; the reader never imports this module.
``ds.torch_dataset(rank)`` (`rolltool.packed.reader.PackedDataset`, the layer above) makes a
`RankRows`, importing this module then: ``import rolltool`` and the CLI never import torch.

>>> data = ds.torch_dataset(rank, start_step=12)                 # doctest: +SKIP
>>> loader = DataLoader(data, batch_size=None, collate_fn=as_is)  # each item is one micro-batch
>>> for mb in prefetch(loader, "cuda"):                           # next one's copy in flight
...     mb["step"], mb["micro_batch"], mb["input_ids"], mb["cu_seqlens"], ...

**Order.** A rank's *stream* is its rows in (step, micro_batch) order (`PackedDataset.rank_rows`).
With W DataLoader workers, worker w yields stream rows w, w + W, w + 2W, ... of the (resumed)
stream, so the DataLoader's in-order round robin gives exactly the single-process order: with
W = 2 and rows r0..r4, worker 0 yields r0 r2 r4, worker 1 yields r1 r3, the loader r0 r1 r2 r3 r4.

**Batching.** Every item is already a packed micro-batch of its own length: use
``batch_size=None``, and ``collate_fn=as_is``, which hands each item on as it is (without it
torch's ``default_convert`` copies every item's dict and visits each of its 14 values: ~10-25
us a row, a tenth of a 0-worker pass over ~27k-token rows). With no workers the dataset can
be iterated itself (``for mb in data``: the same items, ``state_dict`` and ``pin_memory``
included); a DataLoader then adds only its own ``__next__``, whose profiler scope alone took
~30 us a row in a pass on the development VM. The default ``batch_size=1`` (or any other) is
refused with a ValueError that says so, instead of torch's stack error.

**Resume.** ``start_step=`` / ``start_micro_batch=`` start the stream anywhere (the rows of
(s, j) onward, with any number of workers): resume at the last consumed item's (step,
micro_batch + 1). ``state_dict()`` / ``load_state_dict()`` make the dataset ``Stateful`` for
torchdata's ``StatefulDataLoader``, which saves and restores each worker's position.

**Copies.** Shard files are held private to the process (read whole, or over 2 MB mapped
copy-on-write: `rolltool.packed.core.PrivateShard`): a plain item's tensors copy nothing,
stored arrays (``input_ids``, ``loss_mask``, ``logprobs``, ``sample_index``) wrapped where they
lie (a write to one changes the process's copy, never the file) and derived arrays
computed into fresh memory (`rolltool.packed.tensors.to_tensors`). With ``pin_memory=True`` (no
workers) every array is copied once into one pinned buffer per row, ready for ``.to(device,
non_blocking=True)``; `prefetch` issues the next row's transfer while the current one is used.

**Workers.** A worker's item crosses to the main process by reference (`WorkerItem`): the
worker maps and checks the shard and makes the item; the DataLoader's queue carries where its
row lies (~0.5 kB); the main process reads or maps the same file itself (kept per process),
refuses it if it is not the file the worker checked (device, inode, size, mtime) and makes the
same tensors as a 0-worker read (`_rebuild`; the stored arrays copied out of the shard it
keeps, so a write to an item never reaches the rows rebuilt after it, a later epoch's). No
tensor goes through shared memory, whose fresh pages made two workers ~10x slower than none on
the development VM; an item of a remote shard (read whole), or one changed in the worker,
still does. A DataLoader's
``pin_memory=True`` copies each item once into pinned memory (in its pin-memory thread, which
then also makes the rows). Two workers still read ~7x slower than none on the 2-core
development VM, in wall and in CPU time (docs/performance.md, "loading"; ~10x before the
item's bytes were compared instead of crc32'd, `WorkerItem`): starting, feeding and stopping
a 2-worker DataLoader costs more than a whole 0-worker pass there (~0.78 s wall and CPU a
pass with items of one int, against ~0.45 s for the whole 0-worker pass), the row is made
twice (in the worker and again in the main process), and three processes share two cores.
Prefer ``num_workers=0`` unless the workers run a per-row transform worth a process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterableDataset, get_worker_info

from rolltool.errors import RolltoolError
from rolltool.packed.core import RowSource, rebuild_row
from rolltool.packed.tensors import memory_owner, to_tensors

if TYPE_CHECKING:
    from rolltool.packed.core import PackedReader

BATCH_HINT = (
    "use DataLoader(..., batch_size=None): each item is already a packed micro-batch "
    "(one row of many samples, its own length)"
)


class MicroBatch(dict[str, Any]):
    """One packed row: per-token tensors (``input_ids`` [T] int32, ``position_ids`` [T] int32,
    ``loss_mask`` [T] uint8, ``advantages``/``logprobs``/``loss_weight`` [T] float32), the
    next-token targets of each token's logits (``target_ids`` [T] int32, -100 for none:
    ``.long()`` for cross-entropy or ``gather``; ``target_loss_weight``/``target_advantages``/
    ``target_logprobs`` [T] float32, 0 for none; `rolltool.format.targets`), per-segment
    ``cu_seqlens`` [n+1] int32 and ``sample_index`` [n] int64, and the ints ``step`` and
    ``micro_batch`` saying where it is in the run. A CP view adds ``cu_seqlens_padded`` and
    ``cu_seqlens_unpadded`` [n+1] int32 (`rolltool.format.split.cp_view`), an SP view
    ``sp_offset`` [1] int64."""

    def __copy__(self) -> MicroBatch:
        """A shallow copy as a dict copies (the DataLoader's ``default_convert`` copies every
        item: ``copy.copy`` of a dict subclass otherwise goes through ``__reduce_ex__``)."""
        return type(self)(self)


class WorkerItem(MicroBatch):
    """A DataLoader worker's `MicroBatch` of a local shard: plain tensors (no shared memory), and
    a pickling that hands the main process where the row lies instead of its tensors.

    The DataLoader's queue pickles every worker item (torch's ``ForkingPickler``, which moves a
    tensor's storage into shared memory: fresh memory for every row, whose page faults made two
    workers ~10x slower than none on the development VM). This item pickles as its
    `rolltool.packed.core.RowSource` (~0.5 kB): the main process reads the same shard private
    (kept per process) and makes the row as a 0-worker read does (`_rebuild`): the same
    tensors, the stored arrays copied out of the kept shard (`_own`), the derived ones computed
    again (~0.05-0.2 ms a row; sent through the queue's pipe instead they cost the main process
    ~1.5-2.7 ms). A shard that is no longer the file the worker checked is refused there. An item changed in the
    worker after it was made (a key added or replaced, a tensor written by torch or through
    ``.numpy()``/``.data``, or given another dtype, shape or storage: each tensor's bytes are
    copied when the item is made and compared, with its dtype and shape, when it is sent,
    `_bytes_of`) crosses as a plain `MicroBatch`, its tensors through shared memory. Only the
    multiprocessing queue's pickler (``ForkingPickler``) sends it by reference; ``torch.save``,
    ``copy.deepcopy`` and any other pickling get its tensors."""

    source: RowSource
    made: tuple[tuple[str, Any, _Bytes | None], ...]
    """(key, value, the tensor's `_Bytes` or None) of every entry, as made."""

    @classmethod
    def of(
        cls, step: int, micro_batch: int, arrays: dict[str, np.ndarray], source: RowSource
    ) -> WorkerItem:
        """The item of a row of a shard private to this process (`arrays`, writable
        throughout): each tensor wraps its array, so each array's bytes are its tensor's, as
        made."""
        tensors = to_tensors(arrays, writable=True)
        item = cls(step=step, micro_batch=micro_batch)
        item.update(tensors)
        item.source = source
        ints = (("step", step, None), ("micro_batch", micro_batch, None))
        made = ((k, t, _bytes_of_array(arrays[k])) for k, t in tensors.items())
        item.made = (*ints, *made)
        return item

    def __copy__(self) -> WorkerItem:
        new = type(self)(self)
        new.source, new.made = self.source, self.made
        return new

    def unchanged(self) -> bool:
        """Whether every entry is the one made, with the dtype, shape and bytes it was made
        with."""
        if len(self) != len(self.made):
            return False
        return all(
            key == k and value is v and (was is None or _bytes_of(value) == was)
            for (key, value), (k, v, was) in zip(self.items(), self.made, strict=True)
        )

    def __reduce__(self) -> Any:
        return MicroBatch, (dict(self),)


_Bytes = tuple[np.dtype[Any], tuple[int, ...], bytes]
"""A tensor's contents as NumPy sees them: dtype, shape and its bytes in C order."""


def _bytes_of_array(array: np.ndarray) -> _Bytes:
    return array.dtype, array.shape, array.tobytes()


def _bytes_of(value: Any) -> _Bytes | None:
    """A tensor's `_Bytes` (None for anything else), read through the tensor as it is now:
    what a write through any path changes (``_version`` misses writes through ``.numpy()`` or
    ``.data``), and what ``.set_()``, ``.resize_()`` or a ``.data`` swap change too. Exact,
    and cheaper than the crc32 of each tensor it replaces (~0.28 ms a row of 1.2 MB on the
    development VM, taken when made and when sent): ~25 us to copy a row when it is made,
    ~80 us to copy and compare it when it is sent (`WorkerItem.unchanged`, timeit, warm).
    None too for a tensor NumPy cannot read (given a dtype NumPy lacks, such as bfloat16, in
    place), and for one made to require grad (``requires_grad_()``, which no byte shows):
    every tensor made had an array, so it compares unequal, changed."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.requires_grad:  # made without it: rebuilt by reference, the flag would be lost
        return None
    try:
        array = value.detach().numpy()
    except (TypeError, RuntimeError):  # bfloat16, another device, a neg bit: not as made
        return None  # (raised here, in the queue's feeder thread, the DataLoader would hang)
    return _bytes_of_array(array)


def _reduce_for_queue(item: WorkerItem) -> Any:
    """How the DataLoader's queue (``ForkingPickler``) sends a `WorkerItem`: by reference when
    it is as made, else as a plain `MicroBatch` (its tensors through shared memory)."""
    if not item.unchanged():
        return MicroBatch, (dict(item),)
    return _rebuild, (item.source, tuple(item), item["step"], item["micro_batch"])


ForkingPickler.register(WorkerItem, _reduce_for_queue)


def _rebuild(source: RowSource, keys: tuple[str, ...], step: int, micro_batch: int) -> Any:
    """A `WorkerItem` unpickled in the main process: its row made here, as a `MicroBatch`. An
    error (a `RolltoolError`: the shard changed since the worker checked it; or any other)
    comes back as torch's ``ExceptionWrapper``, which the DataLoader re-raises in the main
    process as it does a worker's error: raised here, inside the queue's unpickling, it would
    kill a DataLoader's pin-memory thread ("Pin memory thread exited unexpectedly") instead."""
    try:
        row = {key: _own(array) for key, array in rebuild_row(source).items()}
        item = MicroBatch(step=step, micro_batch=micro_batch)
        item.update(to_tensors(row, writable=True))
        if tuple(item) != keys:  # pragma: no cover - one recipe makes both: a bug
            raise AssertionError(f"rebuilt {tuple(item)}, the worker made {keys}")
    except Exception:
        return ExceptionWrapper(where="in the main process, making a DataLoader worker's item")
    return item


def _own(array: np.ndarray) -> np.ndarray:
    """`array` where NumPy made it for this row (a derived array), else a copy: a stored array
    lies in the shard `rebuild_row` keeps for the rows after it, the next epoch's included,
    which a write to this item's tensor (``mul_``, ``add_``: a trainer's in-place step) must not
    reach (~25 us a row of ~27k tokens)."""
    owner = memory_owner(array)
    made = isinstance(owner, np.ndarray) and not getattr(owner, "copy_on_write", False)
    return array if made else array.copy()  # (a `PrivateRead` owns its memory: a shard's)


def _refuse_batching(batch: Any, *, collate_fn_map: Any = None) -> Any:
    raise ValueError(
        f"a DataLoader batch_size cannot collate packed micro-batches (got {len(batch)}): "
        + BATCH_HINT
    )


def _register_refusal() -> None:
    """torch's documented way to extend ``default_collate``: its type registry."""
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover - an older or newer torch: its stack error remains
        return
    default_collate_fn_map[MicroBatch] = _refuse_batching


_register_refusal()


def as_is(item: Any) -> Any:
    """The DataLoader's ``collate_fn`` for `RankRows` (with ``batch_size=None``): each item
    handed on as it is, already a micro-batch of tensors (the default, ``default_convert``,
    copies its dict and visits every value). A batch (a list of items: any ``batch_size``) is
    refused with the sentence the default collate's refusal gives."""
    if not isinstance(item, MicroBatch):
        _refuse_batching(item)
    return item


class RankRows(IterableDataset[MicroBatch]):
    """One rank's rows as `MicroBatch` items (see the module docstring): sharded over DataLoader
    workers in stream order, resumable, optionally pinned. Made by `PackedDataset.torch_dataset`
    (`rolltool.packed.reader`); reads through any `PackedReader`.
    """

    def __init__(
        self,
        ds: PackedReader,
        rank: int,
        *,
        start_step: int = 0,
        start_micro_batch: int = 0,
        pin_memory: bool = False,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.ds, self.rank, self.pin_memory = ds, rank, pin_memory
        self.gpu: dict[str, int | None] = {"sp_rank": sp_rank, "cp_rank": cp_rank}
        self.start = ds.stream_position(rank, start_step, start_micro_batch)
        # What every iterator needs, made here once: DataLoader workers inherit it (forked) or
        # receive it (pickled) instead of each listing the shards and reading samples.parquet's
        # lengths again; a directory that does not match its manifest is refused here, in the
        # process that made the dataset, not in a worker.
        ds.rank_rows(rank)
        ds._sample_lengths  # noqa: B018  (PackedReader's cached samples.parquet lengths)
        if pin_memory and not torch.accelerator.is_available():
            raise RolltoolError(
                "pin_memory=True needs an accelerator (torch finds none)",
                hint="leave pin_memory off on a CPU-only machine",
            )
        self._next, self._stride, self._worker = self.start, 1, 0
        self._loaded: dict[str, Any] | None = None

    def __len__(self) -> int:
        """Rows from the start position to the end (over all workers)."""
        return len(self.ds.rank_rows(self.rank)) - self.start

    def __iter__(self) -> Iterator[MicroBatch]:
        info = get_worker_info()
        stride, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self.pin_memory and info is not None:
            raise RolltoolError(
                "torch_dataset(pin_memory=True) pins in the process that reads; in a "
                "DataLoader worker it cannot",
                hint="with num_workers > 0 pass pin_memory=True to the DataLoader instead",
            )
        if self._loaded is not None:
            first = self._resume_position(self._loaded, stride, worker)
            self._loaded = None
        else:
            first = self.start + worker
        self._next, self._stride, self._worker = first, stride, worker
        return self._rows(first, stride, shared=info is not None)

    def _rows(self, first: int, stride: int, *, shared: bool) -> Iterator[MicroBatch]:
        """Stream rows first, first + stride, ...; `shared` (in a DataLoader worker): items
        that cross to the main process, by reference (`WorkerItem`) when their shard is a
        local map, else in shared memory (a remote shard, read whole)."""
        refs = self.ds.rank_rows(self.rank)[first::stride]
        gpu = self.gpu
        rows = self.ds.sourced_rows(
            refs, sp_rank=gpu["sp_rank"], cp_rank=gpu["cp_rank"], for_tensors=True
        )
        for ref, (row, source) in zip(refs, rows, strict=True):
            item: MicroBatch
            # a row of a shard private to this process (source) is writable throughout
            if shared and source is not None:
                item = WorkerItem.of(ref.step, ref.micro_batch, row, source)
            else:
                item = MicroBatch(step=ref.step, micro_batch=ref.micro_batch)
                pin, mine = self.pin_memory, source is not None
                item.update(to_tensors(row, pin_memory=pin, shared=shared, writable=mine))
            self._next += stride  # before yielding: state_dict() now names the next row
            yield item

    def _position(self, index: int) -> tuple[int, int]:
        refs = self.ds.rank_rows(self.rank)
        if index >= len(refs):
            return self.ds.num_steps, 0
        return refs[index].step, refs[index].micro_batch

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator (this worker's, in a DataLoader worker) goes on: the (step,
        micro_batch) of the next row it yields, (num_steps, 0) at the end; after
        `load_state_dict` and before the ``iter()`` it applies to, the state loaded (where
        that iterator will start), not the position of the pass before it."""
        if self._loaded is not None:
            return dict(self._loaded)
        step, micro_batch = self._position(self._next)
        return {
            "rank": self.rank,
            **{k: v for k, v in self.gpu.items() if v is not None},
            "step": step,
            "micro_batch": micro_batch,
            "num_workers": self._stride,
            "worker": self._worker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` at the next ``iter()`` (in the same worker slot)."""
        if state.get("rank") != self.rank:
            raise RolltoolError(
                f"the saved loader state is rank {state.get('rank')}'s, this dataset is rank "
                f"{self.rank}'s"
            )
        for key, mine in self.gpu.items():
            if state.get(key) != mine:
                raise RolltoolError(
                    f"the saved loader state is {key} {state.get(key)}'s, this dataset is "
                    f"{key} {mine}'s"
                )
        self._loaded = dict(state)

    def _resume_position(self, state: dict[str, Any], stride: int, worker: int) -> int:
        if (state["num_workers"], state["worker"]) != (stride, worker):
            raise RolltoolError(
                f"the saved state is worker {state['worker']} of {state['num_workers']}, this "
                f"iterator is worker {worker} of {stride}",
                hint="resume with the same num_workers, or start a new dataset at the last "
                "consumed item: torch_dataset(rank, start_step=s, start_micro_batch=j + 1)",
            )
        return self.ds.stream_position(self.rank, state["step"], state["micro_batch"])


def move(item: dict[str, Any], device: Any, *, non_blocking: bool = True) -> dict[str, Any]:
    """The item with every tensor on `device` (ints such as ``step`` stay as they are)."""
    return {
        k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        for k, v in item.items()
    }


def prefetch(items: Iterable[dict[str, Any]], device: Any) -> Iterator[dict[str, Any]]:
    """The items moved to `device`, the next one's transfer issued before the current one is
    handed out. On CUDA the copy runs on a side stream (from pinned memory it overlaps the
    compute); the consumer's stream waits for it before the item is used."""
    device = torch.device(device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    pending: tuple[dict[str, Any], Any] | None = None
    for item in items:
        staged = _stage(item, device, side)
        if pending is not None:
            yield _ready(*pending, device)
        pending = staged
    if pending is not None:
        yield _ready(*pending, device)


def _stage(item: dict[str, Any], device: torch.device, side: Any) -> tuple[dict[str, Any], Any]:
    if side is None:
        return move(item, device), None
    with torch.cuda.stream(side):
        moved = move(item, device)
    return moved, side.record_event()


def _ready(moved: dict[str, Any], event: Any, device: torch.device) -> dict[str, Any]:
    if event is not None:
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        for v in moved.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(current)  # the side stream's memory is now used by `current`
    return moved
