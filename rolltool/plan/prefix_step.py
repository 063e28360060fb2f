"""Planning a ``--share-prefix`` step: prefix trees placed whole, each micro-batch's segments.

`rolltool.plan.prefix` finds a group's shared prefixes from its tokens; planning sees only light
columns, so pack runs detection once per group *before* planning, in a pass over the token
columns (`rolltool.fetch.prefixes`), and hands every planner the result (`GroupForest`, by
group). Why a pass and not the prompt's length: the input's own tokens are what a prefix must
equal, and only they say where agent branches part; the pass reads the token columns once more
(sequentially, group after group), the price of a plan that is exact.

Per step (`plan_shared_step`):

1. **Restriction.** A group's forest is cut to the step's samples (`restrict`): a prefix with
   fewer than two of them goes (its children attach to its nearest kept ancestor), one with
   the same samples as a kept child goes too (the child shares more), and where the step's
   advantages of its samples differ and a trained token lies inside it, a prefix ends before
   that token and its samples of each advantage share the rest under it (detection compared
   tokens, masks and log-probs only; the advantage is known per step). A prefix must still
   share ``share_min`` tokens beyond its parent's. So samples laid out together never store
   more than they do apart (tested), which the placement relies on.
2. **Units.** A tree (a root prefix, everything below it, all their samples) is the unit placed
   on one micro-batch of one rank; an unshared sample is a unit of its own. A tree whose stored
   tokens exceed the budget is cut into subsets of its samples, in layout order (so samples
   under one nested prefix stay together), each as many as fit, each with its own copy of its
   chain (`_cut`). Trees are coarse, so the step is also planned with every tree cut to half
   and to a quarter of the budget, and into single samples (`CUT_AT`), each set of units
   placed by step 4 and by the lockstep planner over the units (`_placements`), and the
   cheapest lockstep cost is kept (a copy of a chain is counted in it; a finer cut or the
   other placement must gain `CUT_GAIN`, and one more micro-batch ``WIDER_GAIN``, to be kept).
3. **Cost.** A unit costs what is computed: ``c`` per sample, ``a`` per stored token and
   ``b · (end² − start²)`` per segment (its queries over its whole context, prefix keys
   included: a sample alone is ``b · L²``); its tokens are what is stored.
4. **Placement.** ``dp · M`` micro-batches, M from the token lower bound up: each unit, the
   costliest first, to the cheapest micro-batch with room (FFD by tokens at M when that fails
   but fits), then the costliest micro-batch lightened by moves and swaps of one unit while
   that lowers it (`_even`); the micro-batches sorted by cost and dealt into M slots of dp,
   each slot's spread over the ranks so rank totals stay even. A micro-batch's samples of one group are laid out
   together (`restrict` of their union: never more tokens than its units apart).

`shared_step_rows` then lays out a step's rows from its fetched tokens and checks them against
the plan: every sample through a prefix must agree with its representative there, as planned;
a sample that does not (the input changed between the pass and the fetch) is an error, never a
wrong or over-budget row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import SharedRecord, SharedTokens
from rolltool.format.layout import PackedRows, SampleTokens
from rolltool.format.prefix import NO_PARENT, shared_rows
from rolltool.plan.partition import StepPlan, plan_units
from rolltool.plan.partition.metrics import ideal, lockstep_cost
from rolltool.plan.partition.plan import WIDER_GAIN, checked_plan
from rolltool.plan.prefix import PrefixForest, SharedLayout, SharingStats, lay_out
from rolltool.plan.workload import Workload


@dataclass(frozen=True)
class GroupForest:
    """One group's prefixes as the token pass found them (`rolltool.plan.prefix.detect`)."""

    samples: np.ndarray
    """[n] int64: the group's sample indices, in the order `forest` numbers them."""
    forest: PrefixForest
    """Its prefixes (m of them) over those samples."""
    first_trained: np.ndarray
    """[m] int64: per prefix, the first position in [1, P) whose token is trained (P = the
    length its samples share, ``node_end + 1``), or P: where differing advantages end it."""


def first_trained(forest: PrefixForest, loss_mask: Sequence[np.ndarray]) -> np.ndarray:
    """`GroupForest.first_trained` from the group's per-sample loss masks (the samples of a
    prefix agree on them there, so its representative's tell)."""
    out = np.empty(len(forest.node_end), dtype=np.int64)
    for j, (i, end) in enumerate(zip(forest.node_sample, forest.node_end, strict=True)):
        shared = int(end) + 1
        hit = np.flatnonzero(np.asarray(loss_mask[int(i)])[1:shared])
        out[j] = int(hit[0]) + 1 if len(hit) else shared
    return out


