"""``--check``: each segment's output in a packed row equals that sequence run alone.

For a sample of rows, the backend runs the whole row; then each segment is copied out and run
on its own through ``scaled_dot_product_attention`` in fp32 (k, v heads repeated explicitly for
GQA) — an independent reference that cannot see other segments. Any element beyond the dtype's
tolerance (``TOLERANCES``) fails the check: it is how cross-contamination, an off-by-one in
``cu_seqlens`` or a wrong causal flag shows up. With ``--backward`` the gradients of q, k, v are
compared too (error relative to the segment's largest gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from rolltool.bench.backends import Backend
from rolltool.bench.config import TOLERANCES, BenchConfig
from rolltool.bench.rows import Row
from rolltool.bench.timing import torch_dtype


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


def check_row(torch: Any, backend: Backend, row: Row, config: BenchConfig) -> dict[str, Any]:
    """Compare every segment of one row (see the module docstring); returns the row's figures."""
    shape, device = config.shape, torch.device(config.device)
    dtype = torch_dtype(torch, config.dtype)
    atol, rtol = TOLERANCES[config.dtype]
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    t = row.tokens

    def rand(heads: int) -> Any:
        x = torch.randn(t, heads, shape.head_dim, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)

    q, k, v = rand(shape.heads), rand(shape.kv_heads), rand(shape.kv_heads)
    group = shape.heads // shape.kv_heads
    kb, vb = k, v
    if not backend.gqa and group > 1:
        kb, vb = (x.repeat_interleave(group, dim=1) for x in (k, v))
    cu = torch.from_numpy(row.cu_seqlens).to(device=device, dtype=torch.int32)
    bounds = [int(x) for x in row.cu_seqlens]
    worst_out = worst_grad = max_err = 0.0
    worst_segment = -1
    with torch.enable_grad():
        leaves = tuple(x.detach().requires_grad_(config.backward) for x in (q, kb, vb))
        out = backend.attend(leaves[0], leaves[1], leaves[2], cu, row.max_len, bounds)
        grads = None
        if config.backward:
            go = rand(shape.heads)
            grads = torch.autograd.grad(out, leaves, go)
            if kb is not k:  # gradients of repeated k, v heads sum back onto the kv heads
                grads = (
                    grads[0],
                    *(g.unflatten(1, (shape.kv_heads, group)).sum(2) for g in grads[1:]),
                )
        for i, (s, e) in enumerate(pairwise(bounds)):
            if e == s:
                continue
            alone = [
                x[s:e].detach().float().clone().requires_grad_(config.backward) for x in (q, k, v)
            ]
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
    ok = worst_out <= 1.0 and worst_grad <= 1.0
    return {
        "step": row.step,
        "rank": row.rank,
        "micro_batch": row.micro_batch,
        "segments": len(bounds) - 1,
        "tokens": t,
        "max_abs_error": max_err,
        "worst_output_ratio": worst_out,
        "worst_grad_ratio": worst_grad if config.backward else None,
        "worst_segment": worst_segment,
        "ok": ok,
    }


def check_rows(
    torch: Any, backend: Backend, rows: Sequence[Row], config: BenchConfig
) -> dict[str, Any]:
    """Check ``config.check_rows`` sampled rows; ``ok`` is False if any element is off."""
    results = [
        check_row(torch, backend, rows[i], config) for i in sample_rows(rows, config.check_rows)
    ]
    atol, rtol = TOLERANCES[config.dtype]
    return {
        "ok": all(r["ok"] for r in results),
        "rows_checked": len(results),
        "segments_checked": sum(r["segments"] for r in results),
        "tolerance": {"atol": atol, "rtol": rtol, "dtype": config.dtype},
        "rows": results,
    }
