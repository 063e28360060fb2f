"""Pure arithmetic over a timing table: step times, efficiencies, FLOP/s, cost-model fits.

A timing table has one entry per packed row: ``step``, ``rank``, ``micro_batch`` and measured
``seconds`` (plus tokens and Σ L² for the fit). With t(r, j) the time of rank r's micro-batch j
in a step and dp ranks:

=================  ============================  ===================================================
figure             formula                       meaning
=================  ============================  ===================================================
``dp_time``        max_r Σ_j t(r, j)             plain data parallel: ranks meet once, at the end
``lockstep_time``  Σ_j max_r t(r, j)             FSDP/ZeRO-3/TP: ranks meet at every micro-batch
``ideal_time``     Σ_r Σ_j t(r, j) / dp          perfectly balanced work
efficiency         ideal / actual                1.0 = no rank ever waits
=================  ============================  ===================================================

Example: dp = 2, rank 0 takes (3, 1) s, rank 1 takes (1, 3) s. dp_time = max(4, 4) = 4,
lockstep_time = max(3, 1) + max(1, 3) = 6, ideal = 8 / 2 = 4: dp efficiency 1.0, lockstep 0.67.
These are `rolltool.plan.partition.metrics`' ``dp_cost``, ``lockstep_cost`` and ``ideal`` of the
measured grid, the figures ``stats`` and the planner compute from the workload's cost.

With ``--cp C`` / ``--sp S`` packs every micro-batch runs on a group of k GPUs, each timed on
its share (`rolltool.bench.shares`), t(r, j, g) for GPU g. The group's GPUs meet at every layer
(ring exchanges, all-to-alls), so the micro-batch takes its slowest GPU's time,
t(r, j) = max_g t(r, j, g), and the figures above are computed on those. The group's own
balance is ``imbalance`` = max_g t(r, j, g) / mean_g t(r, j, g) per micro-batch (1.0: even),
summarized by its median and maximum over micro-batches, and ``efficiency`` = Σ mean / Σ max
(the share of the group's time its GPUs compute). Example: cp 2 GPUs take (3, 1) ms on one
micro-batch and (2, 2) on another: imbalances 1.5 and 1.0, efficiency (2 + 2) / (3 + 2) = 0.8.

FLOPs are counted with `rolltool.plan.workload.flops_coefficients`, the formula of the ``flops``
workload pack balances on, so a FLOP here is the same FLOP there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolltool.plan.cost_fit import fit_micro_batches
from rolltool.plan.partition import metrics
from rolltool.plan.workload import flops_coefficients

TIME_KEYS = ("dp_time", "lockstep_time", "ideal_time")

PEAK_TFLOPS: dict[str, float] = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16/fp16 tensor-core peak by device family (TFLOP/s); other devices: unknown."""


def step_times(
    step: np.ndarray, rank: np.ndarray, micro_batch: np.ndarray, seconds: np.ndarray, dp: int
) -> list[dict[str, Any]]:
    """Per step (ascending): the three times and both efficiencies (see module docstring).

    A rank lacking micro-batch j (never in a rolltool directory) counts as 0 s there.
    """
    result = []
    for s in np.unique(step):
        sel = step == s
        m = int(micro_batch[sel].max()) + 1
        t = np.zeros((dp, m))
        np.add.at(t, (rank[sel], micro_batch[sel]), seconds[sel])
        head = {"step": int(s), "micro_batches_per_rank": m}
        result.append(
            _figures(head, metrics.dp_cost(t), metrics.lockstep_cost(t), metrics.ideal(t))
        )
    return result


@dataclass(frozen=True)
class GroupTimes:
    """Per micro-batch of a split pack, over its group's GPUs (see the module docstring)."""

    step: np.ndarray  # [G] int
    rank: np.ndarray  # [G] int
    micro_batch: np.ndarray  # [G] int
    slowest: np.ndarray
    """[passes, G] max over the group's GPUs: the micro-batch's time."""
    mean: np.ndarray
    """[passes, G] mean over the group's GPUs."""

    @property
    def imbalance(self) -> np.ndarray:
        """[passes, G] slowest / mean (1.0 where the mean is 0)."""
        safe = np.where(self.mean > 0, self.mean, 1.0)
        return np.where(self.mean > 0, self.slowest / safe, 1.0)


