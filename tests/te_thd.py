"""TransformerEngine's THD partitioner, ported line by line (its CUDA kernel has no CPU path).

``tex.thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, world_size, rank)``
(transformer_engine/pytorch/csrc/extensions/attention.cpp, ``thd_partition_indices_kernel`` in
common/fused_attn/thd_utils.cu): the row positions CP rank ``rank`` holds, in its local order,
each sequence's chunks ``rank`` and ``2 * world_size - 1 - rank``. Megatron-Core's
``get_thd_batch_on_this_cp_rank`` selects a rank's tokens with it. A failed ``NVTE_CHECK`` or
device ``assert`` of TE's is a RuntimeError here, as TE raises. Used by
tests/format/test_thd_rows.py (NumPy rows) and the Megatron oracle (`oracle_ports`, torch).
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"TransformerEngine check failed: {what}")


def _binary_search(target: int, array: list[int], length: int) -> int:
    """thd_utils.cuh ``binary_search``: the last i in [0, length - 2] with array[i] <= target
    (the segment of the boundaries holding ``target``)."""
    left, right = 1, length - 1
    while left < right:
        mid = (left + right) // 2
        if array[mid] <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


def partitioned_indices(
    cu_seqlens: Sequence[int], total_tokens: int, world_size: int, rank: int
) -> list[int]:
    """The kernel and its host checks over plain ints: [total_tokens / world_size] positions."""
    # attention.cpp: the host checks (the tensor's dtype and rank are the caller's)
    _check(len(cu_seqlens) >= 2, "cu_seqlens.size(0) >= 2")
    _check(0 <= rank < world_size, "rank >= 0 && rank < world_size")
    _check(world_size > 0, "world_size > 0")
    _check(
        total_tokens > 0 and total_tokens % (world_size * 2) == 0,
        f"total_tokens > 0 && total_tokens % (world_size * 2) == 0 ({total_tokens}, {world_size})",
    )
    batch = len(cu_seqlens) - 1
    # thd_partition_indices_kernel: the shared cu_seqlens / world_size, over every boundary
    local = []
    for i in range(batch + 1):
        seqlen = int(cu_seqlens[i])
        _check(seqlen % (world_size * 2) == 0, f"seqlen % (world_size * 2) == 0 ({seqlen})")
        local.append(seqlen // world_size)
    out = []
    for token_id in range(total_tokens // world_size):  # one thread per output token
        seq_id = _binary_search(token_id, local, batch + 1)
        seq_len = local[seq_id + 1] - local[seq_id]
        index = token_id - local[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += local[seq_id] * world_size + seq_len // 2 * offset
        out.append(index)
    return out
