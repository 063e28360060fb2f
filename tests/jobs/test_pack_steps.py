"""Step assembly as `rolltool pack` applies it: which groups form each optimizer step.

Hand-made inputs (tests/pack_helpers.rollouts) whose group sizes, rewards, lengths and finish
times are chosen so that every rule of the issue's "Step assembly" section has one right answer:
batch units, closing short, --exact, oversize groups, --uniform drop refill, --order, --env-weight,
leftovers and --keep-last, --overlong drop, and advantages (per-step whitening, given columns).
Every run is also checked against the invariants that hold for any options (`_invariants`).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import (
    PROMPT,
    G,
    cli,
    grpo_reference,
    input_samples,
    pack,
    placements,
    rollouts,
    samples,
)

BASE = ("--dp", 2, "--micro-batch-tokens", 1024)


@dataclass
class Run:
    manifest: dict[str, Any]
    samples: dict[str, np.ndarray]
    input: dict[str, list[Any]]
    out: Path

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.manifest["steps"]

    def step_groups(self) -> list[set[int]]:
        """Group numbers (the gNNN of hand-made group ids) trained in each step."""
        found: list[set[int]] = [set() for _ in self.steps]
        for g, st, step in zip(
            self.input["group_id"], self.samples["status"], self.samples["step"], strict=True
        ):
            if st == "trained":
                found[int(step)].add(_gnum(g))
        return found

    def status_of_group(self, g: int) -> set[str]:
        return {
            st
            for gid, st in zip(self.input["group_id"], self.samples["status"], strict=True)
            if _gnum(gid) == g
        }


def _gnum(group_id: str) -> int:
    return int(group_id.split("/g")[1])


@pytest.fixture
def run(tmp_path: Path) -> Any:
    """`run(table_or_groups, *args)`: write the input, pack it with BASE + args, check invariants.

    BASE's token budget is left out when args choose --micro-batch-size."""
    count = iter(range(1000))

    def go(data: pa.Table | list[G], *args: Any) -> Run:
        k = next(count)
        table = data if isinstance(data, pa.Table) else rollouts(data)
        path = tmp_path / f"in{k}.parquet"
        pq.write_table(table, path)
        out = tmp_path / f"out{k}"
        base = BASE[:2] if "--micro-batch-size" in args else BASE
        r = Run(pack(path, out, *base, *args), samples(out), input_samples(path), out)
        _invariants(r)
        return r

    return go


def _invariants(r: Run) -> None:
    """What holds for every option: groups whole, one step per trained sample, metadata adds up."""
    inp, s = r.input, r.samples
    placed = placements(r.out)
    trained = np.flatnonzero(s["status"] == "trained")
    assert sorted(placed) == trained.tolist()
    assert all(len(v) == 1 and v[0].step == s["step"][i] for i, v in placed.items())
    # A group's trained samples share one step; nothing of it is trained elsewhere.
    steps_of: dict[str, set[int]] = {}
    for i in trained:
        steps_of.setdefault(inp["group_id"][i], set()).add(int(s["step"][i]))
    assert all(len(v) == 1 for v in steps_of.values()), steps_of
    unit = r.manifest["config"]["steps"]["batch_unit"]
    for k, meta in enumerate(r.steps):
        mine = trained[s["step"][trained] == k]
        rollouts_ = {inp["rollout_id"][i] for i in mine}
        lengths = np.array([len(inp["input_ids"][i]) for i in mine])
        trainable = sum(int(np.sum(inp["loss_mask"][i])) for i in mine)
        assert meta["samples"] == len(mine) > 0
        assert meta["rollouts"] == len(rollouts_)
        assert meta["groups"] == len({inp["group_id"][i] for i in mine})
        assert meta["sampled_tokens"] == int(lengths.sum())
        assert meta["trainable_tokens"] == trainable
        actual = {"rollouts": len(rollouts_), "samples": len(mine), "tokens": int(lengths.sum())}
        assert meta["actual"] == actual[unit]
        if meta["status"] == "full":
            assert meta["actual"] == meta["nominal"] or unit == "tokens"
        if meta["status"] == "oversize":
            assert meta["actual"] > meta["nominal"] and meta["groups"] == 1
        elif unit != "tokens" or meta["status"] != "partial":
            assert meta["actual"] <= meta["nominal"]
        for env, em in meta["envs"].items():
            sel = [i for i in mine if inp["env"][i] == env]
            assert em["samples"] == len(sel)
            assert em["sampled_tokens"] == sum(len(inp["input_ids"][i]) for i in sel)
            if sel:
                first = {inp["rollout_id"][i]: inp["reward"][i] for i in sel}
                assert em["reward_mean"] == pytest.approx(np.mean(list(first.values())))
                assert {"advantage_mean", "advantage_std", "trainable_tokens"} <= set(em)
        assert sum(em["samples"] for em in meta["envs"].values()) == meta["samples"]


