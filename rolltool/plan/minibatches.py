"""PPO structure: a batch becomes ``epochs`` x ``mini_batches`` optimizer steps.

verl, OpenRLHF and the PPO recipe split each generation batch (what `rolltool.plan.batches` assembles:
a *batch*) into M mini-batches, one optimizer step each, and may go over the batch E times
(``ppo_epochs``). Advantages are computed once over the batch (whitening estimators whiten over
the batch); each optimizer step has its own loss denominators and its own packing.

**Order.** Epoch 0 takes the batch's groups in the order they were assembled; every later epoch
a seeded permutation of them (``numpy.random.default_rng([seed, batch, epoch])``): the same
command gives the same steps. A group's samples keep their order.

**Cuts.** The epoch's samples, group after group, are cut into M contiguous mini-batches of about
``size / M`` batch units each (rollouts, samples or tokens: the batch's unit). Each cut lies on
the *group* boundary nearest to its ideal point, so groups stay whole, whenever the batch has at
least M groups. A batch with fewer groups than M cannot: its cuts fall on *rollout* boundaries
(a group is then shared by two mini-batches, reported as ``split_groups``), or on sample
boundaries with fewer rollouts than M; a batch with fewer trained samples than M is an error.

Worked example (unit rollouts, M = 2): groups of 4, 4, 8 and 4 rollouts (20) -> ideal cut at 10;
the group boundaries sit at 4, 8, 16: the nearest is 8, so mini-batches of 8 and 12 rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import RecordedConfig


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's samples, cut from one epoch of a batch."""

    epoch: int
    index: int  # mini-batch within the epoch
    samples: np.ndarray  # [k] int64 sample indices, in the epoch's order
    level: str  # where the cuts lie: "groups", "rollouts", "samples", or "empty" (some left empty)


def recorded_structure(config: RecordedConfig) -> tuple[int, int] | None:
    """(epochs, mini_batches) a manifest's pack config records ((1, 1) for packs written before
    them); None when they are not positive."""
    e, m = config.steps.epochs, config.steps.mini_batches
    return (e, m) if e >= 1 and m >= 1 else None


def epoch_groups(groups: np.ndarray, batch: int, epoch: int, seed: int) -> np.ndarray:
    """The batch's group codes in epoch `epoch`'s order (epoch 0: as assembled)."""
    if epoch == 0:
        return np.asarray(groups, dtype=np.int64)
    rng = np.random.default_rng([seed, batch, epoch])
    return np.asarray(groups, dtype=np.int64)[rng.permutation(len(groups))]


def cut_points(boundaries: np.ndarray, cum: np.ndarray, m: int) -> list[int]:
    """M + 1 sample positions (first 0, last the sample count), the inner ones chosen from
    `boundaries` (ascending positions, first 0 and last the sample count), each nearest to its
    ideal point k/M of the units (`cum[i]`: units before sample i), leaving every mini-batch at
    least one boundary interval.

    >>> cut_points(np.array([0, 4, 8, 16, 20]), np.arange(21), 2)
    [0, 8, 20]
    """
    total = float(cum[-1])
    cuts, at = [0], 0  # at: index into boundaries of the last cut
    last = len(boundaries) - 1
    for k in range(1, m):
        lo, hi = at + 1, last - (m - k)  # room for the remaining m - k mini-batches
        if lo > hi:
            raise AssertionError("not enough boundaries for the mini-batches")
        candidates = np.arange(lo, hi + 1)
        gap = np.abs(cum[boundaries[candidates]] - total * k / m)
        at = int(candidates[np.argmin(gap)])  # ties: the earlier cut
        cuts.append(int(boundaries[at]))
    cuts.append(int(boundaries[last]))
    return cuts


def _starts(codes: np.ndarray) -> np.ndarray:
    """Positions where a run of equal codes starts, plus the length (ascending)."""
    change = np.flatnonzero(np.diff(codes) != 0) + 1
    return np.concatenate([[0], change, [len(codes)]]).astype(np.int64)


def split_epoch(
    samples: np.ndarray,
    group: np.ndarray,
    rollout: np.ndarray,
    units: np.ndarray,
    m: int,
    *,
    epoch: int,
    where: str,
) -> list[MiniBatch]:
    """Cut one epoch's samples (in order; `group`, `rollout` and `units` per sample) into `m`
    mini-batches (see the module docstring). A batch with fewer samples than `m` (a partial last
    batch, or one that --overlong drop thinned) gets one sample per mini-batch and empty ones
    after them (level ``"empty"``: steps that train nothing, as every rank's empty rows do);
    `where` names the batch in errors."""
    if not len(samples):
        raise RolltoolError(f"{where} trains no sample")  # assembly never makes such a batch
    k = min(m, len(samples))
    cum = np.concatenate([[0], np.cumsum(units, dtype=np.float64)])
    level, bounds = "samples", np.arange(len(samples) + 1, dtype=np.int64)
    for name, codes in (("rollouts", rollout), ("groups", group)):  # the coarsest that can
        starts = _starts(codes)
        if len(starts) - 1 >= k:
            level, bounds = name, starts
    if k < m:
        level = "empty"
    cuts = cut_points(bounds, cum, k)
    parts = [MiniBatch(epoch, j, samples[cuts[j] : cuts[j + 1]], level) for j in range(k)]
    return parts + [MiniBatch(epoch, j, samples[:0], level) for j in range(k, m)]


def sample_units(unit: str, rollout: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[k] each sample's batch units: 1 per rollout (on its first sample), per sample, or its
    tokens."""
    if unit == "samples":
        return np.ones(len(rollout), dtype=np.float64)
    if unit == "tokens":
        return length.astype(np.float64)
    first = np.ones(len(rollout), dtype=bool)
    first[1:] = rollout[1:] != rollout[:-1]
    return first.astype(np.float64)
