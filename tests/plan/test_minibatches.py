"""PPO structure: ``pack --mini-batches M --epochs E`` (`rolltool.plan.minibatches`).

Checked: the cuts (on group boundaries whenever the batch has M groups, else finer, never
empty), that every batch's samples train exactly once per epoch, advantages computed once over
the batch (whitening included), loss denominators per optimizer step, seeded epoch orders, the
format-2 samples.parquet, verify, and loss weights that do not depend on the layout within each
optimizer step.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts

import rolltool
from rolltool.errors import RolltoolError
from rolltool.plan.minibatches import cut_points, epoch_groups, sample_units, split_epoch

# -- the cuts ---------------------------------------------------------------------------------


def test_worked_example() -> None:
    """Groups of 4, 4, 8 and 4 rollouts, M = 2: ideal cut at 10, nearest boundary 8."""
    group = np.repeat([0, 1, 2, 3], [4, 4, 8, 4])
    rollout = np.arange(20)
    parts = split_epoch(np.arange(20), group, rollout, np.ones(20), 2, epoch=0, where="batch 0")
    assert [len(p.samples) for p in parts] == [8, 12] and parts[0].level == "groups"


def nearest_reference(bounds: list[int], cum: np.ndarray, m: int) -> list[int]:
    """Every increasing choice of M - 1 inner boundaries, the one whose cut k is nearest its
    ideal point, compared cut by cut (lexicographically on the errors, as the greedy does)."""
    from itertools import combinations

    total = cum[-1]
    best = None
    for inner in combinations(bounds[1:-1], m - 1):
        errs = [abs(cum[b] - total * (k + 1) / m) for k, b in enumerate(inner)]
        if best is None or errs < best[0]:
            best = (errs, [0, *inner, bounds[-1]])
    assert best is not None
    return best[1]


@pytest.mark.parametrize("seed", range(20))
def test_cuts_are_valid_and_on_group_boundaries(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, rng.integers(2, 9))
    m = int(rng.integers(1, len(sizes) + 1))
    group = np.repeat(np.arange(len(sizes)), sizes)
    units = rng.integers(1, 50, len(group)).astype(np.float64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    cum = np.concatenate([[0], np.cumsum(units)])
    cuts = cut_points(bounds, cum, m)
    assert cuts[0] == 0 and cuts[-1] == len(group) and len(cuts) == m + 1
    assert all(a < b for a, b in itertools.pairwise(cuts))  # never an empty mini-batch
    assert set(cuts) <= set(bounds.tolist())  # whole groups
    if m <= 3:  # the greedy is the cut-by-cut nearest choice
        assert cuts == nearest_reference(bounds.tolist(), cum, m)


def test_fewer_groups_than_mini_batches_cut_finer() -> None:
    group = np.array([0, 0, 0, 0, 1, 1])
    rollout = np.array([0, 0, 1, 2, 3, 3])  # rollout 0 has two branches
    args = {"epoch": 0, "where": "batch 3"}
    parts = split_epoch(np.arange(6), group, rollout, np.ones(6), 3, **args)
    assert parts[0].level == "rollouts"
    for p in parts:  # branches of a rollout stay together
        assert len(set(rollout[p.samples])) == len(set(rollout[p.samples].tolist()))
    cuts = {int(p.samples[0]) for p in parts}
    assert 1 not in cuts and 5 not in cuts
    parts = split_epoch(np.arange(6), group, rollout, np.ones(6), 5, **args)
    assert parts[0].level == "samples" and [len(p.samples) for p in parts].count(0) == 0
    parts = split_epoch(np.arange(6), group, rollout, np.ones(6), 8, **args)  # more than samples
    assert [len(p.samples) for p in parts] == [1] * 6 + [0, 0] and parts[0].level == "empty"
    with pytest.raises(RolltoolError, match="batch 3 trains no sample"):
        split_epoch(np.arange(0), group[:0], rollout[:0], np.ones(0), 2, **args)


def test_units() -> None:
    rollout, length = np.array([0, 0, 1, 2, 2]), np.array([3, 4, 5, 6, 7])
    assert sample_units("rollouts", rollout, length).tolist() == [1, 0, 1, 1, 0]
    assert sample_units("samples", rollout, length).tolist() == [1] * 5
    assert sample_units("tokens", rollout, length).tolist() == [3, 4, 5, 6, 7]


def test_epoch_orders_are_seeded_permutations() -> None:
    groups = np.arange(10, 30)
    assert epoch_groups(groups, 0, 0, 7).tolist() == groups.tolist()
    one = epoch_groups(groups, 0, 1, 7)
    assert sorted(one.tolist()) == groups.tolist() and one.tolist() != groups.tolist()
    assert one.tolist() == epoch_groups(groups, 0, 1, 7).tolist()
    assert one.tolist() != epoch_groups(groups, 0, 2, 7).tolist()
    assert one.tolist() != epoch_groups(groups, 1, 1, 7).tolist()


# -- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 groups of 4 rollouts (one with two branches each), rewards varied, lengths 5..40."""
    rng = np.random.default_rng(11)
    groups = [
        G(
            "math" if g % 3 else "code",
            rng.random(4).round(2).tolist(),
            rng.integers(5, 40, 4).tolist(),
            branches=[2, 1, 1, 1] if g == 4 else None,
        )
        for g in range(12)
    ]
    path = tmp_path_factory.mktemp("ppo") / "in.parquet"
    pq.write_table(rollouts(groups, seed=2), path)
    return path