def group_times(
    step: np.ndarray, rank: np.ndarray, micro_batch: np.ndarray, seconds: np.ndarray
) -> GroupTimes:
    """GPU rows' ``seconds`` ([n] or [passes, n]) reduced over each (step, rank, micro-batch)'s
    GPUs, in ascending (step, rank, micro-batch) order.

    >>> g = group_times(np.zeros(4, int), np.zeros(4, int), np.array([0, 0, 1, 1]),
    ...                 np.array([3.0, 1.0, 2.0, 2.0]))
    >>> g.slowest.tolist(), g.imbalance.tolist()
    ([[3.0, 2.0]], [[1.5, 1.0]])
    """
    t = np.atleast_2d(np.asarray(seconds, dtype=np.float64))
    keys, inv = np.unique(np.stack([step, rank, micro_batch], axis=1), axis=0, return_inverse=True)
    inv = inv.ravel()
    slowest = np.full((t.shape[0], len(keys)), -np.inf)
    np.maximum.at(slowest.T, inv, t.T)
    sums = np.zeros_like(slowest)
    np.add.at(sums.T, inv, t.T)
    mean = sums / np.bincount(inv, minlength=len(keys))
    return GroupTimes(keys[:, 0], keys[:, 1], keys[:, 2], slowest, mean)


def group_figures(g: GroupTimes, sel: np.ndarray | None = None) -> dict[str, float]:
    """Median and max of the (first pass's) imbalance over the chosen micro-batches, and the
    efficiency Σ mean / Σ max."""
    sel = np.ones(len(g.step), bool) if sel is None else sel
    ratio, top, mean = g.imbalance[0][sel], g.slowest[0][sel], g.mean[0][sel]
    return {
        "group_imbalance_median": float(np.median(ratio)),
        "group_imbalance_max": float(ratio.max()),
        "group_efficiency": float(mean.sum() / top.sum()) if top.sum() > 0 else float("nan"),
    }


def group_step_times(g: GroupTimes, dp: int) -> list[dict[str, Any]]:
    """`step_times` of the groups' micro-batch times, each step with its `group_figures`."""
    steps = step_times(g.step, g.rank, g.micro_batch, g.slowest[0], dp)
    return [{**s, **group_figures(g, g.step == s["step"])} for s in steps]


