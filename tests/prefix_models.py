"""A tiny float64 Llama in two copies, shared-prefix attention and stock sdpa (issue 24); not
a test module (tests/bench/test_prefix_attention.py, tests/bench/test_prefix_packed.py).

``tiny_llamas(vocab)`` gives (shared, alone): the same weights, the first with
`rolltool.bench.prefix_attention.hf_attention` registered as its attention (pass
``prefix_index=...`` to its forward), the second stock. RMSNorm runs in float64 in both:
transformers computes it in float32 whatever the model's dtype, the same per token in either
layout, but the backward then rounds a prefix token's gradient (summed over its continuations)
differently from its copies' (~1e-7): not sharing's error.
"""

from __future__ import annotations

import copy
from typing import Any

NAME = "rolltool_shared_prefix"


def tiny_llamas(vocab: int = 24, positions: int = 256) -> tuple[Any, Any]:
    import torch
    import transformers

    from rolltool.bench.prefix_attention import hf_attention

    transformers.AttentionInterface.register(NAME, hf_attention)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    alone = transformers.LlamaForCausalLM(config).to(torch.float64)
    float64_norms(alone)
    shared = copy.deepcopy(alone)
    float64_norms(shared)
    shared.config._attn_implementation = NAME
    return shared, alone


def float64_norms(model: Any) -> None:
    """Every LlamaRMSNorm of `model` computed in the model's dtype (see the module docstring)."""
    import transformers

    for norm in model.modules():
        if isinstance(norm, transformers.models.llama.modeling_llama.LlamaRMSNorm):
            norm.forward = _rms(norm)


def _rms(norm: Any) -> Any:
    import torch

    def forward(x: torch.Tensor) -> torch.Tensor:
        return (
            norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        )

    return forward
