"""One optimizer step's layout: sample -> (data-parallel rank, micro-batch).

``plan_step(lengths, dp=..., max_tokens=...)`` returns a ``StepPlan`` whose
``micro_batches[r][j]`` holds the sample indices of rank r's j-th micro-batch. Guarantees:

* every sample appears exactly once;
* every rank has the same number of micro-batches (``num_micro_batches``); a rank with nothing
  left for a slot gets an empty micro-batch, marked in ``empty`` (the writer pads it with a
  zero-loss-weight row so the collectives line up);
* token mode: no micro-batch holds more than ``max_tokens`` tokens, checked when the plan is built;
  a longer sample is an error naming it, never truncated;
* fixed mode: every micro-batch holds ``micro_batch_size`` samples, except those of the last slot
  when ``dp · micro_batch_size`` does not divide the step (listed in ``short``).

How (token mode, ``align="lockstep"``): with FSDP/ZeRO-3 or tensor parallelism the ranks meet at
every micro-batch, so a step costs Σ_j max_r cost(r, j). The planner picks M, the micro-batch
count per rank: the first count from the token lower bound ceil(tokens / (dp · max_tokens))
upwards at which dp·M bins hold every sample under the cap by any construction: each sample to
the cheapest bin with room (``pack_balanced``), or a token split by LPT or Karmarkar-Karp
(``split_tokens``, the peers' way), or FFD's bins at FFD's count. So M is never above FFD's count
nor above the KK-by-tokens pipeline's. It sorts the bins by cost and deals them into M slots of
dp bins (so each slot's bins cost about the same), and permutes each slot's bins over the ranks
to even out rank totals (which does not change the lockstep cost). Then ``slots.refill`` regroups
the bins so that a slot's bins also hold similar tokens (robust to a cost model that is off) and
``slots.choose`` keeps the best (``_robust``). When M's bins are not cost-balanced, balanced
packing with M + 1 is used if that steps faster in lockstep by ``WIDER_GAIN`` (0.1%) or more;
so is a polished step still above ``LOCKSTEP_TARGET`` planned again with M + 1, up to FFD's
count + 1 (``_wider_if_over``).
``align="total"`` (plain DDP) or ``equal_count=True`` split the samples over ranks first
(``balance``), then pack each rank (by the same constructions) and align its bins by cost.

Example: 8 samples of 7 tokens, dp = 2, max_tokens = 8 -> 4 micro-batches per rank, one sample
each (7 tokens), where "KK into ceil(56 / 8 / 2) = 4 parts" would put 14 tokens in some.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.partition import metrics
from rolltool.plan.partition.balance import (
    balance_labels,
    descending_order,
    refined_and_lpt_labels,
    split_labels,
)
from rolltool.plan.partition.binpack import ffd, first_fit_fits, pack_balanced, split_tokens
from rolltool.plan.partition.bound import lockstep_bound
from rolltool.plan.partition.metrics import ALIGNS
from rolltool.plan.partition.polish import polish, robust_models
from rolltool.plan.partition.resplit import resplit
from rolltool.plan.partition.slots import (
    FEW_FILLS,
    FEW_PER_BIN,
    FILL_PER_BIN,
    Grid,
    bins_to_slots,
    choose,
    grid_labels,
    members,
    refill,
    slots_to_grid,
)
from rolltool.plan.workload import Workload, make_workload
from rolltool.util.ranges import cut

__all__ = ["ALIGNS", "StepPlan", "checked_plan", "plan_step", "plan_units"]


WIDER_GAIN = 1e-3
"""One micro-batch more than FFD needs must cut the lockstep cost by this much (of the ideal)."""


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The layout of one optimizer step over ``dp`` ranks and ``num_micro_batches`` slots."""

    micro_batches: list[list[np.ndarray]]
    """``[dp][M]`` int64 arrays of sample indices (ascending) of rank r's micro-batch j."""
    costs: np.ndarray
    """``[dp, M]`` float64: workload cost of each micro-batch."""
    tokens: np.ndarray
    """``[dp, M]`` int64: tokens in each micro-batch."""
    empty: np.ndarray
    """``[dp, M]`` bool: the micro-batch holds no sample (pad it with a zero-weight row)."""
    num_micro_batches: int
    """M, the same on every rank (0 only for an empty step)."""
    ffd_micro_batches: int | None
    """Token mode: micro-batches per rank that first-fit decreasing needs; ``None`` in fixed mode."""
    min_micro_batches: int | None
    """Token mode: the lower bound ceil(tokens / (dp · max_tokens)); ``None`` in fixed mode."""
    max_tokens: int | None
    """The token cap per micro-batch (token mode), else ``None``."""
    micro_batch_size: int | None
    """Samples per micro-batch (fixed mode), else ``None``."""
    short: list[tuple[int, int]] = field(default_factory=list)
    """Fixed mode: the (rank, slot) micro-batches holding fewer than ``micro_batch_size``."""
    align: str = "lockstep"
    """``lockstep`` or ``total`` (see ``ALIGNS``)."""
    equal_count: bool = False
    """Every rank was given the same number of samples."""
    workload: Workload | None = None
    """The cost model behind ``costs``."""

    @property
    def dp(self) -> int:
        """Number of data-parallel ranks."""
        return len(self.micro_batches)

    @property
    def report(self) -> dict[str, Any]:
        """Per-step numbers: counts, token fill, rank imbalance and lockstep overhead.

        ``imbalance_*`` and ``lockstep_overhead_*`` are `rolltool.plan.partition.metrics`'
        ``imbalance`` and ``lockstep_overhead`` of the ``[dp, M]`` grid in tokens and in the
        workload's cost (1.0 when perfect). ``token_fill`` = tokens / (dp · M · max_tokens).
        """
        dp, m = self.costs.shape if self.costs.ndim == 2 else (self.dp, 0)
        rep: dict[str, Any] = {
            "dp": dp,
            "micro_batches_per_rank": self.num_micro_batches,
            "ffd_micro_batches": self.ffd_micro_batches,
            "min_micro_batches": self.min_micro_batches,
            "samples": int(sum(len(mb) for row in self.micro_batches for mb in row)),
            "samples_per_rank": [int(sum(len(mb) for mb in row)) for row in self.micro_batches],
            "tokens": int(self.tokens.sum()),
            "empty_micro_batches": int(self.empty.sum()),
            "short_micro_batches": len(self.short),
            "token_fill": None,
        }
        if self.max_tokens and m:
            rep["token_fill"] = float(self.tokens.sum()) / (dp * m * self.max_tokens)
        for name, x in (("tokens", self.tokens.astype(np.float64)), ("cost", self.costs)):
            rep[f"imbalance_{name}"] = metrics.imbalance(x)
            rep[f"lockstep_overhead_{name}"] = metrics.lockstep_overhead(x)
        return rep

    def to_dict(self, workload: bool = True) -> dict[str, Any]:
        """A JSON-able summary for the manifest (settings and report, no index arrays);
        ``workload=False`` leaves the workload out (its key holds ``None``)."""
        return {
            "align": self.align,
            "equal_count": self.equal_count,
            "max_tokens": self.max_tokens,
            "micro_batch_size": self.micro_batch_size,
            "workload": None if self.workload is None or not workload else self.workload.to_dict(),
            "short": [list(rc) for rc in self.short],
            **self.report,
        }