def restrict(
    gf: GroupForest, take: np.ndarray, advantage: np.ndarray, share_min: int
) -> PrefixForest:
    """`gf`'s forest cut to the samples ``gf.samples[take]`` (numbered 0.. in `take`'s order;
    `advantage` [len(take)] their step advantages): see the module docstring, step 1.

    Prefixes are rebuilt as *instances* (a forest prefix, some of its samples, the length they
    share), parents first: a prefix's samples under one parent instance form one instance; where
    their advantages differ and a trained token lies in its span, the instance ends before that
    token and each set of samples of one advantage gets its own instance of the full length
    under it (so samples of equal advantage keep sharing their trained tokens, whichever others
    are in the step: the layout of a union of samples never stores more than its parts')."""
    f = gf.forest
    k = len(take)
    members: list[list[int]] = [[] for _ in range(len(f.node_end))]
    for q, t in enumerate(np.asarray(take, dtype=np.int64).tolist()):
        for j in f.chain(t):
            members[j].append(q)
    inst_p: list[int] = []  # each instance's shared length
    inst_parent: list[int] = []
    inst_members: list[list[int]] = []
    at = np.full(k, NO_PARENT, dtype=np.int64)  # each sample's deepest instance so far

    def add(mem: list[int], P: int, parent: int) -> int:
        base = inst_p[parent] if parent >= 0 else 0
        if len(mem) < 2 or P - base < share_min:
            return parent
        inst_p.append(P)
        inst_parent.append(parent)
        inst_members.append(mem)
        at[mem] = len(inst_p) - 1
        return len(inst_p) - 1

    for j in range(len(f.node_end)):  # parents come first
        P, trained = int(f.node_end[j]) + 1, int(gf.first_trained[j])
        under: dict[int, list[int]] = {}
        for q in members[j]:
            under.setdefault(int(at[q]), []).append(q)
        for parent, mem in under.items():
            classes: dict[float, list[int]] = {}
            for q in mem:
                classes.setdefault(float(advantage[q]), []).append(q)
            if trained >= P or len(classes) == 1:
                add(mem, P, parent)
                continue
            head = add(mem, trained, parent)  # shared up to the first trained token
            for cls in classes.values():
                add(cls, P, head)
    keep = _without_repeats(inst_parent, inst_members)
    new = {n: i for i, n in enumerate(keep)}

    def kept_parent(n: int) -> int:
        p = inst_parent[n]
        while p >= 0 and p not in new:
            p = inst_parent[p]
        return p

    deepest = np.full(k, NO_PARENT, dtype=np.int64)
    for n in keep:  # parents first: a deeper instance overwrites
        deepest[inst_members[n]] = new[n]
    parents = [kept_parent(n) for n in keep]
    return PrefixForest(
        lengths=f.lengths[np.asarray(take, dtype=np.int64)],
        node_sample=np.array([min(inst_members[n]) for n in keep], dtype=np.int64),
        node_start=np.array([inst_p[p] - 1 if p >= 0 else 0 for p in parents], dtype=np.int64),
        node_end=np.array([inst_p[n] - 1 for n in keep], dtype=np.int64),
        node_parent=np.array([new[p] if p >= 0 else NO_PARENT for p in parents], np.int64),
        sample_node=deepest,
    )


def _without_repeats(parent: list[int], members: list[list[int]]) -> list[int]:
    """The instances to keep, in order: all but those with exactly one child instance of the
    same samples (the child shares more)."""
    drop = set()
    for n in range(len(parent)):
        p = parent[n]
        if p >= 0 and len(members[p]) == len(members[n]):
            drop.add(p)
    return [n for n in range(len(parent)) if n not in drop]


def unshared(lengths: np.ndarray) -> PrefixForest:
    """The forest of samples that share nothing (a group without prefixes)."""
    none = np.zeros(0, dtype=np.int64)
    return PrefixForest(
        np.asarray(lengths, dtype=np.int64),
        none,
        none,
        none,
        none,
        np.full(len(lengths), NO_PARENT, dtype=np.int64),
    )


