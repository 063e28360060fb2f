"""Rollouts whose groups share prefixes (issue 24): a prompt per group, agent branches.

`shared_rollouts` writes what ``pack --share-prefix`` is for: every sample of a group starts
with the group's prompt (untrained), then its own response (trained, its own log-probs); with
``branches`` each rollout also splits into that many samples that share a trained trajectory
(same tokens, log-probs and, a rollout's reward being one, advantage) before their own ends.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def shared_rollouts(
    *,
    groups: int = 4,
    rollouts: int = 4,
    prompt: tuple[int, int] = (100, 300),
    response: tuple[int, int] = (20, 200),
    branches: int = 1,
    trajectory: tuple[int, int] = (80, 160),
    identical: int = 0,
    seed: int = 0,
    vocab: int = 50_000,
) -> pa.Table:
    """A table of ``groups`` groups (env ``math``, or ``agent`` with ``branches`` > 1) of
    ``rollouts`` rollouts; ``identical``: that many extra samples per group that repeat its
    first sample exactly (a sample id of their own)."""
    rng = np.random.default_rng(seed)
    names = ("group_id", "rollout_id", "sample_id", "env", "reward", "input_ids", "loss_mask",
             "logprobs")  # fmt: skip
    cols: dict[str, list] = {k: [] for k in names}
    env = "agent" if branches > 1 else "math"

    def add(g: int, r: int, b: int, ids: np.ndarray, mask: np.ndarray, lp: np.ndarray,
            reward: float) -> None:  # fmt: skip
        cols["group_id"].append(f"{env}/{g:04d}")
        cols["rollout_id"].append(f"{env}/{g:04d}/r{r}")
        cols["sample_id"].append(f"{env}/{g:04d}/r{r}/b{b}")
        cols["env"].append(env)
        cols["reward"].append(reward)
        cols["input_ids"].append(ids.astype(np.int32))
        cols["loss_mask"].append(mask.astype(bool))
        cols["logprobs"].append(np.where(mask, lp, 0).astype(np.float32))

    for g in range(groups):
        p = rng.integers(1, vocab, size=int(rng.integers(prompt[0], prompt[1] + 1)))
        first = None
        for r in range(rollouts):
            reward = float(rng.integers(0, 2))
            trunk = np.zeros(0, np.int64)
            if branches > 1:
                trunk = rng.integers(1, vocab, size=int(rng.integers(*trajectory)))
            trunk_lp = -rng.random(len(trunk))
            for b in range(branches):
                own = rng.integers(1, vocab, size=int(rng.integers(response[0], response[1] + 1)))
                ids = np.concatenate([p, trunk, own])
                mask = np.concatenate([np.zeros(len(p)), np.ones(len(trunk) + len(own))])
                lp = np.concatenate([np.zeros(len(p)), trunk_lp, -rng.random(len(own))])
                add(g, r, b, ids, mask, lp, reward)
                if first is None:
                    first = (ids, mask, lp, reward)
        for k in range(identical):
            assert first is not None
            add(g, rollouts + k, 0, *first)
    types = {"input_ids": pa.int32(), "loss_mask": pa.bool_(), "logprobs": pa.float32()}
    return pa.table(
        {
            k: pa.array([x.tolist() for x in v], type=pa.list_(types[k]))
            if k in types
            else pa.array(v)
            for k, v in cols.items()
        }
    )
