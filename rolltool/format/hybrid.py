"""``--hybrid-cp`` rows: a group's C GPUs cut into sub-groups per row, and each GPU's view.

A hybrid pack (format version 3) stores one *group row* per (step, rank, micro-batch), like
``--cp C``, holding every token of the slot once; what differs is how the row's C GPUs share
it. Per row they are partitioned into **aligned power-of-two blocks** (sub-groups): GPUs
``[a, a + k)`` with ``a`` a multiple of k, k in {1, 2, 4, ..., C}. A block of k > 1 GPUs holds a
``--cp k`` micro-batch (every sample in it zigzag-split over the k GPUs, `rolltool.format.split`);
a block of one GPU holds a plain packed row of whole samples. Two arrays say how:

- ``row_cp_groups`` (`HYBRID_ROW_ARRAYS`, [R·C] int32, flat): row r's entries ``[r·C, (r+1)·C)``
  are each GPU's block size, e.g. ``[2, 2, 1, 1]``;
- ``seg_cp_start`` (`HYBRID_SEGMENT_ARRAYS`, [S] int32): each segment's block, by its first GPU.

The row stores its blocks in GPU order, each as one contiguous run of segments laid out as that
block's own row: with k > 1 as a ``--cp k`` row (each sample followed by the padding that brings
it to a multiple of 2k; with ``--row-len R`` the block padded to k·R, the padding a multiple of
2k), with k = 1 as a plain row (samples unpadded; with ``--row-len R`` padded to R; a GPU with
no sample gets one padding token, as an empty plain micro-batch does). So every GPU's tokens are
its block's tokens / k, under the per-GPU budget (CP padding counted, row-end padding not).

Worked example, C = 4, groups ``[2, 2, 1, 1]``: a 10-token sample split over GPUs 0-1 (padded to
12), a 3-token sample on GPU 2, nothing on GPU 3. Segments: ``10 (start 0), 2 pad (0), 3 (2),
1 pad (3)``; GPU 0's view is `cp_view` of the first 12 tokens for CP rank 0 of 2 (tokens ``0 1 2
9 p p``), GPU 1's for rank 1, GPU 2's the plain row ``[3 tokens]``, GPU 3's one padding token.

`hybrid_view` gives GPU i's view: its block's sub-row (next-token targets derived on the whole
group row first, like every view), as `cp_view` for k > 1 or as it is for k = 1, plus
``cp_group_size``, ``cp_group_rank`` and ``cp_group_start`` ([1] int64 each; the member GPUs are
``[start, start + size)``). `hybrid_problem` is the reader's cheap check of the layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format.layout import PackedRows, SampleTokens, pack_rows
from rolltool.format.spec import HYBRID_ROW_ARRAYS, HYBRID_SEGMENT_ARRAYS, PAD_SAMPLE
from rolltool.format.split import CP_BOUNDARIES, PER_TOKEN, cp_view

GROUP_FIELDS = ("cp_group_size", "cp_group_rank", "cp_group_start")
"""What a hybrid GPU view adds ([1] int64 each): its sub-group's size k, its rank in it, and
the sub-group's first GPU of the data-parallel group."""

ROW_FIELDS = ("cp_groups", "cp_start")
"""What a hybrid group row (no ``cp_rank``) adds: ``cp_groups`` [C] int32 each GPU's sub-group
size, ``cp_start`` [n] int32 each segment's sub-group (its first GPU)."""


@dataclass(frozen=True)
class HybridRows(PackedRows):
    """`PackedRows` of a hybrid pack: the two arrays that cut each row over its C GPUs."""

    seg_cp_start: np.ndarray  # [S] int32, the first GPU of each segment's sub-group
    row_cp_groups: np.ndarray  # [R·C] int32, each row's C sub-group sizes, flat