def plan_step(
    lengths: np.ndarray,
    *,
    dp: int,
    max_tokens: int | None = None,
    micro_batch_size: int | None = None,
    workload: Workload | None = None,
    equal_count: bool = False,
    align: str = "lockstep",
) -> StepPlan:
    """Lay out one optimizer step: which rank and micro-batch each sample goes to.

    ``lengths``: ``[n]`` tokens per sample. Give exactly one of ``max_tokens`` (token mode: a
    hard cap per micro-batch) or ``micro_batch_size`` (fixed mode: samples per micro-batch).
    ``workload`` prices a sample (default: ``flops`` of the ``dense-7b`` preset). ``equal_count``
    gives every rank the same number of samples (n must be a multiple of dp). Deterministic.
    """
    length = _check_lengths(lengths)
    dp = _check_args(len(length), dp, max_tokens, micro_batch_size, equal_count, align)
    wl = workload if workload is not None else make_workload("flops")
    cost = wl.cost(length)
    settings: dict[str, Any] = {"align": align, "equal_count": equal_count, "workload": wl}
    if micro_batch_size is not None:
        size = _whole("micro_batch_size", micro_batch_size)
        grid, short = _fixed_grid(cost, dp, size)
        return _build(grid, length, cost, max_tokens=None, micro_batch_size=size, ffd_m=None,
                      min_m=None, short=short, **settings)  # fmt: skip
    assert max_tokens is not None
    cap = _whole("max_tokens", max_tokens)
    _check_cap(length, cap)
    if align == "lockstep":
        seen: list[Grid] = []
        grid, ffd_m, min_m = _best_lockstep(cost, length, dp, cap, equal_count, seen)
        if not equal_count:
            quad = wl.b * length.astype(np.float64) ** 2
            grid = _polished(grid, seen, length, cost, quad, cap)
            grid = _wider_if_over(grid, length, cost, quad, cap, ffd_m, wl)
    else:
        grid, ffd_m, min_m = _total_grid(cost, length, dp, cap, equal_count)
    return _build(grid, length, cost, max_tokens=cap, micro_batch_size=None, ffd_m=ffd_m,
                  min_m=min_m, short=[], **settings)  # fmt: skip


def plan_units(
    cost: np.ndarray, tokens: np.ndarray, quad: np.ndarray, *, dp: int, max_tokens: int
) -> tuple[list[list[np.ndarray]], int, int]:
    """`plan_step`'s lockstep plan of items priced by the caller: ``cost`` [n] what each costs
    (``quad`` [n] its L² part, for the polish's misfit models), ``tokens`` [n] what it holds
    under the cap (each <= ``max_tokens``). For units whose cost is not a function of their
    length: a shared-prefix tree (`rolltool.plan.prefix_step`). Returns the ``[dp][M]`` grid of
    item indices, FFD's micro-batch count and the token bound."""
    length = np.asarray(tokens, dtype=np.int64)
    price = np.asarray(cost, dtype=np.float64)
    seen: list[Grid] = []
    grid, ffd_m, min_m = _best_lockstep(price, length, dp, max_tokens, False, seen)
    grid = _polished(grid, seen, length, price, np.asarray(quad, dtype=np.float64), max_tokens)
    return grid, ffd_m, min_m


