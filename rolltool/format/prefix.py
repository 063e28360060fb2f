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
