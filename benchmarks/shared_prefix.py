"""Benchmark: shared-prefix packing (issue 24) against the same rollouts packed unshared.

    python benchmarks/shared_prefix.py [--rollouts 8] [--prompt 4096] [--response 1024]
                                       [--repeats 5] [--threads 1] [--hidden 64] [--layers 2]
                                       [--intermediate 4 x hidden]

Two groups of random tokens (what the model computes does not depend on their values):

  grpo   --rollouts rollouts of --response trained tokens behind one untrained --prompt (the
         issue's aim: 8 x 1k behind 4k, >= 2.5x fewer computed tokens, >= 2x faster replay)
  agent  a --prompt / 2 prompt, then two trajectories of --response trained tokens (equal
         log-probs and advantages: one tree of branches), each branching into --rollouts / 2
         continuations of --response / 2 tokens

Each group is laid out by `rolltool.plan.prefix` (share_min 64) and, for comparison, unshared
(the same samples, one segment each). Per layout: tokens stored (= computed: each stored token
is fed forward once), keys/values gathered, attention pairs (query-key pairs under the causal
mask), dense-7b training TFLOPs (``flops`` workload coefficients: a·tokens + 2b·pairs, the
cost(L) = a·L + b·L² of plan/workload.py counted per query), and the measured CPU time (this process's, so
other load on the machine counts little) of a forward + backward step of a tiny Llama (transformers, float32, --hidden/--intermediate/--layers, 4 heads,
vocab 512, CPU, --threads torch threads) with `rolltool.bench.prefix_attention` as its
attention in both layouts (sdpa per segment; unshared = no gathered prefix), loss = sum of
target weight x -log p. Median of --repeats, the layouts interleaved, after one warm-up each.
The last column checks exactness: max |Δ log p| over every sample's targets, shared vs unshared
(float32 here; the tests check 1e-10 in float64).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers

from rolltool.bench.prefix_attention import hf_attention, prefix_tensors
from rolltool.format.prefix import shared_next_token_targets, target_source
from rolltool.plan.prefix import GroupTokens, PrefixForest, SharedLayout, detect, lay_out
from rolltool.plan.workload import make_workload

NAME = "rolltool_shared_prefix"
VOCAB = 512


def grpo(rollouts: int, prompt: int, response: int, rng: np.random.Generator) -> GroupTokens:
    head = rng.integers(0, VOCAB, prompt)
    ids = [np.r_[head, rng.integers(0, VOCAB, response)] for _ in range(rollouts)]
    mask = [np.r_[np.zeros(prompt), np.ones(response)] for _ in ids]
    return GroupTokens(ids, mask)


def agent(rollouts: int, prompt: int, response: int, rng: np.random.Generator) -> GroupTokens:
    head = rng.integers(0, VOCAB, prompt // 2)
    ids, mask = [], []
    for _ in range(2):
        trajectory = rng.integers(0, VOCAB, response)
        for _ in range(max(1, rollouts // 2)):
            tail = rng.integers(0, VOCAB, response // 2)
            ids.append(np.r_[head, trajectory, tail])
            mask.append(np.r_[np.zeros(len(head)), np.ones(response + len(tail))])
    return GroupTokens(ids, mask)


def unshared(g: GroupTokens) -> SharedLayout:
    n = len(g.input_ids)
    none = np.zeros(0, dtype=np.int64)
    return lay_out(PrefixForest(g.lengths, none, none, none, none, np.full(n, -1)))


def tiny_llama(hidden: int, layers: int, intermediate: int) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1 << 16,
    )  # fmt: skip
    config._attn_implementation = NAME
    return transformers.LlamaForCausalLM(config)


@dataclass
class Step:
    """One layout's inputs as tensors, and what a step over them does."""

    lay: SharedLayout
    ids: Any
    pos: Any
    index: Any
    target: Any
    weight: Any

    @classmethod
    def make(cls, g: GroupTokens, lay: SharedLayout) -> Step:
        trained = sum(float(np.sum(m)) for m in g.loss_mask)
        weights = [np.asarray(m, dtype=np.float64) / trained for m in g.loss_mask]  # token-mean
        row = {
            "input_ids": lay.gather(g.input_ids),
            "loss_weight": lay.summed(weights),
            "advantages": np.zeros(int(lay.cu_seqlens[-1])),
            "logprobs": np.zeros(int(lay.cu_seqlens[-1])),
            "cu_seqlens": lay.cu_seqlens,
            "sample_index": lay.sample,
        }
        t = shared_next_token_targets(row, lay.parent)
        has = target_source(lay.cu_seqlens, lay.parent) >= 0
        ix = lay.kernel_index()
        return cls(
            lay=lay,
            ids=torch.as_tensor(row["input_ids"])[None],
            pos=torch.as_tensor(ix.position_ids)[None],
            index=prefix_tensors(ix),
            target=torch.as_tensor(np.where(has, t["target_ids"], 0))[:, None],
            weight=torch.as_tensor(t["target_loss_weight"]),
        )

    def run(self, model: Any) -> Any:
        """Forward + backward; the per-stored-token target log-probs."""
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=self.ids, position_ids=self.pos, prefix_index=self.index,
                       use_cache=False).logits[0]  # fmt: skip
        logp = logits.log_softmax(-1).gather(1, self.target)[:, 0]
        (self.weight * -logp).sum().backward()
        return logp.detach()


