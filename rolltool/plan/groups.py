"""The input's groups as planning sees them: each group's samples and its sizes for assembly.

A group is the unit every step takes whole (group-local advantages need all of it). Two views,
both indexed by group code (``Rollouts.group``, 0..G-1), with no per-group Python objects:

- `GroupIndex`: each group's sample indices in input order, one CSR array (``order`` holds n
  sample indices, int32 below 2**31 samples, ``starts`` G+1 int64 offsets), so a step's samples
  are gathered from its group codes in one vectorised pass;
- `assembly_groups`: the per-group counts step assembly (`rolltool.plan.batches.assemble`) fills
  steps with, in rollouts, samples and sampled tokens, counting only samples that can train
  (over-budget ones do not).

Imports inside plan/ go one way: groups, group_advantages, budget and step_records import no
sibling of this list; step_plan imports them; placement imports step_plan; step_warnings imports
placement; schedule imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolltool.plan.batches import Groups
from rolltool.schema import Rollouts
from rolltool.util.ranges import slices


@dataclass(frozen=True)
class GroupIndex:
    """Each group's sample indices in input order, in one CSR array (no per-group objects):
    group g's samples are ``order[starts[g]:starts[g + 1]]``.

    >>> ix = GroupIndex.of(np.array([1, 0, 1, 0, 2]), 3)
    >>> ix[1].tolist(), ix.samples(np.array([2, 0])).tolist()
    ([0, 2], [4, 1, 3])
    """

    order: np.ndarray  # [n] int32 (int64 from 2**31 samples): samples sorted by group, stably
    starts: np.ndarray  # [G+1] int64 offsets into ``order``

    @staticmethod
    def of(group: np.ndarray, num_groups: int) -> GroupIndex:
        order = np.argsort(group, kind="stable").astype(index_dtype(len(group)))
        starts = np.zeros(num_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(group, minlength=num_groups), out=starts[1:])
        return GroupIndex(order, starts)

    def __getitem__(self, g: int) -> np.ndarray:
        """[k] int64 samples of group g, in input order."""
        return self.order[self.starts[g] : self.starts[g + 1]].astype(np.int64)

    def samples(self, groups: np.ndarray) -> np.ndarray:
        """[k] int64 sample indices of `groups` (group codes), group after group."""
        groups = np.asarray(groups, dtype=np.int64)
        lo, hi = self.starts[groups], self.starts[groups + 1]
        counts = hi - lo
        first = np.cumsum(counts) - counts  # where each group's run starts in the output
        at = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - first, counts)
        return self.order[at].astype(np.int64)


def index_dtype(n: int) -> type[np.signedinteger]:
    """int32 for indices below 2**31, else int64."""
    return np.int32 if n < 2**31 else np.int64


CHUNK = 1 << 20
"""Samples per pass where a whole-input count would hold several [n] temporaries at once:
counts summed chunk by chunk are the same integers, in a few MB of scratch."""


def assembly_groups(ro: Rollouts, trained: np.ndarray, uniform: np.ndarray) -> Groups:
    """`Groups` for step assembly: per group code, its env and the rollouts, samples and
    sampled tokens of its `trained` ([n] bool) samples; `uniform`: [G] bool.

    Counted chunk by chunk (`CHUNK` samples): whole counts, so the same integers as one pass
    (token sums are exact in float64 below 2**53 per group), at ~13 bytes per sample at most."""
    G = ro.num_groups
    R = int(ro.rollout.max()) + 1 if len(ro.rollout) else 0
    r_has = np.zeros(R, dtype=bool)  # rollouts with a trained sample
    r_group = np.zeros(R, dtype=index_dtype(G))
    r_group[ro.rollout] = ro.group
    samples = np.zeros(G, dtype=np.int64)
    tokens = np.zeros(G, dtype=np.int64)
    for part in slices(len(trained), CHUNK):
        keep = trained[part]
        g = ro.group[part][keep]
        r_has[ro.rollout[part][keep]] = True
        samples += np.bincount(g, minlength=G)
        tokens += np.bincount(g, weights=ro.length[part][keep], minlength=G).astype(np.int64)
    rollouts = np.zeros(G, dtype=np.int64)
    for part in slices(R, CHUNK):
        rollouts += np.bincount(r_group[part][r_has[part]], minlength=G)
    env = np.zeros(G, dtype=np.int32)
    env[ro.group] = ro.env
    completed = None
    if ro.finished_at is not None:
        completed = np.full(G, -np.inf)
        np.maximum.at(completed, ro.group, ro.finished_at)
    return Groups(
        env=env,
        rollouts=rollouts,
        samples=samples,
        tokens=tokens,
        uniform=uniform,
        completed_at=completed,
    )
