"""Cross-row rules: checks that compare rows, over the whole input's light columns.

Each rule in `CROSS_RULES` takes the input frame (one row per sample: ``group_id``,
``rollout_id``, ``sample_id``, ``env``, ``reward``, ``advantage`` when given, ``row`` = the
sample index, ``rollout`` = its dense rollout code) and yields `Flagged` rows of the whole
input. Non-finite and null values are the row rules' to report; these rules skip them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import polars as pl

from rolltool.schema.rows import Flagged


def duplicate_sample_ids(df: pl.DataFrame) -> Iterator[Flagged]:
    """``sample_id.duplicate``: a sample_id seen before, reported at its second row."""
    dup = df.filter(pl.col("sample_id").is_duplicated() & pl.col("sample_id").is_not_null())
    if dup.is_empty():
        return
    rows = dup.group_by("sample_id", maintain_order=True).agg(pl.col("row").head(2))["row"]
    first = {int(r[1]): int(r[0]) for r in rows}
    yield Flagged(
        "sample_id.duplicate",
        np.array(sorted(first), dtype=np.int64),
        lambda i: f"column 'sample_id' repeats (also at row {first[i]} of the ordered input)",
    )


def rollout_rewards(df: pl.DataFrame) -> Iterator[Flagged]:
    """``rollout.reward``: branches of one rollout with different rewards (the reward is the
    rollout's: every branch carries it); reported at the rollout's first row."""
    spread = (
        df.filter(pl.col("reward").is_finite())
        .group_by("rollout")
        .agg(
            pl.col("reward").min().alias("lo"),
            pl.col("reward").max().alias("hi"),
            pl.col("row").min(),
        )
        .filter(pl.col("lo") != pl.col("hi"))
        .sort("row")
    )
    if spread.is_empty():
        return
    span = {int(r): (lo, hi) for r, lo, hi in spread.select("row", "lo", "hi").iter_rows()}
    yield Flagged(
        "rollout.reward",
        spread["row"].to_numpy().astype(np.int64),
        lambda i: (
            "column 'reward': branches of one rollout have different rewards "
            f"({span[i][0]} vs {span[i][1]})"
        ),
    )


def rollout_advantages(df: pl.DataFrame) -> Iterator[Flagged]:
    """``rollout.advantage``: a branch whose given advantage differs from its rollout's first
    branch (the advantage is the rollout's, like the reward); the first such branch of each."""
    if "advantage" not in df.columns or df.is_empty():
        return
    adv = df["advantage"].to_numpy()
    rollout = df["rollout"].to_numpy()
    first = np.full(int(rollout.max()) + 1, -1, dtype=np.int64)
    first[rollout[::-1]] = np.arange(len(rollout))[::-1]  # first branch of each rollout
    ref = adv[first[rollout]]
    differs = (adv != ref) & np.isfinite(adv) & np.isfinite(ref)
    _, at = np.unique(rollout[differs], return_index=True)  # first differing branch of each
    yield Flagged(
        "rollout.advantage",
        np.sort(np.flatnonzero(differs)[at]),
        lambda i: (
            "column 'advantage': branches of one rollout have different advantages "
            f"({ref[i]} in its first branch, {adv[i]} here)"
        ),
    )


def group_envs(df: pl.DataFrame) -> Iterator[Flagged]:
    """``group.env``: a group whose rows name more than one env (its advantages compare
    rollouts of one task); reported at the group's first row."""
    envs = (
        df.group_by("group_id")
        .agg(pl.col("row").min(), pl.col("env").drop_nulls().unique().sort().alias("envs"))
        .filter(pl.col("envs").list.len() > 1)
        .sort("row")
    )
    if envs.is_empty():
        return
    group = dict(zip(envs["row"].to_list(), envs["group_id"].to_list(), strict=True))
    names = dict(zip(envs["row"].to_list(), envs["envs"].to_list(), strict=True))
    yield Flagged(
        "group.env",
        envs["row"].to_numpy().astype(np.int64),
        lambda i: f"column 'env': group {group[i]!r} is spread over envs {names[i]}",
    )


CROSS_RULES: tuple[Callable[[pl.DataFrame], Iterator[Flagged]], ...] = (
    duplicate_sample_ids,
    rollout_rewards,
    rollout_advantages,
    group_envs,
)