def _mixed(env: str, n: int, length: int = 20) -> G:
    """A group of n rollouts with distinct rewards (not uniform)."""
    return G(env, [i / n for i in range(n)], [length] * n)


def _uniform(env: str, n: int, reward: float = 1.0) -> G:
    return G(env, [reward] * n, [20] * n)


def _statuses(r: Run) -> list[str]:
    return [m["status"] for m in r.steps]


# --- batch units ---------------------------------------------------------------------------


def test_rollouts_close_short_and_partial_step_is_dropped(run: Any) -> None:
    groups = [_mixed("math", n) for n in (4, 4, 2, 4, 4)]
    r = run(groups, "--batch-size", 8)
    assert r.step_groups() == [{0, 1}, {2, 3}]
    assert _statuses(r) == ["full", "short"]
    assert [m["actual"] for m in r.steps] == [8, 6] and {m["nominal"] for m in r.steps} == {8}
    assert r.status_of_group(4) == {"leftover"}
    assert r.manifest["partial_step_dropped"] == {"groups": 1, "actual": 4}
    assert r.manifest["samples"]["leftover"] == 4
    assert any("left over" in w for w in r.manifest["warnings"])

    kept = run(groups, "--batch-size", 8, "--keep-last")
    assert kept.step_groups() == [{0, 1}, {2, 3}, {4}]
    assert _statuses(kept) == ["full", "short", "partial"]
    assert kept.manifest["samples"]["leftover"] == 0


