"""Helpers shared by the `rolltool pack` tests (test_pack_*.py); not a test module.

- ``rollouts(groups)``: a tiny hand-made rollout table whose group sizes, rewards, lengths and
  finish times a test chooses exactly.
- ``pack(*args)``: run ``rolltool pack ... --json`` in-process, fail on a non-zero exit, return the
  manifest; ``cli(*args)`` runs any subcommand (click Result, stdout and stderr apart).
- ``placements(out)``: every real segment of every packed row, by sample_index.
- ``input_samples(path)``: the input Parquet's columns per sample, read directly (no rolltool).
- ``grpo_reference``: GRPO advantages computed by hand from the input.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner, Result

import rolltool
from rolltool.cli import main

PROMPT = 2  # leading tokens of every hand-made sample that are not trained on


@dataclass(frozen=True)
class G:
    """One hand-made group: `rewards[k]` and `lengths[k]` of rollout k (one branch each unless
    `branches[k]` > 1; every branch of a rollout has the rollout's length)."""

    env: str
    rewards: Sequence[float]
    lengths: Sequence[int]
    finished: Sequence[float] | None = None
    branches: Sequence[int] | None = None


def rollouts(groups: Sequence[G], *, seed: int = 0, advantage: bool = False) -> pa.Table:
    """A rollout table (input_ids/loss_mask/logprobs, finished_at when every group has times)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[Any]] = defaultdict(list)
    timed = all(g.finished is not None for g in groups)
    for gi, g in enumerate(groups):
        for k, (r, n) in enumerate(zip(g.rewards, g.lengths, strict=True)):
            for b in range(g.branches[k] if g.branches else 1):
                assert n > PROMPT
                cols["group_id"].append(f"{g.env}/g{gi:03d}")
                cols["rollout_id"].append(f"{g.env}/g{gi:03d}/r{k}")
                cols["sample_id"].append(f"{g.env}/g{gi:03d}/r{k}/b{b}")
                cols["env"].append(g.env)
                cols["reward"].append(float(r))
                cols["input_ids"].append(rng.integers(1, 1000, n).tolist())
                cols["loss_mask"].append([False] * PROMPT + [True] * (n - PROMPT))
                cols["logprobs"].append((-rng.random(n)).astype(np.float32).tolist())
                if timed:
                    assert g.finished is not None
                    cols["finished_at"].append(float(g.finished[k]))
                if advantage:  # one value per rollout, as every branch must carry it
                    if b == 0:
                        adv = float(rng.normal())
                    cols["advantage"].append(adv)
    return pa.table(
        {
            **{k: v for k, v in cols.items() if k not in ("input_ids", "loss_mask", "logprobs")},
            "input_ids": pa.array(cols["input_ids"], pa.list_(pa.int32())),
            "loss_mask": pa.array(cols["loss_mask"], pa.list_(pa.bool_())),
            "logprobs": pa.array(cols["logprobs"], pa.list_(pa.float32())),
        }
    )


def cli(*args: Any) -> Result:
    """Run `rolltool ARGS` in-process; an exception escaping the CLI (a traceback) is raised."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def pack(inputs: Path | Sequence[Path], out: Path, *args: Any) -> dict[str, Any]:
    """`rolltool pack INPUTS -o OUT ARGS --json`; asserts success and returns the manifest."""
    paths = [inputs] if isinstance(inputs, Path) else list(inputs)
    result = cli("pack", *paths, "-o", out, *args, "--json")
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def samples(out: Path) -> dict[str, np.ndarray]:
    """samples.parquet as NumPy columns."""
    t = pq.read_table(out / "samples.parquet")
    return {c: np.asarray(t.column(c).to_pylist(), dtype=object) for c in t.column_names} | {
        c: t.column(c).to_numpy()
        for c in ("sample_index", "step", "rank", "micro_batch", "length", "token_loss_weight")
    }


@dataclass(frozen=True)
class Seg:
    """One real segment of a packed row: where it is and its per-token arrays."""

    step: int
    rank: int
    micro_batch: int
    arrays: dict[str, np.ndarray]


def placements(out: Path) -> dict[int, list[Seg]]:
    """sample_index -> every segment of it found in the packed rows (should be exactly one)."""
    ds = rolltool.open_packed(out)
    found: dict[int, list[Seg]] = defaultdict(list)
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for j, row in enumerate(ds.micro_batches(step, rank)):
                cu = row["cu_seqlens"]
                for k, i in enumerate(row["sample_index"].tolist()):
                    if i < 0:
                        continue
                    a, b = int(cu[k]), int(cu[k + 1])
                    arrays = {
                        key: np.asarray(row[key][a:b])
                        for key in (
                            "input_ids",
                            "position_ids",
                            "loss_mask",
                            "advantages",
                            "logprobs",
                            "loss_weight",
                        )
                    }
                    found[i].append(Seg(step, rank, j, arrays))
    return found


def input_samples(paths: Path | Sequence[Path]) -> dict[str, list[Any]]:
    """The input columns per sample, in sample_index order (files in sorted path order)."""
    files = sorted([paths] if isinstance(paths, Path) else paths)
    t = pa.concat_tables([pq.read_table(p) for p in files])
    return {c: t.column(c).to_pylist() for c in t.column_names}


def grpo_reference(inp: dict[str, list[Any]], eps: float = 1e-6) -> np.ndarray:
    """GRPO advantage per sample: rollouts counted once, unbiased std, uniform groups exactly 0."""
    group = np.asarray(inp["group_id"], dtype=object)
    rollout = np.asarray(inp["rollout_id"], dtype=object)
    reward = np.asarray(inp["reward"], dtype=np.float64)
    adv = np.zeros(len(group))
    for g in set(group.tolist()):
        sel = np.flatnonzero(group == g)
        _, first = np.unique(rollout[sel], return_index=True)
        r = reward[sel][first]
        if len(r) == 1:
            adv[sel] = reward[sel] / (1 + eps)
        elif np.all(r == r[0]):
            adv[sel] = 0.0
        else:
            adv[sel] = (reward[sel] - r.mean()) / (r.std(ddof=1) + eps)
    return adv.astype(np.float32)


def token_loss(sample_index: int, n: int) -> np.ndarray:
    """A fixed per-token loss l_t = hash(sample, position) in [0, 1), the same in any layout."""
    pos = np.arange(n, dtype=np.uint64)
    idx = np.full(n, sample_index, dtype=np.uint64)
    h = idx * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xBF58476D1CE4E5B9)
    return ((h >> np.uint64(32)) & np.uint64(0xFFFFFFFF)).astype(np.float64) / 2.0**32
