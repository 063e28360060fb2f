"""One dense decoder layer over a packed row (``--what layer``): what a trainer's layer costs.

For a row of T tokens (``cu_seqlens[-1]``) and its segment boundaries::

    x [T, hidden]
    h = rms_norm(x)
    q = h Wqᵀ -> [T, heads, head_dim]     k, v = h Wkᵀ, h Wvᵀ -> [T, kv_heads, head_dim]
    x = x + attend(q, k, v, cu_seqlens) Woᵀ                     # varlen, causal, per segment
    h = rms_norm(x)
    x = x + (silu(h Wgateᵀ) * h Wupᵀ) Wdownᵀ                      # [T, intermediate] inside

Everything but ``attend`` works token by token, so a packed row's output for one segment equals
the same layer run on that sequence alone: the projections and the MLP give the linear term of
the cost (2·T·``matmul_params`` FLOPs forward), attention the quadratic one. Rotary embeddings
(elementwise, per-segment positions) are left out; their cost is a small part of the linear term.

Weights follow ``nn.Linear`` (``[out, in]``), random normal scaled by 1/√fan_in, seeded, made
once per shape on the device before any timing, and shared by all rows and all ``layers``
repetitions (the output of one repetition is the input of the next, as in a real stack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rolltool.bench.backends import Attend
from rolltool.bench.config import LayerShape

NAMES = ("q", "k", "v", "o", "gate", "up", "down")
"""The layer's matmul weights, in ``LayerWeights.matmuls`` order."""


@dataclass
class LayerWeights:
    """One layer's weights on the device (``requires_grad`` when timing the backward)."""

    shape: LayerShape
    matmuls: list[Any]
    """``[out, in]`` tensors named by ``NAMES``."""
    norms: list[Any]
    """The two RMSNorm scales, ``[hidden]``."""

    @property
    def params(self) -> list[Any]:
        """Every weight, in a fixed order (what the backward differentiates besides the input)."""
        return [*self.matmuls, *self.norms]


def make_weights(
    torch: Any, shape: LayerShape, *, device: str, dtype: Any, seed: int, grad: bool = False
) -> LayerWeights:
    """Random weights of ``shape`` on ``device`` (seeded; see the module docstring)."""
    h, hd, inter = shape.hidden, shape.head_dim, shape.intermediate
    q_out, kv_out = shape.heads * hd, shape.kv_heads * hd
    dims = {
        "q": (q_out, h),
        "k": (kv_out, h),
        "v": (kv_out, h),
        "o": (h, q_out),
        "gate": (inter, h),
        "up": (inter, h),
        "down": (h, inter),
    }
    gen = torch.Generator(device=device).manual_seed(seed)
    matmuls = []
    for name in NAMES:
        out, fan_in = dims[name]
        w = torch.randn(out, fan_in, generator=gen, device=device, dtype=torch.float32)
        matmuls.append(w.mul_(fan_in**-0.5).to(dtype).requires_grad_(grad))
    norms = [torch.ones(h, device=device, dtype=dtype, requires_grad=grad) for _ in range(2)]
    return LayerWeights(shape=shape, matmuls=matmuls, norms=norms)


def layer_forward(
    torch: Any,
    w: LayerWeights,
    x: Any,
    attend: Attend,
    cu: Any,
    max_len: int,
    bounds: Sequence[int],
    *,
    gqa: bool = True,
) -> Any:
    """One layer over a packed row: ``x [T, hidden] -> [T, hidden]``.

    ``attend`` is a backend's call (``rolltool.bench.backends``); ``gqa=False`` repeats k and v
    heads up to ``heads`` first, for a backend that cannot group them.
    """
    s = w.shape

    def mix(q: Any, k: Any, v: Any) -> Any:
        if not gqa and s.kv_heads != s.heads:
            group = s.heads // s.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return attend(q, k, v, cu, max_len, bounds).reshape(q.shape[0], s.heads * s.head_dim)

    return layer_with(torch, w, x, mix)


Mix = Callable[[Any, Any, Any], Any]
"""``(q [t, heads, head_dim], k, v [t, kv_heads, head_dim]) -> [t, heads·head_dim]``: the
attention of a layer's local tokens, however it is shared (`rolltool.bench.split_work`)."""


def layer_with(torch: Any, w: LayerWeights, x: Any, mix: Mix) -> Any:
    """The layer of the module docstring over ``x [t, hidden]``, its attention done by ``mix``
    (one packed row's varlen attention, or a GPU's share of a split row's)."""
    F = torch.nn.functional
    s = w.shape
    t = x.shape[0]
    wq, wk, wv, wo, wgate, wup, wdown = w.matmuls
    h = F.rms_norm(x, (s.hidden,), w.norms[0])
    q = F.linear(h, wq).view(t, s.heads, s.head_dim)
    k = F.linear(h, wk).view(t, s.kv_heads, s.head_dim)
    v = F.linear(h, wv).view(t, s.kv_heads, s.head_dim)
    x = x + F.linear(mix(q, k, v), wo)
    h = F.rms_norm(x, (s.hidden,), w.norms[1])
    return x + F.linear(F.silu(F.linear(h, wgate)) * F.linear(h, wup), wdown)