def blocks(groups: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """A row's sub-groups as (first GPU, size), in GPU order, from each GPU's size (which must
    be a valid partition: `partition_problem`).

    >>> blocks([2, 2, 1, 1])
    [(0, 2), (2, 1), (3, 1)]
    """
    out, g = [], 0
    sizes = [int(x) for x in groups]
    while g < len(sizes):
        out.append((g, sizes[g]))
        g += sizes[g]
    return out


def partition_problem(groups: np.ndarray, cp: int) -> str | None:
    """Why `groups` ([cp] each GPU's sub-group size) is not a partition of the cp GPUs into
    aligned power-of-two blocks, or None."""
    sizes = [int(x) for x in groups]
    if len(sizes) != cp:
        return f"{len(sizes)} sub-group sizes for {cp} GPUs"
    for g, k in enumerate(sizes):
        if k < 1 or k > cp or k & (k - 1):
            return f"GPU {g}'s sub-group size {k} is not a power of two up to cp = {cp}"
        a = g - g % k
        if any(x != k for x in sizes[a : a + k]):
            return f"GPUs {a}..{a + k - 1} do not form one aligned sub-group of {k} ({sizes})"
    return None


# -- writing ----------------------------------------------------------------------------------


def hybrid_rows(
    tokens: SampleTokens,
    rows: Sequence[np.ndarray],
    *,
    cp_start: np.ndarray,
    groups: np.ndarray,
    sample_index: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    row_len: int | None = None,
    pad_id: int = 0,
) -> HybridRows:
    """Lay out `rows` (each an array of positions k into `tokens`, sub-group by sub-group in
    GPU order) as hybrid group rows: ``groups[j]`` ([cp]) is row j's partition, ``cp_start[k]``
    position k's sub-group (its first GPU); ``row_len`` is per GPU. Each block is laid out by
    `pack_rows` as its own row (see the module docstring), then the blocks of a row are
    concatenated."""
    parts: list[PackedRows] = []
    starts: list[int] = []
    per_row: list[int] = []
    for j, members in enumerate(rows):
        members = np.asarray(members, dtype=np.int64)
        found = blocks(groups[j])
        per_row.append(len(found))
        at = cp_start[members]
        for a, k in found:
            mine = members[at == a]
            split = 2 * k if k > 1 else 1
            parts.append(
                pack_rows(tokens, [mine], sample_index=sample_index, advantage=advantage,
                          weight=weight, row_len=None if row_len is None else row_len * k,
                          pad_id=pad_id, sample_multiple=split, row_multiple=split)
            )  # fmt: skip
            starts.append(a)
        assert len(at) == sum(int((at == a).sum()) for a, _ in found), "a sample outside a block"
    return _merge(parts, starts, per_row, groups.reshape(-1).astype(np.int32))


def _merge(
    parts: list[PackedRows], starts: list[int], per_row: list[int], groups: np.ndarray
) -> HybridRows:
    """Blocks laid out as one-row `PackedRows` each -> the group rows (`per_row` blocks each)."""

    def cat(name: str, dtype: type) -> np.ndarray:
        pieces = [getattr(p, name) for p in parts]
        return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)

    block_tokens = np.array([int(p.row_offsets[-1]) for p in parts], dtype=np.int64)
    block_segments = np.array([int(p.row_segments[-1]) for p in parts], dtype=np.int64)
    first = np.zeros(len(per_row) + 1, dtype=np.int64)
    np.cumsum(per_row, out=first[1:])
    tok = np.concatenate([[0], np.cumsum(block_tokens)]).astype(np.int64)
    seg = np.concatenate([[0], np.cumsum(block_segments)]).astype(np.int64)
    return HybridRows(
        input_ids=cat("input_ids", np.int32),
        loss_mask=cat("loss_mask", np.uint8),
        logprobs=cat("logprobs", np.float32),
        row_offsets=tok[first],
        seq_lens=cat("seq_lens", np.int32),
        sample_index=cat("sample_index", np.int64),
        seg_advantage=cat("seg_advantage", np.float32),
        seg_weight=cat("seg_weight", np.float32),
        row_segments=seg[first],
        seg_cp_start=np.repeat(np.array(starts, dtype=np.int32), block_segments),
        row_cp_groups=groups,
    )


