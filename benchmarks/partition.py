"""Partition engine benchmark: speed and quality of balance() and plan_step() against baselines.

Run:  python benchmarks/partition.py            (a few minutes; add --quick for a smoke run,
      --sections verl,primerl for some sections only)

Pinned to one core. Times are medians over repeats. Lengths come from
``rolltool.input.synth.synth_lengths`` (math 200-2k tokens, code 1k-8k, agent heavy-tailed to 32k).

Table 1, balance(weights = lengths, k): quality = heaviest part / lower bound, where the bound is
max(total/k, largest item), and with equal counts the largest item plus the n/k - 1 smallest.
Baselines written here: a straightforward heap-of-lists KK (lists concatenated at every merge)
and a plain-Python heap LPT.

Tables 2 and 3, plan_step(dp = 8, max_tokens = 32,768, 7B flops) in two regimes: "synth" (1,024
samples per rank from synth_lengths) and "agent" (128 per rank, log-normal lengths with median
6,000 tokens and sigma 1.0, clipped to [200, 32,768]). Lockstep
overhead = Σ_j max_r cost(r, j) / (Σ cost / dp), under the planning model and under the same model
with its L² coefficient ×0.5 and ×2 (robustness to a cost model that is off); for the baselines also "aligned", i.e. with each
rank's micro-batches re-sorted by cost (half of rolltool's alignment, given to them for free). Baselines: the peer's pipeline (ranks by
equal-size KK on its workload 24576·L + L², then per rank KK into ceil(tokens / cap) micro-batches,
the count synced to the max over ranks, more parts until the cap holds), LPT ranks then
first-fit decreasing per rank, and FFD bins dealt round-robin.

Then balance(auto) against verl's own karmarkar_karp (CPU-time medians, calls interleaved: three
of balance's to one of verl's, 45 and 15 up to 1,024 items, else 15 and 5; the 20x target applies
where verl's split is as light as auto's), and align="total" on prime-rl's own
randomized test against its prepare_batch (the port in tests/primerl_ref.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.plan.partition import balance, lower_bound, part_loads, plan_step
from rolltool.plan.workload import make_workload

try:
    from rolltool.input.synth import synth_lengths
except ImportError:  # the synth module is not there yet: a local stand-in for the same mix

    def synth_lengths(n: int, seed: int = 0, max_len: int = 32768) -> np.ndarray:
        rng = np.random.default_rng(seed)
        kind = rng.integers(0, 3, n)
        agent = np.minimum((rng.pareto(1.2, n) + 1) * 800, max_len)
        return np.where(
            kind == 0,
            rng.integers(200, 2001, n),
            np.where(kind == 1, rng.integers(1000, 8001, n), agent),
        ).astype(np.int64)


# ---------------------------------------------------------------- baselines (written here)


def heap_of_lists_kk(w: np.ndarray, k: int, equal_count: bool) -> list[list[int]]:
    """Textbook k-way KK: each partial partition is k [sum, items] lists, merged by concatenation."""
    idx = sorted(range(len(w)), key=lambda i: -w[i])
    ws = w.tolist()
    if equal_count:
        starts = [[[ws[i], [i]] for i in idx[b : b + k]] for b in range(0, len(idx), k)]
        for s in starts:
            s += [[0.0, []] for _ in range(k - len(s))]
    else:
        starts = [[[ws[i], [i]]] + [[0.0, []] for _ in range(k - 1)] for i in idx]
    heap = [(-(s[0][0] - s[-1][0]), n, s) for n, s in enumerate(starts)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = [[a[t][0] + b[k - 1 - t][0], a[t][1] + b[k - 1 - t][1]] for t in range(k)]
        merged.sort(key=lambda slot: -slot[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1
    return [slot[1] for slot in heap[0][2]]


def plain_lpt(w: np.ndarray, k: int, equal_count: bool) -> list[list[int]]:
    """Plain-Python LPT with a heap of (load, part); with equal counts full parts drop out."""
    order = sorted(range(len(w)), key=lambda i: -w[i])
    ws = w.tolist()
    cap = -(-len(w) // k) if equal_count else len(w)
    heap = [(0.0, p) for p in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, p = heap[0]
        parts[p].append(i)
        if len(parts[p]) < cap:
            heapq.heapreplace(heap, (load + ws[i], p))
        else:
            heapq.heappop(heap)
    return parts


def _ffd(lengths: np.ndarray, items: np.ndarray, cap: int) -> list[list[int]]:
    """Plain first-fit decreasing by tokens over ``items``."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(items.tolist(), key=lambda i: -lengths[i]):
        t = int(lengths[i])
        for b, r in enumerate(room):
            if r >= t:
                bins[b].append(i)
                room[b] -= t
                break
        else:
            bins.append([i])
            room.append(cap - t)
    return bins


