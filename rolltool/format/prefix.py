"""Shared-prefix rows: what attention and the loss need, from the stored segment table alone.

A shared row (issue 24; docs/shared_prefix.md) stores each shared prefix once. Its segments are
laid out as today (``cu_seqlens`` over the stored tokens) plus one new array, ``parent`` [s]
(int): the segment whose tokens precede this one in every sample through it, or -1. A parent
comes before its children (``parent[j] < j``). A sample is a chain root -> ... -> its own
continuation, and concatenating the chain's stored tokens gives the sample back.

A child starts with its parent's *branch token* re-fed: with P the length its samples share, the
parent stores positions [start, P - 1) and every child starts at P - 1. So every stored token
has exactly one next-token target (see `shared_next_token_targets`), the trainer's loss code is
the same as for unshared rows, and only attention changes:

- a segment's queries are its stored tokens (``cu_seqlens_q`` = ``cu_seqlens``);
- its keys and values are [its ancestors' tokens, root first, then its own]: ``kv_index``
  gathers them from the stored tokens, ``cu_seqlens_k`` bounds them;
- attention is causal and bottom-right aligned (query j of a segment with q queries and k keys
  sees keys 0 .. k - q + j), as flash-attn >= 2.1 and ``causal_lower_right`` do it;
- positions continue from the chain: a segment's first token has position = the number of
  tokens its ancestors store (= its first token's index in its sample).

Worked example: a prefix of 3 stored tokens and two continuations of 2 and 1 tokens,
``cu_seqlens = [0, 3, 5, 6]``, ``parent = [-1, 0, 0]``::

    position_ids  = [0 1 2 | 3 4 | 3]
    cu_seqlens_k  = [0, 3, 8, 12]
    kv_index      = [0 1 2 | 0 1 2 3 4 | 0 1 2 5]

Pure NumPy, no I/O: the reader can call it on a row's arrays, and `rolltool.plan.prefix`
builds the table it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rolltool.format.layout import PackedRows, SampleTokens
from rolltool.format.spec import PAD_SAMPLE
from rolltool.format.targets import NO_TARGET, SHIFTED_FROM, TARGET_FIELDS

NO_PARENT = -1
"""``parent`` of a segment that starts its sample (a root prefix, an unshared sample, padding)."""


@dataclass(frozen=True)
class KernelIndex:
    """What a varlen attention kernel needs to compute a shared row exactly.

    N is the row's stored tokens, s its segments, K = ``cu_seqlens_k[-1]`` the gathered keys.
    """

    cu_seqlens_q: np.ndarray
    """[s+1] int32: query boundaries over the stored tokens (the row's ``cu_seqlens``)."""
    cu_seqlens_k: np.ndarray
    """[s+1] int32: boundaries of each segment's gathered key/value sequence."""
    kv_index: np.ndarray
    """[K] int64: the stored token behind each gathered key/value (``k[kv_index]``)."""
    position_ids: np.ndarray
    """[N] int64: each stored token's position in its sample (rotary embeddings)."""
    start: np.ndarray
    """[s] int64: the position of each segment's first token (what its ancestors store)."""
    max_seqlen_q: int
    max_seqlen_k: int


def check_parents(parent: np.ndarray) -> np.ndarray:
    """``parent`` as int64 [s], or ValueError unless every parent is -1 or an earlier segment."""
    p = np.asarray(parent, dtype=np.int64)
    bad = (p < NO_PARENT) | (p >= np.arange(len(p)))
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"segment {j}'s parent {int(p[j])} is not -1 or an earlier segment")
    return p


