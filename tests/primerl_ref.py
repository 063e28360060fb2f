"""prime-rl's packing, ported as a test reference: its randomized test's generator and the
algorithm of its ``prepare_batch`` for text samples; not a test module.

Ported (rewritten, not copied) from PrimeIntellect-ai/prime-rl at commit
559b44772e471d1538537b8805cc77f3824a5e64: ``tests/unit/orchestrator/test_batch.py``
(``test_randomized_packing_invariants``, ``make_flops_config``) and
``src/prime_rl/trainer/batch.py`` (``build_bin_cost``, ``packed_samples_into_micro_bs``,
``_expand_bins_by_splitting``, ``_MicroBatchBin.split_by_workload``,
``_pad_group_for_distribution``, ``_distribute_group``, ``balanced_partition``). Only what decides
which sample goes to which rank is kept (no token arrays), with the same orders and tie-breaks:

1. samples sorted longest first (a stable sort), packed first-fit decreasing under ``seq_len``;
2. with more than one worker, the costliest bin holding two or more samples (ties: the last
   such bin) is split in two by a greedy over its samples (costliest first, each to the lighter
   half, the left one on ties) until the bin count is a multiple of the workers (at least one
   bin per worker) or no bin can be split;
3. the count padded to a multiple of the workers with copies of bin 0 (zero-loss dummies, which
   weigh as much as bin 0 in the balancing);
4. the bins' costs split over the workers by equal-count Karmarkar-Karp (blocks of ``workers``
   bins in ascending cost order), then improved by the single best swap of two bins between two
   workers, again and again, while one lowers (heaviest worker, heaviest - lightest).

A bin's cost is ``linear · Σ L + quadratic · Σ L²`` in whole numbers: (1, 0) (tokens) without a
model config, (17408, 64) with the test's tiny config (``FLOPS_COEFFS``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

FLOPS_CONFIG = {
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "head_dim": 8,
}
"""prime-rl's ``make_flops_config()``: a dense model, no MoE, no multi-latent attention."""