def total_times(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sums of the step times over the run; efficiencies of the sums."""
    sums = [float(sum(s[k] for s in steps)) for k in TIME_KEYS]
    return _figures({"steps": len(steps)}, *sums)


def _figures(head: dict[str, Any], dp_time: float, lockstep: float, ideal: float) -> dict[str, Any]:
    return {
        **head,
        "dp_time": float(dp_time),
        "lockstep_time": float(lockstep),
        "ideal_time": float(ideal),
        "dp_efficiency": float(ideal / dp_time) if dp_time > 0 else float("nan"),
        "lockstep_efficiency": float(ideal / lockstep) if lockstep > 0 else float("nan"),
    }


def attention_flops(
    lengths: np.ndarray, *, heads: int, head_dim: int, layers: int = 1, backward: bool = False
) -> float:
    """Causal attention FLOPs of segments of ``lengths`` tokens: b·Σ L² with the ``flops``
    workload's b (`rolltool.plan.workload.flops_coefficients`).

    Forward per sequence: QKᵀ and AV, 2·L²·head_dim·heads FLOPs after the causal mask; backward
    2x forward (model FLOPs: FlashAttention's recomputation of the scores is not counted).
    Example: L = 1,024, 32 heads of 128, forward: 2 · 1024² · 128 · 32 = 8.6 GFLOP.
    """
    _, b = flops_coefficients(
        matmul_params=0, attention_width=heads * head_dim, layers=layers, backward=backward
    )
    length = np.asarray(lengths, dtype=np.float64)
    return b * float(np.sum(length * length))


def layer_flops(
    lengths: np.ndarray,
    *,
    matmul_params: int,
    heads: int,
    head_dim: int,
    layers: int = 1,
    backward: bool = False,
) -> float:
    """FLOPs of ``layers`` dense decoder layers over segments of ``lengths`` tokens: a·T + b·Σ L²
    with the ``flops`` workload's coefficients (`rolltool.plan.workload.flops_coefficients`).

    Matmuls: every token multiplies every matmul weight once, 2·T·``matmul_params`` forward;
    attention: the causal FLOPs of ``attention_flops``; backward 2x forward for both (3x in all).
    Norms, SiLU and residual adds are not counted (a few FLOPs per element, memory-bound). With
    backward, all layers of a model plus its output projection (h·vocab, once per model) are
    exactly the ``flops`` workload's cost. Example, dense-7b (N = 233.0 M per layer), one
    sequence of 4,096 tokens, forward: 2 · 4096 · 233.0 M + 2 · 4096² · 128 · 28 = 1.909 + 0.120
    = 2.03 TFLOP.
    """
    a, b = flops_coefficients(
        matmul_params=matmul_params * layers,
        attention_width=heads * head_dim,
        layers=layers,
        backward=backward,
    )
    length = np.asarray(lengths, dtype=np.float64)
    return a * float(np.sum(length)) + b * float(np.sum(length * length))


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense tensor-core peak for bf16/fp16 on a known device, else None (unknown)."""
    if dtype not in ("bf16", "fp16"):
        return None
    for family, peak in PEAK_TFLOPS.items():
        if family in device_name.upper():
            return peak
    return None


def throughput(flops: float, seconds: float, device_name: str, dtype: str) -> dict[str, Any]:
    """Achieved TFLOP/s and its share of the device's peak (None when the peak is unknown)."""
    tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
    peak = peak_tflops(device_name, dtype)
    return {
        "flops": flops,
        "seconds": seconds,
        "tflops": tflops,
        "peak_tflops": peak,
        "peak_share": tflops / peak if peak else None,
    }


def r_squared(y: np.ndarray, fitted: np.ndarray) -> float:
    """1 - SS_res / SS_tot (around the mean); NaN when y is constant."""
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0:
        return float("nan")
    return 1.0 - float(np.sum((y - fitted) ** 2)) / ss_tot


def fit_quadratic(tokens: np.ndarray, sum_sq: np.ndarray, seconds: np.ndarray) -> dict[str, Any]:
    """Fit seconds ≈ a·tokens + b·Σ L² over rows, a, b >= 0 (least squares), with R².

    A row's time is the sum over its segments of a·L + b·L², so the per-segment model fits on
    rows without timing segments apart. Non-negativity keeps the result a valid cost model
    (`rolltool.plan.cost_fit.nnls`: if the free fit makes a coefficient negative, the better
    one-term fit is taken). `fit_cost` adds the per-segment and per-row constants.
    """
    y = np.asarray(seconds, np.float64)
    fit = fit_micro_batches(np.zeros(len(y)), tokens, sum_sq, y, terms=("a", "b"))
    return {"a": fit.a, "b": fit.b, "r2": fit.r2, "rows": fit.rows}


def fit_cost(
    segments: np.ndarray, tokens: np.ndarray, sum_sq: np.ndarray, seconds: np.ndarray
) -> dict[str, Any]:
    """Fit a row's seconds ≈ m + c·segments + a·tokens + b·Σ L², every term >= 0, with R²: the
    calibration ``bench --calibrate`` writes (`rolltool.plan.cost_fit.fit_micro_batches`).

    ``m`` is per row (micro-batch: a kernel's launch and fixed work), ``c`` per segment (what
    a varlen kernel spends on a document whatever its length). Rows packed to the same token
    count cannot tell ``m`` from ``a``: bench several directories (``--balance tokens`` and
    ``count`` packs vary the rows) for a well-determined split. A fit that puts all the time
    in ``m`` (timing noise) prices no sample, so pack could not balance on it: then ``m`` is
    left out (the fit is poor either way, and says so in R²).
    """
    fit = fit_micro_batches(segments, tokens, sum_sq, seconds)
    if fit.a == fit.b == fit.c == 0:
        fit = fit_micro_batches(segments, tokens, sum_sq, seconds, terms=("c", "a", "b"))
    return {**fit.coefficients(), "r2": fit.r2, "rows": fit.rows,
            "rel_rmse": fit.rel_rmse, "max_rel_error": fit.max_rel_error}  # fmt: skip


def proportional_fit(predicted: np.ndarray, seconds: np.ndarray) -> dict[str, Any]:
    """How well a cost model's predictions track measured times: seconds ≈ k·predicted.

    ``k`` converts the workload's units (FLOPs, tokens...) to seconds; R² says how much of the
    rows' time variation the model explains (1.0: perfect ranking and proportions). A balanced
    packing makes rows alike, so there is little variation to explain and R² is at the mercy of
    timing noise; ``rel_rmse``, the root-mean-square error of k·predicted over the mean row time,
    says how close each prediction is whatever the spread (0.02: rows predicted within ~2%).
    """
    p, y = np.asarray(predicted, np.float64), np.asarray(seconds, np.float64)
    if not np.all(np.isfinite(p)) or float(p @ p) == 0:
        return {"seconds_per_unit": None, "r2": None, "rel_rmse": None}
    k = float(p @ y) / float(p @ p)
    mean = float(y.mean())
    rmse = float(np.sqrt(np.mean((y - k * p) ** 2)))
    return {
        "seconds_per_unit": k,
        "r2": r_squared(y, k * p),
        "rel_rmse": rmse / mean if mean > 0 else None,
    }


def calibration(fit: Mapping[str, Any], notes: Mapping[str, Any]) -> dict[str, Any]:
    """The file ``pack --balance calibrated`` reads: ``{"a": s/token, "b": s/token²,
    "c": s/segment, "m": s/micro-batch, "r2", "rows", ...notes}`` (``c`` and ``m`` 0 when the
    fit has none)."""
    terms = {"a": fit["a"], "b": fit["b"], "c": fit.get("c", 0.0), "m": fit.get("m", 0.0)}
    return {**terms, "r2": fit["r2"], "rows": fit["rows"], **notes}


def repeat_spread(
    step: np.ndarray, rank: np.ndarray, micro_batch: np.ndarray, times: np.ndarray, dp: int
) -> dict[str, Any]:
    """How far timing noise alone moves the run's efficiencies: each of the ``[repeats, n]``
    timed passes taken alone gives its own total dp and lockstep efficiency; their range is
    the least difference the reported efficiencies can support. ``row_spread``: the median over
    rows of (max - min) / median of a row's repeats.

    Example: efficiencies 0.97, 0.78 and 0.60 over three passes: range 0.37, far above the
    0.03 the best of them says is lost to imbalance.
    """
    per = [total_times(step_times(step, rank, micro_batch, t, dp)) for t in times]
    spread: dict[str, Any] = {"repeats": len(per)}
    spread["per_pass"] = {k: [p[k] for p in per] for k in ("dp_time", "lockstep_time")}
    for key in ("dp_efficiency", "lockstep_efficiency"):
        xs = [p[key] for p in per if math.isfinite(p[key])]
        spread[key] = {"min": min(xs), "max": max(xs)} if xs else None
    median = np.median(times, axis=0) if times.size else np.zeros(0)
    ok = median > 0
    rel = (times.max(axis=0)[ok] - times.min(axis=0)[ok]) / median[ok] if times.size else median
    spread["row_spread"] = float(np.median(rel)) if rel.size else None
    return spread


NOISE_FLOOR = 0.01
"""A repeat range of the efficiencies below this (1 point) is never called noisy."""


def noise_warning(run: Mapping[str, Any], device: str) -> str | None:
    """A sentence when the repeats' range of an efficiency exceeds `NOISE_FLOOR` and a quarter
    of what the reported efficiency says is lost (1 - efficiency): the timings cannot support
    the figure (CPU timings of small rows, a busy device). None otherwise, or with one repeat.

    >>> run = {"path": "d", "total": {"lockstep_efficiency": 0.78, "dp_efficiency": 0.9},
    ...        "noise": {"repeats": 3, "lockstep_efficiency": {"min": 0.6, "max": 0.98},
    ...                  "dp_efficiency": {"min": 0.89, "max": 0.91}, "row_spread": 0.4}}
    >>> noise_warning(run, "cpu")[:48]
    'd: timing noise is as large as the imbalance mea'
    """
    noise = run.get("noise") or {}
    if noise.get("repeats", 0) < 2:
        return None
    shaky = []
    for key, name in (("lockstep_efficiency", "lockstep"), ("dp_efficiency", "dp")):
        r, e = noise.get(key), run["total"][key]
        if r is None or not math.isfinite(e):
            continue
        if r["max"] - r["min"] > max(NOISE_FLOOR, 0.25 * (1 - e)):
            shaky.append(f"{name} efficiency {e:.1%} ranges {r['min']:.1%}-{r['max']:.1%}")
    if not shaky:
        return None
    where = " (timings on CPU are noisy: bench on the GPU you train on)" if device == "cpu" else ""
    return (
        f"{run['path']}: timing noise is as large as the imbalance measured "
        f"({'; '.join(shaky)} over {noise['repeats']} repeats, rows vary by "
        f"{noise.get('row_spread') or 0:.0%}): do not read the efficiencies, or differences "
        f"between directories, more finely than that; raise --repeats or --layers{where}"
    )


def winner_warning(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """With several directories (timed in the same passes): a sentence when the fastest
    directory by a time is not the same in every pass, i.e. the comparison's best is within
    timing noise; None when every pass agrees (or there is one pass).

    >>> runs = [{"path": p, "noise": {"per_pass": {"dp_time": d, "lockstep_time": d}}}
    ...         for p, d in (("a", [1.0, 2.0]), ("b", [1.5, 1.5]))]
    >>> winner_warning(runs)[:40]
    'the fastest directory changes from pass '
    """
    passes = [r.get("noise", {}).get("per_pass") for r in runs]
    if len(runs) < 2 or any(p is None for p in passes):
        return None
    changes = []
    for key in ("lockstep_time", "dp_time"):
        table = np.array([p[key] for p in passes if p is not None])  # [runs, passes]
        if table.shape[1] < 2:
            return None
        wins = np.bincount(table.argmin(axis=0), minlength=len(runs))
        if (wins > 0).sum() > 1:
            best = int(wins.argmax())
            changes.append(f"{key.replace('_', ' ')}: {runs[best]['path']} fastest in "
                           f"{wins[best]} of {table.shape[1]} passes")  # fmt: skip
    if not changes:
        return None
    return (
        f"the fastest directory changes from pass to pass ({'; '.join(changes)}): the "
        "comparison's best is within timing noise; raise --repeats or --layers"
    )
