"""Planning ``--share-prefix`` steps (`rolltool.plan.prefix_step`, issue 24).

`restrict` cuts a group's forest to some of its samples: the result still reassembles every
sample exactly, each prefix has two samples and pays `share_min`, and a prefix holding a trained
token never spans samples whose advantages differ. `plan_shared_step` places every sample once,
no micro-batch over the cap, its tokens what is stored and its costs what is computed, a tree
whole where it fits.
"""

from __future__ import annotations

import numpy as np
import pytest

from rolltool.plan.partition import plan_step
from rolltool.plan.prefix import GroupTokens, detect, lay_out
from rolltool.plan.prefix_step import (
    GroupForest,
    first_trained,
    layout_cost,
    plan_shared_step,
    restrict,
)
from rolltool.plan.workload import make_workload


def _group(rng: np.random.Generator, n: int) -> GroupTokens:
    """A prompt (untrained), then 2 trained trunks (one per half), then each sample's own."""
    prompt = rng.integers(1, 9, int(rng.integers(6, 14)))
    trunks = [rng.integers(1, 9, int(rng.integers(3, 9))) for _ in range(2)]
    ids, mask = [], []
    for i in range(n):
        own = rng.integers(1, 9, int(rng.integers(1, 6)))
        t = trunks[i % 2] if rng.random() < 0.8 else np.zeros(0, np.int64)
        ids.append(np.r_[prompt, t, own])
        mask.append(np.r_[np.zeros(len(prompt)), np.ones(len(t) + len(own))].astype(np.int8))
    return GroupTokens(ids, mask, [np.zeros(len(x)) for x in ids])


def _step_of(
    groups: list[GroupTokens],
) -> tuple[list[int], list[int], dict[int, GroupForest], list[np.ndarray]]:
    """A step of these groups, in order: (members, group codes, forests, tokens per sample)."""
    members: list[int] = []
    codes: list[int] = []
    forests: dict[int, GroupForest] = {}
    tokens: list[np.ndarray] = []
    for gi, g in enumerate(groups):
        start = len(members)
        f = detect(g, 3)
        members += range(start, start + len(g.input_ids))
        codes += [gi] * len(g.input_ids)
        tokens += list(g.input_ids)
        forests[gi] = GroupForest(np.arange(start, start + len(g.input_ids)), f,
                                  first_trained(f, g.loss_mask))  # fmt: skip
    return members, codes, forests, tokens