def layout_cost(layout: SharedLayout, workload: Workload) -> float:
    """What computing `layout` costs under `workload` (module docstring, step 3)."""
    s = layout.start.astype(np.float64)
    e = layout.end.astype(np.float64)
    return float(
        workload.c * len(layout.lengths)
        + workload.a * (e - s).sum()
        + workload.b * (e * e - s * s).sum()
    )


@dataclass(frozen=True)
class _Part:
    """Some samples of one group laid out together (positions into the step's members)."""

    group: int
    positions: np.ndarray  # [k] int64, in layout order
    layout: SharedLayout  # over ``positions`` (its sample j is positions[j])

    @property
    def tokens(self) -> int:
        return int(self.layout.cu_seqlens[-1])


class _Group:
    """One group's samples in a step, and how any subset of them is laid out."""

    def __init__(
        self,
        code: int,
        positions: np.ndarray,
        members: np.ndarray,
        lengths: np.ndarray,
        advantage: np.ndarray,
        gf: GroupForest | None,
        share_min: int,
    ) -> None:
        self.code, self.positions, self.gf, self.share_min = code, positions, gf, share_min
        self.lengths, self.advantage = lengths, advantage
        if gf is not None:
            at = {int(s): i for i, s in enumerate(gf.samples.tolist())}
            self.local = np.array([at[int(s)] for s in members[positions]], dtype=np.int64)

    def part(self, which: np.ndarray) -> _Part:
        """The samples ``positions[which]`` laid out together, in layout order."""
        which = np.sort(np.asarray(which, dtype=np.int64))
        if self.gf is None:
            forest = unshared(self.lengths[which])
        else:
            forest = restrict(self.gf, self.local[which], self.advantage[which], self.share_min)
        lay = lay_out(forest)
        order = np.array([int(lay.sample[s]) for s in np.flatnonzero(lay.node < 0)], dtype=np.int64)
        if not np.array_equal(order, np.arange(len(which))):  # samples in layout order
            renumber = np.empty(len(which), dtype=np.int64)
            renumber[order] = np.arange(len(which))
            which = which[order]
            lay = _renumbered(lay, renumber)
        return _Part(self.code, self.positions[which], lay)

    def trees(self) -> list[np.ndarray]:
        """The group's units before any cut: each tree's samples, each unshared sample alone
        (indices into ``positions``)."""
        whole = self.part(np.arange(len(self.positions)))
        order = np.searchsorted(self.positions, whole.positions)
        root = np.empty(len(self.positions), dtype=np.int64)
        for s, seg in enumerate(whole.layout.sample_segment.tolist()):
            while whole.layout.parent[seg] >= 0:
                seg = int(whole.layout.parent[seg])
            root[s] = seg
        out: dict[int, list[int]] = {}
        for s, r in enumerate(root.tolist()):
            out.setdefault(r, []).append(int(order[s]))
        return [np.array(v, dtype=np.int64) for v in out.values()]


def _renumbered(lay: SharedLayout, renumber: np.ndarray) -> SharedLayout:
    """`lay` with its samples renumbered (sample i becomes ``renumber[i]``)."""
    inverse = np.empty_like(renumber)
    inverse[renumber] = np.arange(len(renumber))
    return SharedLayout(
        lengths=lay.lengths[inverse],
        sample=renumber[lay.sample],
        start=lay.start,
        end=lay.end,
        parent=lay.parent,
        node=lay.node,
        sample_segment=lay.sample_segment[inverse],
    )


def _cut(group: _Group, tree: np.ndarray, cap: int) -> list[_Part]:
    """A tree as parts of at most `cap` stored tokens: the whole tree when it fits, else its
    samples in layout order, each part as many as fit (each sample alone fits: the over-long
    are out of the step)."""
    whole = group.part(tree)
    if whole.tokens <= cap:
        return [whole]
    pos_index = {int(p): i for i, p in enumerate(group.positions.tolist())}
    ordered = [pos_index[int(p)] for p in whole.positions.tolist()]
    parts, current, best = [], [ordered[0]], group.part(np.array(ordered[:1]))
    for i in ordered[1:]:
        trial = group.part(np.array([*current, i]))
        if trial.tokens <= cap:
            current, best = [*current, i], trial
        else:
            parts.append(best)
            current, best = [i], group.part(np.array([i]))
    parts.append(best)
    return parts


