"""Time one GPU's share of a split row (``--cp`` / ``--sp`` packs): staging and the timed work.

The same protocol as `rolltool.bench.timing` (it calls ``stage_shares`` and ``run_share`` for
rows that carry a `GpuShare`); what differs is the work of a row, one GPU's part of the group's
layer (`rolltool.bench.shares` says which tokens and which attention blocks):

==========  ==========================================================================
``layer``   x ``[T/k, hidden]`` (the GPU's tokens) through the projections and the MLP;
            attention:

            - CP: the local queries' blocks against key blocks gathered by one
              ``index_select`` from the GPU's own k, v and a staged buffer standing in for the
              other CP ranks' (what the ring delivers), bottom-right causal
              (``Backend.attend_blocks``);
            - SP (Ulysses): q ``[T/S, heads]`` reshaped to ``[T, heads/S]`` and k, v alike
              (the all-to-all's shapes; kv heads repeated up to S when fewer), varlen
              attention over the whole row, reshaped back for the output projection.
``attention``  the attention call alone, on staged random q, k, v of those shapes.
==========  ==========================================================================

Communication (the ring's sends, the all-to-alls) is not timed: on one device there is none to
time, and it overlaps the attention in ring implementations; the figures are compute balance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolltool.bench.backends import Backend
from rolltool.bench.config import BenchSetup, torch_dtype
from rolltool.bench.layer import LayerWeights, layer_with, make_weights
from rolltool.bench.rows import Row
from rolltool.bench.shares import GpuShare, sp_heads
from rolltool.errors import RolltoolError


@dataclass
class ShareRun:
    """One share row's device-side boundaries and shapes."""

    share: GpuShare
    q_cu: Any
    """int32 query block boundaries on the device."""
    k_cu: Any
    q_bounds: list[int]
    k_bounds: list[int]
    max_q: int
    max_k: int
    heads: int
    """Query heads this GPU's attention runs (heads / S with SP)."""
    kv_heads: int
    """Key/value heads it runs (after repeating for a backend without GQA)."""
    key_index: Any = None
    """Layer mode, CP: int64 [K] rows of ``cat(own k, remote k)`` that make the key blocks."""
    remote: int = 0
    """Layer mode, CP: how many of those keys other GPUs hold (rows of the remote buffer)."""


@dataclass
class StagedShares:
    """Device-side inputs shared by all share rows (flat buffers: each row views its prefix)."""

    runs: list[ShareRun]
    q: Any = None
    """Attention mode: flat buffer, >= every row's queries x heads x head_dim."""
    k: Any = None
    v: Any = None
    grad_out: Any = None
    """--backward: flat, >= every row's output."""
    x: Any = None
    """Layer mode: [T_max, hidden], the largest share's tokens."""
    weights: LayerWeights | None = None
    remote_k: Any = None
    """Layer mode, CP: [R_max, kv_heads, head_dim], the other ranks' keys."""
    remote_v: Any = None


def _run(torch: Any, backend: Backend, share: GpuShare, setup: BenchSetup) -> ShareRun:
    s, device = setup.shape, torch.device(setup.device)
    heads, kv_heads = s.heads, s.kv_heads
    if share.kind == "sp":
        q_part, kv_part = sp_heads(s.heads, s.kv_heads, share.size, share.gpu)
        heads, kv_heads = q_part.stop - q_part.start, kv_part.stop - kv_part.start
    if share.kind == "cp" and backend.attend_blocks is None:
        raise RolltoolError(f"backend {backend.name} has no block attention for a --cp pack",
                            hint="use --backend sdpa, torch-varlen or flash-attn")  # fmt: skip
    key_index, own = None, share.own_key
    if share.kind == "cp" and setup.what == "layer":
        remote = np.cumsum(own < 0) - 1 + share.tokens
        key_index = torch.from_numpy(np.where(own >= 0, own, remote)).to(device)
    q_len, k_len = np.diff(share.q_cu), np.diff(share.k_cu)
    return ShareRun(
        share=share,
        q_cu=torch.from_numpy(share.q_cu).to(device=device, dtype=torch.int32),
        k_cu=torch.from_numpy(share.k_cu).to(device=device, dtype=torch.int32),
        q_bounds=[int(x) for x in share.q_cu],
        k_bounds=[int(x) for x in share.k_cu],
        max_q=int(q_len.max(initial=0)),
        max_k=int(k_len.max(initial=0)),
        heads=heads,
        kv_heads=kv_heads if backend.gqa else heads,
        key_index=key_index,
        remote=int(np.sum(own < 0)),
    )


