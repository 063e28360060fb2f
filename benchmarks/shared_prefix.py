"""Benchmark: shared-prefix packing (issue 24) against the same rollouts packed unshared.

    python benchmarks/shared_prefix.py [--rollouts 8] [--prompt 4096] [--response 1024] [--synth]
                                       [--repeats 5] [--threads 1] [--hidden 64] [--layers 2]
                                       [--intermediate 4 x hidden] [--packed-groups 2]

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

``--synth`` first prints, for `rolltool synth --shared-prompts` data (`SYNTH_CASES`: the
default env mix, math with 8 rollouts behind a 4k prompt, agent alone) packed ``--dp 8
--share-prefix``, the tokens and attention pairs the pack's step records count unshared and
stored, the dense-7b TFLOPs they cost, and the step time the plans give on the planning model
(these packs are too large for the tiny model on CPU); then, measured, 2 synth math groups of 8
rollouts behind a 4k prompt through pack and the reader, replayed as the ``packed`` rows are.

The ``packed`` rows run the same through the real pipeline: --packed-groups grpo groups
written as a rollout Parquet file, ``rolltool pack --dp 1 --micro-batch-tokens 16384``
with and without ``--share-prefix`` (one step), and every row the reader gives replayed
(``row_prefix_tensors`` of the shared view; an unshared row as one with no parents), loss = sum
of the reader's target weight x -log p; Δ log p compares each sample's targets across the two
packs (found through the chains).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers

import rolltool
from rolltool.bench.prefix_attention import hf_attention, prefix_tensors, row_prefix_tensors
from rolltool.format.prefix import shared_next_token_targets, shared_view, target_source
from rolltool.input.synth import SynthConfig, generate
from rolltool.jobs.pack import run_pack
from rolltool.plan.batches import StepConfig
from rolltool.plan.config import PackConfig
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
    ap.add_argument(
        "--packed-groups",
        type=int,
        default=2,
        help="grpo groups run through rolltool pack and the reader (0: none)",
    )
    ap.add_argument(
        "--synth",
        action="store_true",
        help="also synth --shared-prompts data through pack --share-prefix (tokens and FLOPs)",
    )
    args = ap.parse_args()
    if args.synth:
        synth_rows(make_workload("flops", model="dense-7b"))
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
    if args.synth:  # synth's own data through the pipeline, replayed (measured)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "synth.parquet"
            config = SynthConfig(groups=2, seed=0, envs=("math",), group_size=8, prompt_len=4096,
                                 max_len=8192, shared_prompts=True)  # fmt: skip
            pq.write_table(generate(config), src)
            r = packed_file(src, model, args.repeats, Path(tmp))
        _print_packed("packed (synth math, 2 groups x 8 behind 4k)", r)
    if args.packed_groups:
        groups = [grpo(args.rollouts, args.prompt, args.response, rng)
                  for _ in range(args.packed_groups)]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            r = packed(groups, model, args.repeats, Path(tmp))
        _print_packed(f"packed ({args.packed_groups} x grpo)", r)


def _print_packed(label: str, r: dict[str, Any]) -> None:
    """The table rows of a `packed_file` result: tokens and step time, unshared then shared."""
    base, base_s = r["tokens"]["unshared"], r["seconds"]["unshared"]
    for k in ("unshared", "shared"):
        print(f"| {label} | {k} | {r['tokens'][k]:,} ({base / r['tokens'][k]:.2f}x) | | | | "
              f"{r['seconds'][k]:.3f} ({base_s / r['seconds'][k]:.2f}x) | "
              f"{r['delta'] if k == 'shared' else 0:.1e} |")  # fmt: skip


def packed(groups: list[GroupTokens], model: Any, repeats: int, root: Path) -> dict[str, Any]:
    """The groups through ``rolltool pack`` shared and unshared, each pack's rows replayed."""
    _write_groups(groups, root / "in.parquet")
    return packed_file(root / "in.parquet", model, repeats, root)


def _write_groups(groups: list[GroupTokens], path: Path) -> None:
    """The groups as a rollout Parquet file (group g, rollout i; rewards alternate)."""
    cols: dict[str, list[Any]] = {k: [] for k in ("group_id", "rollout_id", "sample_id", "env",
                                                  "reward", "input_ids", "loss_mask", "logprobs")}  # fmt: skip
    for gi, g in enumerate(groups):
        for i, (ids, mask) in enumerate(zip(g.input_ids, g.loss_mask, strict=True)):
            cols["group_id"].append(f"g{gi}")
            cols["rollout_id"].append(f"g{gi}/r{i}")
            cols["sample_id"].append(f"g{gi}/r{i}")
            cols["env"].append("math")
            cols["reward"].append(float(i % 2))
            cols["input_ids"].append(np.asarray(ids, dtype=np.int32).tolist())
            cols["loss_mask"].append((np.asarray(mask) != 0).tolist())
            cols["logprobs"].append(np.zeros(len(ids), dtype=np.float32).tolist())
    pq.write_table(pa.table(cols), path)


