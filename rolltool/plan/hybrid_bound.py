"""A lower bound on a hybrid-CP step's lockstep cost: what no layout of its samples can beat.

With G = dp x cp GPUs of ``max_tokens`` tokens each, every sample i has a least work w_i (the
least over its feasible degrees k of k x its per-GPU cost, `gpu_cost`; k = 1 where it fits one
GPU, since CP padding and the ring only add work) and a least piece p_i (the least per-GPU
cost over its feasible degrees). With W = Σ w_i:

- every slot's maximum is at least its mean, so Σ_j max_g >= W / G;
- the slot holding the heaviest piece p* = max_i p_i has maximum >= p*, and holds at most
  F of the work, F the most work G x max_tokens tokens can carry (a fractional knapsack by
  work per token, w_i / L_i: a sample occupies at least its L_i tokens); the other slots hold
  the rest, so Σ_j max_g >= p* + (W - F) / G whenever G x p* > F (otherwise the first bound
  is the larger).

The bound is the larger of the two. It shows when a step cannot be balanced at all: on the
agent steps of ``benchmarks/longctx.py`` (8 x 4 GPUs of 32,768 tokens) one 131,072-token sample
split 4 ways outweighs what the slot's other GPUs can hold, and the bound is 1.00-1.08 times
W / G, 1.04 on average (`benchmarks/longctx.py`'s "lower bound" row).
"""

from __future__ import annotations

import numpy as np

from rolltool.plan.hybrid_cost import RingModel, gpu_cost, gpu_tokens
from rolltool.plan.workload import Workload

__all__ = ["least_work", "lower_bound"]


def least_work(
    lengths: np.ndarray, *, cp: int, max_tokens: int, workload: Workload, ring: RingModel
) -> tuple[np.ndarray, np.ndarray]:
    """([n] least work, [n] least per-GPU piece) of each sample over the degrees k <= cp whose
    per-GPU tokens fit `max_tokens` (inf where none does)."""
    length = np.asarray(lengths, dtype=np.int64)
    work = np.full(len(length), np.inf)
    piece = np.full(len(length), np.inf)
    k = 1
    while k <= cp:
        ks = np.full(len(length), k, dtype=np.int64)
        fits = gpu_tokens(length, ks) <= max_tokens
        c = gpu_cost(length, ks, workload, ring)
        work = np.where(fits, np.minimum(work, c * k), work)
        piece = np.where(fits, np.minimum(piece, c), piece)
        k *= 2
    return work, piece


def lower_bound(
    lengths: np.ndarray,
    *,
    dp: int,
    cp: int,
    max_tokens: int,
    workload: Workload,
    ring: RingModel,
) -> float:
    """The larger of the module docstring's two bounds on Σ_j max_g of any hybrid layout of
    `lengths` on dp x cp GPUs (inf when a sample fits no sub-group; 0.0 for an empty step)."""
    length = np.asarray(lengths, dtype=np.int64)
    if not len(length):
        return 0.0
    work, piece = least_work(length, cp=cp, max_tokens=max_tokens, workload=workload, ring=ring)
    if not np.isfinite(work).all():
        return float("inf")
    gpus = dp * cp
    total = float(work.sum())
    heaviest = float(piece.max())
    density = work / np.maximum(length, 1)
    order = np.argsort(-density, kind="stable")
    room = gpus * max_tokens
    taken = np.cumsum(length[order])
    whole = int(np.searchsorted(taken, room, side="right"))  # samples wholly inside the room
    fill = float(work[order[:whole]].sum())
    if whole < len(length):  # and a fraction of the next one
        left = room - (int(taken[whole - 1]) if whole else 0)
        fill += left * float(density[order[whole]])
    slot = heaviest + max(0.0, total - fill) / gpus if gpus * heaviest > fill else 0.0
    return max(total / gpus, slot)
