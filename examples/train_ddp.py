"""Data-parallel training from packed files with real torch.distributed: one process per rank.

    rolltool pack examples/rollouts.parquet --dp 2 -o packed
    torchrun --nproc-per-node 2 examples/train_ddp.py packed
    python -m torch.distributed.run --nproc-per-node 2 examples/train_ddp.py packed  # the same

Each process (gloo on CPU; ``--device cuda``: nccl) reads only its rank's files, through
``ds.torch_dataset(rank)`` and a DataLoader with ``batch_size=None``, and runs a tiny causal
transformer that honours the packing: attention is causal SDPA over each segment of
``cu_seqlens`` alone, rotary and absolute sinusoidal position embeddings are indexed by
``position_ids``. Its loss on a row is

    sum_t loss_weight[t] * token_loss[t]
    token_loss[t] = -advantages[t] * exp(logp[t] - logprobs[t]) - NLL_COEF * logp[t]

(the unclipped PPO surrogate against the behaviour log-probs, plus a likelihood term so every
trainable token moves the model), logp[t] = log p(input_ids[t] | the earlier tokens of its own
segment), 0 for a segment's first token. The weights already divide by the step's denominators
over all ranks, so a step's gradient is the *sum* of the ranks' gradients: ``--sync allreduce``
(default) all-reduces them with SUM; ``--sync ddp`` wraps the model in DistributedDataParallel,
which averages, so the loss is multiplied by the world size. One optimizer step per packed step.

Several PACKED directories train one after another, each from the same initial weights; with
``--out DIR`` every rank saves its parameters after the run as DIR/<name>.rank<R>.npz.
tests/scenarios/test_train_ddp.py runs this for 1, 2 and 4 processes and checks those parameters against
a single process that runs every sample alone.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import rolltool
from rolltool.packed.torch_data import prefetch

VOCAB, DIM, HEADS, LAYERS = 64, 16, 2, 1
NLL_COEF = 0.1
MAX_LOG_RATIO = 20.0  # exp() of a larger log-ratio would overflow float32 (verl clamps too)


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, H, hd] at positions pos [T]."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
    angle = pos.to(x.dtype)[:, None] * freqs  # [T, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sinusoid(pos: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Absolute sinusoidal embedding [T, dim] of positions pos [T]."""
    freqs = 10000.0 ** (-torch.arange(dim // 2, dtype=dtype) / (dim // 2))
    angle = pos.to(dtype)[:, None] * freqs
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class Block(nn.Module):
    """Pre-norm attention + MLP; attention sees only the token's own segment, causally."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cu: list[int]) -> torch.Tensor:
        t, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, dim // self.heads).unbind(1)
        q, k = rotate(q, pos), rotate(k, pos)
        parts = [  # one causal attention per segment: [H, L, hd] each
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                is_causal=True,
            ).transpose(0, 1)
            for a, b in itertools.pairwise(cu)
        ]
        x = x + self.proj(torch.cat(parts).reshape(t, dim))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    """Token ids (mod VOCAB) -> next-token logits [T, VOCAB], segment by segment."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cu: list[int]) -> torch.Tensor:
        x = self.embed(ids.long() % VOCAB)
        x = x + sinusoid(pos, DIM, x.dtype)
        for block in self.blocks:
            x = block(x, pos, cu)
        return self.head(self.norm(x))


def build_model(seed: int, dtype: torch.dtype) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM().to(dtype)


def token_logprobs(
    model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """logp[t] = log p(ids[t] | earlier tokens of its segment) [T]; 0 at a segment's start."""
    cu = cu_seqlens.tolist()
    logits = model(ids, pos, cu)
    target = ids.long() % VOCAB
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, target[1:, None])[:, 0]
    logp = torch.cat([logp.new_zeros(1), logp])
    starts = torch.zeros(len(ids), dtype=torch.bool, device=logp.device)
    starts[cu[:-1]] = True  # no prediction of a segment's first token from inside it
    return logp.masked_fill(starts, 0.0)


def token_loss(
    logp: torch.Tensor, advantages: torch.Tensor, old_logp: torch.Tensor
) -> torch.Tensor:
    """Per-token loss [T] (see the module docstring)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, max=MAX_LOG_RATIO))
    return -advantages * ratio - NLL_COEF * logp


def row_loss(model: nn.Module, mb: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """sum_t loss_weight[t] * token_loss[t] over one packed row."""
    logp = token_logprobs(model, mb["input_ids"], mb["position_ids"], mb["cu_seqlens"])
    tl = token_loss(logp, mb["advantages"].to(dtype), mb["logprobs"].to(dtype))
    return (mb["loss_weight"].to(dtype) * tl).sum()


def step_rows(ds: Any, rank: int, loader: Any, steps: int) -> Iterator[tuple[int, Iterator[Any]]]:
    """(step, that step's rows) for steps 0..steps-1, the counts from the manifest."""
    it = iter(loader)
    for step in range(steps):
        count = ds.manifest.steps[step].ranks[rank].micro_batches
        yield step, (_expect(next(it), step, j) for j in range(count))


def _expect(mb: dict[str, Any], step: int, j: int) -> dict[str, Any]:
    if (mb["step"], mb["micro_batch"]) != (step, j):
        raise RuntimeError(f"loader gave ({mb['step']}, {mb['micro_batch']}), not ({step}, {j})")
    return mb


def train(ds: Any, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, list[float]]:
    """Train on every (or the first --steps) packed step; returns the model and step losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    model = build_model(args.seed, dtype).to(device)
    net: nn.Module = model
    if args.sync == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    cuda = device.type == "cuda"
    data = ds.torch_dataset(rank, pin_memory=cuda and args.workers == 0)
    loader = DataLoader(
        data, batch_size=None, num_workers=args.workers, pin_memory=cuda and args.workers > 0
    )
    steps = ds.num_steps if args.steps is None else min(args.steps, ds.num_steps)
    scale = world if args.sync == "ddp" else 1  # DDP averages over ranks; the weights want a sum
    losses = []
    for step, rows in step_rows(ds, rank, prefetch(loader, device), steps):
        opt.zero_grad(set_to_none=False)
        count = ds.manifest.steps[step].ranks[rank].micro_batches
        local = torch.zeros((), dtype=dtype, device=device)
        for j, mb in enumerate(rows):
            last = j == count - 1
            sync = (
                net.no_sync()
                if isinstance(net, nn.parallel.DistributedDataParallel) and not last
                else nullcontext()
            )
            with sync:
                loss = row_loss(net, mb, dtype)
                (loss * scale).backward()
            local += loss.detach()
        if args.sync == "allreduce":
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        opt.step()
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
        losses.append(float(local))
    return model, losses


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("packed", nargs="+", type=Path, help="packed directories (dp = world size)")
    p.add_argument("--steps", type=int, default=None, help="train the first N steps (default all)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="initial weights")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--sync", choices=["allreduce", "ddp"], default="allreduce")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=None, help="save parameters here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for path in args.packed:
            ds = rolltool.open_packed(path)
            if ds.shared:  # continuations attend to prefixes elsewhere in the row
                raise SystemExit(f"{path} is a --share-prefix pack: this model attends within "
                                 "cu_seqlens only (docs/training.md, shared prefixes)")  # fmt: skip
            if ds.dp != world:
                raise SystemExit(
                    f"{path} was packed for --dp {ds.dp}; launch {ds.dp} processes, not {world}"
                )
            model, losses = train(ds, args, device)
            if rank == 0:
                for step, loss in enumerate(losses):
                    print(
                        f"{path.name} step {step}: loss {loss:+.6f} ({ds.step_meta(step).samples} samples)"
                    )
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                params = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
                np.savez(args.out / f"{path.name}.rank{rank}.npz", **params)
        dist.barrier()  # every rank done before the group goes away
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