def kernel_index(cu_seqlens: np.ndarray, parent: np.ndarray) -> KernelIndex:
    """The `KernelIndex` of a row with segment boundaries ``cu_seqlens`` [s+1] and ``parent``
    [s] (see the module docstring). An unshared row (every parent -1) gets ``cu_seqlens_k =
    cu_seqlens_q`` and ``kv_index = arange(N)``.

    >>> ix = kernel_index(np.array([0, 3, 5, 6]), np.array([-1, 0, 0]))
    >>> ix.kv_index.tolist(), ix.cu_seqlens_k.tolist(), ix.position_ids.tolist()
    ([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5], [0, 3, 8, 12], [0, 1, 2, 3, 4, 3])
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    p = check_parents(parent)
    lens = np.diff(cu)
    s = len(lens)
    start = np.zeros(s, dtype=np.int64)
    for c in np.flatnonzero(p >= 0):  # parents come first, so their start is final
        start[c] = start[p[c]] + lens[p[c]]
    klens = start + lens
    cu_k = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(klens, out=cu_k[1:])
    kv = np.empty(int(cu_k[-1]), dtype=np.int64)
    for j in range(s):
        head = int(cu_k[j] + start[j])
        if p[j] >= 0:  # the parent's own key sequence is exactly this one's first start[j] keys
            kv[cu_k[j] : head] = kv[cu_k[p[j]] : cu_k[p[j] + 1]]
        kv[head : cu_k[j + 1]] = np.arange(cu[j], cu[j + 1])
    seg = np.repeat(np.arange(s), lens)
    positions = start[seg] + np.arange(int(cu[-1]), dtype=np.int64) - cu[seg]
    return KernelIndex(
        cu_seqlens_q=cu.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        kv_index=kv,
        position_ids=positions,
        start=start,
        max_seqlen_q=int(lens.max(initial=0)),
        max_seqlen_k=int(klens.max(initial=0)),
    )


def target_source(
    cu_seqlens: np.ndarray, parent: np.ndarray, sample_index: np.ndarray | None = None
) -> np.ndarray:
    """[N] int64: the stored token each stored token's logits predict, or -1 (no target).

    Inside a segment it is the next stored token. At a segment's last token it is the first
    token of its first child (every child starts with the same re-fed branch token), or -1
    when it has no children (a sample's last token) or is padding (``sample_index`` -1).

    >>> target_source(np.array([0, 3, 5, 6]), np.array([-1, 0, 0])).tolist()
    [1, 2, 3, 4, -1, -1]
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    p = check_parents(parent)
    s = len(p)
    src = np.arange(1, int(cu[-1]) + 1, dtype=np.int64)
    first_child = np.full(s, s, dtype=np.int64)
    kids = np.flatnonzero(p >= 0)
    np.minimum.at(first_child, p[kids], kids)
    has = first_child < s
    src[cu[1:][has] - 1] = cu[first_child[has]]
    src[cu[1:][~has] - 1] = -1
    if sample_index is not None:
        pad = np.asarray(sample_index) == PAD_SAMPLE
        lens = np.diff(cu)
        src[np.repeat(pad, lens)] = -1
    return src


def shared_next_token_targets(
    row: Mapping[str, np.ndarray], parent: np.ndarray
) -> dict[str, np.ndarray]:
    """The `rolltool.format.targets.TARGET_FIELDS` of a shared row: each `SHIFTED_FROM` array
    read at `target_source`, `NO_TARGET` where there is none, except ``target_loss_weight`` at a
    prefix's last token: the sum of its children's first-token weights (summed in float64, then
    cast), since that token predicts the branch token of every sample through the prefix.

    `row` needs the `SHIFTED_FROM` arrays [N], ``cu_seqlens`` [s+1] and ``sample_index`` [s].
    A row with every parent -1 gets exactly `rolltool.format.targets.next_token_targets`.
    """
    cu = np.asarray(row["cu_seqlens"], dtype=np.int64)
    p = check_parents(parent)
    src = target_source(cu, p, row["sample_index"])
    none = src < 0
    safe = np.where(none, 0, src)
    out = {}
    for key, source in SHIFTED_FROM.items():
        a = np.asarray(row[source])
        got = a[safe].astype(TARGET_FIELDS[key])
        got[none] = NO_TARGET[key]
        out[key] = got
    kids = np.flatnonzero(p >= 0)
    if len(kids):
        total = np.zeros(len(p), dtype=np.float64)
        np.add.at(total, p[kids], np.asarray(row["loss_weight"], dtype=np.float64)[cu[kids]])
        parents = np.unique(p[kids])
        weight = out["target_loss_weight"]
        weight[cu[parents + 1] - 1] = total[parents].astype(weight.dtype)
    return out


# -- a shared-prefix pack's rows (format version 4) -------------------------------------------

SHARED_FIELDS = ("parent", "cu_seqlens_q", "cu_seqlens_k", "kv_index", "max_seqlen_q",
                 "max_seqlen_k")  # fmt: skip
"""What a shared-prefix row adds to a reader row: ``parent`` [s] int32, the `KernelIndex`
arrays (``cu_seqlens_q``/``cu_seqlens_k`` [s+1] int32, ``kv_index`` [K] int64) and
``max_seqlen_q``/``max_seqlen_k`` ([1] int64 each, arrays so that a row converts to tensors
whole); its ``position_ids`` continue from each segment's chain and its targets are
`shared_next_token_targets`'."""


@dataclass(frozen=True)
class SharedRows(PackedRows):
    """`PackedRows` of a shared-prefix pack: which segment each segment continues."""

    seg_parent: np.ndarray  # [S] int32, the row's segment before it in every sample, or -1


def shared_rows(
    tokens: SampleTokens,
    *,
    source: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    parent: np.ndarray,
    row_segments: np.ndarray,
    sample_index: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    row_len: int | None = None,
    pad_id: int = 0,
) -> SharedRows:
    """One rank's shared rows from a segment table: segment j stores positions
    ``[start[j], end[j])`` of sample ``source[j]`` (a position into `tokens`), continues segment
    ``parent[j]`` of its row (-1: none), and has ``sample_index``, ``advantage`` and ``weight``
    (per trainable token, summed over the samples through it); row r holds segments
    ``[row_segments[r], row_segments[r+1])``. Each row is padded to ``row_len`` (one padding
    token when a row is empty and there is none); AssertionError if a row does not fit it."""
    lens = (end - start).astype(np.int64)
    assert np.all(lens > 0), "a shared segment has no tokens"
    seg_len, seg_src, seg_par = [], [], []
    for r in range(len(row_segments) - 1):
        a, b = int(row_segments[r]), int(row_segments[r + 1])
        used = int(lens[a:b].sum())
        pad = (row_len - used) if row_len is not None else (0 if b > a else 1)
        assert pad >= 0, f"row of {used} tokens exceeds row_len {row_len}"
        idx = np.arange(a, b, dtype=np.int64)
        seg_len.append(np.append(lens[a:b], pad) if pad else lens[a:b])
        seg_src.append(np.append(idx, -1) if pad else idx)
        seg_par.append(np.append(parent[a:b], NO_PARENT) if pad else parent[a:b])
    counts = [len(x) for x in seg_len]
    out_segments = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out_segments[1:])
    flat_len = np.concatenate(seg_len) if seg_len else np.zeros(0, np.int64)
    src = np.concatenate(seg_src) if seg_src else np.zeros(0, np.int64)
    row_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum([int(x.sum()) for x in seg_len], out=row_offsets[1:])
    total = int(row_offsets[-1])
    ids = np.full(total, pad_id, dtype=np.int32)
    mask = np.zeros(total, dtype=np.uint8)
    logp = np.zeros(total, dtype=np.float32)
    pos = 0
    for j, n in zip(src.tolist(), flat_len.tolist(), strict=True):
        if j >= 0:
            at = int(tokens.offsets[source[j]]) + int(start[j])
            ids[pos : pos + n] = tokens.input_ids[at : at + n]
            mask[pos : pos + n] = tokens.loss_mask[at : at + n]
            logp[pos : pos + n] = tokens.logprobs[at : at + n]
        pos += n
    real = src >= 0
    safe = np.where(real, src, 0)

    def per_segment(values: np.ndarray, fill: float, dtype: type) -> np.ndarray:
        v = np.asarray(values)
        return (
            np.where(real, v[safe], fill).astype(dtype)
            if len(v)
            else np.full(len(src), fill, dtype)
        )

    return SharedRows(
        input_ids=ids,
        loss_mask=mask,
        logprobs=logp,
        row_offsets=row_offsets,
        seq_lens=flat_len.astype(np.int32),
        sample_index=per_segment(sample_index, PAD_SAMPLE, np.int64),
        seg_advantage=per_segment(advantage, 0, np.float32),
        seg_weight=per_segment(weight, 0, np.float32),
        row_segments=out_segments,
        seg_parent=(np.concatenate(seg_par) if seg_par else np.zeros(0)).astype(np.int32),
    )