@dataclass(frozen=True)
class SharedPlan:
    """A ``--share-prefix`` step's stored segments, micro-batch by micro-batch (rank 0's
    first), what `shared_step_rows` lays out: ``S`` segments over ``dp · M`` rows."""

    sample: np.ndarray
    """[S] int64: the sample (input index) whose tokens a segment stores (a prefix's
    representative)."""
    start: np.ndarray
    """[S] int64: its first position in that sample."""
    end: np.ndarray
    """[S] int64: one past its last."""
    parent: np.ndarray
    """[S] int32: the segment of its row it continues (row-relative), or -1."""
    row_segments: np.ndarray
    """[dp · M + 1] int64: row r's segments are ``[row_segments[r], row_segments[r+1])``."""
    record: SharedRecord
    """The step's sharing, for the manifest."""


def plan_shared_step(
    members: np.ndarray,
    lengths: np.ndarray,
    group: np.ndarray,
    advantage: np.ndarray,
    env: np.ndarray,
    env_names: Sequence[str],
    forests: Mapping[int, GroupForest],
    *,
    dp: int,
    max_tokens: int,
    workload: Workload,
    share_min: int,
) -> tuple[StepPlan, SharedPlan]:
    """One ``--share-prefix`` step's plan (module docstring): `members` [n] its samples, with
    their `lengths`, `group` codes, step `advantage` and `env` codes; `forests` the token
    pass's groups with prefixes. ``plan.micro_batches[r][j]`` lists positions in the order
    the row stores their continuations."""
    groups: list[_Group] = []
    codes = group.astype(np.int64)
    _, first = np.unique(codes, return_index=True)
    for g in codes[np.sort(first)].tolist():
        pos = np.flatnonzero(codes == g)
        groups.append(
            _Group(g, pos, members, lengths[pos], advantage[pos], forests.get(g), share_min)
        )
    by_group = {gr.code: gr for gr in groups}
    best: tuple[float, StepPlan, list[list[list[_Part]]]] | None = None
    tried: list[tuple[int, ...]] | None = None
    trees = [(gr, tree) for gr in groups for tree in gr.trees()]
    for fraction in CUT_AT:
        cap = int(max_tokens * fraction)
        units = [p for gr, tree in trees for p in _cut(gr, tree, cap)]
        key = [tuple(u.positions.tolist()) for u in units]
        if key == tried:  # no tree was over this cut: the same units as the last one
            continue
        tried = key
        cost = np.array([layout_cost(u.layout, workload) for u in units])
        tokens = np.array([u.tokens for u in units], dtype=np.int64)
        for bins, m, min_m, ffd_m in _placements(units, cost, tokens, dp, max_tokens, workload):
            laid = [[_merged(by_group, [units[u] for u in b]) for b in row] for row in bins]
            plan = _step_plan(laid, len(members), dp, m, min_m, ffd_m, max_tokens, workload)
            score = lockstep_cost(plan.costs)
            if best is not None:
                extra = plan.num_micro_batches - best[1].num_micro_batches
                score += WIDER_GAIN * ideal(best[1].costs) * extra
            if best is None or score < best[0] * (1 - CUT_GAIN):
                best = (lockstep_cost(plan.costs), plan, laid)
    assert best is not None
    return best[1], _shared_plan(best[2], members, env, env_names)


CUT_AT = (1.0, 0.5, 0.25, 0.0)
"""Trees are cut into parts of at most this fraction of the budget in stored tokens, each cut
planned, the lightest lockstep cost kept: trees are coarse units, and a cut copies its prefix
chain (counted in the cost) but lets the micro-batches even out. 1.0: only trees over the budget
are cut; 0.0: every sample its own unit, the unshared placement (a micro-batch's samples of one
group are still laid out together, `_merged`), so sharing never plans a step more than
`CUT_GAIN` slower than not sharing would (a step of 3 groups over 8 ranks)."""

CUT_GAIN = 1e-3
"""A finer cut must lower the step's lockstep cost by this much (relative) to be kept."""


def _placements(
    units: Sequence[_Part],
    cost: np.ndarray,
    tokens: np.ndarray,
    dp: int,
    cap: int,
    workload: Workload,
) -> Iterator[tuple[list[list[list[int]]], int, int, int]]:
    """The units' placements to compare, each (grid of unit lists, M, token bound, FFD's M):
    this module's (`_place`), then the lockstep planner's over the units as priced items
    (`rolltool.plan.partition.plan_units`: its candidates, refill and polish)."""
    yield _place(cost, tokens, dp, cap)
    if not len(units):
        return
    quad = np.array([workload.b * float((u.layout.end.astype(np.float64) ** 2
                                         - u.layout.start.astype(np.float64) ** 2).sum())
                     for u in units])  # fmt: skip
    grid, ffd_m, min_m = plan_units(cost, tokens, quad, dp=dp, max_tokens=cap)
    m = len(grid[0]) if grid else 0
    yield [[b.tolist() for b in row] for row in grid], m, min_m, ffd_m