def test_exact_makes_a_short_step_an_error(run: Any, tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(rollouts([_mixed("math", n) for n in (4, 4, 2, 4, 4)]), path)
    result = cli("pack", path, "-o", tmp_path / "out", *BASE, "--batch-size", 8, "--exact")
    assert result.exit_code == 1
    assert "Error:" in result.stderr and "--exact" in result.stderr and "step 1" in result.stderr
    assert not (tmp_path / "out").exists()
    ok = run([_mixed("math", 4) for _ in range(4)], "--batch-size", 8, "--exact")
    assert _statuses(ok) == ["full", "full"]


def test_samples_unit_counts_branches(run: Any) -> None:
    groups = [
        G("agent", [0.0, 1.0], [30, 40], branches=[2, 1]),  # 2 rollouts, 3 samples
        G("agent", [0.0, 0.5, 1.0], [30, 30, 30]),  # 3 rollouts, 3 samples
        G("agent", [0.0, 1.0], [30, 40], branches=[1, 3]),  # 2 rollouts, 4 samples
        G("agent", [1.0, 0.0], [30, 30]),  # 2 rollouts, 2 samples
    ]
    r = run(groups, "--batch-unit", "samples", "--batch-size", 6)
    assert r.step_groups() == [{0, 1}, {2, 3}]
    assert [m["samples"] for m in r.steps] == [6, 6]
    assert [m["rollouts"] for m in r.steps] == [5, 4]  # same nominal size, different rollouts
    by_rollouts = run(groups, "--batch-unit", "rollouts", "--batch-size", 4, "--keep-last")
    assert by_rollouts.step_groups() == [{0}, {1}, {2, 3}]
    assert _statuses(by_rollouts) == ["short", "short", "full"]


def test_tokens_unit_fills_within_budget_and_big_group_goes_alone(run: Any) -> None:
    groups = [
        G("code", [0, 1], [50, 50]),  # 100 tokens
        G("code", [0, 1], [40, 40]),  # 80
        G("code", [0, 1], [300, 300]),  # 600: over the 200-token step, alone
        G("code", [0, 1], [50, 50]),  # 100
        G("code", [0, 1], [45, 45]),  # 90
        G("code", [0, 1], [60, 60]),  # 120: the input runs dry before the step is done
    ]
    r = run(groups, "--batch-unit", "tokens", "--batch-size", 200, "--keep-last")
    assert r.step_groups() == [{0, 1}, {2}, {3, 4}, {5}]
    assert [m["actual"] for m in r.steps] == [180, 600, 190, 120]
    assert _statuses(r)[1] == "oversize" and _statuses(r)[3] == "partial"


def test_a_group_larger_than_the_step_goes_alone(run: Any) -> None:
    r = run([_mixed("math", n) for n in (2, 6, 2, 2)], "--batch-size", 4)
    assert r.step_groups() == [{0}, {1}, {2, 3}]
    assert _statuses(r) == ["short", "oversize", "full"]
    assert [m["actual"] for m in r.steps] == [2, 6, 4]


# --- uniform groups ------------------------------------------------------------------------


def test_uniform_drop_refills_the_step_and_counts_per_env(run: Any) -> None:
    groups = [
        _mixed("math", 4),
        _uniform("math", 4, 1.0),
        _mixed("math", 4),
        _uniform("code", 4, 0.0),
        _mixed("math", 4),
        _mixed("code", 4),
    ]
    kept = run(groups, "--batch-size", 8)
    assert kept.step_groups() == [{0, 1}, {2, 3}, {4, 5}]
    assert [m["uniform_groups_kept"] for m in kept.steps] == [1, 1, 0]
    assert [m["uniform_groups_dropped"] for m in kept.steps] == [0, 0, 0]

    dropped = run(groups, "--batch-size", 8, "--uniform", "drop")
    assert dropped.step_groups() == [{0, 2}, {4, 5}]  # each step draws on three groups
    assert [m["groups"] for m in dropped.steps] == [2, 2]
    assert [m["uniform_groups_dropped"] for m in dropped.steps] == [1, 1]
    assert dropped.steps[0]["envs"]["math"]["uniform_groups_dropped"] == 1
    assert dropped.steps[1]["envs"]["code"]["uniform_groups_dropped"] == 1
    assert dropped.steps[1]["envs"]["math"]["uniform_groups_dropped"] == 0
    s = dropped.samples
    for g, step in ((1, 0), (3, 1)):
        sel = [i for i, gid in enumerate(dropped.input["group_id"]) if _gnum(gid) == g]
        assert set(s["status"][sel]) == {"uniform_dropped"} and set(s["step"][sel]) == {step}
    assert dropped.manifest["samples"]["uniform_dropped"] == 8


def test_a_singleton_group_is_never_dropped_as_uniform(run: Any) -> None:
    groups = [G("math", [1.0], [20]), _uniform("math", 2), G("math", [0.0], [20])]
    r = run(groups, "--batch-size", 2, "--uniform", "drop")
    assert r.step_groups() == [{0, 2}]
    assert r.steps[0]["uniform_groups_dropped"] == 1


# --- order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("as_timestamp", [False, True])
def test_completion_order_follows_the_last_rollout(run: Any, as_timestamp: bool) -> None:
    finished = [(10.0, 50.0), (20.0, 30.0), (5.0, 40.0), (1.0, 60.0)]
    table = rollouts([G("math", [0, 1], [20, 20], finished=f) for f in finished])
    if as_timestamp:
        epoch = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
        times = [epoch + dt.timedelta(seconds=x) for x in table.column("finished_at").to_pylist()]
        i = table.column_names.index("finished_at")
        table = table.set_column(i, "finished_at", pa.array(times, pa.timestamp("us", tz="UTC")))
    r = run(table, "--batch-size", 2, "--order", "completion")
    # By last rollout: 30, 40, 50, 60. (By first rollout it would be g3, g2, g0, g1.)
    assert r.step_groups() == [{1}, {2}, {0}, {3}]
    assert r.manifest["config"]["steps"]["order"] == "completion"


def test_shuffle_is_seeded_and_deterministic(run: Any) -> None:
    groups = [_mixed("math", 2) for _ in range(12)]
    a = run(groups, "--batch-size", 2, "--order", "shuffle", "--seed", 1)
    b = run(groups, "--batch-size", 2, "--order", "shuffle", "--seed", 1)
    c = run(groups, "--batch-size", 2, "--order", "shuffle", "--seed", 2)
    order = [next(iter(x)) for x in a.step_groups()]
    assert sorted(order) == list(range(12))  # a permutation of whole groups
    assert order != list(range(12))
    assert b.step_groups() == a.step_groups()
    assert c.step_groups() != a.step_groups()
    for x, y in ((a, b),):
        assert x.samples["rank"].tolist() == y.samples["rank"].tolist()


# --- env weights ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "size", "share"),
    [(("math=0.5", "code=0.5"), 8, {"math": 4, "code": 4}), (("math=3", "code=1"), 16, {"math": 12, "code": 4})],
)  # fmt: skip
def test_env_weights_fix_each_steps_share(
    run: Any, weights: tuple[str, ...], size: int, share: dict[str, int]
) -> None:
    groups = (
        [_mixed("math", 4) for _ in range(9)]
        + [_mixed("code", 2) for _ in range(6)]
        + [_mixed("agent", 2) for _ in range(2)]
    )
    # Interleave envs in the input so quotas, not input order, decide each step's mix.
    order = [0, 9, 15, 1, 10, 2, 11, 16, 3, 12, 4, 13, 5, 14, 6, 7, 8]
    args = [a for w in weights for a in ("--env-weight", w)]
    r = run([groups[i] for i in order], "--batch-size", size, *args)
    assert len(r.steps) >= 2
    for meta in r.steps:
        assert {e: meta["envs"][e]["rollouts"] for e in share} == share
        assert "agent" not in meta["envs"]
        assert meta["actual"] == size
    agent = [i for i, e in enumerate(r.input["env"]) if e == "agent"]
    assert set(r.samples["status"][agent]) == {"env_unweighted"}
    assert any("--env-weight" in w for w in r.manifest["warnings"])
    # Each env's quota is filled from that env's groups in input order.
    for env in share:
        seen = [
            _gnum(g)
            for i, g in sorted(
                enumerate(r.input["group_id"]), key=lambda x: r.samples["step"][x[0]]
            )
            if r.input["env"][i] == env and r.samples["status"][i] == "trained"
        ]
        firsts = list(dict.fromkeys(seen))
        in_input = list(dict.fromkeys(_gnum(g) for g, e in zip(r.input["group_id"], r.input["env"], strict=True) if e == env))  # fmt: skip
        assert firsts == in_input[: len(firsts)]
    # Advantages stay within groups (never pooled over envs).
    placed = placements(r.out)
    ref = grpo_reference(r.input)
    assert placed and all(
        np.allclose(v[0].arrays["advantages"], ref[i], atol=1e-6) for i, v in placed.items()
    )


