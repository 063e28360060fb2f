"""A reader row as torch tensors: the one conversion, with no dataset around it.

Below the reader (`rolltool.packed.core` calls `to_tensors` for ``read_rows(..., torch=True)``)
and the torch adapter (`rolltool.packed.torch_data`, for every item it yields); it imports no
other module of `rolltool.packed`. It imports torch, so the reader imports it only when asked
for tensors: ``import rolltool`` and reading NumPy rows never load torch.

**Copies.** Shard files are memory-mapped. Stored arrays (``input_ids``, ``loss_mask``,
``logprobs``, ``sample_index``) are copied once from the page cache into their tensor, never
wrapped (a tensor over a read-only map is undefined behaviour); derived arrays are computed into
fresh memory and wrapped. Pinned or shared, every array of a row is copied once into one buffer
(see `to_tensors`).
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


def to_tensors(
    row: dict[str, np.ndarray], *, pin_memory: bool = False, shared: bool = False
) -> dict[str, torch.Tensor]:
    """A reader row as tensors. Plain: read-only (memory-mapped) arrays copied once into new
    tensors, fresh (derived) arrays wrapped without a copy. Pinned or shared: every array copied
    once into one buffer for the whole row (one allocation, one shared-memory segment), each
    tensor a view of its 8-byte-aligned slice."""
    if not (pin_memory or shared):
        return {k: torch.from_numpy(a if a.flags.writeable else a.copy()) for k, a in row.items()}
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
