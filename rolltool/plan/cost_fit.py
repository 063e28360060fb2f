"""Fitting the cost model to measured times: exact non-negative least squares over its terms.

A micro-batch of documents of lengths L_1 … L_n costs, in seconds::

    t = m + Σ_i (c + a·L_i + b·L_i²)  =  m·1 + c·n + a·ΣL + b·ΣL²

``m`` per micro-batch (a kernel's launch and fixed work), ``c`` per document (what a varlen
kernel spends on a segment whatever its length: short documents sit on this floor), ``a`` per
token, ``b`` per token² (causal attention). The model is linear in (m, c, a, b), so timed
micro-batches (``rolltool bench``: one row = one micro-batch) give them by least squares over
the features [1, n, ΣL, ΣL²]; a per-document latency profile (one document per point) gives
c, a and b the same way. Non-negative, so the result is a cost model (`nnls`).

Example: five micro-batches timed at exactly m = 1, c = 2, a = 3, b = 0.5 (in any unit)::

    >>> n, tokens = np.array([1, 2, 3, 1, 4]), np.array([4, 6, 9, 10, 8])
    >>> sum_sq = np.array([16, 20, 29, 100, 18])
    >>> fit = fit_micro_batches(n, tokens, sum_sq, 1 + 2 * n + 3 * tokens + 0.5 * sum_sq)
    >>> [round(v, 9) for v in (fit.m, fit.c, fit.a, fit.b)]
    [1.0, 2.0, 3.0, 0.5]

`profile_latency` reads a profile as a function of L (log-log interpolation): what the
benchmarks take as the measured latency of any document.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError

__all__ = [
    "COST_TERMS",
    "CostFit",
    "fit_documents",
    "fit_micro_batches",
    "nnls",
    "profile_latency",
]

COST_TERMS = ("m", "c", "a", "b")
"""The terms of a micro-batch's cost, in the order of its features [1, n, ΣL, ΣL²]."""

WEIGHTINGS = ("absolute", "relative")
"""How points count in a fit: their squared errors in seconds (long micro-batches dominate), or
relative to their time (every point alike, for times spanning several decades)."""