# --- over-long samples ---------------------------------------------------------------------


def test_overlong_drop_removes_only_that_sample(run: Any) -> None:
    groups = [G("math", [1.0, 0.0, 1.0, 0.0], [40, 40, 2000, 40]), _mixed("code", 4)]
    r = run(groups, "--batch-size", 7, "--overlong", "drop")
    s = r.samples
    assert s["status"].tolist() == ["trained"] * 2 + ["overlong_dropped"] + ["trained"] * 5
    assert s["step"][2] == 0
    meta = r.steps[0]
    assert meta["overlong_dropped"] == 1 and meta["envs"]["math"]["overlong_dropped"] == 1
    assert meta["envs"]["code"]["overlong_dropped"] == 0
    assert meta["envs"]["math"]["rollouts"] == 3
    # The group's other samples keep the advantages computed with the dropped one (mean 0.5).
    placed = placements(r.out)
    ref = grpo_reference(r.input)
    assert 2 not in placed and ref[0] != 0
    for i in (0, 1, 3):
        assert np.allclose(placed[i][0].arrays["advantages"], ref[i], atol=1e-6)


def test_samples_outside_kept_steps_say_why_they_could_not_train(run: Any) -> None:
    groups = [
        _mixed("math", 2),
        _uniform("math", 2),  # dropped while filling the final, partial step
        G("math", [0, 1], [20, 2000]),  # one over-long sample; the other is left over
        G("math", [0, 1], [2000, 2000]),  # nothing trainable
    ]
    r = run(groups, "--batch-size", 2, "--uniform", "drop", "--overlong", "drop")
    assert r.step_groups() == [{0}]
    expected = ["trained"] * 2 + ["uniform_dropped"] * 2 + ["leftover"] + ["overlong_dropped"] * 3
    assert r.samples["status"].tolist() == expected
    assert r.samples["step"].tolist() == [0, 0] + [-1] * 6
    counts = r.manifest["samples"]
    assert (counts["uniform_dropped"], counts["overlong_dropped"], counts["leftover"]) == (2, 3, 1)


