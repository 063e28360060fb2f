"""Variable-length causal attention backends, chosen by name from ``BACKENDS``.

Every backend computes the same thing for one packed row::

    out = attend(q, k, v, cu, max_len, bounds)     # q [T, H, D], k/v [T, Hkv, D] -> out [T, H, D]

where ``cu`` is the row's ``cu_seqlens`` as an int32 tensor on the device (first 0, last T),
``max_len`` the longest segment and ``bounds`` the same boundaries as Python ints. Segment i is
``q[cu[i]:cu[i+1]]`` and attends causally to its own keys only. Example: ``cu = [0, 3, 5]`` holds
two sequences, tokens 0-2 and 3-4; token 3 sees only itself.

=================  =================================================  ===========================
name               kernel                                             where
=================  =================================================  ===========================
``flash-attn``     ``flash_attn.flash_attn_varlen_func``              CUDA, fp16/bf16, if installed
``torch-varlen``   ``torch.nn.attention.varlen.varlen_attn`` (2.10+)  CUDA, fp16/bf16
``sdpa``           ``scaled_dot_product_attention`` per segment       anywhere; the exact reference
=================  =================================================  ===========================

Packs made with ``--cp`` also need *block* attention (``Backend.attend_blocks``): query block i
(``q[q_cu[i]:q_cu[i+1]]``, m tokens) attends to key block i (``k[k_cu[i]:k_cu[i+1]]``, n >= m
tokens) causally, **aligned bottom-right**: query j sees keys 0 .. n - m + j, as a chunk of a
sample sees the sample's prefix up to its own end (`rolltool.bench.shares`). flash-attn (2.1+)
and ``varlen_attn``'s ``window_size`` align a causal mask that way; sdpa's ``is_causal`` aligns
it top-left, so the sdpa backend passes a bottom-right mask (``causal_lower_right``). ``--check`` compares
every CP rank's output with each sample run alone, so a kernel aligned the other way fails it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from rolltool.errors import RolltoolError

Attend = Callable[[Any, Any, Any, Any, int, Sequence[int]], Any]
"""``(q, k, v, cu, max_len, bounds) -> out`` (torch tensors; see the module docstring)."""

AttendBlocks = Callable[[Any, Any, Any, Any, Any, int, int, Sequence[int], Sequence[int]], Any]
"""``(q, k, v, q_cu, k_cu, max_q, max_k, q_bounds, k_bounds) -> out [Tq, H, D]``: query block i
against key block i, causal, bottom-right aligned (see the module docstring)."""


@dataclass(frozen=True)
class Backend:
    """A ready-to-call backend."""

    name: str
    """Name in ``BACKENDS``."""
    attend: Attend
    """The attention call for one row."""
    gqa: bool
    """Whether k/v may have fewer heads than q; if not, the caller repeats them beforehand."""
    detail: str
    """What exactly runs (function, signature variant), for the report."""
    attend_blocks: AttendBlocks | None = None
    """Block attention for ``--cp`` packs (None: the backend cannot run them)."""


def _sdpa(torch: Any) -> Backend:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    lower_right = _lower_right(torch)

    def one(q: Any, k: Any, v: Any, **mask: Any) -> Any:
        """One sequence (or block) through sdpa: [L, H, D] -> [1, H, L, D] and back."""
        o = sdpa(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                 enable_gqa=k.shape[1] != q.shape[1], **mask)  # fmt: skip
        return o.squeeze(0).transpose(0, 1)

    def attend(q: Any, k: Any, v: Any, cu: Any, max_len: int, bounds: Sequence[int]) -> Any:
        outs = [one(q[s:e], k[s:e], v[s:e], is_causal=True) for s, e in pairwise(bounds) if e > s]
        return torch.cat(outs, dim=0)

    def blocks(q: Any, k: Any, v: Any, q_cu: Any, k_cu: Any, max_q: int, max_k: int,
               q_bounds: Sequence[int], k_bounds: Sequence[int]) -> Any:  # fmt: skip
        outs = [
            one(q[qs:qe], k[ks:ke], v[ks:ke], attn_mask=lower_right(qe - qs, ke - ks, q.device))
            for (qs, qe), (ks, ke) in zip(pairwise(q_bounds), pairwise(k_bounds), strict=True)
            if qe > qs
        ]
        return torch.cat(outs, dim=0)

    return Backend(
        "sdpa",
        attend,
        True,
        "torch.nn.functional.scaled_dot_product_attention per segment",
        blocks,
    )


def _lower_right(torch: Any) -> Callable[[int, int, Any], Any]:
    """``(m, n, device) -> attn_mask``: causal, bottom-right aligned, for m queries and n keys:
    torch's ``causal_lower_right`` bias (sdpa dispatches it to fused kernels, faster than a
    boolean mask: docs/performance.md, "bench"), else the boolean mask itself (query j sees keys 0 .. n - m + j)."""
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:  # pragma: no cover - torch < 2.2
        return lambda m, n, device: torch.ones(m, n, dtype=torch.bool, device=device).tril(n - m)
    return lambda m, n, device: causal_lower_right(m, n)


def _torch_varlen(torch: Any) -> Backend:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        raise RolltoolError(
            f"torch {torch.__version__} has no torch.nn.attention.varlen (it came in 2.10)",
            hint="upgrade torch, or use --backend sdpa",
        ) from None
    params = inspect.signature(varlen_attn).parameters
    # 2.10: is_causal=True; 2.11+: window_size=(-1, 0) means causal.
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
        variant = "window_size=(-1, 0)"
    elif "is_causal" in params:
        causal, variant = {"is_causal": True}, "is_causal=True"
    else:
        raise RolltoolError(
            f"torch {torch.__version__}: varlen_attn takes neither window_size nor is_causal",
            hint="use --backend sdpa, and report the torch version",
        )
    gqa = "enable_gqa" in params
    call: Any = varlen_attn

    def attend(q: Any, k: Any, v: Any, cu: Any, max_len: int, bounds: Sequence[int]) -> Any:
        extra: dict[str, Any] = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
        return call(q, k, v, cu, cu, max_len, max_len, **causal, **extra)

    def blocks(q: Any, k: Any, v: Any, q_cu: Any, k_cu: Any, max_q: int, max_k: int,
               q_bounds: Sequence[int], k_bounds: Sequence[int]) -> Any:  # fmt: skip
        extra: dict[str, Any] = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
        return call(q, k, v, q_cu, k_cu, max_q, max_k, **causal, **extra)

    return Backend("torch-varlen", attend, gqa,
                   f"torch.nn.attention.varlen.varlen_attn({variant})", blocks)  # fmt: skip


def _flash_attn(torch: Any) -> Backend:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        raise RolltoolError(
            "flash-attn is not importable", hint="use --backend torch-varlen or sdpa"
        ) from None

    def attend(q: Any, k: Any, v: Any, cu: Any, max_len: int, bounds: Sequence[int]) -> Any:
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    def blocks(q: Any, k: Any, v: Any, q_cu: Any, k_cu: Any, max_q: int, max_k: int,
               q_bounds: Sequence[int], k_bounds: Sequence[int]) -> Any:  # fmt: skip
        return flash_attn_varlen_func(q, k, v, q_cu, k_cu, max_q, max_k, causal=True)

    return Backend("flash-attn", attend, True,
                   "flash_attn.flash_attn_varlen_func(causal=True)", blocks)  # fmt: skip


BACKENDS: dict[str, Callable[[Any], Backend]] = {
    "flash-attn": _flash_attn,
    "torch-varlen": _torch_varlen,
    "sdpa": _sdpa,
}
"""Backend constructors by name, each ``(torch module) -> Backend``."""

PREFERENCE = ("flash-attn", "torch-varlen", "sdpa")
"""The order ``auto`` tries them in."""

_CUDA_ONLY = {"flash-attn", "torch-varlen"}
_HALF_ONLY = {"flash-attn", "torch-varlen"}


def make_backend(name: str, torch: Any, *, device: str, dtype: str) -> tuple[Backend, str]:
    """Build backend ``name`` (or the best available for ``auto``) and say why it was chosen.

    Raises RolltoolError when the named backend cannot run on ``device`` with ``dtype``.
    """
    if name == "auto":
        reasons: list[str] = []
        for candidate in PREFERENCE:
            problem = _unsuitable(candidate, device, dtype)
            if problem is None:
                try:
                    backend = BACKENDS[candidate](torch)
                except RolltoolError as e:
                    problem = e.message
                else:
                    return backend, "auto: " + "; ".join([*reasons, f"{candidate} available"])
            reasons.append(f"not {candidate}: {problem}")
        raise AssertionError("sdpa is always suitable")  # pragma: no cover
    if name not in BACKENDS:
        raise RolltoolError(
            f"unknown backend {name!r}", hint=f"choose auto or one of {', '.join(sorted(BACKENDS))}"
        )
    problem = _unsuitable(name, device, dtype)
    if problem is not None:
        raise RolltoolError(f"backend {name}: {problem}", hint="use --backend sdpa on CPU or fp32")
    return BACKENDS[name](torch), "requested"


def _unsuitable(name: str, device: str, dtype: str) -> str | None:
    if name in _CUDA_ONLY and not device.startswith("cuda"):
        return "needs a CUDA device"
    if name in _HALF_ONLY and dtype not in ("bf16", "fp16"):
        return f"needs bf16 or fp16, not {dtype}"
    return None