def row_parent(arrays: Mapping[str, np.ndarray], r: int) -> np.ndarray:
    """[s] int32: row r's ``seg_parent`` (flat shard arrays, `SHARED_SEGMENT_ARRAYS`)."""
    rs = arrays["row_segments"]
    return np.asarray(arrays["seg_parent"][int(rs[r]) : int(rs[r + 1])])


def shared_view(row: dict[str, np.ndarray], parent: np.ndarray) -> dict[str, np.ndarray]:
    """A reader row (`rolltool.format.layout.unpack_row`) of a shared pack made exact: its
    ``position_ids`` continued along each chain, its targets `shared_next_token_targets`, plus
    `SHARED_FIELDS`. A padding segment is its own sequence (parent -1, no target)."""
    index = kernel_index(row["cu_seqlens"], parent)
    out = dict(row)
    out["position_ids"] = index.position_ids.astype(np.int32)
    out.update(shared_next_token_targets(row, parent))
    out["parent"] = np.asarray(parent, dtype=np.int32)
    out["cu_seqlens_q"] = index.cu_seqlens_q
    out["cu_seqlens_k"] = index.cu_seqlens_k
    out["kv_index"] = index.kv_index
    out["max_seqlen_q"] = np.array([index.max_seqlen_q], dtype=np.int64)
    out["max_seqlen_k"] = np.array([index.max_seqlen_k], dtype=np.int64)
    return out