# --- advantages ----------------------------------------------------------------------------


def _whitened_reference(r: Run) -> dict[int, float]:
    """reinforce_pp_baseline per step by hand: a = r - group mean over the whole group (over-long
    samples included), whitened over the trainable tokens of the samples trained in the step."""
    inp, s = r.input, r.samples
    gid = np.asarray(inp["group_id"], dtype=object)
    rid = np.asarray(inp["rollout_id"], dtype=object)
    reward = np.asarray(inp["reward"])
    a = np.zeros(len(gid))
    for g in set(gid.tolist()):
        sel = np.flatnonzero(gid == g)
        _, first = np.unique(rid[sel], return_index=True)
        a[sel] = reward[sel] if len(first) == 1 else reward[sel] - reward[sel][first].mean()
    t = np.array([int(np.sum(m)) for m in inp["loss_mask"]], dtype=np.float64)
    out: dict[int, float] = {}
    for k in range(len(r.steps)):
        sel = np.flatnonzero((s["step"] == k) & (s["status"] == "trained"))
        m = (t[sel] * a[sel]).sum() / t[sel].sum()
        v = (t[sel] * (a[sel] - m) ** 2).sum() / (t[sel].sum() - 1)
        out.update({int(i): float((a[i] - m) / np.sqrt(v + 1e-8)) for i in sel})
    return out


def test_reinforce_pp_baseline_whitens_per_step(run: Any) -> None:
    groups = [
        G("math", [1.0, 0.0, 0.0, 1.0], [30, 50, 2000, 70]),  # sample 2 is over-long
        G("math", [0.2, 0.4, 0.9, 0.1], [25, 35, 45, 55]),
        G("math", [3.0, 1.0, 2.0, 2.0], [40, 30, 20, 10]),
        G("math", [5.0], [60]),  # a singleton: a = r
    ]
    r = run(groups, "--batch-size", 7, "--estimator", "reinforce_pp_baseline",
            "--overlong", "drop", "--keep-last")  # fmt: skip
    assert r.manifest["advantages"]["whitening"] == "per step"
    assert r.manifest["advantages"]["estimators"] == {"math": "reinforce_pp_baseline"}
    assert len(r.steps) == 2
    expected = _whitened_reference(r)
    placed = placements(r.out)
    assert sorted(expected) == sorted(placed) and len(placed) == 12
    for i, v in placed.items():
        np.testing.assert_allclose(v[0].arrays["advantages"], expected[i], rtol=1e-5, atol=1e-6)
        assert r.samples["advantage"][i] == pytest.approx(expected[i], rel=1e-5, abs=1e-6)


def test_per_env_whitening_with_a_step_without_that_env(run: Any) -> None:
    """Step 0 holds only math (grpo), step 1 only code (reinforce_pp_baseline): the whitening
    estimator has nothing to do in step 0, and whitens over step 1's code samples."""
    groups = [_mixed("math", 4), G("code", [1.0, 0.0, 0.5, 0.25], [30, 40, 50, 60])]
    r = run(groups, "--batch-size", 4, "--env-estimator", "code=reinforce_pp_baseline")
    assert r.step_groups() == [{0}, {1}]
    assert r.manifest["advantages"]["estimators"] == {"math": "grpo", "code": "reinforce_pp_baseline"}  # fmt: skip
    whitened = _whitened_reference(r)
    grpo = grpo_reference(r.input)
    for i, v in placements(r.out).items():
        want = whitened[i] if r.input["env"][i] == "code" else grpo[i]
        np.testing.assert_allclose(v[0].arrays["advantages"], want, rtol=1e-5, atol=1e-6)


