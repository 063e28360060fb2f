"""The token pass of ``pack --share-prefix``: each group's shared prefixes, before planning.

Planning sees light columns only, yet a prefix tree's tokens and cost depend on where its
samples' tokens part. So pack reads the token columns once, group after group in input order,
before it plans, and runs `rolltool.plan.prefix.detect` on each group (tokens, loss masks,
log-probs and the input's group advantages; the planner compares each step's advantages again,
`rolltool.plan.prefix_step.restrict`). What it keeps is small: per group with a prefix, the
forest (a few integers per prefix and per sample). A group's samples are fetched together, a
batch of groups of about ``batch_tokens`` tokens at a time, so memory stays bounded.
"""

from __future__ import annotations

import numpy as np

from rolltool.fetch.tokens import TokenReader
from rolltool.plan.groups import GroupIndex
from rolltool.plan.prefix import GroupTokens, detect
from rolltool.plan.prefix_step import GroupForest, first_trained

BATCH_TOKENS = 16_000_000
"""Tokens fetched at a time by the pass (about 9 bytes each)."""


def group_prefixes(
    reader: TokenReader,
    groups: GroupIndex,
    lengths: np.ndarray,
    share_min: int,
    *,
    advantage: np.ndarray | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> dict[int, GroupForest]:
    """Every group's prefixes (`detect` with `share_min`), keyed by group code, for the groups
    that have at least one; `lengths` [n] each sample's tokens; `advantage` [n] (the input's
    group advantages, or None) compared where trained, so that prefixes split where advantages
    do (the planner compares the step's again)."""
    out: dict[int, GroupForest] = {}
    batch: list[int] = []
    size = 0
    num_groups = len(groups.starts) - 1
    for g in range(num_groups):
        n = int(groups.starts[g + 1] - groups.starts[g])
        if n < 2:
            continue  # one sample shares with no one
        batch.append(g)
        size += int(lengths[groups[g]].sum())
        if size >= batch_tokens:
            out.update(_detect_batch(reader, groups, batch, share_min, advantage))
            batch, size = [], 0
    if batch:
        out.update(_detect_batch(reader, groups, batch, share_min, advantage))
    return out


def _detect_batch(
    reader: TokenReader,
    groups: GroupIndex,
    batch: list[int],
    share_min: int,
    advantage: np.ndarray | None,
) -> dict[int, GroupForest]:
    samples = groups.samples(np.array(batch, dtype=np.int64))
    tokens = reader.fetch(samples)
    off = tokens.offsets
    out: dict[int, GroupForest] = {}
    at = 0
    for g in batch:
        mine = groups[g]
        spans = [(int(off[at + i]), int(off[at + i + 1])) for i in range(len(mine))]
        at += len(mine)
        mask = [tokens.loss_mask[a:b] for a, b in spans]
        found = detect(
            GroupTokens(
                input_ids=[tokens.input_ids[a:b] for a, b in spans],
                loss_mask=mask,
                logprobs=[tokens.logprobs[a:b] for a, b in spans],
                advantages=None if advantage is None else np.asarray(advantage)[mine],
            ),
            share_min,
        )
        if len(found.node_end):
            out[g] = GroupForest(mine, found, first_trained(found, mask))
    return out
