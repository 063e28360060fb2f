"""Lockstep re-split: trade samples between a slot's costliest bin and any other bin at once.

A lockstep step costs Σ_j max_r cost(r, j): slot j waits for its costliest bin. Where the bins
are full to the token cap and a slot's bins differ by their leaders' L² (agent steps, cost ≈
a·tokens + b·ΣL²), ``polish`` stops at a local optimum: evening such a slot takes shorter
partners for its costliest bin h and tokens moved between slots, several samples at once.
``resplit`` pairs h with every other bin b, of its slot or of another, and tries every trade of
up to ``MAX_MOVED`` samples of h (a set X) for up to as many of b (a set Y) that keeps both
bins under the cap: h becomes h - X + Y, b becomes b - Y + X. It generalizes the polish's steps
(a move is X = {x}, Y = {}; a swap X = {x}, Y = {y}; a pair trade Y = {y, y'}). Once that is
stuck, a second pass from there trades up to three samples each way between small bins
(``PASSES``).

A trade is scored like the polish's steps: the lockstep cost's change under the planning model
and the same with its L² term halved and doubled (real GPU time is never exactly the model),
each relative to its ideal. A trade must not raise the planning model's, must lower their sum
by ``MIN_GAIN``, and may let b's slot rise by less than h's slot falls. The trades applied
never raise any of the three models' cost above where the re-split started (each model's
changes so far are summed, and a trade that would take one above zero is skipped), so its
result is never costlier than its input under any of them, in exact sums of the float64 costs:
where these sum with rounding (not whole numbers of a power of two, as calibrated seconds), a
trade counts as a rise unless its change is below minus the rounding's bound
(``polish.rounding_bound``, 0 for FLOPs and token costs).

Every pair's trades are found at once: each bin's subsets of up to ``MAX_MOVED`` samples are
listed with their tokens and costs, sorted by (bin, planning cost); for h's subset X, the
trades with b that can keep the planning cost from rising have w(Y) - w(X) in a window (see
``_windows``), found by binary search; the token cap and the exact scores are checked after,
``CHUNK`` candidates at a time (a round's memory is bounded, however many it looks at).

Example (dp 2, cost = L², cap 10): slots {2 | 4} (4 | 16) and {5 | 4} (25 | 16) step in 16 + 25
= 41. The polish moves nothing: the 4 would raise the other slot's maximum (to 81 beside the 5,
to 32 beside the 4). The re-split trades it anyway, to the other 4 (16 down, 7 up):
{2 | -} and {5 | 4, 4} step in 4 + 32 = 36; then the 2 joins the 5 (29, under 32): 0 + 32.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from rolltool.plan.partition.polish import rest_max, robust_models, rounding_bound, slot_heads
from rolltool.util.ranges import concat_ranges

__all__ = ["MAX_BIN", "MAX_MOVED", "MIN_GAIN", "PASSES", "resplit"]

MAX_MOVED = 2
"""Samples a trade takes out of each bin: subsets of up to this many (529 of a bin of 32)."""

MAX_BIN = 32
"""Bins of more samples than this take no part (their subsets would crowd the search)."""

PASSES: tuple[tuple[int, int, int | None], ...] = ((MAX_MOVED, MAX_BIN, None), (3, 12, 6))
"""The re-split's passes, each from where the one before stopped: (samples a trade takes out
of each bin, largest bin that takes part, most rounds; None: ``max_rounds``). Trades of three
samples, after the two-sample pass is stuck, take 2 of `benchmarks/lockstep.py`'s 12 agent
steps over 1.003 under it, just (σ 0.6 seed 14: 1.00307 -> 1.00300, σ 0.8 seed 9: 1.00303 ->
1.00299), and lower the planning model's cost of 120 of the 140 (mean -1.7e-5), for 35-45 ms
more a step at σ 0.6-0.8 (`lockstep_time.py`: the re-split 68-147 -> 102-184 ms) in 6 rounds
(3 rounds: neither under; 10 or 40: the same two). Run from the start instead, trades of three
end costlier than the two-sample pass on half of σ 0.6-0.8's steps under some model."""

MIN_GAIN = 1e-6
"""A trade must lower the sum of the three models' lockstep overheads by at least this: on the
benchmark's agent steps, trades worth less add rounds (2-3× the time) for 1e-4 at most."""


