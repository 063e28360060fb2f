"""Shared-prefix detection and layout (issue 24): `rolltool.plan.prefix` against slow references.

Detection is compared with a brute force over every subset of a small group: a subset is a trie
node when no other sample agrees with it as far as its own members do (pairwise agreement by a
token-by-token loop); nodes become prefixes by the ``share_min`` rule, largest first. The layout
must give every sample back (its chain's stored tokens, at positions 0 .. L - 1), gather each
segment's keys as its samples' tokens, and keep the step's weighted loss: the shared layout's
sum of target weight x token loss equals the unshared one's for random per-token losses.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.format.prefix import kernel_index, shared_next_token_targets, target_source
from rolltool.format.targets import next_token_targets
from rolltool.plan.prefix import GroupTokens, PrefixForest, SharedLayout, detect, lay_out

# --- the slow, obvious references -----------------------------------------------------------


def ref_agree(g: GroupTokens, i: int, j: int) -> int:
    """Leading tokens samples i and j agree on, one token at a time."""
    cap_i, cap_j = len(g.input_ids[i]), len(g.input_ids[j])
    if g.limit is not None:
        cap_i, cap_j = min(cap_i, int(g.limit[i])), min(cap_j, int(g.limit[j]))
    t = 0
    while t < min(cap_i, cap_j):
        if g.input_ids[i][t] != g.input_ids[j][t]:
            break
        if t > 0:
            mi, mj = bool(g.loss_mask[i][t]), bool(g.loss_mask[j][t])
            if mi != mj:
                break
            if mi and g.logprobs is not None and not g.logprobs[i][t] == g.logprobs[j][t]:
                break
            if mi and g.advantages is not None:
                ai = np.broadcast_to(g.advantages[i], len(g.input_ids[i]))[t]
                aj = np.broadcast_to(g.advantages[j], len(g.input_ids[j]))[t]
                if not ai == aj:
                    break
        t += 1
    return t


def ref_forest(g: GroupTokens, share_min: int) -> tuple[set, dict]:
    """(prefixes as (members, start, end, parent members), sample -> continuation start)."""
    n = len(g.input_ids)
    agree = {(i, j): ref_agree(g, i, j) for i in range(n) for j in range(n)}
    closed = []
    for size in range(n, 1, -1):
        for s in itertools.combinations(range(n), size):
            b = min(agree[i, j] for i, j in itertools.combinations(s, 2))
            outside = [j for j in range(n) if j not in s]
            if not any(min(agree[i, j] for i in s) >= b for j in outside):
                closed.append((frozenset(s), b))
    chosen: list[tuple[frozenset, int]] = []  # supersets come first: sizes descend
    for s, b in closed:
        above = [(c, cb) for c, cb in chosen if s < c]
        anc = min(above, key=lambda x: len(x[0])) if above else None
        if b - (anc[1] if anc else 0) >= share_min:
            chosen.append((s, b))
    nodes = set()
    for s, b in chosen:
        above = [(c, cb) for c, cb in chosen if s < c]
        anc = min(above, key=lambda x: len(x[0])) if above else None
        nodes.add((s, anc[1] - 1 if anc else 0, b - 1, anc[0] if anc else None))
    starts = {}
    for i in range(n):
        mine = [(c, cb) for c, cb in chosen if i in c]
        starts[i] = min(mine, key=lambda x: len(x[0]))[1] - 1 if mine else 0
    return nodes, starts


def as_sets(f: PrefixForest) -> tuple[set, dict]:
    members = [frozenset(f.members(j)) for j in range(len(f.node_end))]
    nodes = {
        (members[j], int(f.node_start[j]), int(f.node_end[j]),
         members[f.node_parent[j]] if f.node_parent[j] >= 0 else None)
        for j in range(len(f.node_end))
    }  # fmt: skip
    return nodes, {i: int(x) for i, x in enumerate(f.continuation_start)}


# --- random groups ---------------------------------------------------------------------------


@st.composite
def groups(draw: st.DrawFn, max_n: int = 6) -> GroupTokens:
    """Small groups that share a lot, and break agreement in every way: each sample is a
    leading part of a base sequence (all of it, often, then a leading part of a second one:
    nested branches), then a random tail; tokens from {0, 1, 2}. Trained from the group's prompt
    length on (or its own), log-probs from a per-position table (now and then one changed),
    advantages 0 or 1. The shape is drawn by hypothesis, the details by a seeded generator
    (hypothesis' draws are the slow part)."""
    n = draw(st.integers(1, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, mid = rng.integers(0, 3, draw(st.integers(0, 12))), rng.integers(0, 3, rng.integers(7))
    prompt, table = rng.integers(13), rng.choice([-0.5, -1.0], 24)

    def often(full: int) -> int:  # all of it half the time, else any leading part
        return full if rng.random() < 0.5 else int(rng.integers(full + 1))

    ids, mask, lp = [], [], []
    for _ in range(n):
        seq = base[: often(len(base))]
        if len(seq) == len(base):
            seq = np.r_[seq, mid[: often(len(mid))]]
        seq = np.r_[seq, rng.integers(0, 3, rng.integers(5))].astype(np.int64)
        seq = seq if len(seq) else np.zeros(1, dtype=np.int64)
        own = prompt if rng.random() < 0.7 else rng.integers(len(seq) + 1)
        m = (np.arange(len(seq)) >= own).astype(np.int8)
        m[0] = 0
        p = table[: len(seq)].copy()
        if rng.random() < 0.25:
            p[rng.integers(len(seq))] = -2.0
        ids.append(seq)
        mask.append(m)
        lp.append(p)
    adv = rng.choice([0.0, 1.0], n)
    limit = rng.integers(0, 21, n) if draw(st.booleans()) else None
    return GroupTokens(ids, mask, lp, adv, limit)


def dyadic_weights(g: GroupTokens, seed: int) -> list[np.ndarray]:
    """Loss weights (0 where untrained) whose sums are exact in float32: target weights come
    out of the format as float32, and the comparison should not hide a rule in rounding."""
    rng = np.random.default_rng(seed)
    return [rng.choice([0.125, 0.25, 0.5, 1.0], size=len(m)) * (m != 0) for m in g.loss_mask]


def shared_row(g: GroupTokens, lay: SharedLayout, w: list[np.ndarray]) -> dict[str, np.ndarray]:
    adv = [np.broadcast_to(a, len(x)) for a, x in zip(g.advantages, g.input_ids, strict=True)]
    return {
        "input_ids": lay.gather(g.input_ids),
        "loss_weight": lay.summed(w),
        "advantages": lay.gather(adv),
        "logprobs": lay.gather(g.logprobs),
        "cu_seqlens": lay.cu_seqlens,
        "sample_index": lay.sample,
    }


# --- detection -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(groups(), st.integers(2, 4))
def test_detect_equals_the_brute_force(g: GroupTokens, share_min: int) -> None:
    f = detect(g, share_min=share_min)
    assert as_sets(f) == ref_forest(g, share_min)
    assert all(f.node_parent < np.arange(len(f.node_parent)))
    assert all(f.node_sample[j] == min(f.members(j)) for j in range(len(f.node_end)))


def test_the_brute_force_sees_prefixes() -> None:
    """A guard against a vacuous comparison: the strategy's groups do have prefixes, nested
    ones and trained tokens inside them."""
    shared = nested = trained = 0

    @settings(max_examples=300, deadline=None)
    @given(groups())
    def count(g: GroupTokens) -> None:
        nonlocal shared, nested, trained
        f = detect(g, share_min=2)
        shared += int(len(f.node_end) > 0)
        nested += int((f.node_parent >= 0).any())
        trained += any(  # a trained token among a prefix's targets
            (g.loss_mask[f.node_sample[j]][f.node_start[j] + 1 : f.node_end[j] + 1] != 0).any()
            for j in range(len(f.node_end))
        )

    count()
    assert shared >= 100 and nested >= 20 and trained >= 20, (shared, nested, trained)


def test_no_common_prefix_is_the_unshared_layout() -> None:
    g = GroupTokens([np.array([1, 2, 3]), np.array([4, 2, 3, 5]), np.array([6])],
                    [np.zeros(3), np.zeros(4), np.zeros(1)])  # fmt: skip
    lay = lay_out(detect(g, share_min=2))
    assert lay.parent.tolist() == [-1, -1, -1] and lay.node.tolist() == [-1, -1, -1]
    assert lay.cu_seqlens.tolist() == [0, 3, 7, 8]
    ix = lay.kernel_index()
    assert ix.kv_index.tolist() == list(range(8)) and ix.cu_seqlens_k.tolist() == [0, 3, 7, 8]
    s = lay.stats()
    assert s.tokens == s.tokens_shared == 8 and s.attention_pairs == s.attention_pairs_shared


def test_identical_samples_keep_their_last_token() -> None:
    """Everything but the last token is stored once; each copy re-feeds the last token (no
    target), so no segment is empty."""
    seq = np.arange(10)
    g = GroupTokens([seq] * 3, [np.r_[np.zeros(4), np.ones(6)]] * 3,
                    [np.full(10, -0.5)] * 3, np.zeros(3))  # fmt: skip
    lay = lay_out(detect(g, share_min=4))
    assert lay.cu_seqlens.tolist() == [0, 9, 10, 11, 12]
    assert lay.parent.tolist() == [-1, 0, 0, 0] and lay.start.tolist() == [0, 9, 9, 9]
    w = [np.r_[np.zeros(4), np.ones(6)] * k for k in (1, 2, 4)]
    assert lay.summed(w).tolist() == [0] * 4 + [7] * 5 + [1, 2, 4]
    row = shared_row(g, lay, w)
    t = shared_next_token_targets(row, lay.parent)
    assert t["target_ids"].tolist() == [*range(1, 10), -100, -100, -100]
    assert t["target_loss_weight"].tolist() == [0] * 3 + [7] * 6 + [0, 0, 0]


def test_nested_branches() -> None:
    """A prompt shared by all four, a trajectory shared by two of them beyond it."""
    prompt, traj = list(range(100, 110)), list(range(200, 206))
    seqs = [[*prompt, *traj, 1, 2], [*prompt, *traj, 3], [*prompt, 4, 5], [*prompt, 6]]
    g = GroupTokens([np.array(s) for s in seqs], [np.zeros(len(s)) for s in seqs])
    f = detect(g, share_min=4)
    assert f.node_start.tolist() == [0, 9] and f.node_end.tolist() == [9, 15]
    assert f.node_parent.tolist() == [-1, 0] and f.sample_node.tolist() == [1, 1, 0, 0]
    assert f.continuation_start.tolist() == [15, 15, 9, 9]
    lay = lay_out(f)
    assert lay.parent.tolist() == [-1, 0, 1, 1, 0, 0]  # depth first, siblings by lowest sample
    # with share_min 7 the trajectory (6 tokens beyond the prompt) no longer pays
    assert detect(g, share_min=7).node_end.tolist() == [9]


def test_a_trained_token_is_shared_only_with_equal_copies() -> None:
    ids = [np.arange(8), np.arange(8), np.r_[np.arange(6), 9]]
    mask = [np.r_[0, 0, 0, 1, 1, 1, 1, 1]] * 2 + [np.r_[0, 0, 0, 1, 1, 1, 1]]
    lp = [np.full(8, -1.0), np.full(8, -1.0), np.r_[np.full(4, -1.0), -2.0, -1.0, -1.0]]
    g = GroupTokens(ids, mask, lp, np.ones(3))
    f = detect(g, share_min=2)
    # all three agree up to token 3; token 4 differs in log-prob for sample 2; 0 and 1 agree on all
    assert as_sets(f)[0] == {
        (frozenset({0, 1, 2}), 0, 3, None),
        (frozenset({0, 1}), 3, 7, frozenset({0, 1, 2})),
    }
    # another advantage for sample 1: they agree up to the first trained token (3) only
    g_adv = GroupTokens(ids, mask, lp, np.array([1.0, 0.5, 1.0]))
    assert as_sets(detect(g_adv, share_min=2))[0] == {(frozenset({0, 1, 2}), 0, 2, None)}
    g_cap = GroupTokens(ids, mask, lp, np.ones(3), limit=np.array([3, 3, 3]))  # the prompt only
    assert as_sets(detect(g_cap, share_min=2))[0] == {(frozenset({0, 1, 2}), 0, 2, None)}


def test_share_min_is_checked() -> None:
    g = GroupTokens([np.arange(3)] * 2, [np.zeros(3)] * 2)
    with pytest.raises(RolltoolError):
        detect(g, share_min=1)


# --- the layout ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(groups(), st.integers(2, 4))
def test_layout_gives_every_sample_back(g: GroupTokens, share_min: int) -> None:
    lay = lay_out(detect(g, share_min=share_min))
    ix = lay.kernel_index()
    cu = lay.cu_seqlens
    assert (np.diff(cu) > 0).all() and (lay.parent < np.arange(len(lay.parent))).all()
    ids = lay.gather(g.input_ids)
    seen = np.zeros(len(ids), dtype=bool)
    for i, x in enumerate(g.input_ids):
        rows = lay.sample_rows(i)
        assert ids[rows].tolist() == x.tolist()
        assert ix.position_ids[rows].tolist() == list(range(len(x)))
        seg = lay.sample_segment[i]
        # a continuation's keys are exactly its sample's tokens, in order
        assert (
            ix.kv_index[ix.cu_seqlens_k[seg] : ix.cu_seqlens_k[seg + 1]].tolist() == rows.tolist()
        )
        seen[rows] = True
    assert seen.all()  # nothing stored that no sample needs
    for s in range(len(cu) - 1):  # a prefix's keys: its representative's tokens up to its end
        if lay.node[s] >= 0:
            rows = lay.sample_rows(int(lay.sample[s]))[: lay.end[s]]
            assert (
                ix.kv_index[ix.cu_seqlens_k[s] : ix.cu_seqlens_k[s + 1]].tolist() == rows.tolist()
            )
    # each prefix saves its stored tokens once per extra sample through it
    f = detect(g, share_min=share_min)
    saved = sum((len(f.members(j)) - 1) * int(f.node_end[j] - f.node_start[j])
                for j in range(len(f.node_end)))  # fmt: skip
    s = lay.stats()
    assert s.tokens == int(lay.lengths.sum()) and s.tokens_shared == int(cu[-1]) == s.tokens - saved


@settings(max_examples=300, deadline=None)
@given(groups(), st.integers(2, 4), st.integers(0, 2**32 - 1))
def test_summed_weights_keep_the_step_loss(g: GroupTokens, share_min: int, seed: int) -> None:
    """sum_k target_weight[k] * loss(k) over the shared row equals sum_i sum_t w_i[t] * loss_i(t)
    for a random per-token loss that is a function of what the model sees: the context's tokens,
    the target token and its log-prob and advantage (equal wherever two samples agree)."""
    rng = np.random.default_rng(seed)
    table: dict[tuple, float] = {}

    def loss(i: int, t: int) -> float:  # token t of sample i as a target
        a = float(np.broadcast_to(g.advantages[i], len(g.input_ids[i]))[t])
        key = (tuple(g.input_ids[i][: t + 1].tolist()), float(g.logprobs[i][t]), a)
        return table.setdefault(key, float(rng.normal()))

    w = dyadic_weights(g, seed)
    unshared = sum(w[i][t] * loss(i, t) for i in range(len(w)) for t in range(1, len(w[i])))
    lay = lay_out(detect(g, share_min=share_min))
    row = shared_row(g, lay, w)
    targets = shared_next_token_targets(row, lay.parent)
    src = target_source(lay.cu_seqlens, lay.parent)
    owner = np.repeat(lay.sample, np.diff(lay.cu_seqlens))
    pos = lay.kernel_index().position_ids
    shared = 0.0
    for k in np.flatnonzero(src >= 0):
        i, t = int(owner[k]), int(pos[k]) + 1  # the representative has the target token too
        assert targets["target_ids"][k] == g.input_ids[i][t]
        assert targets["target_logprobs"][k] == np.float32(g.logprobs[i][t])
        shared += float(targets["target_loss_weight"][k]) * loss(i, t)
    assert shared == pytest.approx(unshared, abs=1e-12)
    total = sum(float(x[1:].sum()) for x in w)
    assert float(targets["target_loss_weight"].sum()) == pytest.approx(total, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(groups())
def test_unshared_rows_get_the_usual_targets(g: GroupTokens) -> None:
    """With nothing shared, the shared targets are `next_token_targets` exactly."""
    lay = lay_out(PrefixForest(g.lengths, *(np.zeros(0, dtype=np.int64),) * 4,
                               sample_node=np.full(len(g.lengths), -1)))  # fmt: skip
    row = shared_row(g, lay, dyadic_weights(g, 0))
    a, b = shared_next_token_targets(row, lay.parent), next_token_targets(row)
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_kernel_index_of_nested_chains() -> None:
    # root (3 tokens) -> nested (2) -> continuation (2); root -> continuation (1)
    ix = kernel_index(np.array([0, 3, 5, 7, 8]), np.array([-1, 0, 1, 0]))
    assert ix.start.tolist() == [0, 3, 5, 3]
    assert ix.cu_seqlens_k.tolist() == [0, 3, 8, 15, 19]
    assert ix.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 7]
    assert ix.max_seqlen_q == 3 and ix.max_seqlen_k == 7
    with pytest.raises(ValueError):
        kernel_index(np.array([0, 3, 5]), np.array([1, -1]))


def test_the_issue_example_counts() -> None:
    """8 rollouts of 1,024 tokens behind a 4,096-token prompt: 40,960 tokens become 12,287."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 4096)
    ids = [np.r_[prompt, rng.integers(0, 1000, 1024)] for _ in range(8)]
    mask = [np.r_[np.zeros(4096), np.ones(1024)] for _ in range(8)]
    s = lay_out(detect(GroupTokens(ids, mask))).stats()
    assert (s.tokens, s.tokens_shared) == (40960, 4095 + 8 * 1025)
    assert s.token_ratio > 3.3
    assert (s + s).tokens == 2 * s.tokens