def rows(out: Path) -> dict[str, np.ndarray]:
    t = pq.read_table(out / "samples.parquet")
    return {c: np.asarray(t.column(c).to_pylist(), dtype=object) for c in t.column_names}


def test_each_batch_trains_once_per_epoch_in_whole_groups(ppo_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    m = pack(ppo_input, out, "--dp", 2, "--batch-size", 24, "--mini-batches", 3,
             "--epochs", 2, "--micro-batch-tokens", 64)  # fmt: skip
    assert m["format_version"] == 2
    assert [(s["batch"], s["epoch"], s["mini_batch"]) for s in m["steps"]] == [
        (b, e, j) for b in range(2) for e in range(2) for j in range(3)
    ]
    r = rows(out)
    n = len(r["sample_index"]) // 2
    assert r["epoch"].tolist() == [0] * n + [1] * n
    assert r["sample_index"].tolist() == list(range(n)) * 2
    batch_of = {k: s["batch"] for k, s in enumerate(m["steps"])}
    for epoch in range(2):
        mine = r["epoch"] == epoch
        assert (r["status"][mine] == "trained").all()
        steps = r["step"][mine]
        assert {int(x) for x in steps} == {
            k for k, s in enumerate(m["steps"]) if s["epoch"] == epoch
        }
        for g in set(r["group_id"].tolist()):  # a group trains at one step per epoch
            assert len({int(x) for x in steps[r["group_id"][mine] == g]}) == 1
        for b in (0, 1):  # the batch's groups, whatever the epoch
            groups = {r["group_id"][mine][i] for i, s in enumerate(steps) if batch_of[int(s)] == b}
            assert len(groups) == 6
    assert cli("verify", out).exit_code == 0


def test_advantages_once_over_the_batch(ppo_input: Path, tmp_path: Path) -> None:
    """Whitening estimators whiten over the batch: every mini-batch and epoch carries the
    advantages the batch has as one optimizer step."""
    args = ("--dp", 2, "--batch-size", 24, "--estimator", "reinforce_pp_baseline")
    pack(ppo_input, tmp_path / "one", *args)
    pack(ppo_input, tmp_path / "ppo", *args, "--mini-batches", 4, "--epochs", 3)
    one, ppo = rows(tmp_path / "one"), rows(tmp_path / "ppo")
    n = len(one["advantage"])
    for e in range(3):
        got = ppo["advantage"][e * n : (e + 1) * n].astype(np.float32)
        assert np.array_equal(got, one["advantage"].astype(np.float32))


def test_denominators_per_optimizer_step(ppo_input: Path, tmp_path: Path) -> None:
    """token-mean: each optimizer step's weights sum to 1 over its trainable tokens (its own
    T); seq-mean-token-mean: each step's samples' weights x tokens sum to 1 (its own S)."""
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = tmp_path / agg
        m = pack(ppo_input, out, "--dp", 2, "--batch-size", 24, "--mini-batches", 3,
                 "--loss-agg", agg)  # fmt: skip
        r = rows(out)
        per_step: dict[int, float] = defaultdict(float)
        for s, w, t in zip(r["step"], r["token_loss_weight"], r["trainable_tokens"], strict=True):
            if s >= 0:
                per_step[int(s)] += float(w) * int(t)
        assert len(per_step) == 6
        for k, total in per_step.items():
            assert total == pytest.approx(1.0, rel=1e-6)
            d = m["steps"][k]["denominators"]
            assert d["trainable_tokens"] == m["steps"][k]["trainable_tokens"]


def test_same_command_same_steps(ppo_input: Path, tmp_path: Path) -> None:
    args = ("--dp", 2, "--batch-size", 24, "--mini-batches", 2, "--epochs", 3, "--seed", 5)
    pack(ppo_input, tmp_path / "a", *args)
    pack(ppo_input, tmp_path / "b", *args)
    assert (tmp_path / "a" / "samples.parquet").read_bytes() == (
        tmp_path / "b" / "samples.parquet"
    ).read_bytes()
    pack(ppo_input, tmp_path / "c", *args[:-1], 6)
    assert rows(tmp_path / "a")["step"].tolist() != rows(tmp_path / "c")["step"].tolist()


def weights_by_step(out: Path) -> dict[tuple[int, int, int], float]:
    """(optimizer step, sample, position) -> loss weight, from the packed rows."""
    ds = rolltool.open_packed(out)
    w = {}
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for row in ds.micro_batches(step, rank):
                cu = row["cu_seqlens"]
                for q, i in enumerate(row["sample_index"].tolist()):
                    if i >= 0:
                        for p, x in enumerate(row["loss_weight"][cu[q] : cu[q + 1]].tolist()):
                            w[(step, i, p)] = x
    return w


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_layout_invariance_per_optimizer_step(ppo_input: Path, tmp_path: Path, agg: str) -> None:
    seen = []
    for dp, budget in [(1, 200), (2, 64), (4, 40)]:
        out = tmp_path / f"p{dp}"
        pack(ppo_input, out, "--dp", dp, "--micro-batch-tokens", budget, "--batch-size", 24,
             "--mini-batches", 2, "--epochs", 2, "--loss-agg", agg)  # fmt: skip
        seen.append(weights_by_step(out))
    assert seen[0] and all(x == seen[0] for x in seen[1:])


def test_a_single_step_pack_is_format_1(ppo_input: Path, tmp_path: Path) -> None:
    m = pack(ppo_input, tmp_path / "p", "--dp", 2, "--batch-size", 24, "--mini-batches", 2)
    assert m["format_version"] == 1
    assert "epoch" not in pq.read_schema(tmp_path / "p" / "samples.parquet").names
    assert cli("verify", tmp_path / "p").exit_code == 0


def test_verify_catches_a_renumbered_step(ppo_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    pack(ppo_input, out, "--dp", 2, "--batch-size", 24, "--mini-batches", 2, "--epochs", 2)
    doc = json.loads((out / "manifest.json").read_text())
    doc["steps"][1]["mini_batch"] = 0
    (out / "manifest.json").write_text(json.dumps(doc))
    r = cli("verify", out, "--json")
    assert r.exit_code == 1
    assert json.loads(r.stdout)["counts"] == {"step.structure": 1}


def test_a_batch_smaller_than_the_mini_batches_leaves_some_empty(
    ppo_input: Path, tmp_path: Path
) -> None:
    """A batch of 4 samples cut into 6 mini-batches: 4 steps of one sample, 2 empty steps
    (training nothing, rows of padding), a warning, and verify agrees."""
    r = cli("pack", ppo_input, "-o", tmp_path / "x", "--dp", 1, "--batch-size", 4,
            "--mini-batches", 6, "--json")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    m = json.loads(r.stdout)
    first = [s["samples"] for s in m["steps"] if s["batch"] == 0]
    assert first == [1, 1, 1, 1, 0, 0]
    assert "leave their last mini-batches empty" in r.stderr
    assert cli("verify", tmp_path / "x").exit_code == 0


def test_groups_split_when_a_batch_has_fewer_than_m(ppo_input: Path, tmp_path: Path) -> None:
    r = cli("pack", ppo_input, "-o", tmp_path / "x", "--dp", 1, "--batch-size", 8,
            "--mini-batches", 3, "--json")  # fmt: skip
    assert r.exit_code == 0
    assert "fewer groups than --mini-batches 3" in r.stderr
    m: dict[str, Any] = json.loads(r.stdout)
    assert any("fewer groups" in w for w in m["warnings"])
    assert cli("verify", tmp_path / "x").exit_code == 0


def test_a_trim_that_empties_a_mini_batch_counts_no_group(ppo_input: Path, tmp_path: Path) -> None:
    """--equal-count-trim per optimizer step: a mini-batch of fewer samples than dp trains none;
    its record then counts the groups that train in it (none), and verify agrees."""
    out = tmp_path / "p"
    m = pack(ppo_input, out, "--dp", 3, "--batch-size", 8, "--mini-batches", 4,
             "--equal-count-trim")  # fmt: skip
    assert any(s["samples"] == 0 for s in m["steps"])
    for s in m["steps"]:
        assert (s["groups"] == 0) == (s["samples"] == 0)
    assert cli("verify", out).exit_code == 0


def test_a_partial_last_batch_over_epochs_verifies(ppo_input: Path, tmp_path: Path) -> None:
    """--keep-last: every optimizer step of the last, partial batch says partial, and verify
    takes that as the run's last batch."""
    out = tmp_path / "p"
    m = pack(ppo_input, out, "--dp", 2, "--batch-size", 20, "--keep-last", "--epochs", 2,
             "--mini-batches", 2)  # fmt: skip
    last = m["steps"][-1]["batch"]
    assert [s["status"] == "partial" for s in m["steps"]] == [
        s["batch"] == last for s in m["steps"]
    ]
    assert sum(s["status"] == "partial" for s in m["steps"]) == 4
    assert cli("verify", out).exit_code == 0


def test_mini_batches_and_epochs_must_be_positive(ppo_input: Path, tmp_path: Path) -> None:
    from rolltool.plan.batches import StepConfig

    for flag in ("--mini-batches", "--epochs"):
        r = cli("pack", ppo_input, "-o", tmp_path / "x", "--dp", 2, flag, 0)
        assert r.exit_code == 2 and flag in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "x").exists()
    with pytest.raises(RolltoolError, match="--epochs must be at least 1, got 0"):
        StepConfig(batch_size=8, epochs=0)