def shared_problem(arrays: Mapping[str, np.ndarray], lengths: np.ndarray) -> str | None:
    """Why a shared pack's shard does not hold valid shared rows, or None (the reader's cheap
    check; `rolltool verify` compares the tokens with the input). Expects arrays that passed
    `rolltool.format.layout.check_rows` and the value checks; `lengths` [n]: each input
    sample's length (samples.parquet). Per row: every ``seg_parent`` is -1 or an earlier real
    segment of the row, padding continues nothing; a prefix (a segment with children) has the
    ``sample_index`` of its first child (its representative: the first sample through it),
    every child starts with the same (re-fed branch) token, and its weight is the sum of its
    children's; a leaf (a sample's continuation) ends at its sample's last token, a prefix
    before its representative's."""
    par = arrays.get("seg_parent")
    if par is None:
        return "missing array seg_parent (a --share-prefix pack's rows)"
    if par.ndim != 1 or len(par) != len(arrays["seq_lens"]) or par.dtype != np.int32:
        return "seg_parent is not one int32 per segment"
    rs = arrays["row_segments"].astype(np.int64)
    lens = arrays["seq_lens"].astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for r in range(len(rs) - 1):
        a, b = int(rs[r]), int(rs[r + 1])
        wrong = _row_problem(arrays, par[a:b].astype(np.int64), a, cu[a : b + 1], lengths)
        if wrong is not None:
            return f"row {r}: {wrong}"
    return None


def _row_problem(
    arrays: Mapping[str, np.ndarray], p: np.ndarray, a: int, cu: np.ndarray, lengths: np.ndarray
) -> str | None:
    """`shared_problem` of one row: its segments are ``a + j`` for j < len(p), bounded by
    ``cu`` (absolute token offsets)."""
    s = len(p)
    bad = (p < NO_PARENT) | (p >= np.arange(s))
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        return f"segment {j}'s parent {int(p[j])} is not -1 or an earlier segment"
    index = arrays["sample_index"][a : a + s]
    weight = arrays["seg_weight"][a : a + s].astype(np.float64)
    lens = np.diff(cu)
    pad = index == PAD_SAMPLE
    kids = np.flatnonzero(p >= 0)
    if np.any(pad[kids]) or np.any(pad[p[kids]]):
        return "a padding segment continues or is continued by another"
    start = np.zeros(s, dtype=np.int64)
    for c in kids:
        start[c] = start[p[c]] + lens[p[c]]
    first = np.full(s, s, dtype=np.int64)
    np.minimum.at(first, p[kids], kids)  # each prefix's first child
    first[first == s] = -1
    total = np.zeros(s, dtype=np.float64)
    np.add.at(total, p[kids], weight[kids])
    if np.any(index[~pad] >= len(lengths)):
        return f"sample_index {int(index.max())} is not a sample of the input"
    end = start + lens
    leaf = ~pad & (first < 0)
    short = np.flatnonzero(leaf & (end != lengths[np.where(pad, 0, index)]))
    if len(short):
        j = int(short[0])
        i = int(index[j])
        return f"sample {i}'s continuation ends at token {end[j]}, the sample has {lengths[i]}"
    ids = arrays["input_ids"]
    for j in np.flatnonzero(first >= 0).tolist():
        i = int(index[j])
        if end[j] >= lengths[i]:
            return f"a prefix of sample {i} runs to its end ({end[j]} tokens)"
        if int(index[first[j]]) != i:
            return (
                f"prefix segment {j} names sample {i}, its first child {int(index[first[j]])} "
                "(a prefix's sample is its first child's)"
            )
        heads = ids[cu[np.flatnonzero(p == j)]]
        if np.any(heads != heads[0]):
            return f"the children of prefix segment {j} start with different tokens"
        if not np.isclose(weight[j], total[j], rtol=1e-5, atol=0.0):
            return (
                f"prefix segment {j} weighs {weight[j]:.9g}, its children {total[j]:.9g} "
                "(a prefix's weight is the sum over its samples)"
            )
    return None