def _merged(groups: Mapping[int, _Group], units: Sequence[_Part]) -> list[_Part]:
    """A micro-batch's units, each group's laid out together (module docstring, step 4), or
    its units apart where together would store more (`restrict` makes that impossible; the
    placement's token counts must hold whatever)."""
    out: dict[int, list[_Part]] = {}
    for u in units:
        out.setdefault(u.group, []).append(u)
    parts = []
    for g, mine in out.items():
        gr = groups[g]
        which = np.searchsorted(gr.positions, np.concatenate([u.positions for u in mine]))
        together = gr.part(which)
        apart = sum(u.tokens for u in mine)
        parts.extend([together] if together.tokens <= apart else mine)
    return parts


def _place(
    cost: np.ndarray, tokens: np.ndarray, dp: int, cap: int
) -> tuple[list[list[list[int]]], int, int, int]:
    """Units into ``[dp][M]`` micro-batches under `cap` (module docstring, step 4): (the
    grid of unit lists, M, the token lower bound, FFD's count)."""
    n = len(cost)
    min_m = max(1, math.ceil(int(tokens.sum()) / (dp * cap))) if n else 0
    ffd_m = _ffd_count(tokens, dp, cap)
    if not n:
        return [[] for _ in range(dp)], 0, 0, 0
    by_cost = sorted(range(n), key=lambda u: (-cost[u], -tokens[u], u))
    by_tokens = sorted(range(n), key=lambda u: (-tokens[u], -cost[u], u))
    m = min_m
    while True:
        fill = _fill(by_cost, cost, tokens, dp * m, cap, cheapest=True)
        if fill is None:
            fill = _fill(by_tokens, cost, tokens, dp * m, cap, cheapest=False)
        if fill is not None:
            break
        m += 1
    fill = _even(fill, cost, tokens, cap)
    loads = [float(cost[b].sum()) if b else 0.0 for b in fill]
    ranked = sorted(range(len(fill)), key=lambda b: (-loads[b], b))
    grid: list[list[list[int]]] = [[] for _ in range(dp)]
    totals = [0.0] * dp
    for j in range(m):
        slot = ranked[j * dp : (j + 1) * dp]
        ranks = sorted(range(dp), key=lambda r: (totals[r], r))
        for r, b in zip(ranks, slot, strict=True):  # the heaviest bin to the lightest rank
            grid[r].append(fill[b])
            totals[r] += loads[b]
    return grid, m, min_m, ffd_m


def _even(
    fill: list[list[int]], cost: np.ndarray, tokens: np.ndarray, cap: int, rounds: int = 1000
) -> list[list[int]]:
    """`fill` with its costliest micro-batch lightened while a move or a swap of one unit with
    a lighter micro-batch (room permitting) lowers the pair's larger cost: trees are coarse, so
    greedy placement alone leaves micro-batches uneven. Never raises the costliest one."""
    out = [list(b) for b in fill]
    load = np.array([float(cost[b].sum()) if b else 0.0 for b in out])
    used = np.array([int(tokens[b].sum()) if b else 0 for b in out], dtype=np.int64)
    for _ in range(rounds):
        h = int(np.argmax(load))
        done = True
        for low in np.argsort(load, kind="stable").tolist():
            if low == h or load[low] >= load[h]:
                break
            move = _best_exchange(out[h], out[low], load[h], load[low], used[h], used[low],
                                  cost, tokens, cap)  # fmt: skip
            if move is None:
                continue
            u, v = move
            out[h].remove(u)
            out[low].append(u)
            delta_c, delta_t = float(cost[u]), int(tokens[u])
            if v is not None:
                out[low].remove(v)
                out[h].append(v)
                delta_c -= float(cost[v])
                delta_t -= int(tokens[v])
            load[h] -= delta_c
            load[low] += delta_c
            used[h] -= delta_t
            used[low] += delta_t
            done = False
            break
        if done:
            break
    return out


