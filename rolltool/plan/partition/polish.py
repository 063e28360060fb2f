"""Lockstep polish: lower slots' costliest micro-batches by moving or trading one sample.

A lockstep step costs Σ_j max_r cost(r, j): slot j waits for its costliest bin. ``polish`` takes
a slot's costliest bin b under one of three models (the planning model, and the same with its L²
term halved or doubled: real GPU time is never exactly the model) and looks at every move of
one of its samples x to another bin b2, and every swap of x with a sample y of another bin that
is cheaper under b's model (with ``pairs``, also with two samples of one bin, cheaper together),
that keeps both bins under the token cap and, when b2 is in another slot, raises that slot's
maximum under none of the models. Scored by the three models' lockstep costs, each relative to
its ideal: a step must not raise the planning model's and must lower their sum; the best such
step is applied (lowest sum).
The slots' steps are found together and applied in rounds (see ``polish``). The micro-batch
count, the cap and every sample's presence are unchanged; the planning model's lockstep cost
never rises, in exact sums of the float64 costs (where those sum with rounding, a step must
lower it by more than the rounding could hide: ``rounding_bound``).

Example (dp 2, cost = L, cap 10): slots {6, 3 | 2} (9 | 2) and {5 | 4} (5 | 4) step in
9 + 5 = 14; moving 3 to its slot's other bin gives {6 | 2, 3} (6 | 5): 6 + 5 = 11. Then 6 can
go nowhere (it would raise the other slot's 5, or pass the cap), nor can 5: the polish stops.

Trading x for a pair is what evens slots of bins full to the cap whose costs differ by their
leaders' L² (agent steps): the costliest bin gives a long sample for two whose tokens sum to a
little less, a few tokens of a·L for b·L², which no one-sample move or swap out of it reaches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rolltool.util.ranges import concat_ranges

__all__ = ["ROBUST_SCALES", "polish", "rest_max", "robust_models", "rounding_bound"]

ROBUST_SCALES = (0.5, 2.0)
"""The L² coefficient's factors the polish also scores a step under (besides 1.0)."""


def robust_models(cost: np.ndarray, quad: np.ndarray) -> np.ndarray:
    """``[K, n]``: each sample's planning ``cost``, then the same with its L² part ``quad``
    scaled by each of ``ROBUST_SCALES`` (the models a lockstep step is scored under)."""
    return np.stack([cost, *(cost + (f - 1.0) * quad for f in ROBUST_SCALES)])


SLACK_TIERS = np.array([4, 16, 64, 256, 1024, 4096])
"""Bounds on a bin's free tokens that group the bins when pairs are listed: a pair can take
x's place only if its bin has room for x's extra tokens, so each group's window around x's
length is as wide as that group's largest room, not the roomiest bin's (a few bins of the last
slots are nearly empty)."""


def polish(
    labels: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    quad: np.ndarray,
    *,
    dp: int,
    m: int,
    cap: int,
    max_rounds: int,
    max_work: int,
    pairs: bool = False,
) -> np.ndarray:
    """Improve ``labels`` (``[n]`` bin of each sample, bin ``j·dp + r`` is rank r's micro-batch
    j); returns new labels. ``cost``: ``[n]`` planning cost, ``quad``: ``[n]`` its L² part (the
    robustness models add ``(f - 1)·quad``). ``pairs``: also trade a sample for two of one bin
    (more candidates; ``_polish_grid`` runs it after the one-sample polish, from its result).

    Works in rounds: every slot not known to be stuck offers its best step (all found at once,
    against the round's starting point), and the steps are applied best first, each only if no
    step before it in the round touched its slots (so each one's score stays exact). Stops after
    ``max_rounds``, once the candidates looked at number ``max_work``, or when every slot is
    stuck (it offered no step since one of its bins last changed)."""
    lab = labels.copy()
    nb = dp * m
    if len(lab) == 0 or dp < 2 or m == 0:
        return lab
    w = robust_models(cost, quad)  # [K, n]
    if not (w.sum(axis=1) > 0).all():  # samples that cost nothing: no score is defined
        return lab
    tol = rounding_bound(w)
    stuck = np.zeros(m, dtype=bool)
    for _ in range(max_rounds):
        if max_work <= 0 or stuck.all():
            break
        # the bins' costs summed afresh each round: their rounding never accumulates
        c = np.stack([np.bincount(lab, weights=wk, minlength=nb) for wk in w])  # [K, nb]
        t = np.bincount(lab, weights=length, minlength=nb)
        slots = np.flatnonzero(~stuck)
        steps, work = _best_steps(w, c, t, lab, length, slots, dp, m, cap, pairs, tol)
        max_work -= work
        stuck[slots] = True
        touched: set[int] = set()
        for _, j, x, y, y2, b2 in steps:
            j2 = b2 // dp
            if j in touched or j2 in touched:
                continue
            touched.update((j, j2))
            ys = [i for i in (y, y2) if i >= 0]
            lab[ys] = lab[x]
            lab[x] = b2
        if not touched:
            break
        stuck[list(touched)] = False
    return lab