def packed_file(src: Path, model: Any, repeats: int, root: Path) -> dict[str, Any]:
    """A rollout file through ``rolltool pack --dp 1 --micro-batch-tokens 16384`` shared and
    unshared (one step of all its rollouts), each pack's rows replayed (token ids folded into
    the tiny model's vocabulary: what it computes does not depend on their values)."""
    rollouts = len(set(pq.read_table(src, columns=["rollout_id"])["rollout_id"].to_pylist()))
    out: dict[str, Any] = {"rows": {}, "seconds": {}, "tokens": {}, "logp": {}}
    for name, share in (("unshared", False), ("shared", True)):
        config = PackConfig(dp=1, share_prefix=share, micro_batch_tokens=16384,
                            steps=StepConfig(batch_size=rollouts))  # fmt: skip
        run_pack([str(src)], root / name, config, force=True)
        ds = rolltool.open_packed(root / name)
        rows = [r if share else shared_view(r, np.full(len(r["sample_index"]), -1))
                for r in ds.micro_batches(0, 0)]  # fmt: skip
        out["rows"][name] = rows
        out["tokens"][name] = sum(len(r["input_ids"]) for r in rows)
    for name, rows in out["rows"].items():  # warm-up, and each sample's target log-probs
        out["logp"][name] = _chains_logp(model, rows)
    times: dict[str, list[float]] = {k: [] for k in out["rows"]}
    for _ in range(repeats):
        for name, rows in out["rows"].items():
            t0 = time.process_time()
            for r in rows:
                _packed_step(model, r)
            times[name].append(time.process_time() - t0)
    out["seconds"] = {k: statistics.median(v) for k, v in times.items()}
    a, b = out["logp"]["shared"], out["logp"]["unshared"]
    out["delta"] = max(float((a[i] - b[i]).abs().max()) for i in a)
    return out


def _packed_step(model: Any, row: dict[str, Any]) -> Any:
    """Forward + backward of one reader row; its per-stored-token target log-probs."""
    model.zero_grad(set_to_none=True)
    ids = torch.from_numpy(np.array(row["input_ids"], dtype=np.int64) % VOCAB)[None]
    pos = torch.from_numpy(np.array(row["position_ids"], dtype=np.int64))[None]
    logits = model(input_ids=ids, position_ids=pos, prefix_index=row_prefix_tensors(row),
                   use_cache=False).logits[0]  # fmt: skip
    target = torch.from_numpy(np.array(row["target_ids"], dtype=np.int64))
    target = torch.where(target >= 0, target % VOCAB, target)
    logp = logits.log_softmax(-1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    weight = torch.from_numpy(np.array(row["target_loss_weight"]))
    (weight * -logp).sum().backward()
    return logp.detach()


def _chains_logp(model: Any, rows: list[dict[str, Any]]) -> dict[int, Any]:
    """sample_index -> its targets' log-probs, read along its chain in the rows."""
    out = {}
    for r in rows:
        logp = _packed_step(model, r)
        parent, cu = r["parent"], r["cu_seqlens"]
        named = set(parent[parent >= 0].tolist())
        for j, i in enumerate(r["sample_index"].tolist()):
            if i < 0 or j in named:
                continue
            chain, seg = [], j
            while seg >= 0:
                chain.append(seg)
                seg = int(parent[seg])
            at = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in chain[::-1]])
            out[i] = logp[torch.from_numpy(at[:-1])]
    return out


SYNTH_CASES = {
    "synth default mix": dict(groups=300, seed=5, batch_size=32),
    "synth math, 8 x 4k prompt": dict(groups=40, seed=0, envs=("math",), group_size=8,
                                      prompt_len=4096, batch_size=64),
    "synth agent": dict(groups=60, seed=0, envs=("agent",), batch_size=16),
}  # fmt: skip
"""``--synth``: `rolltool synth --shared-prompts` configs, each packed ``--dp 8 --batch-size B
--share-prefix``."""


def synth_rows(w: Any) -> None:
    """Per `SYNTH_CASES` entry: tokens unshared and stored, attention pairs and dense-7b training
    TFLOPs (a per token, 2b per pair), summed over the pack's step records (``plan.shared``),
    and the step time the plans give (Σ_j max_r of computed cost, ``rolltool stats --json``
    ``step_cost`` summed over the steps) of the same data packed unshared and shared."""
    print("| data | tokens unshared | stored | attention pairs | 7B TFLOPs | step time (model) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, case in SYNTH_CASES.items():
        case = dict(case)
        batch = case.pop("batch_size")
        times = {}
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "in.parquet"
            pq.write_table(generate(SynthConfig(shared_prompts=True, **case)), src)
            for share in (False, True):
                out = Path(tmp) / f"out-{share}"
                config = PackConfig(dp=8, share_prefix=share, steps=StepConfig(batch_size=batch))
                run_pack([str(src)], out, config, force=True)
                report = subprocess.run([sys.executable, "-m", "rolltool", "stats", str(out),
                                         "--json"], capture_output=True, text=True, check=True)  # fmt: skip
                times[share] = sum(st["step_cost"] for st in json.loads(report.stdout)["steps"])
            ds = rolltool.open_packed(Path(tmp) / "out-True")
            rec = [st.plan.shared for st in ds.manifest.steps]
        tok = sum(r.tokens for r in rec)
        kept = sum(r.stored for r in rec)
        pairs = sum(r.attention_pairs for r in rec)
        shared = sum(r.attention_pairs_shared for r in rec)
        flops = (w.a * tok + 2 * w.b * pairs) / 1e12, (w.a * kept + 2 * w.b * shared) / 1e12
        print(f"| {name} | {tok:,} | {kept:,} ({tok / kept:.2f}x fewer) | {pairs / 1e9:.2f}G -> "
              f"{shared / 1e9:.2f}G ({pairs / shared:.2f}x) | {flops[0]:,.0f} -> {flops[1]:,.0f} "
              f"({flops[0] / flops[1]:.2f}x) | {times[False]:.3e} -> {times[True]:.3e} "
              f"({times[False] / times[True]:.2f}x) |")  # fmt: skip
    print()


def tflops(w: Any, s: Any) -> float:
    """Training TFLOPs of a layout: a per stored token, b·L² as 2b per attention pair."""
    return (w.a * s.tokens_shared + 2 * w.b * s.attention_pairs_shared) / 1e12


if __name__ == "__main__":
    main()