MAX_WORK = 1 << 24
"""Candidate trades a re-split may look at in all (its time grows with them; its memory does
not, see ``CHUNK``): it stops before a round that would pass it. `benchmarks/lockstep.py`'s
agent steps look at 0.2-1.2 M, the largest of `plan_hashes.py`'s mixed steps (dp 16 x 256) at
10 M."""

CHUNK = 1 << 17
"""Candidate trades listed and scored at once (``_best_trades``). Each holds ~300-500 bytes
while scored, so a round holds ~50 MB however many it looks at: a re-split of dp 16 x 32 bins
of 8 samples dealt at random looks at ~10 M in its first round, which held 2.2 GB when they
were scored all at once. Its time hardly depends on the size (2^15-2^19: within 10%)."""


WIDTH_TIERS = 4.0 ** np.arange(-16, 1)
"""Bounds on the width of a (bin, subset)'s interval of planning cost (the bin's room below its
slot's maximum plus its gap above the slot's other bins), relative to the costliest slot, that
group the bins for the search (``_windows``): each group's window is as wide as its widest."""


def resplit(
    labels: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    quad: np.ndarray,
    *,
    dp: int,
    m: int,
    cap: int,
    max_rounds: int,
    max_work: int = MAX_WORK,
    passes: tuple[tuple[int, int, int | None], ...] = PASSES,
) -> np.ndarray:
    """Improve ``labels`` (``[n]`` bin of each sample, bin ``j·dp + r`` is rank r's micro-batch
    j); returns new labels. ``cost``: ``[n]`` planning cost, ``quad``: ``[n]`` its L² part (the
    robustness models add ``(f - 1)·quad``). Bins must already be within ``cap`` tokens.

    Works in ``passes`` (``PASSES``), each from the last one's result, and each in rounds: each
    slot not known to be stuck pairs its costliest bin (under each model) with every other
    bin, every pair offers its best trade (all found at once, against the round's starting
    point), and the trades are applied best first, each only if no trade before it in the
    round touched its slots (so its score stays exact) and it keeps every model at or below
    where the pass started. A slot is stuck once it offers nothing (or only trades the models'
    sums refuse) until one of its bins changes. A pass stops after ``max_rounds``, when a round
    applies nothing, or before a round that would take the candidate trades looked at in all
    past ``max_work``."""
    lab = labels.copy()
    if len(lab) == 0 or dp < 2 or m == 0:
        return lab
    w = robust_models(cost, quad)  # [K, n]
    if not (w.sum(axis=1) > 0).all():  # samples that cost nothing (zero lengths): no score
        return lab
    copies = 1
    if len(w) == 3 and (w[1:] == w[0]).all():  # no L² term (tokens, count): one model, 3 times
        w, copies = w[:1], len(w)
    for moved, most, rounds in passes:
        rounds = max_rounds if rounds is None else min(rounds, max_rounds)
        lab, max_work = _rounds(lab, length, w, dp, m, cap, rounds, max_work, moved, most, copies)
    return lab


