"""Hybrid CP planning (issue 22): `rolltool.plan.hybrid.plan_hybrid_step` against slow
references on small worlds (dp <= 2, cp <= 4).

Every plan is checked by an independent loop: each sample placed once, in an aligned
power-of-two sub-group of its data-parallel group, every GPU's tokens (CP padding counted) under
the cap and its cost the sum of its samples' shares; equal micro-batch counts hold by
construction (one [dp, M, cp] grid). A sample is split wider than it must be only when that
lowers the step's lockstep cost; the plan is deterministic; and on tiny steps its lockstep cost
is compared with the optimum found by exhaustive search.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.plan import hybrid
from rolltool.plan.hybrid import RingModel, cp_degrees, plan_hybrid_step
from rolltool.plan.workload import make_workload

WORKLOAD = make_workload("flops", model="dense-7b")
RING = RingModel.for_workload(WORKLOAD)


def _share(length: int, k: int) -> tuple[int, float]:
    """(tokens, cost) one sample puts on each GPU of a k-way split, by the plain definition."""
    if k == 1:
        return length, float(WORKLOAD.cost(np.array([length]))[0])
    padded = math.ceil(length / (2 * k)) * 2 * k
    chunk = length / k
    comm = 3 * chunk * RING.kv_bytes_per_token / RING.bandwidth * RING.speed
    exposed = (k - 1) * max(0.0, comm - WORKLOAD.b * chunk * chunk)
    return padded // k, float(WORKLOAD.cost(np.array([padded]))[0]) / k + exposed


def _check(plan: hybrid.HybridPlan, lengths: list[int], dp: int, cp: int, cap: int) -> None:
    m = plan.num_micro_batches
    tokens = np.zeros((dp, m, cp), dtype=np.int64)
    costs = np.zeros((dp, m, cp))
    for i, length in enumerate(lengths):
        d, j, a, k = (int(x[i]) for x in (plan.rank, plan.slot, plan.start, plan.degree))
        assert 0 <= d < dp and 0 <= j < m and k in (1, 2, 4, 8)[: int(math.log2(cp)) + 1]
        assert a % k == 0 and a + k <= cp  # aligned: GPUs [a, a + k) of the group
        t, c = _share(length, k)
        for g in range(a, a + k):
            tokens[d, j, g] += t
            costs[d, j, g] += c
        # its GPUs form one aligned sub-group of its size in that slot
        assert (plan.groups[d, j, a : a + k] == k).all()
    for d, j, g in np.ndindex(*plan.groups.shape):
        k = int(plan.groups[d, j, g])
        a = g // k * k
        assert (plan.groups[d, j, a : a + k] == k).all()  # a partition into aligned blocks
    assert (tokens <= cap).all()
    assert np.array_equal(tokens, plan.tokens)
    np.testing.assert_allclose(costs, plan.costs, rtol=1e-12)
    assert (plan.degree >= cp_degrees(np.array(lengths), cp, cap)).all()


WORLDS = st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (2, 4)])


@settings(max_examples=150, deadline=None)
@given(world=WORLDS, cap=st.integers(16, 400), data=st.data())
def test_every_plan_keeps_the_rules(world: tuple[int, int], cap: int, data: st.DataObject) -> None:
    dp, cp = world
    most = cp * cap - 2 * cp  # fits cp GPUs after padding to a multiple of 2cp
    lengths = data.draw(st.lists(st.integers(1, max(1, most)), min_size=1, max_size=24))
    plan = plan_hybrid_step(np.array(lengths), dp=dp, cp=cp, max_tokens=cap, workload=WORKLOAD)
    _check(plan, lengths, dp, cp, cap)
    again = plan_hybrid_step(np.array(lengths), dp=dp, cp=cp, max_tokens=cap, workload=WORKLOAD)
    for name in ("rank", "slot", "start", "degree", "costs", "tokens"):
        assert np.array_equal(getattr(plan, name), getattr(again, name))  # deterministic


@settings(max_examples=150, deadline=None)
@given(world=WORLDS, cap=st.integers(16, 400), data=st.data())
def test_a_sample_is_split_wider_only_when_that_lowers_the_cost(
    world: tuple[int, int], cap: int, data: st.DataObject
) -> None:
    dp, cp = world
    lengths = np.array(
        data.draw(st.lists(st.integers(1, max(1, cp * cap - 2 * cp)), min_size=1, max_size=24))
    )
    plan = plan_hybrid_step(lengths, dp=dp, cp=cp, max_tokens=cap, workload=WORKLOAD)
    least = cp_degrees(lengths, cp, cap)
    base = hybrid._place_all(lengths, least, dp, cp, cap, WORKLOAD, RING, None)
    if np.array_equal(plan.degree, base.degree):  # (a widening may land where a join did)
        assert plan.lockstep_cost <= base.lockstep_cost
    else:
        assert plan.lockstep_cost < base.lockstep_cost
    if not np.array_equal(base.degree, least):  # whole samples joined sub-groups to fit M
        m = base.num_micro_batches
        grid = hybrid.gpu_tokens(lengths, least)
        cost = hybrid._gpu_cost(lengths, least, WORKLOAD, RING)
        unsplit = hybrid._place(grid, cost, least, dp, cp, m + 1, cap, None)
        assert unsplit is None or base.lockstep_cost <= unsplit.lockstep_cost


def test_samples_that_fit_one_gpu_stay_whole_when_splitting_cannot_help() -> None:
    # eight equal samples over 2 x 4 GPUs: one each, perfectly even; nothing to gain
    lengths = np.full(8, 1000)
    plan = plan_hybrid_step(lengths, dp=2, cp=4, max_tokens=1000, workload=WORKLOAD)
    assert plan.split_counts() == {1: 8} and plan.lockstep_overhead == 1.0


def test_one_heavy_sample_is_split_over_the_group() -> None:
    # a 4,000-token sample beside 12 short ones on 1 x 4 GPUs of 4,096 tokens: whole it is one
    # GPU's whole share and more; split 4 ways every GPU gets a quarter of it plus short ones
    lengths = np.array([4000] + [300] * 12)
    plan = plan_hybrid_step(lengths, dp=1, cp=4, max_tokens=4096, workload=WORKLOAD)
    assert plan.degree[0] > 1
    whole = hybrid._place_all(
        lengths, np.ones(13, dtype=np.int64), 1, 4, 4096, WORKLOAD, RING, None
    )
    assert plan.lockstep_cost < whole.lockstep_cost


def test_a_sample_that_fits_no_sub_group_is_refused_by_index() -> None:
    with pytest.raises(RolltoolError, match=r"sample 1 \(900 tokens\) does not fit 2 GPUs of 400"):
        cp_degrees(np.array([10, 900]), 2, 400)
    with pytest.raises(RolltoolError, match="power of two"):
        plan_hybrid_step(np.array([1]), dp=1, cp=3, max_tokens=10, workload=WORKLOAD)


def _optimum(lengths: list[int], dp: int, cp: int, m: int, cap: int) -> float:
    """The least lockstep cost of any placement at M = m (exhaustive: tiny steps only)."""
    options = []
    for length in lengths:
        mine = []
        for k in (1, 2, 4)[: int(math.log2(cp)) + 1]:
            t, c = _share(length, k)
            if t <= cap:
                mine += [
                    (d, j, a, k, t, c) for d in range(dp) for j in range(m) for a in range(0, cp, k)
                ]
        options.append(mine)
    best = math.inf
    for choice in itertools.product(*options):
        tokens, costs = np.zeros((dp, m, cp), dtype=np.int64), np.zeros((dp, m, cp))
        size = np.ones((dp, m, cp), dtype=np.int64)
        clash = False
        for d, j, a, k, t, c in choice:
            tokens[d, j, a : a + k] += t
            costs[d, j, a : a + k] += c
            if k > 1:
                clash |= bool(((size[d, j, a : a + k] != 1) & (size[d, j, a : a + k] != k)).any())
                size[d, j, a : a + k] = k
        for d, j, a, k, _t, _c in choice:  # a whole sample may not sit in a sub-group
            clash |= k == 1 and size[d, j, a] != 1
        if not clash and (tokens <= cap).all():
            best = min(best, float(costs.max(axis=(0, 2)).sum()))
    return best


def test_tiny_steps_are_near_the_exhaustive_optimum() -> None:
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(60):
        dp, cp = [(1, 2), (2, 2), (1, 4)][int(rng.integers(3))]
        cap = int(rng.integers(200, 600))
        lengths = rng.integers(1, cp * cap - 2 * cp, size=int(rng.integers(2, 5))).tolist()
        plan = plan_hybrid_step(np.array(lengths), dp=dp, cp=cp, max_tokens=cap, workload=WORKLOAD)
        opt = _optimum(lengths, dp, cp, plan.num_micro_batches, cap)
        assert plan.lockstep_cost >= opt * (1 - 1e-12)  # the search is a true lower bound here
        ratios.append(plan.lockstep_cost / opt)
    # measured: worst 1.034, mean 1.001 (3 of 60 not optimal): a greedy, not a search
    assert max(ratios) <= 1.1 and float(np.mean(ratios)) <= 1.01, (max(ratios), np.mean(ratios))
