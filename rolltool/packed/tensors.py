"""A reader row as torch tensors: the one conversion, with no dataset around it.

Below the reader (`rolltool.packed.core` calls `to_tensors` for ``read_rows(..., torch=True)``)
and the torch adapter (`rolltool.packed.torch_data`, for every item it yields); it imports no
other module of `rolltool.packed`. It imports torch, so the reader imports it only when asked
for tensors: ``import rolltool`` and reading NumPy rows never load torch.

**Copies.** Plain tensors copy nothing. Local shard files are held private to the process
(`rolltool.packed.core.PrivateShard`: read whole into its memory, or over 2 MB mapped
copy-on-write): a stored array (``input_ids``, ``loss_mask``, ``logprobs``, ``sample_index``)
is wrapped as it lies there, and a write to its tensor changes this process's copy (a mapped
page is copied first), never the file or another read of it (the reader's NumPy views stay
read-only; a tensor and the NumPy row it was made from share that memory). Derived arrays are computed into fresh memory and wrapped. An array of a read-only
map or of bytes read whole (a remote shard) is copied once. Pinned or shared, every array of a
row is copied once into one buffer (see `to_tensors`).
"""

from __future__ import annotations

import numpy as np
import torch


def _block(nbytes: int, *, pin: bool, shared: bool) -> torch.Tensor:
    """One uint8 buffer: pinned, or in shared memory (then the worker -> main process hand-over
    copies nothing), or plain."""
    if shared:
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is None:  # pragma: no cover - torch without the allocator hook
            return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def memory_owner(a: np.ndarray) -> object:
    """What holds `a`'s memory: up its ``base`` chain to the array that owns it, the first one
    marked ``copy_on_write`` (a `rolltool.packed.core.PrivateRead`: a shard read whole), or the
    buffer under the chain (a map: `rolltool.packed.core.PrivateMap` behind ``np.frombuffer``'s
    memoryview)."""
    owner: object = a
    while (
        isinstance(owner, np.ndarray)
        and owner.base is not None
        and not getattr(owner, "copy_on_write", False)
    ):
        owner = owner.base
    return owner.obj if isinstance(owner, memoryview) else owner


def _wrappable(a: np.ndarray) -> np.ndarray:
    """`a` itself when writable (a derived array), a writable view of it when it lies in a
    shard's bytes private to this process (`rolltool.packed.core.PrivateShard`: a copy-on-write
    map, whose write copies the page, or the shard read whole into this process's memory: a
    write never reaches the file), else a copy (a read-only map, bytes read whole)."""
    if a.flags.writeable:
        return a
    if getattr(memory_owner(a), "copy_on_write", False):
        view = a.view()
        view.flags.writeable = True
        return view
    return a.copy()


def to_tensors(
    row: dict[str, np.ndarray],
    *,
    pin_memory: bool = False,
    shared: bool = False,
    writable: bool = False,
) -> dict[str, torch.Tensor]:
    """A reader row as tensors. Plain: every array wrapped without a copy (`_wrappable`: a
    stored one over the shard's private bytes; one that cannot be wrapped safely, a read-only
    map or bytes, copied once). ``writable``: every array of `row` is known writable (a row the
    reader made for tensors from a shard private to this process, `PackedReader.sourced_rows`
    with ``for_tensors``), each wrapped without looking at it (~1 us an array less). Pinned or
    shared: every array copied once into one buffer for the whole row (one allocation, one
    shared-memory segment), each tensor a view of its 8-byte-aligned slice."""
    if not (pin_memory or shared):
        if writable:
            return {k: torch.from_numpy(a) for k, a in row.items()}
        return {k: torch.from_numpy(_wrappable(a)) for k, a in row.items()}
    starts, end = {}, 0
    for key, a in row.items():
        starts[key] = end
        end += -(-a.nbytes // 8) * 8
    block = _block(max(end, 8), pin=pin_memory, shared=shared)
    out: dict[str, torch.Tensor] = {}
    for key, a in row.items():
        dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype  # numpy's dtype as torch's
        t = block[starts[key] : starts[key] + a.nbytes].view(dtype).view(a.shape)
        t.numpy()[...] = a
        out[key] = t
    return out