def peer_pipeline(lengths: np.ndarray, dp: int, cap: int) -> list[list[list[int]]]:
    """Ranks by equal-size KK on 24576·L + L², then per-rank KK into ceil(tokens/cap) parts."""
    verl = make_workload("verl").cost(lengths)
    ranks = heap_of_lists_kk(verl, dp, equal_count=True)
    m = max(-(-int(lengths[r].sum()) // cap) for r in ranks)  # synced with all_reduce MAX
    while True:
        grid = []
        for r in ranks:
            parts = heap_of_lists_kk(verl[r], m, equal_count=False) if r else [[] for _ in range(m)]
            grid.append([[r[i] for i in p] for p in parts])
        if all(lengths[mb].sum() <= cap for row in grid for mb in row):
            return grid
        m += 1  # since 0.9.1: more parts until the cap holds


def lpt_then_ffd(lengths: np.ndarray, dp: int, cap: int, cost: np.ndarray) -> list[list[list[int]]]:
    ranks = plain_lpt(cost, dp, equal_count=False)
    grid = [_ffd(lengths, np.array(r, dtype=np.int64), cap) for r in ranks]
    m = max(len(row) for row in grid)
    return [row + [[] for _ in range(m - len(row))] for row in grid]


def ffd_round_robin(lengths: np.ndarray, dp: int, cap: int) -> list[list[list[int]]]:
    bins = _ffd(lengths, np.arange(len(lengths)), cap)
    m = -(-len(bins) // dp)
    bins += [[] for _ in range(m * dp - len(bins))]
    return [[bins[j * dp + r] for j in range(m)] for r in range(dp)]


# ---------------------------------------------------------------- measuring


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall time in milliseconds over ``repeats`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out


def grid_numbers(
    grid: list[list[list[int]]], lengths: np.ndarray, cost: np.ndarray, dp: int
) -> dict[str, float]:
    """Micro-batch count, max tokens, lockstep overhead (as produced, and with each rank's
    micro-batches sorted by cost, i.e. aligned) and rank-total imbalance of a baseline's grid."""
    m = max(len(row) for row in grid)
    c = np.zeros((dp, m))
    t = np.zeros((dp, m))
    for r, row in enumerate(grid):
        for j, mb in enumerate(row):
            c[r, j], t[r, j] = cost[mb].sum(), lengths[mb].sum()
    ideal = c.sum() / dp
    aligned = -np.sort(-c, axis=1)
    return {
        "m": m,
        "max_tokens": t.max(),
        "lockstep": c.max(axis=0).sum() / ideal,
        "aligned": aligned.max(axis=0).sum() / ideal,
        "imbalance": c.sum(axis=1).max() / ideal,
    }


def tight_equal_count_bound(w: np.ndarray, k: int) -> float:
    """A tighter bound with equal counts: the t heaviest items sit in t different parts, which
    hold at least the t·(n/k - 1) smallest others, so some part weighs their average or more."""
    s = np.sort(w)
    m = len(w) // k
    top = np.cumsum(s[::-1][:k])
    small = np.concatenate([[0.0], np.cumsum(s)])[np.minimum(np.arange(1, k + 1) * (m - 1), len(s))]
    return float(
        max(lower_bound(w, k, equal_count=True), ((top + small) / np.arange(1, k + 1)).max())
    )


def balance_table(quick: bool) -> None:
    print("\n## balance(lengths, k): median time (ms) and quality (heaviest / lower bound)\n")
    head = ["n", "k", "eq", "auto ms", "auto q", "kk ms", "kk q", "lpt ms", "lpt q",
            "list-KK ms", "list-KK q", "kk speedup", "py-LPT ms", "py-LPT q"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    notes: list[str] = []
    for n in (256, 1024, 4096, 16384):
        w = synth_lengths(n, seed=n).astype(np.float64)
        for k in (8, 64):
            for eq in (False, True):
                lb = lower_bound(w, k, equal_count=eq)
                reps = 3 if quick else (15 if n <= 4096 else 9)
                row: list[str] = [str(n), str(k), "on" if eq else "off"]
                for method in ("auto", "kk", "lpt"):
                    r = 1 if (method == "kk" and not eq and n >= 4096) else reps
                    ms, parts = timed(partial(balance, w, k, equal_count=eq, method=method), r)
                    row += [f"{ms:.2f}", f"{part_loads(w, parts).max() / lb:.5f}"]
                kk_ms = float(row[5])
                if quick and not eq and n >= 4096:
                    row += ["-", "-", "-"]
                else:
                    r = 1 if (not eq and n >= 1024) else max(1, reps // 3)
                    ms, parts = timed(partial(heap_of_lists_kk, w, k, eq), r)
                    q = max(w[p].sum() for p in parts) / lb
                    row += [f"{ms:.1f}", f"{q:.5f}", f"{ms / kk_ms:.1f}x"]
                ms, parts = timed(partial(plain_lpt, w, k, eq), reps)
                row += [f"{ms:.2f}", f"{max(w[p].sum() for p in parts) / lb:.5f}"]
                print("| " + " | ".join(row) + " |", flush=True)
                auto_ms, auto_q = float(row[3]), float(row[4])
                where = f"n={n} k={k} eq={row[2]}"
                if n == 16384 and k == 64:
                    notes.append(
                        f"auto < 10 ms at {where}: {auto_ms:.2f} ms ({_met(auto_ms < 10)})"
                    )
                if n // k >= 64:
                    notes.append(
                        f"quality <= 1.0001 at {where}: {auto_q:.5f} ({_met(auto_q <= 1.0001)})"
                    )
                if n == 1024 and k == 64 and eq:
                    notes.append(
                        f"quality <= 1.02 at {where}: {auto_q:.5f} ({_met(auto_q <= 1.02)})"
                    )
                    tight = auto_q * lb / tight_equal_count_bound(w, k)
                    notes.append(
                        "  same, against a tighter equal-count bound (the t heaviest items in t "
                        f"parts with the t(n/k-1) smallest): {tight:.5f} ({_met(tight <= 1.02)})"
                    )
                if row[11] != "-":
                    x = float(row[11].rstrip("x"))
                    notes.append(f"kk >= 10x list-KK at {where}: {row[11]} ({_met(x >= 10)})")
    print("\n## balance targets\n")
    print("\n".join(f"- {line}" for line in notes))


def cpu_timed(fns: list[Callable[[], Any]], repeats: list[int]) -> tuple[list[float], list[Any]]:
    """Median CPU milliseconds of each function, calls interleaved (fn 0, fn 1, ... again), the
    i-th repeated ``repeats[i]`` times; and each one's last result. CPU time leaves out the time
    other processes take the core (this machine is shared)."""
    times: list[list[float]] = [[] for _ in fns]
    outs: list[Any] = [None] * len(fns)
    for r in range(max(repeats)):
        for i, fn in enumerate(fns):
            if r < repeats[i]:
                t = time.process_time()
                outs[i] = fn()
                times[i].append((time.process_time() - t) * 1e3)
    return [statistics.median(t) for t in times], outs


def verl_table(quick: bool, seeds: int) -> None:
    """balance(method="auto") against verl's own ``karmarkar_karp`` (verl.utils.seqlen_balancing,
    the function behind get_seqlen_balanced_partitions), CPU-time medians, calls interleaved.

    The last column times ``balance`` alone, called again and again: right after verl's call it
    runs slower (its data and NumPy's code are out of the cache), which the interleaved column,
    the one the target is judged on, charges to it."""
    try:
        from verl.utils.seqlen_balancing import karmarkar_karp
    except ImportError:
        print("\n## balance vs verl's KK: verl is not installed, skipped")
        return
    print("\n## balance (auto) vs verl's karmarkar_karp: CPU ms (medians, interleaved), quality "
          f"(heaviest / lower bound); seed n (the table above){f' and {seeds - 1} more' if seeds > 1 else ''}\n")  # fmt: skip
    head = ["n", "k", "eq", "seed", "auto ms", "verl ms", "speedup", "auto q", "verl q",
            "verl as good", "target", "auto ms in a row"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    misses: list[str] = []
    for n in (256, 1024, 4096, 16384):
        for k in (8, 64):
            for eq in (False, True):
                for s in range(seeds):
                    w = synth_lengths(n, seed=n + 1000 * s).astype(np.float64)
                    wl = [int(x) for x in w]
                    lb = lower_bound(w, k, equal_count=eq)
                    slow = not eq and n >= 4096
                    # three of balance's calls to one of verl's; up to 1,024 items (calls of
                    # ~0.1-0.3 ms, where one spike of this shared machine moves a median of
                    # 15) three times as many, in the same pattern
                    more = 1 if slow or n > 1024 else 3
                    reps = [3 if quick else 15 * more, 1 if (slow or quick) else 5 * more]
                    fns = [partial(balance, w, k, equal_count=eq),
                           partial(karmarkar_karp, wl, k, eq)]  # fmt: skip
                    (ms, verl_ms), (parts, theirs) = cpu_timed(fns, reps)
                    (row_ms,), _ = cpu_timed(fns[:1], reps[:1])  # context: warm, not judged
                    q = part_loads(w, parts).max() / lb
                    vq = max(float(w[p].sum()) for p in theirs) / lb
                    as_good = vq <= q * (1 + 1e-12)
                    x = verl_ms / ms
                    ok = x >= 20 if as_good else True
                    if not ok:
                        misses.append(f"n={n} k={k} eq={eq} seed +{s}: {x:.1f}x")
                    print(f"| {n} | {k} | {'on' if eq else 'off'} | +{s} | {ms:.2f} | {verl_ms:.1f} | "
                          f"{x:.1f}x | {q:.6f} | {vq:.6f} | {'yes' if as_good else 'no'} | "
                          f"{_met(ok) if as_good else '-'} | {row_ms:.2f} |", flush=True)  # fmt: skip
    print(f"\n- balance >= 20x verl's KK wherever verl reaches the same quality: "
          f"{'met' if not misses else 'NOT met: ' + '; '.join(misses)}")  # fmt: skip


def primerl_table() -> None:
    """prime-rl's own randomized test (tests/primerl_ref.py: its generator and its prepare_batch,
    ported from PrimeIntellect-ai/prime-rl at 559b4477): align="total"'s heaviest rank against
    prime-rl's (its dummy micro-batches count nothing), and the micro-batch counts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from primerl_ref import heaviest_worker, prepare_batch, randomized_cases

    from rolltool.plan.workload import Workload

    rows: dict[str, list[float]] = {"flops": [], "tokens": []}
    more_mb = fewer_mb = 0
    times = []
    for case in randomized_cases():
        linear, quadratic = case.coeffs
        wl = Workload(kind="calibrated", a=float(linear), b=float(quadratic))
        run = partial(plan_step, np.array(case.lengths), dp=case.workers,
                      max_tokens=case.seq_len, workload=wl, align="total")  # fmt: skip
        (ms,), (plan,) = cpu_timed([run], [3])
        times.append(ms)
        layout = prepare_batch(case)
        theirs = heaviest_worker(layout, case)
        rows["flops" if quadratic else "tokens"].append(
            float(plan.costs.sum(axis=1).max()) / theirs
        )
        more_mb += plan.num_micro_batches > len(layout[0])
        fewer_mb += plan.num_micro_batches < len(layout[0])
    print(
        '\n## align="total" on prime-rl\'s own randomized test (80 cases of '
        "test_randomized_packing_invariants, default_rng(0)) against its prepare_batch\n"
    )
    print("| cost | cases | heavier | as heavy | lighter | worst ratio | best ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        x = np.array(r)
        print(f"| {name} | {len(x)} | {(x > 1).sum()} | {(x == 1).sum()} | {(x < 1).sum()} | "
              f"{x.max():.5f} | {x.min():.5f} |")  # fmt: skip
    heavier = sum(int((np.array(r) > 1).sum()) for r in rows.values())
    print(f"\n- never heavier than prime-rl's algorithm: {heavier} of 80 heavier ({_met(not heavier)})"
          f"; micro-batches per rank: more than prime-rl's in {more_mb}, fewer in {fewer_mb}; "
          f"plan_step median {statistics.median(times):.2f} CPU ms")  # fmt: skip


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


L2_SCALES = (1.0, 0.5, 2.0)
"""Scoring models: the planning model, then the same with its L² coefficient halved and doubled
(real GPU time is never exactly the model; issue 10, section 3)."""

REGIMES = {
    "synth": (1024, "rolltool.input.synth.synth_lengths: math, code and agent mix", 100),
    "agent": (128, "log-normal, median 6,000, sigma 1.0, clipped to [200, 32,768]", 200),
}
"""Plan-table regimes: (samples per rank, what the lengths are, first seed)."""


def agent_lengths(n: int, seed: int, cap: int = 32768) -> np.ndarray:
    """A heavy-tailed agent-like step: log-normal lengths (median 6,000 tokens, sigma 1.0)
    rounded and clipped to [200, cap]; about 4% sit at the cap."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(6000), 1.0, n)), 200, cap).astype(np.int64)


def model_overheads(grid: Any, lengths: np.ndarray, wl: Any, aligned: bool) -> list[float]:
    """Lockstep overhead of a ``[dp][M]`` grid of index lists under each ``L2_SCALES`` model;
    ``aligned``: each rank's micro-batches first sorted by planning cost (free for baselines)."""
    plan_cost = wl.cost(lengths)
    rows = [sorted(r, key=lambda mb: -plan_cost[mb].sum()) if aligned else r for r in grid]
    m = max(len(r) for r in rows)
    out = []
    for f in L2_SCALES:
        c = dataclasses.replace(wl, b=wl.b * f).cost(lengths)
        x = np.zeros((len(rows), m))
        for r, row in enumerate(rows):
            for j, mb in enumerate(row):
                x[r, j] = c[mb].sum()
        out.append(float(x.max(axis=0).sum() / (x.sum() / len(rows))))
    return out


def plan_table(quick: bool, regime: str = "synth") -> None:
    dp, cap = 8, 32768
    per_rank, what, first_seed = REGIMES[regime]
    wl = make_workload("flops", model="dense-7b")
    print(f"\n## plan_step, {regime} regime (dp={dp}, {per_rank} samples per rank, "
          f"max_tokens={cap}, {wl.describe()}); lengths: {what}\n")  # fmt: skip
    head = ["step", "planner", "ms", "M", "ceil(T/rank/cap)", "FFD M", "max tok",
            "lockstep (cost)", "same, aligned", "aligned, ×0.5 L²", "aligned, ×2 L²",
            "lockstep (tok)", "rank imbalance"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "---:|" * (len(head) - 2))
    worst: dict[str, float] = {}
    for seed in range(first_seed, first_seed + (2 if quick else 5)):
        if regime == "agent":
            lengths = agent_lengths(dp * per_rank, seed, cap)
        else:
            lengths = synth_lengths(dp * per_rank, seed=seed, max_len=cap)
        _rolltool_rows(seed, lengths, dp, cap, wl, quick, worst)
        _baseline_rows(seed, lengths, dp, cap, wl)
    _plan_targets(worst, regime)


def _rolltool_rows(
    seed: int, lengths: np.ndarray, dp: int, cap: int, wl: Any, quick: bool, worst: dict[str, float]
) -> None:
    bound = -(-int(lengths.sum()) // (dp * cap))
    for name, align, eq in (("rolltool lockstep", "lockstep", False),
                            ("rolltool lockstep eq", "lockstep", True),
                            ("rolltool total", "total", False)):  # fmt: skip
        run = partial(
            plan_step, lengths, dp=dp, max_tokens=cap, workload=wl, align=align, equal_count=eq
        )
        ms, plan = timed(run, 3 if quick else 7)
        rep = plan.report
        over = model_overheads(plan.micro_batches, lengths, wl, aligned=False)
        print(f"| {seed} | {name} | {ms:.1f} | {plan.num_micro_batches} | {bound} | "
              f"{plan.ffd_micro_batches} | {int(plan.tokens.max())} | "
              f"{rep['lockstep_overhead_cost']:.4f} | - | {over[1]:.4f} | {over[2]:.4f} | "
              f"{rep['lockstep_overhead_tokens']:.4f} | {rep['imbalance_cost']:.4f} |", flush=True)  # fmt: skip
        for key, value in ((name, over[0]), (name + " x0.5", over[1]), (name + " x2", over[2]),
                           (name + " ms", ms),
                           (name + " dM", plan.num_micro_batches - bound),
                           (name + " over FFD", plan.num_micro_batches - plan.ffd_micro_batches)):  # fmt: skip
            worst[key] = max(worst.get(key, -1e9), value)
        over_ffd = plan.num_micro_batches > (plan.ffd_micro_batches or 0)
        worst[name + " steps over FFD"] = worst.get(name + " steps over FFD", 0) + over_ffd


def _baseline_rows(seed: int, lengths: np.ndarray, dp: int, cap: int, wl: Any) -> None:
    cost = wl.cost(lengths)
    bound = -(-int(lengths.sum()) // (dp * cap))
    for name, fn in (("peer: KK ranks, KK micro", partial(peer_pipeline, lengths, dp, cap)),
                     ("LPT ranks, FFD micro", partial(lpt_then_ffd, lengths, dp, cap, cost)),
                     ("FFD bins round-robin", partial(ffd_round_robin, lengths, dp, cap))):  # fmt: skip
        ms, grid = timed(fn, 1)
        g = grid_numbers(grid, lengths, cost, dp)
        tok = grid_numbers(grid, lengths, lengths.astype(np.float64), dp)["lockstep"]
        over = model_overheads(grid, lengths, wl, aligned=True)
        print(f"| {seed} | {name} | {ms:.0f} | {g['m']} | {bound} | - | {int(g['max_tokens'])} | "
              f"{g['lockstep']:.4f} | {g['aligned']:.4f} | {over[1]:.4f} | {over[2]:.4f} | "
              f"{tok:.4f} | {g['imbalance']:.4f} |", flush=True)  # fmt: skip


def _plan_targets(worst: dict[str, float], regime: str) -> None:
    print(f"\n## targets, {regime} regime (rolltool lockstep, worst over the steps)\n")
    lock = "rolltool lockstep"
    print(f"- lockstep overhead <= 1.003 under the planning model: worst {worst[lock]:.4f} "
          f"({_met(worst[lock] <= 1.003)})")  # fmt: skip
    for f in ("x0.5", "x2"):
        w = worst[f"{lock} {f}"]
        print(f"- lockstep overhead <= 1.008 with the L² coefficient {f}: worst {w:.4f} "
              f"({_met(w <= 1.008)})")  # fmt: skip
    over, steps = worst[lock + " over FFD"], worst[lock + " steps over FFD"]
    print(f"- micro-batches no more than FFD's: worst {over:+.0f}, {steps:.0f} step(s) above "
          f"({_met(over <= 0)}; one more is allowed where it steps >= 0.1% faster, WIDER_GAIN)")  # fmt: skip
    if regime == "synth":
        ms = worst[lock + " ms"]
        print(f"- plan time <= 50 ms (dp 8 x 1,024): worst median {ms:.1f} ms ({_met(ms <= 50)})")
    print(f"- micro-batches within 1 of ceil(tokens per rank / cap): worst "
          f"+{worst[lock + ' dM']:.0f} ({_met(worst[lock + ' dM'] <= 1)})")  # fmt: skip


def total_vs_pairwise_table(quick: bool) -> None:
    """prime-rl-style randomized steps (cost 17408·L + 64·L², 2-8 ranks, a cap of 8-64 tokens,
    19-64 samples of 1..cap tokens, seed 0): align="total"'s heaviest rank against KK alone and
    KK followed by the exhaustive pairwise swap/move search (``refine_pairs`` without limits,
    which the tests hold equal to a slow reference)."""
    from rolltool.plan.partition import balance_labels
    from rolltool.plan.partition.refine import refine_pairs
    from rolltool.plan.workload import Workload

    wl = Workload(kind="calibrated", a=17408.0, b=64.0)
    rng = np.random.default_rng(0)
    cases, over, wins, times = 80, [], 0, []
    for _ in range(cases):
        dp, cap, n = int(rng.integers(2, 9)), int(rng.integers(8, 65)), int(rng.integers(19, 65))
        lengths = rng.integers(1, cap + 1, n)
        cost = wl.cost(lengths)
        run = partial(plan_step, lengths, dp=dp, max_tokens=cap, workload=wl, align="total")
        ms, plan = timed(run, 1 if quick else 3)
        times.append(ms)
        ours = float(plan.costs.sum(axis=1).max())
        order = np.argsort(-cost, kind="stable")
        kk = balance_labels(cost, dp, method="kk")[order]
        ref = refine_pairs(cost[order], kk, dp, equal_count=False, max_steps=10**6, max_work=10**12)
        ref_max = float(np.bincount(ref, weights=cost[order], minlength=dp).max())
        if ours > ref_max:
            over.append(ours / ref_max - 1)
        wins += ours < float(np.bincount(kk, weights=cost[order], minlength=dp).max())
    print(f"\n## align=\"total\" on {cases} prime-rl-style steps (17408·L + 64·L², 2-8 ranks, "
          "cap 8-64, 19-64 samples)\n")  # fmt: skip
    worst = f"{max(over) * 100:.3f}%" if over else "-"
    print(f"- heavier than KK + exhaustive pairwise search: {len(over)} of {cases} (worst +{worst})"
          f" ({_met(not over)})")  # fmt: skip
    ms = statistics.median(times)
    print(f"- lighter than KK alone: {wins} of {cases}; plan_step median {ms:.2f} ms")


def verl_dropin_table(quick: bool) -> None:
    """verl's pipeline (peer_pipeline) as is, with rolltool.integrations.verl's
    get_seqlen_balanced_partitions patched in for its KK calls (what ``patch()`` does), and the
    full drop-in (equal-size ranks, then get_micro_batch_partitions aligned to the DP max)."""
    from rolltool.integrations import verl as rv

    def dropin(lengths: np.ndarray, dp: int, cap: int) -> list[list[list[int]]]:
        w = make_workload("verl").cost(lengths).tolist()
        ranks = rv.get_seqlen_balanced_partitions(w, dp, True)
        m = max(rv.num_micro_batches(lengths[r].tolist(), cap) for r in ranks)  # all_reduce MAX
        mbs = [rv.get_micro_batch_partitions(lengths[r].tolist(), cap, m) for r in ranks]
        return [[[r[i] for i in p] for p in row] for r, row in zip(ranks, mbs, strict=True)]

    def patched(lengths: np.ndarray, dp: int, cap: int) -> list[list[list[int]]]:
        saved = globals()["heap_of_lists_kk"]
        globals()["heap_of_lists_kk"] = lambda w, k, equal_count: rv.get_seqlen_balanced_partitions(
            w.tolist(), k, equal_count
        )
        try:
            return peer_pipeline(lengths, dp, cap)
        finally:
            globals()["heap_of_lists_kk"] = saved

    dp, cap = 8, 32768
    wl = make_workload("flops", model="dense-7b")
    print(f"\n## verl drop-in (dp={dp}, max_token_len={cap}, costs {wl.describe()}): lockstep "
          "overhead with micro-batches heaviest first (verl's dynamic-bsz order)\n")  # fmt: skip
    head = ["regime", "step", "pipeline", "ms", "M", "max tok", "lockstep", "rank imbalance"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 3 + "---:|" * (len(head) - 3))
    for regime in ("synth", "agent"):
        per_rank, _, first_seed = REGIMES[regime]
        for seed in range(first_seed, first_seed + (1 if quick else 3)):
            if regime == "agent":
                lengths = agent_lengths(dp * per_rank, seed, cap)
            else:
                lengths = synth_lengths(dp * per_rank, seed=seed, max_len=cap)
            for name, fn in (("verl (KK, KK micro)", peer_pipeline),
                             ("verl + patch()", patched),
                             ("rolltool drop-in", dropin)):  # fmt: skip
                ms, grid = timed(partial(fn, lengths, dp, cap), 1 if quick else 3)
                g = grid_numbers(grid, lengths, wl.cost(lengths), dp)
                print(f"| {regime} | {seed} | {name} | {ms:.0f} | {g['m']} | "
                      f"{int(g['max_tokens'])} | {g['aligned']:.4f} | {g['imbalance']:.4f} |",
                      flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps (smoke run)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per case against verl's KK")
    parser.add_argument("--sections", default="balance,verl,synth,agent,total,primerl,dropin",
                        help="comma-separated sections to run")  # fmt: skip
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, one core, medians")
    if "balance" in sections:
        balance_table(args.quick)
    if "verl" in sections:
        verl_table(args.quick, 1 if args.quick else args.seeds)
    for regime in ("synth", "agent"):
        if regime in sections:
            plan_table(args.quick, regime)
    if "total" in sections:
        total_vs_pairwise_table(args.quick)
    if "primerl" in sections:
        primerl_table()
    if "dropin" in sections:
        verl_dropin_table(args.quick)


if __name__ == "__main__":
    main()