def _rounds(
    lab: np.ndarray,
    length: np.ndarray,
    w: np.ndarray,
    dp: int,
    m: int,
    cap: int,
    max_rounds: int,
    max_work: int,
    moved: int,
    most: int,
    copies: int = 1,
) -> tuple[np.ndarray, int]:
    """One pass of ``resplit`` (trades of up to ``moved`` samples each way, bins of at most
    ``most`` taking part): the labels (a copy) and the budget of candidates left. ``copies``:
    how many equal models ``w``'s one row stands for (`_best_trades`)."""
    lab = lab.copy()
    nb = dp * m
    ideal = w.sum(axis=1) / dp
    tol = rounding_bound(w)  # [K]: 0 where the costs sum exactly (FLOPs, tokens)
    spent = np.zeros(len(w))  # each model's lockstep change so far, plus tol per trade
    stuck = np.zeros(m, dtype=bool)
    cache: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [(_NONE, w[:, :0], _NONE)] * nb
    dirty = np.arange(nb)
    for _ in range(max_rounds):
        if stuck.all():
            break
        c = np.stack([np.bincount(lab, weights=wk, minlength=nb) for wk in w])  # [K, nb]
        t = np.bincount(lab, weights=length, minlength=nb).astype(np.int64)
        slots = np.flatnonzero(~stuck)
        members = np.argsort(lab, kind="stable")
        start = np.r_[0, np.cumsum(np.bincount(lab, minlength=nb))]
        subsets = _subsets(members, start, length, w, cache, dirty, moved, most)
        heads = _heads(c, slots, dp)  # each slot's costliest bins
        found = _best_trades(heads, subsets, w, c, t, ideal, dp, cap, max_work, tol=float(tol[0]),
                             copies=copies)  # fmt: skip
        if found is None:
            break
        h, b, score, delta, x_mask, y_mask, work = found
        max_work -= work
        good = np.flatnonzero(score <= -MIN_GAIN)
        good = good[np.argsort(score[good], kind="stable")]
        stuck[slots] = True
        touched: set[int] = set()
        changed: list[int] = []
        for i in good.tolist():
            j, j2 = int(h[i]) // dp, int(b[i]) // dp
            if j in touched or j2 in touched:
                stuck[j] = False  # offered a trade; try again next round
                continue
            if (spent + delta[:, i] + tol > 0).any():  # some model would end above its start
                continue
            spent += delta[:, i] + tol  # the change's rounding may hide up to tol of a rise
            touched.update((j, j2))
            changed += [int(h[i]), int(b[i])]
            hm = members[start[h[i]] : start[h[i] + 1]]
            bm = members[start[b[i]] : start[b[i] + 1]]
            x, y = hm[_bits(int(x_mask[i]), len(hm))], bm[_bits(int(y_mask[i]), len(bm))]
            lab[x] = b[i]
            lab[y] = h[i]
        if not touched:
            break
        stuck[list(touched)] = False
        dirty = np.unique(changed)
    return lab, max_work


