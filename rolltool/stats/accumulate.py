"""Mergeable statistics: partial results of two inputs combine with ``+``, exactly.

Like datatrove's stats, every accumulator here is a small value whose ``a + b`` equals the
accumulator of the concatenated inputs, so files (or batches) are summarized one at a time and
summed. Nothing is approximated: lengths are kept as exact value counts (a sequence length has
at most a few hundred thousand distinct values), moments as (count, mean, M2) merged with Chan's
formula.

Example::

    >>> a = ValueCounts.of(np.array([3, 1, 3]))
    >>> b = ValueCounts.of(np.array([2, 3]))
    >>> (a + b).values.tolist(), (a + b).counts.tolist()
    ([1, 2, 3], [1, 1, 3])
    >>> (a + b).quantile(0.5)
    3
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
"""The percentiles reported for every distribution (key -> fraction)."""


@dataclass(frozen=True)
class ValueCounts:
    """Exact distribution of integers: each distinct value and how often it occurs."""

    values: np.ndarray  # [k] int64, ascending, distinct
    counts: np.ndarray  # [k] int64, > 0

    @classmethod
    def empty(cls) -> ValueCounts:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def of(cls, x: np.ndarray) -> ValueCounts:
        """Value counts of ``x`` (``[n]`` integers)."""
        values, counts = np.unique(np.asarray(x, dtype=np.int64), return_counts=True)
        return cls(values.astype(np.int64), counts.astype(np.int64))

    def __add__(self, other: ValueCounts) -> ValueCounts:
        if not len(other.values):
            return self
        if not len(self.values):
            return other
        values = np.concatenate([self.values, other.values])
        counts = np.concatenate([self.counts, other.counts])
        uniq, inverse = np.unique(values, return_inverse=True)
        return ValueCounts(uniq, np.bincount(inverse, weights=counts).astype(np.int64))

    @property
    def n(self) -> int:
        """Number of values counted."""
        return int(self.counts.sum())

    @property
    def total(self) -> int:
        """Sum of all values (e.g. tokens, for a distribution of lengths)."""
        return int((self.values * self.counts).sum())

    def quantile(self, q: float) -> int | None:
        """The smallest value with at least ``q·n`` values at or below it (inverted CDF).

        Equals ``np.percentile(x, 100·q, method="inverted_cdf")`` on the raw values.
        """
        n = self.n
        if not n:
            return None
        cum = np.cumsum(self.counts)
        k = int(np.searchsorted(cum, q * n, side="left"))
        return int(self.values[min(k, len(self.values) - 1)])

    def mode(self) -> int | None:
        """The most frequent value (the smallest one on a tie)."""
        return int(self.values[int(np.argmax(self.counts))]) if len(self.counts) else None

    def summary(self) -> dict[str, Any]:
        """``total, mean, p50, p90, p99, max`` (and ``min``); None where there is no value."""
        n = self.n
        out: dict[str, Any] = {"total": self.total, "mean": self.total / n if n else None}
        out["min"] = int(self.values[0]) if n else None
        out.update({k: self.quantile(q) for k, q in QUANTILES.items()})
        out["max"] = int(self.values[-1]) if n else None
        return out

    def as_dict(self) -> dict[str, int]:
        """``{value: count}`` with string keys (for JSON)."""
        return {str(int(v)): int(c) for v, c in zip(self.values, self.counts, strict=True)}


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations (M2) of floats, plus min and max."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    @classmethod
    def of(cls, x: np.ndarray) -> Moments:
        x = np.asarray(x, dtype=np.float64)
        if not len(x):
            return cls()
        mean = float(x.mean())
        return cls(len(x), mean, float(((x - mean) ** 2).sum()), float(x.min()), float(x.max()))

    def __add__(self, other: Moments) -> Moments:
        if not other.n:
            return self
        if not self.n:
            return other
        n = self.n + other.n
        delta = other.mean - self.mean
        return Moments(
            n,
            self.mean + delta * other.n / n,
            self.m2 + other.m2 + delta * delta * self.n * other.n / n,
            min(self.min, other.min),
            max(self.max, other.max),
        )

    @property
    def std(self) -> float | None:
        """Unbiased (n - 1) standard deviation; None below two values."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else None

    def summary(self) -> dict[str, Any]:
        return {
            "mean": self.mean if self.n else None,
            "std": self.std,
            "min": self.min if self.n else None,
            "max": self.max if self.n else None,
        }


@dataclass(frozen=True)
class Stats:
    """What ``rolltool stats`` computes: the report and, for plots, sample lengths per env."""

    report: dict[str, Any]
    """The JSON document (keys documented in the README, section `rolltool stats`)."""
    lengths: dict[str, ValueCounts]
    """Sample lengths (tokens) per env: all rows of rollout Parquet, trained samples if packed."""


def add_dicts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Key-wise ``+`` of two dicts of accumulators (a key missing on one side is taken as is)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def percentiles(x: np.ndarray) -> dict[str, Any]:
    """``mean, min, p50, p90, max`` of a small float array (per-step figures across steps).

    Percentiles are inverted-CDF, as everywhere in stats (``ValueCounts.quantile``): the
    smallest value with at least q·n values at or below it, always one of the values."""
    x = np.asarray([v for v in x if v is not None], dtype=np.float64)
    x = x[np.isfinite(x)]
    if not len(x):
        return {"mean": None, "min": None, "p50": None, "p90": None, "max": None}
    return {
        "mean": float(x.mean()),
        "min": float(x.min()),
        "p50": float(np.percentile(x, 50, method="inverted_cdf")),
        "p90": float(np.percentile(x, 90, method="inverted_cdf")),
        "max": float(x.max()),
    }