def dense_cost_coeffs(config: dict[str, int]) -> tuple[int, int]:
    """prime-rl's per-sequence forward FLOPs of a dense decoder as (linear, quadratic):
    Q/K/V projections, the output projection, the MLP and the LM head per token; attention
    scores and values per token²."""
    h, d, layers = config["hidden_size"], config["head_dim"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    qkv = 2 * h * heads * d + 4 * h * kv * d
    per_layer = qkv + 2 * h * h + 6 * h * config["intermediate_size"]
    return layers * per_layer + 2 * h * config["vocab_size"], layers * 2 * heads * d


FLOPS_COEFFS = dense_cost_coeffs(FLOPS_CONFIG)
"""(17408, 64) for the test's config."""


@dataclass(frozen=True)
class Case:
    """One draw of prime-rl's randomized test."""

    index: int
    seq_len: int
    workers: int
    lengths: list[int]
    coeffs: tuple[int, int]
    """(linear, quadratic): FLOPs on even cases, tokens (1, 0) on odd ones."""


def randomized_cases(count: int = 80, seed: int = 0) -> Iterator[Case]:
    """The draws of ``test_randomized_packing_invariants`` (``default_rng(0)``, 80 cases), in
    its order: seq_len in {8, 16, 32, 64}, workers in {1, 2, 4, 8}, 1-64 samples of 1..seq_len."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        seq_len = int(rng.choice([8, 16, 32, 64]))
        workers = int(rng.choice([1, 2, 4, 8]))
        n = int(rng.integers(1, 65))
        lengths = [int(x) for x in rng.integers(1, seq_len + 1, size=n)]
        yield Case(i, seq_len, workers, lengths, FLOPS_COEFFS if i % 2 == 0 else (1, 0))


def bin_cost(lengths: list[int], coeffs: tuple[int, int]) -> int:
    linear, quadratic = coeffs
    return linear * sum(lengths) + quadratic * sum(x * x for x in lengths)


def _ffd(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per bin: longest first (ties in input order), each to the first bin with
    room, in the order they were added."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b in range(len(bins)):
            if used[b] + lengths[i] <= seq_len:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def _split(samples: list[int], cost: list[int]) -> tuple[list[int], list[int]]:
    """Two halves: samples costliest first (stable), each to the lighter half (left on ties)."""
    left: list[int] = []
    right: list[int] = []
    lw = rw = 0
    for i in sorted(samples, key=lambda i: -cost[i]):
        if lw <= rw:
            left.append(i)
            lw += cost[i]
        else:
            right.append(i)
            rw += cost[i]
    return left, right


def _expand(bins: list[list[int]], target: int, cost: list[int]) -> None:
    """Split the costliest splittable bin (ties: the last) until there are ``target`` bins."""
    while len(bins) < target:
        candidates = [(sum(cost[i] for i in b), j) for j, b in enumerate(bins) if len(b) > 1]
        if not candidates:
            return
        _, j = max(candidates)
        bins[j], right = _split(bins[j], cost)
        bins.append(right)


@dataclass
class _Set:
    total: int
    items: list[int]

    def __lt__(self, other: _Set) -> bool:
        return (self.total, self.items) < (other.total, other.items)


class _State:
    """A partial partition of KK: k sets, kept heaviest first (ties: larger item list first)."""

    def __init__(self, items: list[tuple[int, int]]) -> None:
        self.sets = sorted((_Set(w, [i]) for i, w in items), reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].total - self.sets[-1].total

    def merge(self, other: _State) -> None:
        k = len(self.sets)
        for t in range(k):
            o = other.sets[k - 1 - t]
            self.sets[t] = _Set(self.sets[t].total + o.total, self.sets[t].items + o.items)
        self.sets.sort(reverse=True)

    def __lt__(self, other: _State) -> bool:
        """The larger spread pops first, then the state with the larger top set."""
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.sets[0] < self.sets[0]


def _karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Equal-count KK over blocks of k items in ascending (weight, index) order."""
    ordered = sorted((w, i) for i, w in enumerate(weights))
    heap = [_State([(i, w) for w, i in ordered[b : b + k]]) for b in range(0, len(ordered), k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        state = heapq.heappop(heap)
        state.merge(heapq.heappop(heap))
        heapq.heappush(heap, state)
    return [sorted(s.items) for s in heap[0].sets]


def _swap_refine(weights: list[int], parts: list[list[int]]) -> list[list[int]]:
    """Apply the best single swap between two parts while one lowers (max load, max - min)."""
    parts = [list(p) for p in parts]
    loads = [sum(weights[i] for i in p) for p in parts]
    while True:
        best = (max(loads), max(loads) - min(loads))
        step = None
        for a in range(len(parts)):
            for b in range(a + 1, len(parts)):
                for pa, x in enumerate(parts[a]):
                    for pb, y in enumerate(parts[b]):
                        new = list(loads)
                        new[a] += weights[y] - weights[x]
                        new[b] += weights[x] - weights[y]
                        score = (max(new), max(new) - min(new))
                        if score < best:
                            best, step = score, (a, b, pa, pb, new)
        if step is None:
            return parts
        a, b, pa, pb, loads = step
        parts[a][pa], parts[b][pb] = parts[b][pb], parts[a][pa]


def prepare_batch(case: Case) -> list[list[list[int]]]:
    """prime-rl's layout of the case: ``[worker][micro-batch]`` lists of sample indices; a
    dummy micro-batch (a zero-loss copy of bin 0) is an empty list here."""
    cost = [bin_cost([x], case.coeffs) for x in case.lengths]
    bins = _ffd(case.lengths, case.seq_len)
    w = case.workers
    if w > 1:
        _expand(bins, max(-(-len(bins) // w) * w, w), cost)
    weights = [bin_cost([case.lengths[i] for i in b], case.coeffs) for b in bins]
    pad = -len(bins) % w
    weights += [weights[0]] * pad  # dummies weigh as bin 0 does
    groups = bins + [[] for _ in range(pad)]
    parts = _swap_refine(weights, _karmarkar_karp(weights, w))
    return [[groups[j] for j in part] for part in parts]


def heaviest_worker(layout: list[list[list[int]]], case: Case) -> int:
    """The heaviest worker's cost over its real samples (dummies count nothing here)."""
    return max(
        sum(bin_cost([case.lengths[i] for i in mb], case.coeffs) for mb in row) for row in layout
    )