def _heads(c: np.ndarray, slots: np.ndarray, dp: int) -> np.ndarray:
    """Each of ``slots``' costliest bins under each model, without repeats (sorted): the
    polish's `slot_heads` of the ``[K, nb]`` bin costs."""
    k, nb = c.shape
    return slot_heads(c.reshape(k, nb // dp, dp), slots, dp)[0]


class _Subsets(NamedTuple):
    """Each bin's subsets of up to a pass's samples moved, sorted by (bin, planning cost)."""

    bin: np.ndarray  # [S] int64: the bin
    tokens: np.ndarray  # [S] int64
    cost: np.ndarray  # [K, S] float64: per model
    mask: np.ndarray  # [S] int64: bit i = the bin's i-th sample (in bin order) is in it
    first: np.ndarray  # [nb + 1] int64: where each bin's subsets start
    key: np.ndarray  # [S] float64: bin·span + cost - base, ascending
    span: float  # wider than any two subsets' planning costs differ
    base: float  # the least planning cost of a subset


def _subsets(
    members: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    w: np.ndarray,
    cache: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    dirty: np.ndarray,
    moved: int = MAX_MOVED,
    most: int = MAX_BIN,
) -> _Subsets:
    """Each bin's subsets of up to ``moved`` samples (bins of at most ``most``): bin
    ``i``'s samples are ``members[start[i]:start[i + 1]]``, in that order for the masks.
    ``cache[i]``: bin i's (tokens, costs, masks) sorted by planning cost, rebuilt for the
    ``dirty`` bins (those whose samples changed) and kept for the others."""
    nb = len(start) - 1
    size = np.diff(start)
    for k in np.unique(size[dirty]).tolist():
        bins = dirty[size[dirty] == k]
        if k > most:
            for i in bins.tolist():
                cache[i] = (_NONE, np.zeros((len(w), 0)), _NONE)
            continue
        at = members[start[bins][:, None] + np.arange(k)]  # [B, k]
        mask = _small_masks(k, moved)
        bits = ((mask[:, None] >> np.arange(k)) & 1).astype(np.float64)  # [S, k]
        tok = np.rint(length[at].astype(np.float64) @ bits.T).astype(np.int64)  # [B, S]
        cw = np.stack([wk[at] @ bits.T for wk in w])  # [K, B, S]
        by_cost = np.argsort(cw[0], axis=1, kind="stable")  # [B, S]
        for r, i in enumerate(bins.tolist()):
            o = by_cost[r]
            cache[i] = (tok[r, o], cw[:, r, o], mask[o])
    count = np.array([len(e[0]) for e in cache], dtype=np.int64)
    first = np.r_[0, np.cumsum(count)]
    sb = np.repeat(np.arange(nb), count)
    st = np.concatenate([e[0] for e in cache])
    sw = np.concatenate([e[1] for e in cache], axis=1)
    sm = np.concatenate([e[2] for e in cache])
    base = float(sw[0].min(initial=0.0))
    span = 2.0 * (float(sw[0].max(initial=0.0)) - base) + 1.0
    return _Subsets(sb, st, sw, sm, first, sb * span + (sw[0] - base), span, base)


_NONE = np.zeros(0, dtype=np.int64)


@functools.cache
def _small_masks(k: int, moved: int = MAX_MOVED) -> np.ndarray:
    """Bit masks of the subsets of ``k`` items with at most ``moved`` members, ascending."""
    out = [np.zeros(1, dtype=np.int64)]
    last = np.zeros(1, dtype=np.int64)
    for _ in range(moved):  # each subset grows by one bit above its highest
        top = np.array([int(v).bit_length() for v in last], dtype=np.int64)
        grow = k - top
        base = np.repeat(last, grow)
        bit = concat_ranges(top, grow)
        last = base | (1 << bit)
        out.append(last)
    return np.unique(np.concatenate(out))


def _best_trades(
    heads: np.ndarray,
    sub: _Subsets,
    w: np.ndarray,
    c: np.ndarray,
    t: np.ndarray,
    ideal: np.ndarray,
    dp: int,
    cap: int,
    max_work: int,
    chunk: int = CHUNK,
    tol: float = 0.0,
    copies: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """Each pair (h of ``heads``, another bin b) that has a trade lowering the score, with its
    best: ``[P]`` h, b, score (the sum over models of the lockstep cost's change, each relative
    to its ideal), ``[K, P]`` the changes, the trade's subsets as masks over h's and b's
    samples (``_Subsets.mask``), and the candidates looked at; None if they would be more than
    ``max_work``. The candidates are listed and scored about ``chunk`` at a time (``CHUNK``),
    each chunk's best per pair kept with the best so far; ties go to the candidate listed
    first, as if all were scored at once. A trade raises the planning model unless its
    change is at most ``-tol`` (its ``rounding_bound``: 0 where the costs sum exactly).
    ``copies``: ``w`` is one row standing for that many equal models (no L² term): the score
    is its change times ``copies``, bit for bit the sum over three equal models (x + x is
    exact, so (x + x) + x and 3·x are both 3x rounded once), so the same trades win."""
    k, nb = c.shape
    s = c.reshape(k, nb // dp, dp)
    top = s.max(axis=2)  # [K, m]
    slot = np.arange(nb) // dp
    rest = rest_max(s, slot, np.arange(nb) % dp, np.full(nb, -1))  # [K, nb]: slot's max without
    room = top[:, slot] - c  # [K, nb]: how far below its slot's maximum
    gap = top[:, slot] - rest  # [K, nb]: how far above the rest of its slot (0: not its max)
    windows = _windows(heads, sub, c[0], room[0], gap[0], top[0], dp)
    work = sum(int(seg.n.sum()) for seg in windows)
    if work > max_work:
        return None
    best = _Found(_NONE, _NONE, _NONE, _NONE, np.zeros((k, 0)), np.zeros(0))
    for ch, cb, cx, cy in _listed(windows, sub, slot, chunk):
        dt = sub.tokens[cy] - sub.tokens[cx]  # h's change in tokens
        fits = (t[ch] + dt <= cap) & (t[cb] - dt <= cap)
        ch, cb, cx, cy = ch[fits], cb[fits], cx[fits], cy[fits]
        d = np.zeros((k, len(ch)))
        for q in range(k):  # the planning model first: most candidates raise it, dropped at once
            dw = sub.cost[q, cy] - sub.cost[q, cx]
            d[q] = _change(c[q], top[q], rest[q], s[q], ch, cb, dw, dp)
            if q == 0:
                keep = d[0] <= -tol
                ch, cb, cx, cy, d = ch[keep], cb[keep], cx[keep], cy[keep], d[:, keep]
        total = (d / ideal[:, None]).sum(axis=0)
        if copies > 1:
            total *= copies
        lower = total < 0  # only these can be a pair's best
        found = _Found(ch[lower], cb[lower], cx[lower], cy[lower], d[:, lower], total[lower])
        best = _per_pair(best, found, nb)
    return (best.h, best.b, best.total, best.d, sub.mask[best.x], sub.mask[best.y],
            work)  # fmt: skip


class _Found(NamedTuple):
    """Candidate trades: ``[P]`` h, b, X and Y (subset indices), ``[K, P]`` each model's
    change, ``[P]`` the score."""

    h: np.ndarray
    b: np.ndarray
    x: np.ndarray
    y: np.ndarray
    d: np.ndarray
    total: np.ndarray


def _per_pair(before: _Found, more: _Found, nb: int) -> _Found:
    """Each pair (h, b)'s best trade (lowest score) of ``before`` then ``more``, the first
    listed among equals, by pair."""
    f = _Found(*(np.concatenate([a, b], axis=-1) for a, b in zip(before, more, strict=True)))
    pair = f.h * nb + f.b
    by = np.lexsort((f.total, pair))  # per pair, its best trade first
    best = by[np.r_[True, pair[by][1:] != pair[by][:-1]]] if len(by) else by
    return _Found(*(a[..., best] for a in f))


class _Segment(NamedTuple):
    """Queries (h, X) and, per query, the window of candidate subsets Y: ``pool[lo : lo + n]``
    (``pool`` None: the subsets ``lo : lo + n`` themselves, all of b's, in h's slot), to keep
    where the subset's interval reaches ``floor`` (``upper[Y] >= floor``; None: keep all)."""

    h: np.ndarray  # [Q] the head bin
    x: np.ndarray  # [Q] X, a subset index
    lo: np.ndarray  # [Q]
    n: np.ndarray  # [Q]
    pool: np.ndarray | None
    floor: np.ndarray | None  # [Q]
    upper: np.ndarray | None  # [S]


def _listed(
    segments: list[_Segment], sub: _Subsets, slot: np.ndarray, chunk: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The candidate trades of ``segments`` (h, b, X, Y), in order, in pieces of about
    ``chunk`` (whole queries, of one segment or several: at least one, however many candidates
    it has): the other slots' bins kept where Y's interval reaches the query's window and b
    is in another slot."""
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    room = chunk
    for seg in segments:
        ends = np.cumsum(seg.n)
        a, done = 0, 0
        while done < (int(ends[-1]) if len(ends) else 0):
            z = max(int(np.searchsorted(ends, done + room, side="right")), a + 1)
            n = seg.n[a:z]
            cq = np.repeat(np.arange(a, z), n)
            at = concat_ranges(seg.lo[a:z], n)
            cy = at if seg.pool is None else seg.pool[at]
            cb = sub.bin[cy]
            ch = seg.h[cq]
            if seg.floor is not None and seg.upper is not None:
                ok = (slot[cb] != slot[ch]) & (seg.upper[cy] >= seg.floor[cq])
                cq, cy, cb, ch = cq[ok], cy[ok], cb[ok], ch[ok]
            pieces.append((ch, cb, seg.x[cq], cy))
            room -= int(ends[z - 1]) - done
            a, done = z, int(ends[z - 1])
            if room <= 0:
                yield _joined(pieces)
                pieces, room = [], chunk
    if pieces:
        yield _joined(pieces)


def _joined(
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces' (h, b, X, Y) laid end to end, in order."""
    if len(pieces) == 1:
        return pieces[0]
    ch, cb, cx, cy = (np.concatenate([p[i] for p in pieces]) for i in range(4))
    return ch, cb, cx, cy


def _windows(
    heads: np.ndarray,
    sub: _Subsets,
    c0: np.ndarray,
    room: np.ndarray,
    gap: np.ndarray,
    top: np.ndarray,
    dp: int,
) -> list[_Segment]:
    """Candidate trades (h, b, X, Y as subset indices) that may keep the planning model's
    lockstep cost from rising, from its ``[nb]`` bin costs ``c0``, rooms, gaps and ``[m]`` slot
    maxima ``top``, as windows over the subsets per query (h, X) (``_listed`` lists them). A
    trade changes h's cost by D = w(Y) - w(X) and b's by -D.

    b in h's slot j: both bins must stay at most the slot's maximum, D in [-room_b, room_h].
    b in another slot: the two slots' maxima, now top_j + top_j2, become at least c_h + D +
    top_j2 - gap_b and top_j - gap_h + c_b - D, so D is in [-(room_b + gap_h), room_h + gap_b]:
    w(X) is within [w(Y) - gap_b - room_h, w(Y) + room_b + gap_h]. Each (b, Y) is an interval
    [w(Y) - gap_b, w(Y) + room_b] of the planning cost; the bins are grouped by its width
    (``WIDTH_TIERS``) so that each group is searched by its lower ends in one window per
    (h, X). The windows are widened by a margin for rounding: every candidate is checked
    exactly after. The windows' sizes (``_Segment.n``) are the candidates looked at, known
    before any is listed."""
    nb = len(c0)
    slot = np.arange(nb) // dp
    margin = 1e-9 * float(np.abs(sub.cost[0]).max(initial=1.0)) + 1.0
    nx = sub.first[heads + 1] - sub.first[heads]
    qh = np.repeat(heads, nx)  # queries: each head with each of its subsets X
    qx = concat_ranges(sub.first[heads], nx)
    wx = sub.cost[0, qx]
    # other slots: one window per width tier
    lower = sub.cost[0] - gap[sub.bin]
    width = room[sub.bin] + gap[sub.bin]
    upper = lower + width
    floor = wx - gap[qh] - margin
    tier = np.digitize(width, WIDTH_TIERS * float(top.max(initial=1.0)))
    out = []
    for k in np.unique(tier).tolist():
        pool = np.flatnonzero(tier == k)
        pool = pool[np.argsort(lower[pool], kind="stable")]
        most = float(width[pool].max())
        lo = np.searchsorted(lower[pool], wx - gap[qh] - most - margin, side="left")
        hi = np.searchsorted(lower[pool], wx + room[qh] + margin, side="right")
        out.append(_Segment(qh, qx, lo, hi - lo, pool, floor, upper))
    # h's own slot: every other bin, one window per (h, X, b)
    mate = (slot[heads][:, None] * dp + np.arange(dp)).ravel()
    mh = np.repeat(heads, dp)
    mh, mate = mh[mate != mh], mate[mate != mh]
    nx = sub.first[mh + 1] - sub.first[mh]
    mq, mb = np.repeat(mh, nx), np.repeat(mate, nx)
    mx = concat_ranges(sub.first[mh], nx)
    m_lo, m_hi = _bin_window(sub, mb, sub.cost[0, mx] - room[mb] - margin,
                             sub.cost[0, mx] + room[mq] + margin)  # fmt: skip
    out.append(_Segment(mq, mx, m_lo, m_hi - m_lo, None, None, None))
    return out


def _bin_window(
    sub: _Subsets, b: np.ndarray, lo_w: np.ndarray, hi_w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi)`` into the subsets: bin ``b``'s subsets whose planning cost is in [lo_w,
    hi_w], per query. One binary search for all: bin i's costs are offset into a band of
    their own, ``i·span`` (``_Subsets.key``)."""
    lo = np.searchsorted(sub.key, b * sub.span + (lo_w - sub.base), side="left")
    hi = np.searchsorted(sub.key, b * sub.span + (hi_w - sub.base), side="right")
    lo = np.clip(lo, sub.first[b], sub.first[b + 1])  # rounding never reaches another bin
    hi = np.clip(hi, lo, sub.first[b + 1])
    return lo, hi


def _change(
    c: np.ndarray,
    top: np.ndarray,
    rest: np.ndarray,
    s: np.ndarray,
    h: np.ndarray,
    b: np.ndarray,
    dw: np.ndarray,
    dp: int,
) -> np.ndarray:
    """The lockstep cost's change under one model when bin h's cost changes by ``dw`` and bin
    b's by ``-dw`` (``c`` [nb] bin costs, ``top`` [m] slot maxima, ``rest`` [nb] each bin's
    slot's maximum without it, ``s`` [m, dp] the bin costs by slot)."""
    j, j2 = h // dp, b // dp
    wh, wb = c[h] + dw, c[b] - dw
    out = np.maximum(rest[h], wh) + np.maximum(rest[b], wb) - top[j] - top[j2]
    same = np.flatnonzero(j == j2)
    if len(same):  # the slot's maximum without both bins
        hs, bs = h[same], b[same]
        rest2 = rest_max(s[None], j[same], hs % dp, bs % dp)[0]
        out[same] = np.maximum(rest2, np.maximum(wh[same], wb[same])) - top[j[same]]
    return out


def _bits(mask: int, k: int) -> np.ndarray:
    """``[k]`` bool: bit i of ``mask``."""
    return ((mask >> np.arange(k)) & 1).astype(bool)
