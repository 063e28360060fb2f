"""`verify` checks every figure of a step's record, overall and per env (issue 13).

A manifest edited in any `StepCounts` field (groups, rollouts, rewards, uniform and over-long
drops, ...) is one problem of a stable kind; the test walks the dataclass's fields, so a figure
added to the format without a check fails here. The packs drop uniform groups and over-long
samples, so the drop counts are not all zero.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from verify_helpers import copier, edit_manifest, edit_samples, kinds, pack_layouts, rehash

from rolltool.format import StepCounts
from rolltool.verify import verify

BASE = ("--dp", 2, "--batch-size", 32, "--micro-batch-tokens", 3000, "--overlong", "drop")
PACKS = {"drop": (*BASE, "--uniform", "drop"), "keep": BASE}
KIND = {
    "reward_mean": "step.reward",
    "advantage_mean": "step.advantage",
    "advantage_std": "step.advantage",
    "loss_weight_sum": "step.weight_sum",
}
FIGURES = [f.name for f in dataclasses.fields(StepCounts)]


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return pack_layouts(tmp_path_factory.mktemp("verify_steps"), PACKS, groups=24, seed=5)


@pytest.fixture
def copy(packs: dict[str, Path], tmp_path: Path) -> Any:
    return copier(packs, tmp_path)


def _steps(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "manifest.json").read_text())["steps"]


def _changed(value: Any) -> Any:
    return 0.5 if value is None else value + (0.25 if isinstance(value, float) else 1)


def test_the_packs_exercise_every_count(packs: dict[str, Path]) -> None:
    """Guard: the fixtures have dropped uniform groups, over-long samples and kept uniform
    groups, and pass untouched with nothing left unchecked."""
    for name in PACKS:
        report = verify(packs[name])
        assert report["ok"] and report["notes"] == [], report
    totals = {
        key: sum(s[key] for name in PACKS for s in _steps(packs[name]))
        for key in ("uniform_groups_dropped", "overlong_dropped", "uniform_groups_kept")
    }
    assert all(totals.values()), totals


@pytest.mark.parametrize("field", FIGURES)
@pytest.mark.parametrize("scope", ["step", "env"])
def test_every_step_figure_is_checked(copy: Any, field: str, scope: str) -> None:
    out = copy("drop")
    step = 2  # holds kept groups, dropped uniform groups and over-long samples
    env = sorted(_steps(out)[step]["envs"])[0]

    def edit(m: dict[str, Any]) -> None:
        rec = m["steps"][step] if scope == "step" else m["steps"][step]["envs"][env]
        rec[field] = _changed(rec[field])

    edit_manifest(out, edit)
    assert kinds(out, recorded_inputs=False) == {KIND.get(field, "step.counts"): 1}


def test_uniform_groups_kept_is_checked(copy: Any) -> None:
    out = copy("keep")
    step = next(i for i, s in enumerate(_steps(out)) if s["uniform_groups_kept"])
    edit_manifest(out, lambda m: m["steps"][step].update(uniform_groups_kept=0))
    assert kinds(out, recorded_inputs=False) == {"step.counts": 1}


def test_actual_is_checked_in_its_batch_unit(copy: Any) -> None:
    out = copy("drop")
    edit_manifest(out, lambda m: m["steps"][1].update(actual=m["steps"][1]["actual"] - 1))
    assert kinds(out, recorded_inputs=False) == {"step.counts": 1}


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        (lambda st: st.update(nominal=st["nominal"] + 1), {"step.status": 1}),
        (lambda st: st.update(status="bogus"), {"step.status": 1}),
        (lambda st: st.update(status="partial"), {"step.status": 1}),
        (lambda st: st.update(actual=st["actual"] - 1), {"step.counts": 1}),  # not also status
    ],
)
def test_step_status_and_nominal_are_checked(copy: Any, edit: Any, want: dict) -> None:
    out = copy("keep")
    edit_manifest(out, lambda m: edit(m["steps"][0]))
    assert kinds(out, recorded_inputs=False) == want


def test_an_edited_reward_in_samples_parquet_is_caught(copy: Any) -> None:
    out = copy("keep")
    s = pq.read_table(out / "samples.parquet").to_pydict()
    # A trained sample of a non-uniform group: its step's and env's reward means move.
    i = next(
        k for k, st in enumerate(s["status"]) if st == "trained" and s["reward"][k] not in (0, 1)
    )

    def edit(v: np.ndarray) -> None:
        same = np.asarray(s["group_id"]) == s["group_id"][i]
        v[same & (np.asarray(s["rollout_id"]) == s["rollout_id"][i])] += 100.0

    edit_samples(out, "reward", edit)
    assert kinds(out, recorded_inputs=False) == {"step.reward": 2}


def test_a_pack_without_rewards_uses_the_input_or_says_what_was_not_checked(copy: Any) -> None:
    """Packs written before samples.parquet had a reward column: rewards come from the input
    when it is read; without it, the reward figures are left unchecked and the notes say so."""
    out = copy("drop")
    t = pq.read_table(out / "samples.parquet")
    pq.write_table(t.drop_columns(["reward"]), out / "samples.parquet")
    rehash(out, "samples.parquet")
    report = verify(out)
    assert report["ok"] and report["input"] == "compared", report
    assert len(report["notes"]) == 1 and "read from the input" in report["notes"][0]
    edit_manifest(out, lambda m: m["steps"][0].update(reward_mean=123.0))
    assert kinds(out) == {"step.reward": 1}
    report = verify(out, recorded_inputs=False)
    assert report["ok"], report
    assert len(report["notes"]) == 1 and "reward_mean" in report["notes"][0]
    edit_manifest(out, lambda m: m["steps"][0].update(groups=99))
    assert kinds(out, recorded_inputs=False) == {"step.counts": 1}


@pytest.mark.parametrize(
    ("key", "edit"),
    [
        ("dp", lambda v: v + 1),
        ("samples", lambda v: v - 1),
        ("samples_per_rank", lambda v: [v[0] + 1, *v[1:]]),
        ("tokens", lambda v: v + 7),
        ("empty_micro_batches", lambda v: v + 1),
        ("imbalance_cost", lambda v: v * 0.999),
        ("lockstep_overhead_cost", lambda v: v + 1e-6),
        ("imbalance_tokens", lambda v: 1.0),
        ("lockstep_overhead_tokens", lambda v: v * 1.01),
        ("token_fill", lambda v: v / 2),
        ("min_micro_batches", lambda v: v + 1),
    ],
)
def test_the_plan_record_is_checked(copy: Any, key: str, edit: Any) -> None:
    out = copy("drop")
    edit_manifest(
        out, lambda m: m["steps"][1]["plan"].update({key: edit(m["steps"][1]["plan"][key])})
    )
    assert kinds(out, recorded_inputs=False) == {"step.plan": 1}