@pytest.mark.parametrize("seed", range(12))
def test_restrict_keeps_every_sample_and_the_rules(seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _group(rng, int(rng.integers(3, 9)))
    share_min = 3
    f = detect(g, share_min)
    gf = GroupForest(np.arange(len(g.input_ids)), f, first_trained(f, g.loss_mask))
    take = np.sort(rng.choice(len(g.input_ids), int(rng.integers(1, len(g.input_ids) + 1)),
                              replace=False))  # fmt: skip
    adv = rng.choice([0.0, 1.0], len(take))
    r = restrict(gf, take, adv, share_min)
    lay = lay_out(r)
    for q, i in enumerate(take.tolist()):  # every sample reassembles
        got = np.concatenate([g.input_ids[take[lay.sample[s]]][lay.start[s] : lay.end[s]]
                              for s in lay.chain(q)])  # fmt: skip
        np.testing.assert_array_equal(got, g.input_ids[i])
    for j in range(len(r.node_end)):
        members = [q for q in range(len(take)) if j in r.chain(q)]
        assert len(members) >= 2
        base = r.node_end[r.node_parent[j]] + 1 if r.node_parent[j] >= 0 else 0
        assert r.node_end[j] + 1 - base >= share_min
        trained = np.asarray(g.loss_mask[take[members[0]]])[1 : r.node_end[j] + 1].any()
        if trained:
            assert len(set(adv[members].tolist())) == 1


def test_differing_advantages_end_a_prefix_before_its_first_trained_token() -> None:
    prompt, trunk = np.arange(1, 11), np.arange(20, 30)
    ids = [np.r_[prompt, trunk, [40 + i]] for i in range(2)]
    mask = [np.r_[np.zeros(10), np.ones(11)] for _ in ids]
    g = GroupTokens(ids, mask, [np.zeros(21)] * 2)
    f = detect(g, 3)
    assert f.node_end.tolist() == [19]  # prompt and trunk shared: 20 tokens
    gf = GroupForest(np.arange(2), f, first_trained(f, mask))
    same = restrict(gf, np.arange(2), np.array([0.5, 0.5]), 3)
    assert same.node_end.tolist() == [19]
    differ = restrict(gf, np.arange(2), np.array([0.5, -0.5]), 3)
    assert differ.node_end.tolist() == [9]  # shared up to the trained trunk's first token


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dp", [1, 3])
def test_a_shared_plan_places_every_sample_under_the_cap(seed: int, dp: int) -> None:
    rng = np.random.default_rng(100 + seed)
    members, codes, forests, tokens = _step_of([_group(rng, int(rng.integers(2, 8)))
                                                for _ in range(5)])  # fmt: skip
    lengths = np.array([len(t) for t in tokens])
    cap = int(lengths.max()) + int(rng.integers(0, 40))
    w = make_workload("flops")
    plan, shared = plan_shared_step(
        np.array(members), lengths, np.array(codes), np.zeros(len(members), np.float32),
        np.zeros(len(members), np.int64), ["math"], forests, dp=dp, max_tokens=cap, workload=w,
        share_min=3,
    )  # fmt: skip
    placed = np.concatenate([mb for row in plan.micro_batches for mb in row])
    assert sorted(placed.tolist()) == list(range(len(members)))  # every sample once
    assert plan.tokens.max() <= cap
    assert int(plan.tokens.sum()) == shared.record.stored == int((shared.end - shared.start).sum())
    assert shared.record.tokens == int(lengths.sum())
    rs = shared.row_segments
    for r in range(dp):  # row r's segments rebuild every sample of its micro-batches
        for j, mb in enumerate(plan.micro_batches[r]):
            a, b = (
                int(rs[r * plan.num_micro_batches + j]),
                int(rs[r * plan.num_micro_batches + j + 1]),
            )
            leaves = set(range(b - a)) - set(shared.parent[a:b][shared.parent[a:b] >= 0].tolist())
            assert sorted(int(shared.sample[a + k]) for k in leaves) == sorted(mb.tolist())
            for k in leaves:
                chain, seg = [], k
                while seg >= 0:
                    chain.append(a + seg)
                    seg = int(shared.parent[a + seg])
                i = int(shared.sample[a + k])
                got = np.concatenate([tokens[shared.sample[s]][shared.start[s] : shared.end[s]]
                                      for s in chain[::-1]])  # fmt: skip
                np.testing.assert_array_equal(got, tokens[i])
    whole = [lay_out(f.forest) for f in forests.values()]
    ideal = sum(layout_cost(lay, w) for lay in whole)
    if shared.record.stored == sum(int(lay.cu_seqlens[-1]) for lay in whole):  # no tree cut
        assert plan.costs.sum() == pytest.approx(ideal, rel=1e-12)
    else:  # a cut tree (over the budget, or cut for balance) computes its prefix again
        assert plan.costs.sum() >= ideal * (1 - 1e-12)
        assert shared.record.stored > sum(int(lay.cu_seqlens[-1]) for lay in whole)


def test_evening_lowers_the_costliest_micro_batch_within_the_cap() -> None:
    from rolltool.plan.prefix_step import _even, _fill

    lowered = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n, cap = int(rng.integers(4, 30)), 100
        tokens = rng.integers(5, 60, n)
        cost = tokens * rng.uniform(0.5, 2.0, n)
        order = sorted(range(n), key=lambda u: -cost[u])
        fill = _fill(order, cost, tokens, n, cap, cheapest=False)  # first fit: uneven
        assert fill is not None
        fill = [b for b in fill if b] + [[], []]
        evened = _even(fill, cost, tokens, cap)
        assert sorted(u for b in evened for u in b) == list(range(n))  # each unit once
        assert all(tokens[b].sum() <= cap for b in evened if b)
        before = max(cost[b].sum() for b in fill if b)
        after = max(cost[b].sum() if b else 0.0 for b in evened)
        assert after <= before + 1e-9
        lowered += after < before - 1e-9
    assert lowered > 20  # it really evens


def test_rows_from_tokens_that_no_longer_agree_are_refused() -> None:
    """shared_step_rows checks every sample against its prefix's representative: tokens that
    changed since the token pass are an error, never a row with another sample's prompt."""
    from rolltool.errors import RolltoolError
    from rolltool.format.layout import SampleTokens
    from rolltool.plan.prefix_step import shared_step_rows

    rng = np.random.default_rng(7)
    g = _group(rng, 4)
    f = detect(g, 3)
    forests = {0: GroupForest(np.arange(4), f, first_trained(f, g.loss_mask))}
    lengths = g.lengths
    plan, shared = plan_shared_step(
        np.arange(4), lengths, np.zeros(4, np.int64), np.zeros(4, np.float32),
        np.zeros(4, np.int64), ["math"], forests, dp=1, max_tokens=int(lengths.sum()),
        workload=make_workload("tokens"), share_min=3,
    )  # fmt: skip
    order = np.concatenate(plan.micro_batches[0])

    def tokens(ids: list[np.ndarray]) -> SampleTokens:
        offsets = np.r_[0, np.cumsum([len(ids[i]) for i in order])]
        return SampleTokens(
            offsets=offsets.astype(np.int64),
            input_ids=np.concatenate([ids[i] for i in order]).astype(np.int32),
            loss_mask=np.concatenate([g.loss_mask[i] for i in order]).astype(np.uint8),
            logprobs=np.zeros(int(offsets[-1]), np.float32),
        )

    def rows(ids: list[np.ndarray]) -> list:
        return list(shared_step_rows(tokens(ids), order, np.zeros(4, np.float32),
                                     np.ones(4, np.float32), shared, dp=1, step=0))  # fmt: skip

    assert shared.record.prefixes >= 1
    (ok,) = rows(list(g.input_ids))
    assert int(ok.row_offsets[-1]) == shared.record.stored
    changed = [x.copy() for x in g.input_ids]
    last = int(order[-1])  # a sample through the prompt, not its representative
    changed[last][2] += 1
    with pytest.raises(RolltoolError, match="no longer shares"):
        rows(changed)


def test_samples_laid_out_together_never_store_more_than_apart() -> None:
    """Two parts of a group's samples in one micro-batch are laid out together: with advantages
    that differ over a shared trained trunk too, never more tokens than the parts apart (what
    lets the placement count a micro-batch's tokens by its units)."""
    from rolltool.plan.prefix_step import _Group

    compared = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        g = _group(rng, int(rng.integers(3, 10)))
        f = detect(g, 3)
        n = len(g.input_ids)
        gf = GroupForest(np.arange(n), f, first_trained(f, g.loss_mask))
        adv = rng.choice([0.0, 1.0], n).astype(np.float32)
        gr = _Group(0, np.arange(n), np.arange(n), g.lengths, adv, gf, 3)
        perm = rng.permutation(n)
        k = int(rng.integers(1, n))
        a, b = np.sort(perm[:k]), np.sort(perm[k:])
        together = gr.part(np.r_[a, b]).tokens
        assert together <= gr.part(a).tokens + gr.part(b).tokens
        compared += together < gr.part(a).tokens + gr.part(b).tokens
    assert compared > 100  # sharing across the parts really happened


def test_a_pass_with_the_advantages_is_kept_whole() -> None:
    """With the advantages given to the token pass (pack gives the input's group advantages)
    and the same advantages in the step, restricting to all of a group's samples keeps its
    layout exactly: the step stores what detection with advantages finds."""
    differ = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        g0 = _group(rng, int(rng.integers(3, 10)))
        adv = rng.choice([0.0, 1.0], len(g0.input_ids))
        g = GroupTokens(g0.input_ids, g0.loss_mask, g0.logprobs, adv)
        f = detect(g, 3)
        gf = GroupForest(np.arange(len(adv)), f, first_trained(f, g.loss_mask))
        r = restrict(gf, np.arange(len(adv)), adv, 3)
        assert int(lay_out(r).cu_seqlens[-1]) == int(lay_out(f).cu_seqlens[-1])
        blind = detect(g0, 3)  # the pass without advantages
        gb = GroupForest(np.arange(len(adv)), blind, first_trained(blind, g0.loss_mask))
        rb = restrict(gb, np.arange(len(adv)), adv, 3)
        differ += int(lay_out(rb).cu_seqlens[-1]) > int(lay_out(f).cu_seqlens[-1])
    assert differ > 0  # without them the pass can miss prefixes: the case is exercised


def test_trees_are_cut_for_balance_only_where_the_step_gets_cheaper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two big trees and nothing else on 4 ranks: whole, two ranks idle; cut into parts (each
    with its own prompt copy, counted in the cost), all four busy and the step cheaper. The
    chosen plan is the cheapest of the cuts tried (whole-tree placement alone: CUT_AT (1.0,))."""
    import rolltool.plan.prefix_step as ps
    from rolltool.plan.partition.metrics import lockstep_cost

    rng = np.random.default_rng(7)
    members, codes, forests, tokens = [], [], {}, []
    for gi in range(2):
        prompt = rng.integers(1, 50, 40)
        ids = [np.r_[prompt, rng.integers(1, 50, 60)] for _ in range(8)]
        mask = [np.r_[np.zeros(40), np.ones(60)].astype(np.int8) for _ in ids]
        g = GroupTokens(ids, mask, [np.zeros(len(x)) for x in ids])
        start = len(members)
        f = detect(g, 3)
        members += range(start, start + 8)
        codes += [gi] * 8
        tokens += ids
        forests[gi] = GroupForest(np.arange(start, start + 8), f, first_trained(f, mask))
    lengths = np.array([len(t) for t in tokens])
    args = (np.array(members), lengths, np.array(codes), np.zeros(16, np.float32),
            np.zeros(16, np.int64), ["math"], forests)  # fmt: skip
    kw = dict(dp=4, max_tokens=1000, workload=make_workload("flops"), share_min=3)
    plan, shared = plan_shared_step(*args, **kw)
    monkeypatch.setattr(ps, "CUT_AT", (1.0,))
    whole, whole_shared = plan_shared_step(*args, **kw)
    assert (whole.costs.sum(axis=1) == 0).sum() == 2  # whole trees: two ranks idle
    assert (plan.costs.sum(axis=1) > 0).all()
    assert lockstep_cost(plan.costs) < lockstep_cost(whole.costs)
    assert shared.record.stored > whole_shared.record.stored  # the prompt copied per part
    placed = np.concatenate([mb for row in plan.micro_batches for mb in row])
    assert sorted(placed.tolist()) == list(range(16)) and plan.tokens.max() <= 1000


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_plan_is_never_costlier_than_whole_trees_placed_greedily(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of the cuts x placers tried, the kept plan's lockstep cost is at most the first
    candidate's (whole trees, this module's placer) and within CUT_GAIN of the unshared plan's
    (`plan_step` over the samples), unless it saves micro-batches."""
    import rolltool.plan.prefix_step as ps
    from rolltool.plan.partition.metrics import lockstep_cost

    rng = np.random.default_rng(300 + seed)
    members, codes, forests, tokens = _step_of([_group(rng, int(rng.integers(2, 9)))
                                                for _ in range(int(rng.integers(3, 12)))])  # fmt: skip
    n = len(members)
    lengths = np.array([len(t) for t in tokens])
    args = (np.array(members), lengths, np.array(codes), np.zeros(n, np.float32),
            np.zeros(n, np.int64), ["math"], forests)  # fmt: skip
    kw = dict(dp=int(rng.integers(2, 5)), max_tokens=int(lengths.max()) + int(rng.integers(0, 60)),
              workload=make_workload("flops"), share_min=3)  # fmt: skip
    kept, _ = plan_shared_step(*args, **kw)
    unshared = plan_step(lengths, dp=kw["dp"], max_tokens=kw["max_tokens"], workload=kw["workload"])
    if kept.num_micro_batches >= unshared.num_micro_batches:  # sharing never plans it slower
        assert lockstep_cost(kept.costs) <= lockstep_cost(unshared.costs) * (1 + ps.CUT_GAIN)
    monkeypatch.setattr(ps, "CUT_AT", (1.0,))
    monkeypatch.setattr(ps, "_placements", lambda units, cost, tokens, dp, cap, w: iter(
        [ps._place(cost, tokens, dp, cap)]))  # fmt: skip
    first, _ = plan_shared_step(*args, **kw)
    if kept.num_micro_batches >= first.num_micro_batches:
        assert lockstep_cost(kept.costs) <= lockstep_cost(first.costs) * (1 + 1e-12)
    placed = np.concatenate([mb for row in kept.micro_batches for mb in row])
    assert sorted(placed.tolist()) == list(range(n)) and kept.tokens.max() <= kw["max_tokens"]


def test_an_empty_step_plans_no_micro_batch() -> None:
    """A mini-batch can train nothing (``--mini-batches`` beyond a last batch's samples)."""
    none = np.zeros(0, np.int64)
    plan, shared = plan_shared_step(
        none, none, none, np.zeros(0, np.float32), none, ["math"], {}, dp=2, max_tokens=64,
        workload=make_workload("flops"), share_min=3,
    )  # fmt: skip
    assert plan.num_micro_batches == 0 and shared.record.stored == 0