def stage_shares(
    torch: Any,
    backend: Backend,
    rows: Sequence[Row],
    setup: BenchSetup,
    weights: LayerWeights | None = None,
) -> StagedShares:
    """Every share row's inputs on the device (step 1 of `rolltool.bench.timing`'s protocol);
    ``weights``: the layer's, when the plain rows' staging made them already."""
    shares = [r.share for r in rows if r.share is not None]
    runs = [_run(torch, backend, sh, setup) for sh in shares]
    s = setup.shape
    device, dtype = torch.device(setup.device), torch_dtype(torch, setup.dtype)
    gen = torch.Generator(device="cpu").manual_seed(setup.seed + 3)

    def rand(*dims: int) -> Any:
        return torch.randn(*dims, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    if setup.what == "layer":
        if weights is None:
            weights = make_weights(torch, s, device=setup.device, dtype=dtype,
                                   seed=setup.seed + 2, grad=setup.backward)  # fmt: skip
        t_max = max(sh.tokens for sh in shares)
        r_max = max(r.remote for r in runs)
        return StagedShares(runs=runs, x=rand(t_max, s.hidden), weights=weights,
                            grad_out=rand(t_max, s.hidden) if setup.backward else None,
                            remote_k=rand(max(r_max, 1), s.kv_heads, s.head_dim),
                            remote_v=rand(max(r_max, 1), s.kv_heads, s.head_dim))  # fmt: skip
    q_max = max(int(r.q_bounds[-1]) * r.heads for r in runs) * s.head_dim
    k_max = max(int(r.k_bounds[-1]) * r.kv_heads for r in runs) * s.head_dim
    return StagedShares(runs=runs, q=rand(q_max), k=rand(k_max), v=rand(k_max),
                        grad_out=rand(q_max) if setup.backward else None)  # fmt: skip


def attention(torch: Any, backend: Backend, run: ShareRun, q: Any, k: Any, v: Any) -> Any:
    """The GPU's attention on ready q [Tq, heads, D], k, v [Tk, kv_heads, D]: block attention
    (CP) or the row's varlen attention (SP)."""
    if run.share.kind == "cp":
        assert backend.attend_blocks is not None
        return backend.attend_blocks(q, k, v, run.q_cu, run.k_cu, run.max_q, run.max_k,
                                     run.q_bounds, run.k_bounds)  # fmt: skip
    return backend.attend(q, k, v, run.q_cu, run.max_q, run.q_bounds)


def layer_mix(torch: Any, backend: Backend, st: StagedShares, run: ShareRun) -> Any:
    """The ``mix`` of `rolltool.bench.layer.layer_with` for one share row (module docstring)."""
    share = run.share

    def mix(q: Any, k: Any, v: Any) -> Any:
        t, heads, dim = q.shape
        if share.kind == "cp":
            k = torch.cat([k, st.remote_k[: run.remote]]).index_select(0, run.key_index)
            v = torch.cat([v, st.remote_v[: run.remote]]).index_select(0, run.key_index)
        else:
            rows = t * share.size
            if k.shape[1] % share.size:  # fewer kv heads than S: the all-to-all repeats them
                k, v = (x.repeat_interleave(share.size // x.shape[1], dim=1) for x in (k, v))
            q = q.reshape(rows, heads // share.size, dim)
            k, v = (x.reshape(rows, x.shape[1] // share.size, dim) for x in (k, v))
        if k.shape[1] != run.kv_heads:  # a backend without GQA: repeat up to the query heads
            k, v = (x.repeat_interleave(run.kv_heads // x.shape[1], dim=1) for x in (k, v))
        return attention(torch, backend, run, q, k, v).reshape(t, heads * dim)

    return mix


def run_share(torch: Any, backend: Backend, st: StagedShares, i: int, setup: BenchSetup) -> None:
    """Share row i's work: ``layers`` layers or attention calls, with backward when configured."""
    run = st.runs[i]
    layers, dim = setup.shape.layers, setup.shape.head_dim
    if st.weights is not None:
        t = run.share.tokens
        x0 = st.x[:t].detach().requires_grad_(setup.backward)
        x, mix = x0, layer_mix(torch, backend, st, run)
        for _ in range(layers):
            x = layer_with(torch, st.weights, x, mix)
        if setup.backward:
            torch.autograd.grad(x, (x0, *st.weights.params), st.grad_out[:t])
        return
    nq, nk = run.q_bounds[-1], run.k_bounds[-1]
    q = st.q[: nq * run.heads * dim].view(nq, run.heads, dim)
    k, v = (b[: nk * run.kv_heads * dim].view(nk, run.kv_heads, dim) for b in (st.k, st.v))
    if not setup.backward:
        for _ in range(layers):
            attention(torch, backend, run, q, k, v)
        return
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    for _ in range(layers):
        out = attention(torch, backend, run, q, k, v)
        torch.autograd.grad(out, (q, k, v), st.grad_out[: out.numel()].view(out.shape))
