"""``--check``: each segment's output in a packed row equals that sequence run alone.

For a sample of rows, the backend runs the whole row; then each segment is copied out and run
on its own through ``scaled_dot_product_attention`` in fp32 (k, v heads repeated explicitly for
GQA) — an independent reference that cannot see other segments. Any element beyond the dtype's
tolerance (``TOLERANCES``) fails the check: it is how cross-contamination, an off-by-one in
``cu_seqlens`` or a wrong causal flag shows up. With ``--backward`` the gradients of q, k, v are
compared too (error relative to the segment's largest gradient).

Packs made with ``--cp`` / ``--sp`` are checked per GPU instead, from the reader's views
(`rolltool.bench.split_check`). A ``--share-prefix`` row's segment is compared with its whole
chain run alone (its ancestors' tokens then its own, the last rows of the output); forward only
(a prefix's key/value gradients sum over its continuations, no segment's alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from rolltool.bench.backends import Backend
from rolltool.bench.config import TOLERANCES, BenchSetup, torch_dtype
from rolltool.bench.rows import Row
from rolltool.bench.timing import shared_attend


def sample_rows(rows: Sequence[Row], n: int) -> list[int]:
    """Up to n row indices: the row with the most segments, the one with the longest segment,
    then rows spread evenly over the run (deterministic)."""
    if n <= 0 or not rows:
        return []
    picks = [
        max(range(len(rows)), key=lambda i: len(rows[i].cu_seqlens)),
        max(range(len(rows)), key=lambda i: rows[i].max_len),
    ]
    picks += [int(i) for i in np.linspace(0, len(rows) - 1, num=max(n, 2))]
    return list(dict.fromkeys(picks))[:n]


def reference(torch: Any, q: Any, k: Any, v: Any) -> Any:
    """Causal attention of ONE sequence in fp32: q [L, H, D], k/v [L, Hkv, D] -> [L, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True
    )
    return out.squeeze(0).transpose(0, 1)


def _excess(torch: Any, got: Any, want: Any, atol: float, rtol: float) -> tuple[float, float]:
    """(max |got - want|, max of |got - want| / (atol + rtol·|want|)); the check needs <= 1."""
    diff = (got.float() - want).abs()
    return float(diff.max()), float((diff / (atol + rtol * want.abs())).max())


def _whole_row(
    torch: Any, backend: Backend, row: Row, qkv: tuple[Any, Any, Any], go: Any
) -> tuple[Any, Any]:
    """The backend over the whole row: its output and, given the output gradient ``go``, the
    gradients of q, k, v (summed back onto the kv heads when k, v were repeated for GQA)."""
    q, k, v = qkv
    group = q.shape[1] // k.shape[1]
    kb, vb = k, v
    if not backend.gqa and group > 1:
        kb, vb = (x.repeat_interleave(group, dim=1) for x in (k, v))
    cu = torch.from_numpy(row.cu_seqlens).to(device=q.device, dtype=torch.int32)
    bounds = [int(x) for x in row.cu_seqlens]
    leaves = tuple(x.detach().requires_grad_(go is not None) for x in (q, kb, vb))
    attend = backend.attend if row.prefix is None else shared_attend(torch, backend, row, q.device)
    out = attend(leaves[0], leaves[1], leaves[2], cu, row.max_len, bounds)
    if go is None:
        return out, None
    grads = torch.autograd.grad(out, leaves, go)
    if kb is not k:
        grads = (grads[0], *(g.unflatten(1, (k.shape[1], group)).sum(2) for g in grads[1:]))
    return out, grads


def _segments(
    torch: Any,
    row: Row,
    qkv: tuple[Any, ...],
    out: Any,
    grads: Any,
    go: Any,
    tol: tuple[float, float],
) -> dict[str, Any]:
    """Each segment of the row against the reference run alone: the largest error, the worst
    output ratio to the tolerance (and its segment), the worst gradient ratio."""
    atol, rtol = tol
    worst_out = worst_grad = max_err = 0.0
    worst_segment = -1
    p = row.prefix
    for i, (s, e) in enumerate(pairwise(int(x) for x in row.cu_seqlens)):
        if e == s:
            continue
        if p is not None:  # its chain alone: its ancestors' tokens, then its own
            chain = torch.from_numpy(p.kv_index[p.cu_seqlens_k[i] : p.cu_seqlens_k[i + 1]])
            alone = [x[chain.to(x.device)].detach().float() for x in qkv]
            ref = reference(torch, *alone)[-(e - s) :]
            err, excess = _excess(torch, out[s:e].detach(), ref.detach(), atol, rtol)
            max_err = max(max_err, err)
            if excess > worst_out:
                worst_out, worst_segment = excess, i
            continue
        alone = [x[s:e].detach().float().clone().requires_grad_(go is not None) for x in qkv]
        ref = reference(torch, *alone)
        err, excess = _excess(torch, out[s:e].detach(), ref.detach(), atol, rtol)
        max_err = max(max_err, err)
        if excess > worst_out:
            worst_out, worst_segment = excess, i
        if grads is not None:
            ref_grads = torch.autograd.grad(ref, alone, go[s:e].float())
            for g, rg in zip(grads, ref_grads, strict=True):
                scale = float(rg.abs().max()) or 1.0
                rel = float((g[s:e].float() - rg).abs().max()) / scale
                worst_grad = max(worst_grad, rel / (2 * rtol))
    return {"max_abs_error": max_err, "worst_output_ratio": worst_out,
            "worst_grad_ratio": worst_grad, "worst_segment": worst_segment}  # fmt: skip


def check_row(torch: Any, backend: Backend, row: Row, setup: BenchSetup) -> dict[str, Any]:
    """Compare every segment of one row (see the module docstring); returns the row's figures."""
    shape, device = setup.shape, torch.device(setup.device)
    dtype = torch_dtype(torch, setup.dtype)
    gen = torch.Generator(device="cpu").manual_seed(setup.seed + 1)

    def rand(heads: int) -> Any:
        x = torch.randn(row.tokens, heads, shape.head_dim, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)

    qkv = (rand(shape.heads), rand(shape.kv_heads), rand(shape.kv_heads))
    with torch.enable_grad():
        # a shared row's prefix gradients sum over its continuations: forward only
        go = rand(shape.heads) if setup.backward and row.prefix is None else None
        out, grads = _whole_row(torch, backend, row, qkv, go)
        fig = _segments(torch, row, qkv, out, grads, go, TOLERANCES[setup.dtype])
    return {
        "step": row.step,
        "rank": row.rank,
        "micro_batch": row.micro_batch,
        "segments": len(row.cu_seqlens) - 1,
        "tokens": row.tokens,
        **fig,
        "worst_grad_ratio": fig["worst_grad_ratio"] if setup.backward else None,
        "ok": fig["worst_output_ratio"] <= 1.0 and fig["worst_grad_ratio"] <= 1.0,
    }


def check_rows(
    torch: Any, backend: Backend, rows: Sequence[Row], setup: BenchSetup
) -> dict[str, Any]:
    """Check ``setup.check_rows`` sampled rows; ``ok`` is False if any element is off."""
    results = [
        check_row(torch, backend, rows[i], setup) for i in sample_rows(rows, setup.check_rows)
    ]
    atol, rtol = TOLERANCES[setup.dtype]
    return {
        "ok": all(r["ok"] for r in results),
        "rows_checked": len(results),
        "segments_checked": sum(r["segments"] for r in results),
        "tolerance": {"atol": atol, "rtol": rtol, "dtype": setup.dtype},
        "rows": results,
    }