def hybrid_step_rows(
    tokens: SampleTokens,
    micro_batches: Sequence[Sequence[np.ndarray]],
    *,
    cp_start: np.ndarray,
    groups: np.ndarray,
    sample_index: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    row_len: int | None = None,
    pad_id: int = 0,
) -> Iterator[HybridRows]:
    """Each rank's hybrid rows of one step (`hybrid_rows`): like
    `rolltool.format.layout.step_rows`, `tokens` and the per-sample arrays (``cp_start``
    included) in row order; ``groups`` [dp, M, cp]."""
    start = 0
    for r, mbs in enumerate(micro_batches):
        spans = []
        for m in mbs:
            spans.append(np.arange(start, start + len(m)))
            start += len(m)
        yield hybrid_rows(tokens, spans, cp_start=cp_start, groups=groups[r],
                          sample_index=sample_index, advantage=advantage, weight=weight,
                          row_len=row_len, pad_id=pad_id)  # fmt: skip


# -- reading ----------------------------------------------------------------------------------


def row_groups(arrays: dict[str, np.ndarray], r: int, cp: int) -> np.ndarray:
    """[cp] int32: row r's sub-group sizes (``row_cp_groups``)."""
    return arrays["row_cp_groups"][r * cp : (r + 1) * cp]


def hybrid_fields(arrays: dict[str, np.ndarray], r: int, cp: int) -> dict[str, np.ndarray]:
    """`ROW_FIELDS` of row r of a hybrid shard's arrays (beside `unpack_row`'s)."""
    s0, s1 = int(arrays["row_segments"][r]), int(arrays["row_segments"][r + 1])
    return {"cp_groups": row_groups(arrays, r, cp), "cp_start": arrays["seg_cp_start"][s0:s1]}


def hybrid_view(row: dict[str, np.ndarray], cp: int, rank: int) -> dict[str, np.ndarray]:
    """GPU `rank`'s view of a hybrid group row (a reader row with `ROW_FIELDS`): its
    sub-group's segments as a plain row (k = 1) or as `cp_view` for its rank in the sub-group
    (k > 1), plus `GROUP_FIELDS`. See the module docstring."""
    if not isinstance(rank, int | np.integer) or not 0 <= rank < cp:
        raise RolltoolError(f"cp_rank {rank} out of range (the pack's group has {cp} GPUs)")
    groups = row["cp_groups"]
    wrong = partition_problem(groups, cp)
    if wrong is not None:
        raise RolltoolError(f"not a hybrid CP row ({wrong})")
    k = int(groups[rank])
    a = rank - rank % k
    mine = np.flatnonzero(row["cp_start"] == a)
    if not len(mine) or mine[-1] - mine[0] + 1 != len(mine):
        raise RolltoolError(f"sub-group {a}..{a + k - 1} is not one run of segments")
    s0, s1 = int(mine[0]), int(mine[-1]) + 1
    cu = row["cu_seqlens"]
    t0, t1 = int(cu[s0]), int(cu[s1])
    sub = {key: row[key][t0:t1] for key in PER_TOKEN}
    sub["cu_seqlens"] = (cu[s0 : s1 + 1] - cu[s0]).astype(np.int32)
    sub["sample_index"] = row["sample_index"][s0:s1]
    if k > 1:
        sub = cp_view(sub, k, rank - a)
        keys: tuple[str, ...] = (*PER_TOKEN, *CP_BOUNDARIES)
    else:
        keys = (*PER_TOKEN, "cu_seqlens", "sample_index")
    out = {key: sub[key] for key in keys}
    for key, value in zip(GROUP_FIELDS, (k, rank - a, a), strict=True):
        out[key] = np.array([value], dtype=np.int64)
    return out


# -- the reader's cheap check -----------------------------------------------------------------