def _best_exchange(heavy: list[int], light: list[int], hi: float, lo: float, used_hi: int,
                   used_lo: int, cost: np.ndarray, tokens: np.ndarray,
                   cap: int) -> tuple[int, int | None] | None:  # fmt: skip
    """The move (u, None) or swap (u, v) of a unit u of `heavy` with v of `light` that lowers
    max(hi, lo) the most within `cap`, or None."""
    best, best_max = None, hi * (1 - 1e-9)
    for u in heavy:
        for v in [None, *light]:
            d = float(cost[u]) - (float(cost[v]) if v is not None else 0.0)
            t = int(tokens[u]) - (int(tokens[v]) if v is not None else 0)
            if d <= 0 or used_lo + t > cap or used_hi - t > cap:
                continue
            new = max(hi - d, lo + d)
            if new < best_max:
                best, best_max = (u, v), new
    return best


def _fill(
    order: Sequence[int],
    cost: np.ndarray,
    tokens: np.ndarray,
    bins: int,
    cap: int,
    *,
    cheapest: bool,
) -> list[list[int]] | None:
    """Units in `order`, each to the cheapest bin with room (or the first, FFD), or None."""
    load = np.zeros(bins)
    used = np.zeros(bins, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(bins)]
    for u in order:
        room = np.flatnonzero(used + tokens[u] <= cap)
        if not len(room):
            return None
        b = int(room[np.argmin(load[room])]) if cheapest else int(room[0])
        out[b].append(u)
        load[b] += cost[u]
        used[b] += tokens[u]
    return out


def _ffd_count(tokens: np.ndarray, dp: int, cap: int) -> int:
    """Micro-batches per rank first-fit decreasing needs for the units' tokens."""
    bins: list[int] = []
    for t in sorted(tokens.tolist(), reverse=True):
        for b, used in enumerate(bins):
            if used + t <= cap:
                bins[b] += t
                break
        else:
            bins.append(t)
    return math.ceil(len(bins) / dp) if bins else 0


def _step_plan(
    laid: list[list[list[_Part]]],
    n: int,
    dp: int,
    m: int,
    min_m: int,
    ffd_m: int,
    cap: int,
    workload: Workload,
) -> StepPlan:
    """The `StepPlan` of laid-out micro-batches over the step's `n` positions: positions in row
    order, stored tokens and computed cost; every micro-batch under the cap and every position
    once, checked
    (`rolltool.plan.partition.plan.checked_plan`)."""
    grid = [
        [np.concatenate([p.positions for p in mb]) if mb else np.zeros(0, np.int64) for mb in row]
        for row in laid
    ]
    tokens = np.array(
        [[sum(p.tokens for p in mb) for mb in row] for row in laid], dtype=np.int64
    ).reshape(dp, m)
    costs = np.array(
        [[sum(layout_cost(p.layout, workload) for p in mb) for mb in row] for row in laid],
        dtype=np.float64,
    ).reshape(dp, m)
    return checked_plan(grid, tokens, costs, n, max_tokens=cap, micro_batch_size=None,
                        ffd_micro_batches=ffd_m, min_micro_batches=min_m, workload=workload)  # fmt: skip


def _shared_plan(
    laid: list[list[list[_Part]]], members: np.ndarray, env: np.ndarray, env_names: Sequence[str]
) -> SharedPlan:
    """The segment table of laid-out micro-batches, rank-major, and the step's record."""
    sample, start, end, parent, counts = [], [], [], [], []
    stats = SharingStats()
    per_env: dict[str, list[int]] = {}
    for row in laid:
        for mb in row:
            n = 0
            for p in mb:
                lay = p.layout
                sample.append(members[p.positions[lay.sample]])
                start.append(lay.start)
                end.append(lay.end)
                parent.append(np.where(lay.parent >= 0, lay.parent + n, NO_PARENT))
                n += len(lay.sample)
                stats = stats + lay.stats()
                name = env_names[int(env[p.positions[0]])]
                got = per_env.setdefault(name, [0, 0])
                got[0] += int(lay.lengths.sum())
                got[1] += p.tokens
            counts.append(n)
    row_segments = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=row_segments[1:])

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    record = SharedRecord(
        prefixes=stats.prefixes,
        tokens=stats.tokens,
        stored=stats.tokens_shared,
        attention_pairs=stats.attention_pairs,
        attention_pairs_shared=stats.attention_pairs_shared,
        kv_tokens=stats.kv_tokens_shared,
        envs={e: SharedTokens(tokens=t, stored=s) for e, (t, s) in per_env.items()},
    )
    return SharedPlan(
        sample=cat(sample, np.int64),
        start=cat(start, np.int64),
        end=cat(end, np.int64),
        parent=cat(parent, np.int32),
        row_segments=row_segments,
        record=record,
    )