def _check_args(
    n: int,
    dp: Any,
    max_tokens: int | None,
    micro_batch_size: int | None,
    equal_count: bool,
    align: str,
) -> int:
    """The settings' rules (before any work); returns dp as an int."""
    if isinstance(dp, bool) or not isinstance(dp, int | np.integer) or dp < 1:
        raise RolltoolError(f"dp (data-parallel ranks) must be an integer >= 1, got {dp!r}")
    if align not in ALIGNS:
        raise RolltoolError(f"unknown align {align!r}", hint=f"choose one of {', '.join(ALIGNS)}")
    if (max_tokens is None) == (micro_batch_size is None):
        raise RolltoolError(
            "give exactly one of max_tokens (token budget mode) and micro_batch_size (fixed mode)"
        )
    if equal_count and n % dp:
        raise RolltoolError(
            f"equal_count needs a step size divisible by dp: {n} samples over {dp} ranks",
            hint="drop or add samples so that the step divides, or turn equal_count off",
        )
    return int(dp)


def _whole(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (a whole float is fine, a bool is not)."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise RolltoolError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_cap(length: np.ndarray, cap: int) -> None:
    """No sample may be longer than the token cap: an error naming the first, never truncation."""
    over = np.flatnonzero(length > cap)
    if len(over):
        i = int(over[0])
        more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
        raise RolltoolError(
            f"sample {i} has {int(length[i])} tokens, more than max_tokens={cap}{more}",
            hint="raise max_tokens or drop over-long samples before planning (and count them)",
        )


def _check_lengths(lengths: np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise RolltoolError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise RolltoolError("lengths must be whole numbers of tokens")
    length = arr.astype(np.int64)
    bad = np.flatnonzero(length < 0)
    if len(bad):
        raise RolltoolError(f"sample {int(bad[0])} has a negative length {int(length[bad[0]])}")
    return length


def _fewest_bins(
    cs: np.ndarray, ts: np.ndarray, cap: int, per: int, lo: int, hi: int
) -> tuple[int, np.ndarray, bool] | None:
    """The first m from ``lo`` to ``hi`` at which ``per · m`` bins hold every sample (costs
    ``cs``, tokens ``ts``, longest first) under the cap, by any construction: cost-balanced
    packing, else a token split by LPT, else by Karmarkar-Karp (the peers' way, which fits at a
    tight cap where the others do not). Returns (m, bin labels, cost-balanced?) or ``None``.

    KK only runs where the cheap two fail (it costs ~50 ms at 8,192 samples into 600 bins).
    """
    for m in range(lo, hi + 1):
        labels = pack_balanced(cs, ts, cap, per * m)
        if labels is not None:
            return m, labels, True
        for method in ("lpt", "kk"):
            labels = split_tokens(ts, cap, per * m, method)
            if labels is not None:
                return m, labels, False
    return None


def _lockstep_grid(
    cost: np.ndarray,
    length: np.ndarray,
    dp: int,
    cap: int,
    seen: list[Grid] | None = None,
    order: np.ndarray | None = None,
) -> tuple[Grid, int, int]:
    """The slot-balanced plan: the fewest micro-batches any construction fits (never more than
    FFD's or the KK-by-tokens pipeline's), bins dealt into slots by cost, then ``_robust``
    (every grid it looks at is added to ``seen``)."""
    n = len(cost)
    if n == 0:
        return [[] for _ in range(dp)], 0, 0
    if order is None:  # longest first, hence costliest first
        order = descending_order(length)
    cs, ts = cost[order], length[order]
    min_m = max(1, -(-int(length.sum()) // (dp * cap)))
    ffd_labels: np.ndarray | None = None
    if first_fit_fits(ts, cap, dp * min_m):  # FFD needs at most the bound's bins: its count
        ffd_m = min_m  # (~10% of a synth step's plan: the FFD of 1,024 samples, not run)
    else:
        ffd_labels, ffd_bins = ffd(ts, cap)
        ffd_m = max(1, -(-ffd_bins // dp))
    found = _fewest_bins(cs, ts, cap, dp, min_m, ffd_m - 1)
    if found is None:
        balanced_ffd = pack_balanced(cs, ts, cap, dp * ffd_m)
        if balanced_ffd is not None:
            found = ffd_m, balanced_ffd, True
        else:  # FFD's own bins
            found = ffd_m, ffd(ts, cap)[0] if ffd_labels is None else ffd_labels, False
    m, labels, balanced = found
    grid = _robust(bins_to_slots(labels, order, cost, dp, m), length, cost, cap, seen, order)
    if not balanced:
        # no cost-balanced packing at m: one more micro-batch if that steps faster by WIDER_GAIN
        wider_labels = pack_balanced(cs, ts, cap, dp * (m + 1))
        if wider_labels is not None:
            wider_grid = bins_to_slots(wider_labels, order, cost, dp, m + 1)
            wider = _robust(wider_grid, length, cost, cap, seen, order)
            gain = _lockstep_cost(grid, cost) - _lockstep_cost(wider, cost)
            if gain > WIDER_GAIN * float(cost.sum()) / dp:
                grid = wider
    return grid, ffd_m, min_m


POLISH_PER_BIN = 8
"""Lockstep steps with up to this many samples per micro-batch (on average) are polished
(``polish.py``); with more, the slots' many short samples already even them out (synth steps:
1.001) and the polish would look at too many candidates."""

POLISH_ROUNDS, POLISH_WORK = 24, 1 << 23
"""The polish's budget: rounds, and candidate (sample, sample or bin) pairs looked at."""

POLISH_PAIR_ROUNDS, POLISH_PAIR_WORK = 48, 1 << 23
"""The budget of the polish that follows, trading a sample also for two (``pairs``). On the
benchmark's agent steps it stops stuck after 20-60 rounds; the first few rounds look at all
slots and do most of the work, the later ones apply a step or two each and cost little (16
rounds: ~80% of the gain of 48 for ~5% less plan time)."""

RESPLIT_ROUNDS = 40
"""The budget of the re-split of the polished plan (``resplit.py``): rounds of trades of up to
two samples each way between a slot's costliest bin and any other bin."""


def _polished(
    chosen: Grid, seen: list[Grid], length: np.ndarray, cost: np.ndarray, quad: np.ndarray, cap: int
) -> Grid:
    """A lockstep step with few samples per bin, polished (``polish.py``): of the grids the
    planner looked at with as many micro-batches as ``chosen``, the most robust one (the lowest
    sum of lockstep overheads under the planning model and the ``ROBUST_SCALES`` models), or
    ``chosen`` itself where that one polishes to a higher lockstep cost than ``chosen`` does;
    then re-split (``_resplit_grid``). So the polished plan is never costlier than ``chosen``
    under the planning model, and never less robust. ``quad``: ``[n]`` the L² part of each
    sample's cost."""
    dp, m = len(chosen), len(chosen[0]) if chosen else 0
    n = len(length)
    if dp < 2 or not m or n > POLISH_PER_BIN * dp * m:
        return chosen
    models = robust_models(cost, quad)

    def robustness(g: Grid) -> float:
        return sum(metrics.lockstep_overhead(metrics.grid_costs(g, c)) for c in models)

    same = [chosen, *(g for g in seen if len(g[0]) == m)]
    scores = [robustness(g) for g in same]
    start = same[scores.index(min(scores))]
    out = _polish_grid(start, length, cost, quad, cap)
    if start is not chosen and _lockstep_cost(out, cost) > _lockstep_cost(chosen, cost):
        out = _polish_grid(chosen, length, cost, quad, cap)
    return _resplit_grid(out, length, cost, quad, cap)


LOCKSTEP_TARGET = 3e-3
"""A polished lockstep step whose overhead is still above this (of the ideal) is also planned
with one micro-batch more (``_wider_if_over``): issue 23's aim for agent steps. A step under
it pays one lockstep cost more (~0.2 ms of a ~400 ms agent step), one over it a plan more."""


def _wider_if_over(
    grid: Grid,
    length: np.ndarray,
    cost: np.ndarray,
    quad: np.ndarray,
    cap: int,
    ffd_m: int,
    wl: Workload,
) -> Grid:
    """The polished lockstep ``grid``, or the same samples planned and polished with one
    micro-batch more (never more than FFD's count + 1) where that steps faster by
    ``WIDER_GAIN`` of the ideal plus the workload's cost per micro-batch, and no slower under
    the polish's ×0.5 and ×2 L² models. Tried only where ``grid`` is above
    ``LOCKSTEP_TARGET`` and further than that gain above the lower bound
    (`bound.lockstep_bound`: no plan can gain more; it needs a workload without a cost per
    sample); M + 1 bins leave room to the longest samples' bins, which at M are full to the cap
    (`benchmarks/lockstep.py`'s σ 0.6 seed 18: 1.0041 at FFD's 28, 1.0016 at 29). `rolltool
    stats`' ``count`` alternative (a cost per sample) is so never planned wider: planned on
    counts, one micro-batch more would step slower on FLOPs."""
    dp, m, n = len(grid), len(grid[0]) if grid else 0, len(length)
    if wl.c or dp < 2 or not m or m > ffd_m or n > POLISH_PER_BIN * dp * m:
        return grid  # (a cost per sample: no bound known, e.g. ``count``'s; not tried)
    ideal = float(cost.sum()) / dp
    if not ideal > 0:  # every sample of length 0: nothing to gain (and no overhead to divide)
        return grid
    current = _lockstep_cost(grid, cost)
    over = current / ideal - 1.0
    if over <= LOCKSTEP_TARGET:
        return grid
    charge = WIDER_GAIN * ideal + wl.m
    if (over - lockstep_bound(length, a=wl.a, b=wl.b, dp=dp, cap=cap)) * ideal <= charge:
        return grid
    order = descending_order(length)
    found = _fewest_bins(cost[order], length[order], cap, dp, m + 1, m + 1)
    if found is None:
        return grid
    seen: list[Grid] = []
    wider = _robust(bins_to_slots(found[1], order, cost, dp, m + 1), length, cost, cap, seen, order)
    wider = _polished(wider, seen, length, cost, quad, cap)
    models = robust_models(cost, quad)
    before = [current, *(_lockstep_cost(grid, c) for c in models[1:])]
    after = [_lockstep_cost(wider, c) for c in models]
    if before[0] - after[0] > charge and all(a <= b for a, b in zip(after, before, strict=True)):
        return wider
    return grid


def _polish_grid(
    grid: Grid, length: np.ndarray, cost: np.ndarray, quad: np.ndarray, cap: int
) -> Grid:
    """``polish`` a grid, moving and swapping single samples, then from there trading a sample
    also for two (``pairs``: the wider search, started from the narrow one's optimum, keeps
    every step at least as good as the narrow search alone: started cold it ends elsewhere,
    worse on many agent steps); then spread each slot's bins over the ranks again
    (``slots_to_grid``: even rank totals, the same lockstep cost)."""
    dp, m, n = len(grid), len(grid[0]), len(length)
    labels = grid_labels(grid, n)
    for pairs, rounds, work in ((False, POLISH_ROUNDS, POLISH_WORK),
                                (True, POLISH_PAIR_ROUNDS, POLISH_PAIR_WORK)):  # fmt: skip
        labels = polish(labels, length, cost, quad, dp=dp, m=m, cap=cap, max_rounds=rounds,
                        max_work=work, pairs=pairs)  # fmt: skip
    return _spread(labels, cost, dp, m)


def _resplit_grid(
    grid: Grid, length: np.ndarray, cost: np.ndarray, quad: np.ndarray, cap: int
) -> Grid:
    """The polished grid ``resplit`` (trades of up to two samples each way, never raising any
    of the polish's three models above the polished plan's), spread over the ranks again; the
    grid itself where the re-split changes nothing."""
    dp, m, n = len(grid), len(grid[0]), len(length)
    labels = grid_labels(grid, n)
    out = resplit(labels, length, cost, quad, dp=dp, m=m, cap=cap, max_rounds=RESPLIT_ROUNDS)
    return grid if np.array_equal(out, labels) else _spread(out, cost, dp, m)


def _spread(labels: np.ndarray, cost: np.ndarray, dp: int, m: int) -> Grid:
    """Bin labels (bin ``j·dp + r``) -> grid, each slot's bins spread over the ranks again
    (``slots_to_grid``: even rank totals, the same lockstep cost)."""
    bins = members(labels, None, dp * m)
    bin_cost = np.bincount(labels, weights=cost, minlength=dp * m)
    return slots_to_grid(bins, bin_cost, np.arange(dp * m).reshape(m, dp))


def _robust(
    grid: Grid,
    length: np.ndarray,
    cost: np.ndarray,
    cap: int,
    seen: list[Grid] | None = None,
    order: np.ndarray | None = None,
) -> Grid:
    """The grid or one of its ``slots.refill`` variants (``FILL_PER_BIN`` short samples per bin
    taken out and put back), chosen by ``slots.choose``: lowest lockstep cost, ties within
    ``ROBUST_TOLERANCE`` to the most even tokens per slot. A step with few samples per bin (up to
    ``FEW_PER_BIN``) also tries the ``FEW_FILLS`` refills, and then refills the chosen grid once
    more (its slots regrouped: in the benchmark's agent steps 1.0031 -> 1.0029 at worst).
    Every grid looked at is added to ``seen``."""
    dp, m = len(grid), len(grid[0])
    if dp < 2:
        return grid
    few = len(length) <= FEW_PER_BIN * dp * m
    fills = (FILL_PER_BIN, *FEW_FILLS) if few else (FILL_PER_BIN,)
    variants = [refill(grid, length, cost, cap, int(f * dp * m), order) for f in fills]
    grids = [grid, *(g for g in variants if g is not None)]
    best = grids[choose(grids, cost, length)]
    if few:
        again = refill(best, length, cost, cap, int(FEW_FILLS[0] * dp * m), order)
        if again is not None:
            grids.append(again)
            best = [best, again][choose([best, again], cost, length)]
    if seen is not None:
        seen += grids
    return best


CANDIDATES_UP_TO = 512
"""Samples per rank up to which lockstep planning also tries the rank-first plans (cheap there,
and where the slot-balanced plan can lose to them: few large bins, an unsplittable long sample)."""


def _best_lockstep(
    cost: np.ndarray,
    length: np.ndarray,
    dp: int,
    cap: int,
    equal_count: bool,
    seen: list[Grid] | None = None,
) -> tuple[Grid, int, int]:
    """The lockstep plan with the lowest Σ_j max_r cost(r, j) among the candidates (``_pick``),
    never using more than one micro-batch more than the fewest any candidate needs.

    Candidates: the slot-balanced plan (``_lockstep_grid``; not with equal counts) and the
    rank-first plans (bins sorted by cost per rank): ranks balanced by ``refined`` then balanced
    packing or first-fit decreasing per rank, and ranks by LPT then first-fit decreasing (LPT
    ranks with balanced packing, a fourth, never changed a plan's cost over the 145 steps of
    benchmarks/lockstep.py nor 120 steps of 8-512 samples per rank, and costs ~10% of the plan);
    all three up to ``CANDIDATES_UP_TO`` samples per rank; beyond that only the ``refined``
    rank-first plan, and only with equal counts (the slot-balanced plan cannot keep counts
    equal). So up to that size a lockstep plan is never worse than the naive "LPT ranks, FFD per
    rank, bins aligned by cost"; beyond it the slot-balanced plan has won in every benchmark
    step (1,024 per rank: 1.0021 vs 1.0024).
    The choice is ``_pick``'s (deterministic). Every grid looked at is added to ``seen``.
    """
    n = len(cost)
    candidates: list[tuple[Grid, int, int]] = []
    order = descending_order(length)  # one sort for every candidate (and their refills)
    if not equal_count:
        candidates.append(_lockstep_grid(cost, length, dp, cap, seen, order))
    if n <= CANDIDATES_UP_TO * dp:
        refined, lpt = refined_and_lpt_labels(cost, dp, equal_count=equal_count)
        candidates += _rank_first_grids(cost, length, dp, cap, equal_count, rank=refined,
                                        order=order)  # fmt: skip
        candidates += _rank_first_grids(cost, length, dp, cap, equal_count, packings=("ffd",),
                                        rank=lpt, order=order)  # fmt: skip
    elif equal_count:
        candidates.append(
            _rank_first_grid(cost, length, dp, cap, equal_count, method="refined", order=order)
        )
    if seen is not None:
        seen += [c[0] for c in candidates[1 - equal_count :]]  # the slot plan's are in already
    return _pick(candidates, cost, length)


def _pick(
    candidates: list[tuple[Grid, int, int]], cost: np.ndarray, length: np.ndarray
) -> tuple[Grid, int, int]:
    """The candidate to keep, with the first candidate's FFD and lower-bound counts.

    Only candidates with at most one micro-batch more than the fewest take part; one with more
    micro-batches than the fewest is charged ``WIDER_GAIN`` of the ideal per extra micro-batch
    (more micro-batches only when they buy that much). Then ``slots.choose``: the lowest charged
    lockstep cost, or within ``ROBUST_TOLERANCE`` of it the most even tokens per slot.
    """
    first = candidates[0]
    if not first[0] or not first[0][0]:  # empty step
        return first
    fewest = min(len(c[0][0]) for c in candidates)
    kept = [c for c in candidates if len(c[0][0]) <= fewest + 1]
    charge = WIDER_GAIN * float(cost.sum()) / len(first[0])
    extra = [(len(c[0][0]) - fewest) * charge for c in kept]
    best = kept[choose([c[0] for c in kept], cost, length, extra)]
    return best[0], first[1], first[2]


def _lockstep_cost(grid: Grid, cost: np.ndarray) -> float:
    """Σ_j max_r cost(r, j) of a grid (`metrics.lockstep_cost`)."""
    return metrics.lockstep_cost(metrics.grid_costs(grid, cost))


def _total_grid(
    cost: np.ndarray, length: np.ndarray, dp: int, cap: int, equal_count: bool
) -> tuple[Grid, int, int]:
    """``align="total"``: the lightest heaviest rank among the candidates with no more
    micro-batches per rank than ranks by ``refined`` get (fewer micro-batches, then the earlier
    candidate, on ties), with that candidate's FFD and lower-bound counts.

    Candidates: ranks by ``auto`` then packed (``_rank_first_grid``); up to ``CANDIDATES_UP_TO``
    samples per rank also ranks by ``refined`` (``auto`` before issue 23) and, without equal
    counts, bins first (``_split_bins_grid``, prime-rl's way); beyond that the ``refined`` ranks
    only when ``auto``'s need more micro-batches than the token bound (else nothing has fewer).
    So no plan has more micro-batches than before issue 23, nor a heavier rank; on prime-rl's
    own randomized test none is heavier than prime-rl's plan (2 of 80 have one micro-batch more
    than prime-rl's, 4 did before). A lighter split that needs one more micro-batch is not
    taken: each costs a pass of its own.
    """
    n = len(cost)
    first = _rank_first_grid(cost, length, dp, cap, equal_count)
    if n == 0:
        return first
    plans = [first]
    few = n <= CANDIDATES_UP_TO * dp
    if few or len(first[0][0]) > max(1, -(-int(length.sum()) // (dp * cap))):
        plans.append(_rank_first_grid(cost, length, dp, cap, equal_count, method="refined"))
        if few and not equal_count:
            plans.append(_split_bins_grid(cost, length, dp, cap))
    most = len(plans[min(1, len(plans) - 1)][0][0])  # the refined ranks' micro-batches
    keys = [
        (float(metrics.grid_costs(g, cost).sum(axis=1).max()), len(g[0]), i)
        for i, (g, _, _) in enumerate(plans)
        if len(g[0]) <= most
    ]
    return plans[min(keys)[2]]


def _split_bins_grid(
    cost: np.ndarray, length: np.ndarray, dp: int, cap: int
) -> tuple[Grid, int, int]:
    """Bins first: FFD's bins, the costliest bin of two or more samples split in two (its samples
    costliest first, each to the cheaper half) until their count is a multiple of dp (or nothing
    splits), then the bins over the ranks by ``auto`` with equal counts (empty bins pad the
    count), each rank's bins sorted by cost. prime-rl packs this way; its ranks then get KK and
    single swaps of bins, which ``auto`` never does worse than in its randomized test. Also
    returns FFD's micro-batches per rank and the token bound ceil(tokens / (dp · cap))."""
    order = descending_order(length)
    labels, count = ffd(length[order], cap)
    counts = (max(1, -(-count // dp)), max(1, -(-int(length.sum()) // (dp * cap))))
    bins = [b.tolist() for b in members(labels, order, count)]
    loads = [float(cost[b].sum()) for b in bins]
    while len(bins) < max(-(-len(bins) // dp), 1) * dp:
        split = [(loads[j], j) for j, b in enumerate(bins) if len(b) > 1]
        if not split:
            break
        j = max(split)[1]
        halves: tuple[list[int], list[int]] = ([], [])
        sums = [0.0, 0.0]
        for i in sorted(bins[j], key=lambda i: -cost[i]):
            side = 0 if sums[0] <= sums[1] else 1
            halves[side].append(i)
            sums[side] += float(cost[i])
        bins[j], loads[j] = halves[0], sums[0]
        bins.append(halves[1])
        loads.append(sums[1])
    bins += [[] for _ in range(-len(bins) % dp)]
    loads += [0.0] * (len(bins) - len(loads))
    w = np.array(loads)
    rank = balance_labels(w, dp, equal_count=True)
    grid: Grid = []
    for r in range(dp):
        mine = np.flatnonzero(rank == r)
        mine = mine[np.argsort(-w[mine], kind="stable")]
        grid.append([np.array(sorted(bins[int(b)]), dtype=np.int64) for b in mine])
    return grid, *counts


def _rank_first_grid(
    cost: np.ndarray,
    length: np.ndarray,
    dp: int,
    cap: int,
    equal_count: bool,
    ffd_only: bool = False,
    method: str = "auto",
    order: np.ndarray | None = None,
) -> tuple[Grid, int, int]:
    """Split samples over ranks (``balance``), then pack each rank into the same M bins (balanced
    packing, or first-fit decreasing with ``ffd_only``), each rank's bins sorted by cost so that
    slot j holds every rank's j-th costliest bin."""
    packing = "ffd" if ffd_only else "balanced"
    return _rank_first_grids(cost, length, dp, cap, equal_count, method, (packing,), order=order)[0]


def _rank_first_grids(
    cost: np.ndarray,
    length: np.ndarray,
    dp: int,
    cap: int,
    equal_count: bool,
    method: str = "auto",
    packings: tuple[str, ...] = ("balanced", "ffd"),
    rank: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> list[tuple[Grid, int, int]]:
    """`_rank_first_grid`'s plan for each of `packings` ("balanced": balanced packing where it
    fits, else FFD's; "ffd": FFD's), from one split over ranks (``balance_labels`` by
    ``method``, or the given ``rank`` labels) and one FFD per rank."""
    n = len(cost)
    if n == 0:
        return [([[] for _ in range(dp)], 0, 0) for _ in packings]
    if rank is None:
        rank = balance_labels(cost, dp, equal_count=equal_count, method=method)
    # each rank's samples longest first, ties by index: the global order split by rank
    if order is None:
        order = descending_order(length)
    orders = [order[p] for p in split_labels(rank[order], dp)]
    by_rank = np.concatenate(orders)
    # each rank's lengths and costs: views of one gather, cut at the ranks' ends
    sizes = [len(o) for o in orders]
    by_rank_cost = cost[by_rank]
    lengths, costs = cut(length[by_rank], sizes), cut(by_rank_cost, sizes)
    min_m = max(1, max(-(-int(np.add.reduce(x)) // cap) for x in lengths))
    ffds = [ffd(x, cap) for x in lengths]
    ffd_m = max(1, max(b for _, b in ffds))

    def grid_of(m: int, packed: list[np.ndarray]) -> tuple[Grid, int, int]:
        # every rank's bins at once: bin r·m + label, each rank's bins costliest first
        labels = np.concatenate(packed) + np.repeat(np.arange(dp) * m, sizes)
        bins = members(labels, by_rank, dp * m)
        bin_cost = np.bincount(labels, weights=by_rank_cost, minlength=dp * m).reshape(dp, m)
        ranked = np.argsort(-bin_cost, axis=1, kind="stable").tolist()
        grid = [[bins[r * m + b] for b in row] for r, row in enumerate(ranked)]
        return grid, ffd_m, min_m

    plans = []
    for packing in packings:
        balanced = None
        if packing == "balanced":
            balanced = _pack_ranks_balanced(costs, lengths, cap, min_m, ffd_m)
        plans.append(grid_of(*balanced) if balanced is not None
                     else grid_of(ffd_m, [labels for labels, _ in ffds]))  # fmt: skip
    return plans


def _pack_ranks_balanced(
    costs: list[np.ndarray],
    lengths: list[np.ndarray],
    cap: int,
    min_m: int,
    max_m: int,
) -> tuple[int, list[np.ndarray]] | None:
    """The fewest bins per rank, from ``min_m`` to ``max_m``, into which every rank's samples
    (``costs[r]`` and ``lengths[r]``, longest first) fit, each rank by balanced packing or else
    by a token split (``_fewest_bins``), with each rank's bin labels; ``None`` if none fits
    (then FFD's)."""
    for m in range(min_m, max_m + 1):
        packed = [_fewest_bins(c, x, cap, 1, m, m) for c, x in zip(costs, lengths, strict=True)]
        if all(p is not None for p in packed):
            return m, [cast(tuple[int, np.ndarray, bool], p)[1] for p in packed]
    return None


def _fixed_grid(cost: np.ndarray, dp: int, size: int) -> tuple[Grid, list[tuple[int, int]]]:
    """Fixed mode: slots of dp·size samples by cost, each split into dp bins of ``size``.

    Samples sorted by cost fill slot 0 first; within a slot, ``size`` rounds give each bin one
    sample, the costliest of the round to the cheapest bin. The last slot may be partial.
    """
    n = len(cost)
    if n == 0:
        return [[] for _ in range(dp)], []
    per_slot = dp * size
    m = -(-n // per_slot)
    order = descending_order(cost)
    padded = np.full(m * per_slot, -1, dtype=np.int64)
    padded[:n] = order
    blocks = padded.reshape(m, size, dp)  # [slot, round, position in round]
    pc = np.where(blocks >= 0, cost[np.maximum(blocks, 0)], 0.0)
    loads = np.zeros((m, dp))
    bins = np.empty((m, size, dp), dtype=np.int64)  # bin of each position
    rows = np.arange(m)[:, None]
    for q in range(size):
        lightest = np.argsort(loads, axis=1, kind="stable")
        bins[:, q, :] = lightest
        loads[rows, lightest] += pc[:, q, :]
    labels = (np.arange(m)[:, None, None] * dp + bins)[blocks >= 0]
    sample = blocks[blocks >= 0]
    grid_bins = bins_to_slots(labels, sample, cost, dp, m)
    short = [(r, j) for r in range(dp) for j in range(m) if len(grid_bins[r][j]) < size]
    return grid_bins, short


def _build(
    grid: Grid,
    length: np.ndarray,
    cost: np.ndarray,
    *,
    max_tokens: int | None,
    micro_batch_size: int | None,
    ffd_m: int | None,
    min_m: int | None,
    short: list[tuple[int, int]],
    align: str,
    equal_count: bool,
    workload: Workload,
) -> StepPlan:
    """Assemble the StepPlan of per-sample `length` and `cost` (`checked_plan`)."""
    dp = len(grid)
    m = len(grid[0]) if dp else 0
    total = np.add.reduce  # NumPy's sum (ndarray.sum calls it), as recorded since format v1
    costs = np.array([[total(cost[mb]) for mb in row[:m]] for row in grid], dtype=np.float64)
    costs = costs.reshape(dp, m)
    tokens = metrics.grid_costs([row[:m] for row in grid], length).astype(np.int64)  # whole: exact
    return checked_plan(grid, tokens, costs, len(length), max_tokens=max_tokens,
                        micro_batch_size=micro_batch_size, ffd_micro_batches=ffd_m,
                        min_micro_batches=min_m, short=short, align=align,
                        equal_count=equal_count, workload=workload)  # fmt: skip


def checked_plan(
    grid: Grid, tokens: np.ndarray, costs: np.ndarray, n: int, **fields: Any
) -> StepPlan:
    """The StepPlan of `grid` (``[dp][M]`` arrays over items 0..n-1) with its ``[dp, M]``
    `tokens` and `costs`, its invariants checked (they are promises, not hopes): every rank M
    micro-batches, every item exactly once, none over ``fields["max_tokens"]``. `fields`: the
    rest of StepPlan's fields (``empty`` and ``num_micro_batches`` come from the grid)."""
    dp = len(grid)
    m = len(grid[0]) if dp else 0
    for r, row in enumerate(grid):
        if len(row) != m:
            raise AssertionError(f"bug: rank {r} has {len(row)} micro-batches, rank 0 has {m}")
    flat = [mb for row in grid for mb in row]
    held = [mb for mb in flat if len(mb)]  # an empty micro-batch may be of any dtype
    every = np.concatenate(held) if held else np.empty(0, np.int64)
    if every.size and (every.dtype.kind not in "iu" or int(every.min()) < 0):
        raise AssertionError(f"bug: sample indices that are not whole numbers >= 0 ({every.dtype})")
    if n and not (len(every) == n and (np.bincount(every, minlength=n) == 1).all()):
        raise AssertionError("bug: a sample is missing from the plan or appears twice")
    cap = fields.get("max_tokens")
    if cap is not None and m and int(tokens.max()) > cap:
        raise AssertionError(f"bug: a micro-batch holds {int(tokens.max())} > {cap} tokens")
    empty = np.array([len(mb) == 0 for mb in flat], dtype=bool).reshape(dp, m)
    return StepPlan(micro_batches=grid, costs=costs, tokens=tokens, empty=empty,
                    num_micro_batches=m, **fields)  # fmt: skip