def hybrid_problem(
    arrays: dict[str, np.ndarray], cp: int, row_len: int | None, cap: int | None
) -> str | None:
    """Why a hybrid shard's rows are not laid out as a ``--hybrid-cp`` pack's, or None: the two
    arrays present with their dtypes and lengths; each row's sizes a partition of the cp GPUs
    into aligned power-of-two blocks (`partition_problem`); its segments in its blocks in GPU
    order, every block at least one segment (each GPU has a view); in a block of k > 1 every
    sample followed by exactly its padding to a multiple of 2k and every other padding segment
    a multiple of 2k (valid THD for the block's ring); with ``row_len`` (per GPU) every block
    k x row_len tokens; every GPU's tokens, CP padding counted and row-end padding not, at most
    ``cap`` (the per-GPU budget). Expects arrays that passed `value_problem`; O(rows + blocks)
    Python steps over NumPy slices."""
    for name, dtype in {**HYBRID_SEGMENT_ARRAYS, **HYBRID_ROW_ARRAYS}.items():
        if name not in arrays:
            return f"missing array {name} (a --hybrid-cp pack's)"
        if arrays[name].ndim != 1 or arrays[name].dtype != dtype:
            return f"{name} is not a 1-D {np.dtype(dtype).name} array"
    rows = len(arrays["row_offsets"]) - 1
    if len(arrays["row_cp_groups"]) != rows * cp:
        return f"row_cp_groups holds {len(arrays['row_cp_groups'])} sizes for {rows} rows x {cp}"
    start, lens = arrays["seg_cp_start"], arrays["seq_lens"].astype(np.int64)
    if len(start) != len(lens):
        return "seg_cp_start and seq_lens have different lengths"
    index, bounds = arrays["sample_index"], arrays["row_segments"]
    for r in range(rows):
        groups = row_groups(arrays, r, cp)
        wrong = partition_problem(groups, cp)
        if wrong is not None:
            return f"row {r}: {wrong}"
        s0, s1 = int(bounds[r]), int(bounds[r + 1])
        found = blocks(groups)
        want = np.array([a for a, _ in found], dtype=np.int64)
        at = start[s0:s1]
        runs = np.flatnonzero(np.diff(at, prepend=-1) != 0)
        if not np.array_equal(at[runs], want):
            return (
                f"row {r}: segments of sub-groups {at[runs].tolist()} in this order, the row's "
                f"sub-groups are {want.tolist()} (each one run of segments, in GPU order)"
            )
        ends = np.append(runs[1:], len(at))
        for (a, k), b0, b1 in zip(found, runs.tolist(), ends.tolist(), strict=True):
            why = block_problem(lens[s0 + b0 : s0 + b1], index[s0 + b0 : s0 + b1], k, row_len, cap)
            if why is not None:
                return f"row {r}, sub-group {a}..{a + k - 1}: {why}"
    return None


def block_problem(
    lens: np.ndarray, index: np.ndarray, k: int, row_len: int | None, cap: int | None
) -> str | None:
    """Why one block's segments are not laid out as a k-GPU block's own row, or None."""
    pad = index == PAD_SAMPLE
    used = int(lens.sum())
    if k > 1:
        m = 2 * k
        q = 0
        while q < len(lens):
            n = int(lens[q])
            if pad[q]:
                if n % m:
                    return f"{n} padding tokens are not a multiple of 2 x {k} = {m} (not valid THD)"
                q += 1
                continue
            need = -n % m
            got = int(lens[q + 1]) if need and q + 1 < len(lens) and pad[q + 1] else 0
            if got != need:
                return (
                    f"sample {int(index[q])} ({n} tokens) is not followed by the {need} padding "
                    f"tokens that bring it to a multiple of 2 x {k} = {m}"
                )
            q += 2 if need else 1
    if row_len is not None and used != row_len * k:
        return f"{used} tokens, not {k} x --row-len {row_len} = {row_len * k}"
    if cap is not None:
        real = lens[~pad]
        held = int((-(-real // (2 * k)) * 2).sum()) if k > 1 else int(real.sum())
        if held > cap:
            return f"{held} tokens on each GPU (CP padding counted), over the {cap}-token budget"
    return None
