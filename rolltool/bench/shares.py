"""One GPU's share of a group row's work with ``--cp`` or ``--sp`` (pure NumPy, no torch).

A pack made with ``--cp C`` or ``--sp S`` stores each data-parallel group's row; each of the
group's k GPUs gets a view of it (`rolltool.format.split`). Bench times every GPU's share of one layer:

- **linear part** (projections, MLP: ``--what layer``): the GPU's local tokens, T / k;
- **attention**: *query blocks* against *key blocks*, block i's m queries attending to block i's
  n >= m keys causally, **aligned bottom-right** (query j sees keys 0 .. n - m + j: the queries
  are the last m positions of the keys' sequence).

========  ====================================================================================
``cp``    CP rank r holds chunks r and 2C-1-r of every sample (padded to P, chunks of
          c = P / 2C). Its blocks: per sample, chunk r's c queries against the sample's first
          (r+1)·c keys, chunk 2C-1-r's c queries against the first (2C-r)·c keys: what ring
          attention computes, keys gathered from all CP ranks. Row-end padding (split into C
          contiguous parts) attends within its own part only (no ring exchange for it).
``sp``    Ulysses: after the all-to-all every SP rank holds the whole row for 1/S of the heads;
          its blocks are the row's segments (queries = keys), with ``heads / S`` heads.
hybrid    ``--hybrid-cp``: a GPU in a sub-group of k > 1 GPUs is CP rank r of a ``cp k`` row (as
          above, over its sub-group); a plain GPU (k = 1) attends within its own segments.
========  ====================================================================================

Example, a 10-token sample over cp 2 (padded to 12, chunks of 3): rank 0 has query blocks of 3
and 3 against key blocks of 3 (chunk 0) and 12 (chunk 3); rank 1 blocks of 3 against 6 and 9.
Attention pairs (``GpuShare.pairs``): rank 0: 6 + 33 = 39; rank 1: 15 + 24 = 39 — the zigzag
evens them (contiguous chunks would give 21 and 57).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE
from rolltool.format.split import cp_token_map


@dataclass(frozen=True, kw_only=True)
class GpuShare:
    """One GPU's work on a group row (see the module docstring)."""

    kind: str
    """``"cp"`` or ``"sp"``."""
    size: int
    """GPUs in the group (C or S)."""
    gpu: int
    """This GPU's CP or SP rank."""
    tokens: int
    """Local tokens: what the GPU's projections and MLP process (T / size)."""
    q_cu: np.ndarray
    """[B+1] int32 query block boundaries (into the local queries with CP, the row with SP)."""
    k_cu: np.ndarray
    """[B+1] int32 key block boundaries in the gathered keys (block i has >= the queries of
    query block i; causal, bottom-right aligned)."""
    own_key: np.ndarray
    """[k_cu[-1]] int64, CP: each gathered key's local offset on this GPU, -1 for a key another
    GPU holds (what the ring delivers); SP: empty."""

    @property
    def head_share(self) -> int:
        """The attention runs ``heads / head_share`` heads (S with SP, 1 with CP)."""
        return self.size if self.kind == "sp" else 1

    @property
    def pairs(self) -> int:
        """(query, key) pairs the causal attention computes: Σ m·n - m(m-1)/2 over blocks."""
        m: np.ndarray = np.diff(np.asarray(self.q_cu, dtype=np.int64))
        n: np.ndarray = np.diff(np.asarray(self.k_cu, dtype=np.int64))
        return int(np.sum(m * n - m * (m - 1) // 2))

    @property
    def sum_sq(self) -> float:
        """The attention work in Σ L² units of full-head causal attention (one segment of L
        tokens: L(L+1)/2 pairs = (L² + L) / 2): (2·pairs - queries) / head_share. Without a
        split this is the row's Σ L², so bench's a·L + b·L² fit and FLOPs read it alike."""
        return (2 * self.pairs - int(self.q_cu[-1])) / self.head_share


def cp_share(view: Mapping[str, np.ndarray], cp: int, gpu: int) -> GpuShare:
    """CP rank ``gpu``'s share from its view (`rolltool.format.split.cp_view`: ``cu_seqlens``,
    ``cu_seqlens_padded``, ``sample_index``)."""
    local = np.diff(np.asarray(view["cu_seqlens"], dtype=np.int64))
    padded = np.diff(np.asarray(view["cu_seqlens_padded"], dtype=np.int64))
    sample = np.asarray(view["sample_index"], dtype=np.int64)
    q: list[int] = []
    k: list[int] = []
    own: list[np.ndarray] = []
    start = 0
    for n, p, s in zip(local.tolist(), padded.tolist(), sample.tolist(), strict=True):
        if s == PAD_SAMPLE:
            q.append(n)
            k.append(n)
            own.append(start + np.arange(n, dtype=np.int64))
        else:
            c = p // (2 * cp)
            rank_of, offset_of = cp_token_map(p, cp)
            for chunk in (gpu, 2 * cp - 1 - gpu):
                end = (chunk + 1) * c
                q.append(c)
                k.append(end)
                own.append(np.where(rank_of[:end] == gpu, start + offset_of[:end], -1))
        start += n
    return GpuShare(kind="cp", size=cp, gpu=gpu, tokens=start, q_cu=_cu(q), k_cu=_cu(k),
                    own_key=np.concatenate(own) if own else np.zeros(0, np.int64))  # fmt: skip


def hybrid_share(view: Mapping[str, np.ndarray]) -> GpuShare:
    """A ``--hybrid-cp`` GPU's share from its view (`rolltool.format.hybrid.hybrid_view`): in a
    sub-group of k > 1 GPUs its `cp_share` for its rank there (size k); on a plain GPU (k = 1)
    its row's segments, each attending to itself (size 1, every key its own)."""
    k, rank = int(view["cp_group_size"][0]), int(view["cp_group_rank"][0])
    if k > 1:
        return cp_share(view, k, rank)
    cu = np.asarray(view["cu_seqlens"], dtype=np.int32)
    n = int(cu[-1])
    return GpuShare(kind="cp", size=1, gpu=0, tokens=n, q_cu=cu, k_cu=cu,
                    own_key=np.arange(n, dtype=np.int64))  # fmt: skip


def sp_share(view: Mapping[str, np.ndarray], sp: int, gpu: int) -> GpuShare:
    """SP rank ``gpu``'s share from its view (`rolltool.format.split.sp_view`: the row's
    ``cu_seqlens``, its slice of the tokens)."""
    cu = np.asarray(view["cu_seqlens"], dtype=np.int32)
    return GpuShare(kind="sp", size=sp, gpu=gpu, tokens=len(view["input_ids"]), q_cu=cu, k_cu=cu,
                    own_key=np.zeros(0, np.int64))  # fmt: skip


def sp_heads(heads: int, kv_heads: int, sp: int, gpu: int) -> tuple[slice, slice]:
    """SP rank ``gpu``'s query heads and key/value heads (Ulysses): the gpu-th 1/S of the query
    heads, with the kv heads they read (kv_heads / S of them, or the one they share when
    kv_heads < S: the all-to-all repeats it). RolltoolError when the heads do not split.

    >>> sp_heads(4, 1, 2, 1)
    (slice(2, 4, None), slice(0, 1, None))
    """
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise RolltoolError(
            f"bench: {heads} heads ({kv_heads} kv) do not split over --sp {sp} (Ulysses gives "
            "each SP rank heads / sp query heads and kv_heads / sp, or one, kv heads)",
            hint="give --heads and --kv-heads that --sp divides (or that divide it, for kv)",
        )
    part = heads // sp
    group = heads // kv_heads
    first = gpu * part // group
    last = ((gpu + 1) * part - 1) // group
    return slice(gpu * part, (gpu + 1) * part), slice(first, last + 1)


def _cu(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out
