"""Feed packed rows to a Hugging Face causal LM and get each sample's per-token log-probs.

    python examples/hf_packed.py        (CPU, a tiny random Llama; nothing is downloaded)

A packed row concatenates samples; ``position_ids`` restart at 0 for each sample. The model must
not let a token attend to the previous samples of its row. transformers (4.57) finds the sample
boundaries from ``position_ids`` only when ``attention_mask`` is None and there is no KV cache,
so call the model with ``attention_mask=None, use_cache=False``. Flash-attention-style kernels
also take the boundaries as keyword arguments: ``cu_seq_lens_q/k`` (int32 offsets, ``[0, l0,
l0+l1, ...]``) and ``max_length_q/k``; `packed_inputs` builds both.

The script prints, for each attention implementation, the largest difference between packed and
alone log-probs, under the right call and under two common mistakes: ``use_cache`` left at its
default (True: a KV cache is made and the boundary detection is off) and an all-ones
``attention_mask``; both silently let samples attend to each other. The varlen reference is a
pure-torch attention registered here that reads only ``cu_seq_lens_q/k``: it shows the varlen
keywords reach the attention on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "rolltool_varlen_reference"
"""Name under which `register_varlen_reference` registers its attention."""


def tiny_llama(attn_implementation: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocab 128) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)  # fmt: skip
    model: Any = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def packed_inputs(samples: list[torch.Tensor]) -> dict[str, Any]:
    """One packed row: ``input_ids`` and ``position_ids`` ``[1, T]`` and the varlen keywords."""
    lengths = torch.tensor([len(s) for s in samples])
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return {
        "input_ids": torch.cat(samples)[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in samples])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ids[..t]) for one sample: ``[len - 1]``."""
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]


def packed_logprobs(model: Any, samples: list[torch.Tensor], **call: Any) -> list[torch.Tensor]:
    """Each sample's per-token log-probs from one packed forward; ``call`` adds to the call's
    keywords (default: the right call, ``attention_mask=None, use_cache=False``, varlen keys)."""
    inputs = packed_inputs(samples)
    kwargs = {"attention_mask": None, "use_cache": False, **inputs, **call}
    if kwargs["use_cache"] is None:  # the model's default (config.use_cache, True for Llama)
        del kwargs["use_cache"]
    with torch.no_grad():
        logits = model(**kwargs).logits[0]
    out, start = [], 0
    for s in samples:
        out.append(token_logprobs(logits[start : start + len(s)], s))
        start += len(s)
    return out


def alone_logprobs(model: Any, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's per-token log-probs, running it alone."""
    with torch.no_grad():
        return [token_logprobs(model(input_ids=s[None], use_cache=False).logits[0], s)
                for s in samples]  # fmt: skip


def register_varlen_reference() -> str:
    """Register a pure-torch attention that uses only ``cu_seq_lens_q/k`` (no mask, no
    position_ids): causal SDPA over each sample's slice. Returns its name."""
    from transformers import AttentionInterface

    def attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        whole = torch.tensor([0, q.shape[2]])  # no keywords (a sample alone): one sequence
        cu_q = kwargs.get("cu_seq_lens_q", whole).tolist()
        cu_k = kwargs.get("cu_seq_lens_k", whole).tolist()
        rep = q.shape[1] // k.shape[1]  # grouped-query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        parts = []
        for i in range(len(cu_q) - 1):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            parts.append(F.scaled_dot_product_attention(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], is_causal=True, scale=scaling))  # fmt: skip
        return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None

    AttentionInterface.register(VARLEN, attention)
    return VARLEN


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest absolute difference over all tokens of all samples."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True) if len(x))


CALLS: dict[str, dict[str, Any]] = {
    "attention_mask=None, use_cache=False": {},
    "use_cache left at its default (True)": {"use_cache": None},
    "all-ones attention_mask": {"attention_mask": "ones"},
}
"""The right call and two common mistakes (``"ones"`` is replaced by an all-ones mask)."""


def check(
    attn_implementation: str, samples: list[torch.Tensor], dtype: torch.dtype = torch.float64
) -> dict[str, float]:
    """Max |packed - alone| log-prob per call in ``CALLS`` for one implementation."""
    model = tiny_llama(attn_implementation, dtype=dtype)
    alone = alone_logprobs(model, samples)
    total = sum(len(s) for s in samples)
    out = {}
    for name, call in CALLS.items():
        if call.get("attention_mask") == "ones":
            call = {"attention_mask": torch.ones(1, total, dtype=torch.long)}
        out[name] = max_diff(packed_logprobs(model, samples, **call), alone)
    return out


def demo_samples(seed: int = 0) -> list[torch.Tensor]:
    """Five random samples of 1 to 40 tokens (one of length 1 and two of the same length)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g) for n in (17, 1, 40, 9, 9)]


def main() -> None:
    samples = demo_samples()
    impls = ["eager", "sdpa", "flex_attention", register_varlen_reference(), "flash_attention_2"]
    print("max |packed - alone| per-token log-prob; ~1e-15 (float64) or ~1e-6 (float32, flex on "
          "CPU) means packing is respected")  # fmt: skip
    for impl in impls:
        dtype = torch.float32 if impl == "flex_attention" else torch.float64
        try:
            res = check(impl, samples, dtype)
        except Exception as exc:  # report what does not run here, go on
            print(f"{impl:28s} not available here: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        print(f"{impl:28s} " + "  ".join(f"{k}: {v:.1e}" for k, v in res.items()))


if __name__ == "__main__":
    main()