def test_an_advantage_column_is_used_as_is(run: Any) -> None:
    groups = [_mixed("math", 4), _uniform("code", 4), _mixed("math", 2)]
    table = rollouts(groups, advantage=True)
    r = run(table, "--batch-size", 4, "--estimator", "reinforce_pp_baseline", "--keep-last")
    assert "input" in r.manifest["advantages"]["source"]
    assert r.manifest["advantages"]["whitening"] is None
    given = np.asarray(r.input["advantage"], dtype=np.float32)
    placed = placements(r.out)
    assert len(placed) == 10
    for i, v in placed.items():
        assert np.all(v[0].arrays["advantages"] == given[i]), i


@pytest.mark.parametrize("option", [("--estimator", "rloo"), ("--env-estimator", "nosuchenv=rloo")])
def test_estimator_options_on_given_advantages_warn_alike(run: Any, option: tuple) -> None:
    # Only the group statistics are computed from given advantages: an estimator option,
    # even one naming an env the input lacks, is ignored with the same warning.
    table = rollouts([_mixed("math", 4), _mixed("math", 4)], advantage=True)
    r = run(table, "--batch-size", 8, *option)
    assert any("used as is" in w for w in r.manifest["warnings"])
    given = np.asarray(r.input["advantage"], dtype=np.float32)
    assert all(np.all(v[0].arrays["advantages"] == given[i]) for i, v in placements(r.out).items())


# --- partition options ---------------------------------------------------------------------


def test_micro_batch_size_fixed_mode(run: Any) -> None:
    groups = [
        G("math", [i / 8 for i in range(8)], [10 + 7 * i for i in range(8)]) for _ in range(3)
    ]
    r = run(groups, "--batch-size", 8, "--micro-batch-size", 3, "--dp", 2, "--row-len", 512)
    placed = placements(r.out)
    counts: Counter[tuple[int, int, int]] = Counter(
        (v[0].step, v[0].rank, v[0].micro_batch) for v in placed.values()
    )
    assert len(placed) == 24 and max(counts.values()) == 3
    for meta in r.steps:
        # 8 samples over 2 ranks in micro-batches of 3: 2 slots per rank, the last one short.
        assert [x["micro_batches"] for x in meta["ranks"]] == [2, 2]
        assert sorted(counts[(meta["step"], rk, j)] for rk in (0, 1) for j in (0, 1)) == [
            1,
            1,
            3,
            3,
        ]


def test_equal_count_gives_every_rank_the_same_number_of_samples(run: Any) -> None:
    # One long sample and seven short ones per step: token balance alone would not count evenly.
    groups = [G("math", [i / 8 for i in range(8)], [900] + [20] * 7) for _ in range(2)]
    free = run(groups, "--batch-size", 8, "--dp", 2, "--balance", "tokens")
    even = run(groups, "--batch-size", 8, "--dp", 2, "--balance", "tokens", "--equal-count")
    assert [[x["samples"] for x in m["ranks"]] for m in free.steps] != [[4, 4]] * 2
    assert [[x["samples"] for x in m["ranks"]] for m in even.steps] == [[4, 4]] * 2
    assert even.manifest["config"]["equal_count"] is True


def test_align_total_still_meets_every_invariant(run: Any) -> None:
    groups = [
        G("code", [i / 6 for i in range(6)], [50 * (i + 1) for i in range(6)]) for _ in range(4)
    ]
    r = run(groups, "--batch-size", 12, "--dp", 3, "--align", "total")
    assert r.manifest["config"]["align"] == "total"
    result = cli("verify", r.out)
    assert result.exit_code == 0, result.stdout
    assert len(placements(r.out)) == 24


def test_prompt_tokens_are_not_trained(run: Any) -> None:
    r = run([_mixed("math", 4)], "--batch-size", 4)
    for v in placements(r.out).values():
        a = v[0].arrays
        assert np.all(a["loss_mask"][:PROMPT] == 0) and np.all(a["loss_weight"][:PROMPT] == 0)
        assert np.all(a["loss_weight"][PROMPT:] > 0)