def _best_steps(
    w: np.ndarray,
    c: np.ndarray,
    t: np.ndarray,
    lab: np.ndarray,
    length: np.ndarray,
    slots: np.ndarray,
    dp: int,
    m: int,
    cap: int,
    pairs: bool,
    tol: np.ndarray,
) -> tuple[list[tuple[float, int, int, int, int, int]], int]:
    """For each of ``slots``, its best step out of one of its costliest bins (one per model)
    as (score, slot, x, y or -1, y2 or -1, x's new bin), best score first; and the candidates
    looked at. The pairs (``pairs``) come after the one-sample steps, which win ties. ``tol``:
    ``[K]`` the models' ``rounding_bound``: a slot's maximum counts as risen unless it is at
    least that far below where it was (0 where the costs sum exactly).

    The head's own model filters first (token cap, x costlier than y, no rise in another
    slot); the three models score the candidates left, each relative to its ideal."""
    k, nb = c.shape
    s = c.reshape(k, m, dp)
    heads, model = slot_heads(s, slots, dp)
    is_head = np.zeros(nb, dtype=bool)
    is_head[heads] = True
    hx = np.flatnonzero(is_head[lab])  # samples in a head bin
    hi = np.searchsorted(heads, lab[hx])  # which head (heads are sorted and distinct)
    # candidates: each head sample x with every bin that has room for it (a move) and every
    # sample y shorter than x by at most the most room any bin has (costs grow with length, so
    # only a shorter y makes x's bin cheaper, and x's new bin must take x - y more tokens)
    sx, ys = _swaps(hx, length, cap - t.min())
    mx, mb = _moves(hx, length, cap - t)
    x = np.concatenate([hx[sx], hx[mx]])
    y = np.concatenate([ys, np.full(len(mx), -1)])
    b2 = np.concatenate([lab[ys], mb])
    hi = np.concatenate([hi[sx], hi[mx]])
    y2 = np.full(len(x), -1)
    if pairs:
        px, p0, p1, pb = _pair_trades(lab, length, hx, cap - t)
        x, y, y2 = np.concatenate([x, px]), np.concatenate([y, p0]), np.concatenate([y2, p1])
        b2 = np.concatenate([b2, pb])
        hi = np.concatenate([hi, np.searchsorted(heads, lab[px])])
    hb, q = heads[hi], model[hi]
    work = len(x)
    ty = _members_sum(lambda i: length[i], y, y2)
    tx = length[x]
    dq = w[q, x] - _members_sum(lambda i: w[q, i], y, y2)
    j = hb // dp
    j2 = b2 // dp
    top = s.max(axis=2)  # [K, m]
    ok = (b2 != hb) & (dq > 0) & (t[hb] - tx + ty <= cap) & (t[b2] - ty + tx <= cap)
    ok &= (j2 == j) | (c[q, b2] + dq <= top[q, j2])
    x, y, y2, hb, b2, j, j2 = x[ok], y[ok], y2[ok], hb[ok], b2[ok], j[ok], j2[ok]
    if len(x) == 0:
        return [], work
    dx = w[:, x] - _members_sum(lambda i: w[:, i], y, y2)  # [K, cand]
    cb = c[:, hb] - dx
    cb2 = c[:, b2] + dx
    same = j2 == j
    rest = rest_max(s, j, hb - j * dp, np.where(same, b2 - j * dp, -1))
    new_j = np.maximum(rest, np.where(same, np.maximum(cb, cb2), cb))
    # another slot's maximum rises in no model (by more than rounding could hide)
    fits = same | (cb2 <= top[:, j2] - tol[:, None]).all(axis=0)
    delta = new_j - top[:, j]  # [K, cand]
    ideal = c.sum(axis=1, keepdims=True) / dp
    total = (delta / ideal).sum(axis=0)
    good = np.flatnonzero(fits & (delta[0] <= -tol[0]) & (total < -1e-12))
    if len(good) == 0:
        return [], work
    pick = good[np.lexsort((total[good], j[good]))]  # by slot, best first
    firsts = pick[np.r_[True, j[pick][1:] != j[pick][:-1]]]
    firsts = firsts[np.argsort(total[firsts], kind="stable")]
    return [
        (float(total[i]), int(j[i]), int(x[i]), int(y[i]), int(y2[i]), int(b2[i]))
        for i in firsts.tolist()
    ], work