def nnls(x: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """``argmin_β ‖w·(xβ − y)‖²`` over ``β >= 0``, exactly, for a few columns (at most 6).

    ``x``: ``[n, k]``, ``y``: ``[n]``, ``weight``: ``[n]`` (default 1). Every support (set of
    non-zero coefficients) is solved by plain least squares and the best one with no negative
    coefficient is kept: the non-negative optimum is the least-squares solution on its own
    support, so it is among them (2^k − 1 small solves; k = 4 gives 15). Columns are scaled to
    a unit maximum first (ΣL² is ~1e4x ΣL). Returns ``[k]`` float64; ties go to fewer terms.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k = x.shape[1]
    if k > 6:
        raise ValueError(f"nnls tries every support: at most 6 columns, got {k}")
    w = np.ones(len(y)) if weight is None else np.asarray(weight, dtype=np.float64)
    xw, yw = x * w[:, None], y * w
    scale = np.abs(xw).max(axis=0) if len(y) else np.ones(k)
    scale = np.where(scale > 0, scale, 1.0)
    xs = xw / scale
    best, best_res = np.zeros(k), float(yw @ yw)
    tie = 1e-12 * best_res  # residuals this close are equal: the fewer terms win
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            coef, *_ = np.linalg.lstsq(xs[:, cols], yw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(k)
            full[cols] = coef
            res = float(np.sum((yw - xs @ full) ** 2))
            if res < best_res - tie:
                best, best_res = full, res
    return best / scale


@dataclass(frozen=True, kw_only=True)
class CostFit:
    """A fitted cost model ``t = m + Σ (c + a·L + b·L²)`` (seconds) and how well it fits."""

    m: float
    """Seconds per micro-batch, whatever it holds (0 when not fitted)."""
    c: float
    """Seconds per document, whatever its length."""
    a: float
    """Seconds per token."""
    b: float
    """Seconds per token²."""
    rows: int
    """Points fitted (micro-batches, or profiled lengths)."""
    r2: float
    """1 − SS_res / SS_tot of the fitted times (NaN when every time is the same)."""
    max_rel_error: float
    """max over the points of ``|fitted / measured − 1|``."""
    rel_rmse: float
    """Root mean square of ``fitted / measured − 1`` over the points."""
    weighting: str
    """``absolute`` or ``relative`` (`WEIGHTINGS`)."""

    def coefficients(self) -> dict[str, float]:
        """``{"a", "b", "c", "m"}``: the keys of a calibration file, in seconds."""
        return {"a": self.a, "b": self.b, "c": self.c, "m": self.m}

    def predict(self, segments: np.ndarray, tokens: np.ndarray, sum_sq: np.ndarray) -> np.ndarray:
        """``[n]`` seconds of micro-batches with ``segments`` documents, ``tokens`` = ΣL and
        ``sum_sq`` = ΣL² each."""
        return self.m + self.c * _f(segments) + self.a * _f(tokens) + self.b * _f(sum_sq)


def fit_micro_batches(
    segments: np.ndarray,
    tokens: np.ndarray,
    sum_sq: np.ndarray,
    seconds: np.ndarray,
    *,
    terms: Sequence[str] = COST_TERMS,
    weighting: str = "absolute",
) -> CostFit:
    """Fit ``seconds ≈ m + c·segments + a·tokens + b·sum_sq`` over micro-batches, every term >= 0.

    ``[n]`` arrays, one entry per timed micro-batch: its documents (segments), ΣL, ΣL², seconds.
    ``terms``: which of `COST_TERMS` to fit (the others are 0), e.g. ``("a", "b")``. ``m`` and
    ``a`` are told apart only if the micro-batches hold different token counts, ``m`` and ``c``
    only if they hold different document counts (else the fit shares the time between them;
    the fitted times are the same either way).
    """
    unknown = set(terms) - set(COST_TERMS)
    if unknown or not terms:
        raise ValueError(f"terms must be some of {COST_TERMS}, got {tuple(terms)}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    y = _f(seconds)
    features = {"m": np.ones(len(y)), "c": _f(segments), "a": _f(tokens), "b": _f(sum_sq)}
    cols = [t for t in COST_TERMS if t in terms]
    x = np.stack([features[t] for t in cols], axis=1)
    if weighting == "relative" and np.any(y <= 0):
        raise RolltoolError("a relative fit needs every measured time > 0")
    weight = 1.0 / y if weighting == "relative" else None
    coef = dict(zip(cols, nnls(x, y, weight).tolist(), strict=True))
    fitted = x @ np.array([coef[t] for t in cols])
    rel = fitted / y - 1 if np.all(y > 0) else np.full(len(y), math.nan)
    return CostFit(
        m=coef.get("m", 0.0),
        c=coef.get("c", 0.0),
        a=coef.get("a", 0.0),
        b=coef.get("b", 0.0),
        rows=len(y),
        r2=_r_squared(y, fitted),
        max_rel_error=float(np.abs(rel).max()) if len(y) else math.nan,
        rel_rmse=float(np.sqrt(np.mean(rel**2))) if len(y) else math.nan,
        weighting=weighting,
    )


def fit_documents(
    lengths: np.ndarray,
    seconds: np.ndarray,
    *,
    terms: Sequence[str] = ("c", "a", "b"),
    weighting: str = "relative",
) -> CostFit:
    """Fit ``seconds ≈ c + a·L + b·L²`` to a per-document latency profile (``[n]`` lengths and
    their seconds), every term >= 0; relative by default: each profiled length counts alike,
    whatever its time (a profile spans 4 decades: 11 µs to 150 ms).

    ``m`` is not fitted (0): one document per point makes it the same column as ``c``. A
    profile whose every test runs the same total tokens (L tokens each, T/L of them per call)
    spreads a per-call constant over its documents as m·L/T, a per-token term: it is inside
    ``a``, which for micro-batches filled to about T tokens is the same cost.
    """
    if "m" in terms:
        raise ValueError("a per-document profile cannot tell m from c: fit c, a and b")
    length = _f(lengths)
    return fit_micro_batches(np.ones(len(length)), length, length * length, seconds,
                             terms=terms, weighting=weighting)  # fmt: skip


def profile_latency(
    lengths: np.ndarray, profile_lengths: np.ndarray, profile_seconds: np.ndarray
) -> np.ndarray:
    """``[n]`` seconds of documents of ``lengths`` read off a measured profile: linear in
    log(L)-log(t) between profiled lengths, and beyond the ends along the end segments' power
    laws (a profile flat below 128 tokens stays flat; t ∝ L² past the longest).

    ``profile_lengths``: ``[p]`` strictly increasing, > 0; ``profile_seconds``: ``[p]`` > 0.

    >>> t = profile_latency(np.array([2, 4, 8]), np.array([1, 4]), np.array([1.0, 16.0]))
    >>> np.round(t, 9).tolist()
    [4.0, 16.0, 64.0]
    """
    pl, pt = np.log(_f(profile_lengths)), np.log(_f(profile_seconds))
    if len(pl) < 2 or np.any(np.diff(pl) <= 0) or not np.all(np.isfinite(pt)):
        raise RolltoolError(
            "a latency profile needs 2 or more strictly increasing lengths with times > 0"
        )
    x = np.log(_f(lengths))
    y = np.interp(x, pl, pt)
    lo, hi = x < pl[0], x > pl[-1]
    y[lo] = pt[0] + (x[lo] - pl[0]) * (pt[1] - pt[0]) / (pl[1] - pl[0])
    y[hi] = pt[-1] + (x[hi] - pl[-1]) * (pt[-1] - pt[-2]) / (pl[-1] - pl[-2])
    return np.exp(y)


def _f(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _r_squared(y: np.ndarray, fitted: np.ndarray) -> float:
    ss_tot = float(np.sum((y - y.mean()) ** 2)) if len(y) else 0.0
    if ss_tot == 0:
        return math.nan
    return 1.0 - float(np.sum((y - fitted) ** 2)) / ss_tot
