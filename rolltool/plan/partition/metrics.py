"""How well a step is balanced: figures of a ``[R, M]`` grid, in tokens, cost or seconds.

``x[r, j]`` is what rank r's micro-batch j holds or takes (tokens, the workload's cost, measured
seconds), R ranks, M micro-batches per rank. The planner (`rolltool.plan.partition.plan`), ``rolltool
stats`` and ``rolltool bench`` all use these, so a figure means the same everywhere:

=====================  ============================  =============================================
figure                 formula                       meaning
=====================  ============================  =============================================
``ideal``              Σ_r Σ_j x(r, j) / R           perfectly balanced work
``dp_cost``            max_r Σ_j x(r, j)             plain data parallel (``--align total``):
                                                     ranks meet once, at the end of the step
``lockstep_cost``      Σ_j max_r x(r, j)             FSDP/ZeRO-3/TP (``--align lockstep``): ranks
                                                     meet at every micro-batch
``imbalance``          dp_cost / ideal               1.0 when perfect
``lockstep_overhead``  lockstep_cost / ideal         1.0 when perfect; >= imbalance
=====================  ============================  =============================================

``step_cost(x, align)`` is the step's time in x's units under the alignment: ``dp_cost`` for
``total``, ``lockstep_cost`` for ``lockstep``. An empty grid (or one with nothing in it) has
costs 0 and ratios 1.0.

Example: R = 2, rank 0 holds (3, 1), rank 1 holds (1, 3). ideal = 8 / 2 = 4, dp_cost =
max(4, 4) = 4, lockstep_cost = max(3, 1) + max(1, 3) = 6: imbalance 1.0, lockstep overhead 1.5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "ALIGNS",
    "STEP_COSTS",
    "dp_cost",
    "grid_costs",
    "ideal",
    "imbalance",
    "lockstep_cost",
    "lockstep_overhead",
    "step_cost",
]


def ideal(x: np.ndarray) -> float:
    """Σ x / R: each rank's share of perfectly balanced work."""
    return float(x.sum()) / x.shape[0]


def dp_cost(x: np.ndarray) -> float:
    """max_r Σ_j x(r, j): the slowest rank's total (0.0 for an empty grid)."""
    return float(x.sum(axis=1).max()) if x.size else 0.0


def lockstep_cost(x: np.ndarray) -> float:
    """Σ_j max_r x(r, j): every slot waits for its slowest rank (0.0 for an empty grid).

    Summed slot by slot in order (not NumPy's pairwise sum), so the planner's comparisons of
    candidate plans and the figure reported for the chosen one are the same number.
    """
    return float(sum(x.max(axis=0).tolist())) if x.size else 0.0


STEP_COSTS: dict[str, Callable[[np.ndarray], float]] = {
    "lockstep": lockstep_cost,
    "total": dp_cost,
}
"""The step's cost by ``--align`` name: how the ranks meet."""

ALIGNS = tuple(STEP_COSTS)
"""``lockstep``: minimize Σ_j max_r cost(r, j); ``total``: minimize max_r Σ_j cost(r, j)."""


def step_cost(x: np.ndarray, align: str) -> float:
    """The step's time under ``align`` (``lockstep`` or ``total``), in x's units."""
    return STEP_COSTS[align](x)


def imbalance(x: np.ndarray) -> float:
    """dp_cost / ideal: the slowest rank's total over the mean; 1.0 when perfect or empty."""
    if not x.size or float(x.sum()) <= 0:
        return 1.0
    return dp_cost(x) / ideal(x)


def lockstep_overhead(x: np.ndarray) -> float:
    """lockstep_cost / ideal: Σ_j max_r over the mean rank total; 1.0 when perfect or empty."""
    if not x.size or float(x.sum()) <= 0:
        return 1.0
    return lockstep_cost(x) / ideal(x)


def grid_costs(grid: Sequence[Sequence[np.ndarray]], weight: np.ndarray) -> np.ndarray:
    """``[R, M]`` float64: Σ ``weight`` over the sample indices of each rank's micro-batch.

    ``grid[r][j]`` holds the sample indices of rank r's micro-batch j (every rank has M).
    """
    r_count = len(grid)
    m = len(grid[0]) if r_count else 0
    if not r_count * m:
        return np.zeros((r_count, m))
    flat = [mb for row in grid for mb in row]
    sizes = np.fromiter((len(mb) for mb in flat), dtype=np.int64, count=len(flat))
    if not sizes.sum():
        return np.zeros((r_count, m))
    cell = np.repeat(np.arange(len(flat)), sizes)
    w = np.asarray(weight, dtype=np.float64)[np.concatenate(flat).astype(np.int64, copy=False)]
    return np.bincount(cell, weights=w, minlength=len(flat)).reshape(r_count, m)