def _swaps(hx: np.ndarray, length: np.ndarray, most_room: float) -> tuple[np.ndarray, np.ndarray]:
    """Each (i, y) with y shorter than sample ``hx[i]`` by at most ``most_room``, by i then y's
    length."""
    by_len = np.argsort(length, kind="stable")
    lo = np.searchsorted(length[by_len], length[hx] - most_room, side="left")
    span = np.searchsorted(length[by_len], length[hx], side="left") - lo
    return np.repeat(np.arange(len(hx)), span), by_len[concat_ranges(lo, span)]


def _moves(hx: np.ndarray, length: np.ndarray, slack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each (i, bin) where bin has room for sample ``hx[i]``, by i then bin: of the bins, full to
    the cap in agent steps, few take a head's sample, and listing only those saves most of the
    ``len(hx)·bins`` moves."""
    by_room = np.argsort(slack, kind="stable")
    k = len(slack) - np.searchsorted(slack[by_room], length[hx], side="left")  # bins with room
    i = np.repeat(np.arange(len(hx)), k)
    bins = by_room[concat_ranges(len(slack) - k, k)]
    order = np.lexsort((bins, i))
    return i[order], bins[order]


def _members_sum(
    get: Callable[[np.ndarray], np.ndarray], y: np.ndarray, y2: np.ndarray
) -> np.ndarray:
    """``get(y) + get(y2)`` per candidate, where a member of -1 (none) adds 0."""
    first = np.where(y >= 0, get(np.maximum(y, 0)), 0)
    return first + np.where(y2 >= 0, get(np.maximum(y2, 0)), 0)


def _pair_trades(
    lab: np.ndarray, length: np.ndarray, hx: np.ndarray, slack: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate trades of a head sample (``hx``) for two samples of one other bin that fit:
    ``[cand]`` x, the two samples and their bin. A pair can take x's place only if its tokens
    are within x's bin's slack above x's length and within its own bin's slack below it: a
    window over the pairs sorted by tokens, per group of bins (``SLACK_TIERS``), exact on the
    first side and checked on the second later."""
    order = np.argsort(lab, kind="stable")
    sb = lab[order]
    firsts, seconds = [], []
    for d in range(1, len(order)):
        same = sb[d:] == sb[:-d]
        if not same.any():
            break
        firsts.append(order[:-d][same])
        seconds.append(order[d:][same])
    p0 = np.concatenate([np.zeros(0, dtype=np.int64), *firsts])
    p1 = np.concatenate([np.zeros(0, dtype=np.int64), *seconds])
    pb = lab[p0]
    pt = length[p0] + length[p1]
    tier = np.digitize(slack[pb], SLACK_TIERS)
    hi = length[hx] + slack[lab[hx]]
    out = []
    for k in np.unique(tier).tolist():
        pool = np.flatnonzero(tier == k)
        pool = pool[np.argsort(pt[pool], kind="stable")]
        lo = np.searchsorted(pt[pool], length[hx] - slack[pb[pool]].max(), side="left")
        span = np.maximum(np.searchsorted(pt[pool], hi, side="right") - lo, 0)
        at = pool[concat_ranges(lo, span)]
        out.append((np.repeat(hx, span), at))
    px = np.concatenate([np.zeros(0, dtype=np.int64), *(o[0] for o in out)])
    at = np.concatenate([np.zeros(0, dtype=np.int64), *(o[1] for o in out)])
    return px, p0[at], p1[at], pb[at]


def slot_heads(s: np.ndarray, slots: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's costliest bin under each model, without repeats (sorted), and the first
    model under which it is the costliest."""
    k = s.shape[0]
    bins = (slots[None, :] * dp + np.argmax(s[:, slots, :], axis=2)).ravel()  # model-major
    models = np.repeat(np.arange(k), len(slots))
    heads, first = np.unique(bins, return_index=True)
    return heads, models[first]


def rest_max(s: np.ndarray, j: np.ndarray, p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
    """``[K, cand]``: per model, the costliest bin of slot ``j`` other than positions ``p1``
    and ``p2`` (-1: none), from the slot's three costliest bins (-inf where none is left)."""
    k, m, dp = s.shape
    padded = np.concatenate([s, np.full((k, m, max(0, 3 - dp)), -np.inf)], axis=2)
    order = np.argsort(-padded, axis=2, kind="stable")[:, :, :3]  # [K, m, 3]
    vals = np.take_along_axis(padded, order, axis=2)
    o, v = order[:, j, :], vals[:, j, :]  # [K, cand, 3]
    free = (o != p1[None, :, None]) & (o != p2[None, :, None])
    first = np.argmax(free, axis=2)  # the first of the three left free (one always is)
    return np.take_along_axis(v, first[:, :, None], axis=2)[:, :, 0]


def rounding_bound(w: np.ndarray) -> np.ndarray:
    """``[K]`` per model (``w``: ``[K, n]`` each sample's cost): how far a lockstep cost's
    change computed in float64 from these costs (bin sums, a trade's subsets, their
    differences, the slots' maxima) may lie from the true one, that of the exact sums of the
    same float64 values. 0 where every computation is exact: every cost a multiple of one
    power of two u and Σ|w| at most 2^52·u, so every sum of costs and every difference of two
    such sums is a whole number of u below 2^53·u (FLOPs and token costs: whole numbers, or
    halves for the L² ×0.5 model, so the plans are those an exact search makes). Otherwise
    (calibrated seconds, say) ``16·(n + 4)·ε·Σ|w|`` (ε = 2^-53): a change's few terms each err
    by at most n·ε·Σ|w| (the sequential sum of a bin's costs, which every sum it takes part in
    inherits) plus ε of its size; a change is then taken as a rise unless it is at most
    minus the bound, which only refuses (~1e-12 of the ideal, against ``MIN_GAIN`` 1e-6).

    Example: costs [0.1, 0.2, 0.3] (none a multiple of a power of two that sums exactly:
    0.1 + 0.2 is 0.30000000000000004 in float64) give a bound > 0; [3, 5, 0.5] give 0."""
    n = w.shape[1]
    mag = np.abs(w).sum(axis=1)
    mant, exp = np.frexp(w)  # w = mant·2^exp, |mant| in [0.5, 1): mant·2^53 is a whole number
    whole = np.abs(mant * 2.0**53).astype(np.int64)
    low = np.log2(whole & -whole, where=whole > 0, out=np.full(w.shape, np.inf))  # trailing zeros
    unit = np.min(exp - 53 + low, axis=1, initial=np.inf)  # the largest u = 2^unit dividing all
    exact = (mag == 0) | (mag <= np.exp2(np.minimum(unit + 52, 1023.0)))
    return np.where(exact, 0.0, 16.0 * (n + 4) * 2.0**-53 * mag)