# -- laying out a planned step from its tokens ------------------------------------------------


def shared_step_rows(
    tokens: SampleTokens,
    rows_of: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    plan: SharedPlan,
    *,
    dp: int,
    step: int,
    row_len: int | None = None,
    pad_id: int = 0,
) -> Iterator[PackedRows]:
    """Each rank's rows of a planned ``--share-prefix`` step: `tokens` hold the step's samples
    ``rows_of`` [n] (input indices) in that order, with their `advantage` and `weight` (per
    trainable token). A prefix's weight is the sum of its samples' (float64, rounded once);
    every sample through a prefix must agree with its representative there (`_check_agree`)."""
    at = {int(s): k for k, s in enumerate(rows_of.tolist())}
    source = np.array([at[int(s)] for s in plan.sample.tolist()], dtype=np.int64)
    rs = plan.row_segments
    summed = np.zeros(len(source), dtype=np.float64)
    has_kids = np.zeros(len(source), dtype=bool)
    for r in range(len(rs) - 1):
        a = int(rs[r])
        p = plan.parent[a : int(rs[r + 1])]
        has_kids[a + p[p >= 0]] = True
    w = np.asarray(weight, dtype=np.float32).astype(np.float64)
    for r in range(len(rs) - 1):
        a = int(rs[r])
        for j in range(a, int(rs[r + 1])):
            if has_kids[j]:
                continue
            k = int(source[j])  # a leaf: its sample's continuation; walk up its chain
            seg = j
            while seg >= 0:
                summed[seg] += w[k]
                if seg != j:
                    _check_agree(
                        tokens,
                        k,
                        int(source[seg]),
                        int(plan.end[seg]) + 1,
                        advantage,
                        rows_of,
                        step,
                    )
                up = int(plan.parent[seg])
                seg = a + up if up >= 0 else -1
    m = (len(rs) - 1) // dp if dp else 0
    for r in range(dp):
        a, b = int(rs[r * m]), int(rs[(r + 1) * m])
        yield shared_rows(
            tokens,
            source=source[a:b],
            start=plan.start[a:b],
            end=plan.end[a:b],
            parent=plan.parent[a:b],
            row_segments=rs[r * m : (r + 1) * m + 1] - a,
            sample_index=rows_of[source[a:b]],
            advantage=np.asarray(advantage, dtype=np.float32)[source[a:b]],
            weight=summed[a:b].astype(np.float32),
            row_len=row_len,
            pad_id=pad_id,
        )


def _check_agree(
    tokens: SampleTokens,
    k: int,
    rep: int,
    shared: int,
    advantage: np.ndarray,
    rows_of: np.ndarray,
    step: int,
) -> None:
    """Sample k agrees with the representative `rep` on their first `shared` tokens by
    detection's rule (ids; masks from token 1; log-probs and advantages where trained)."""
    if k == rep:
        return
    a, b = int(tokens.offsets[k]), int(tokens.offsets[rep])
    long_enough = min(int(tokens.offsets[k + 1]) - a, int(tokens.offsets[rep + 1]) - b) >= shared
    ids = tokens.input_ids[a : a + shared], tokens.input_ids[b : b + shared]
    mask = tokens.loss_mask[a + 1 : a + shared], tokens.loss_mask[b + 1 : b + shared]
    lp = tokens.logprobs[a + 1 : a + shared], tokens.logprobs[b + 1 : b + shared]
    trained = mask[0] != 0
    same = (
        long_enough
        and np.array_equal(ids[0], ids[1])
        and np.array_equal(mask[0], mask[1])
        and np.array_equal(lp[0][trained], lp[1][trained])
        and (not trained.any() or advantage[k] == advantage[rep])
    )
    if not same:
        raise RolltoolError(
            f"step {step}: sample {int(rows_of[k])} no longer shares its first {shared} tokens "
            f"with sample {int(rows_of[rep])}, as the input's token pass found (the input "
            "changed while packing?)",
            hint="pack again from input that does not change",
        )