def compare(g: GroupTokens, model: Any, repeats: int) -> dict[str, Any]:
    shared = lay_out(detect(g))
    steps = {"unshared": Step.make(g, unshared(g)), "shared": Step.make(g, shared)}
    logp = {k: s.run(model) for k, s in steps.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, s in steps.items():
            t0 = time.process_time()
            s.run(model)
            times[k].append(time.process_time() - t0)
    delta = max(
        float((logp["shared"][steps["shared"].lay.sample_rows(i)[:-1]]
               - logp["unshared"][steps["unshared"].lay.sample_rows(i)[:-1]]).abs().max())
        for i in range(len(g.input_ids))
    )  # fmt: skip
    return {"stats": {k: s.lay.stats() for k, s in steps.items()},
            "seconds": {k: statistics.median(v) for k, v in times.items()}, "delta": delta}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None, help="default: 4 x --hidden")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.AttentionInterface.register(NAME, hf_attention)
    intermediate = args.intermediate or 4 * args.hidden
    model = tiny_llama(args.hidden, args.layers, intermediate)
    w = make_workload("flops", model="dense-7b")
    rng = np.random.default_rng(0)
    print(f"{args.rollouts} rollouts x {args.response} tokens, prompt {args.prompt}; tiny Llama "
          f"hidden {args.hidden} (MLP {intermediate}) x {args.layers} layers, float32, {args.threads} thread(s)\n")  # fmt: skip
    print("| group | layout | tokens | K/V gathered | attention pairs | 7B TFLOPs | "
          "step CPU s | max Δ log p |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, make in (("grpo", grpo), ("agent", agent)):
        r = compare(make(args.rollouts, args.prompt, args.response, rng), model, args.repeats)
        base, base_s = r["stats"]["unshared"], r["seconds"]["unshared"]
        for k in ("unshared", "shared"):
            s, sec = r["stats"][k], r["seconds"][k]
            print(" | ".join([
                f"| {name}", k,
                f"{s.tokens_shared:,} ({base.tokens_shared / s.tokens_shared:.2f}x)",
                f"{s.kv_tokens_shared:,}",
                f"{s.attention_pairs_shared / 1e6:.1f}M "
                f"({base.attention_pairs_shared / s.attention_pairs_shared:.2f}x)",
                f"{tflops(w, s):.1f} ({tflops(w, base) / tflops(w, s):.2f}x)",
                f"{sec:.3f} ({base_s / sec:.2f}x)",
                f"{r['delta'] if k == 'shared' else 0:.1e} |",
            ]))  # fmt: skip


def tflops(w: Any, s: Any) -> float:
    """Training TFLOPs of a layout: a per stored token, b·L² as 2b per attention pair."""
    return (w.a * s.tokens_shared + 2 * w.b * s.attention_pairs_shared) / 1e12


if __name__ == "__main__":
    main()
