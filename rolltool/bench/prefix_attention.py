"""Attention over a shared-prefix row: keys and values gathered, then causal per segment.

A shared row (`rolltool.format.prefix`) stores each prefix once. Its segment j's queries are its
stored tokens ``cu_seqlens_q[j] : cu_seqlens_q[j+1]``; its keys and values are
``k[kv_index[cu_seqlens_k[j] : cu_seqlens_k[j+1]]]`` (its ancestors' tokens, then its own), and
query i of q attends to keys ``0 .. k - q + i`` (causal, bottom-right aligned). That is what a
varlen kernel computes from (``cu_seqlens_q``, ``cu_seqlens_k``, the gathered K/V): flash-attn's
``flash_attn_varlen_func(q, k[kv_index], v[kv_index], cu_q, cu_k, max_q, max_k, causal=True)``
(bottom-right since 2.1), or `rolltool.bench.backends`' ``attend_blocks``. Here the reference:
torch's ``scaled_dot_product_attention`` per segment, exact on CPU in float64.

``hf_attention`` has the signature of a transformers attention function
(``AttentionInterface.register``), so a Hugging Face model runs a shared row unchanged: pass
``prefix_index=prefix_tensors(...)`` to the model's forward, with ``position_ids`` from it.

torch is imported on call, never at import time (like the rest of `rolltool.bench`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolltool.format.prefix import KernelIndex


@dataclass(frozen=True)
class PrefixTensors:
    """A `KernelIndex` on a torch device (and its boundaries as Python ints, for slicing)."""

    cu_seqlens_q: Any
    """[s+1] int32 tensor."""
    cu_seqlens_k: Any
    """[s+1] int32 tensor."""
    kv_index: Any
    """[K] int64 tensor."""
    position_ids: Any
    """[N] int64 tensor."""
    max_seqlen_q: int
    max_seqlen_k: int
    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]


def prefix_tensors(index: KernelIndex, device: Any = "cpu") -> PrefixTensors:
    """`index` as torch tensors on ``device``."""
    import torch

    def t(a: Any, dtype: Any) -> Any:
        return torch.as_tensor(a, dtype=dtype, device=device)

    return PrefixTensors(
        cu_seqlens_q=t(index.cu_seqlens_q, torch.int32),
        cu_seqlens_k=t(index.cu_seqlens_k, torch.int32),
        kv_index=t(index.kv_index, torch.int64),
        position_ids=t(index.position_ids, torch.int64),
        max_seqlen_q=index.max_seqlen_q,
        max_seqlen_k=index.max_seqlen_k,
        q_bounds=tuple(int(x) for x in index.cu_seqlens_q),
        k_bounds=tuple(int(x) for x in index.cu_seqlens_k),
    )


def row_prefix_tensors(row: Mapping[str, Any], device: Any = "cpu") -> PrefixTensors:
    """The `PrefixTensors` of a reader row of a ``--share-prefix`` pack
    (`rolltool.format.prefix.SHARED_FIELDS`, NumPy arrays or tensors), on ``device``."""
    import torch

    def t(name: str, dtype: Any) -> Any:
        return torch.as_tensor(row[name], dtype=dtype, device=device)

    q = [int(x) for x in row["cu_seqlens_q"].tolist()]
    return PrefixTensors(
        cu_seqlens_q=t("cu_seqlens_q", torch.int32),
        cu_seqlens_k=t("cu_seqlens_k", torch.int32),
        kv_index=t("kv_index", torch.int64),
        position_ids=t("position_ids", torch.int64),
        max_seqlen_q=int(row["max_seqlen_q"][0]),
        max_seqlen_k=int(row["max_seqlen_k"][0]),
        q_bounds=tuple(q),
        k_bounds=tuple(int(x) for x in row["cu_seqlens_k"].tolist()),
    )


def attend(q: Any, k: Any, v: Any, index: PrefixTensors, scale: float | None = None) -> Any:
    """[N, H, D]: attention of a shared row's queries ``q`` [N, H, D] over the gathered keys
    and values of ``k``, ``v`` [N, H_kv, D] (H a multiple of H_kv), per segment."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads = q.shape[1] // k.shape[1]
    kg, vg = (x.index_select(0, index.kv_index) for x in (k, v))
    if heads > 1:
        kg, vg = (x.repeat_interleave(heads, dim=1) for x in (kg, vg))

    def seq(x: Any, a: int, b: int) -> Any:  # [L, H, D] rows a:b -> [1, H, L, D]
        return x[a:b].transpose(0, 1).unsqueeze(0)

    outs = []
    qb, kb = index.q_bounds, index.k_bounds
    for j in range(len(qb) - 1):
        m, n = qb[j + 1] - qb[j], kb[j + 1] - kb[j]
        if m == 0:
            continue
        mask = causal_lower_right(m, n) if n > m else None
        o = sdpa(seq(q, qb[j], qb[j + 1]), seq(kg, kb[j], kb[j + 1]), seq(vg, kb[j], kb[j + 1]),
                 attn_mask=mask, is_causal=mask is None, scale=scale)  # fmt: skip
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def hf_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """A transformers attention function over one shared row (batch 1): ``query`` [1, H, N, D]
    and ``key``, ``value`` [1, H_kv, N, D] in, ([1, N, H, D], None) out. Reads the row's
    `PrefixTensors` from the ``prefix_index`` keyword the model's forward passes through; the
    attention mask is not used (register no mask function for this attention's name)."""
    if query.shape[0] != 1:
        raise ValueError(
            f"a shared row is one sequence of stored tokens, got batch {query.shape[0]}"
        )
    if dropout:
        raise ValueError("dropout is not supported by the shared-prefix reference attention")
    index: PrefixTensors = kwargs["prefix_index"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return attend(q, k, v, index, scale=scaling).unsqueeze(0), None
