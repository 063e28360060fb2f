"""The schedule as flat arrays (issue 12): the compact plan the driver keeps says exactly what the
planner's per-step objects say.

`schedule` folds each planned step into per-sample arrays (status code, step, advantage, weight),
one CSR of the trained samples in row order and a small outline per step, and rebuilds a
`PlannedStep` when one is read. These tests keep the planner's own `PlannedStep`s (through the
``mapper`` hook) and compare them, and a slow per-sample placement written out the obvious way,
with what the compact schedule gives back, over random inputs and settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from pack_helpers import G, rollouts

from rolltool.errors import RolltoolError
from rolltool.format import STATUSES
from rolltool.input.resolve import resolve_inputs
from rolltool.plan.batches import StepConfig
from rolltool.plan.config import PackConfig
from rolltool.plan.groups import GroupIndex
from rolltool.plan.schedule import Schedule, schedule
from rolltool.plan.step_plan import PlannedStep
from rolltool.plan.workload import make_workload
from rolltool.schema import Rollouts, scan
from rolltool.util.ranges import slices


def _light(tmp: Path, rng: np.random.Generator) -> Rollouts:
    groups = []
    for _ in range(int(rng.integers(4, 14))):
        k = int(rng.integers(1, 6))
        rewards = rng.integers(0, 2, k).astype(float) if rng.random() < 0.7 else rng.random(k)
        env = ["math", "code"][int(rng.integers(0, 2))]
        finished = rng.random(k).tolist()
        groups.append(G(env, rewards.tolist(), rng.integers(3, 300, k).tolist(), finished))
    path = tmp / "in.parquet"
    pq.write_table(rollouts(groups), path)
    return scan(resolve_inputs([str(path)]), {})


def _reference(n: int, epochs: int, steps: list[PlannedStep], base: Schedule) -> dict[str, Any]:
    """Every row's fate, placed step by step from the planner's objects (the obvious way).
    Rows no step touches keep the schedule's initial fate (leftover, env_unweighted, ...)."""
    status = base.status.copy()
    touched = np.zeros(epochs * n, dtype=bool)
    step = np.full(epochs * n, -1, dtype=np.int64)
    rank, mb = step.copy(), step.copy()
    weight = np.zeros(epochs * n)
    advantage = np.full(epochs * n, np.nan, dtype=np.float32)
    for st in steps:
        at = st.epoch * n
        for fate in ("uniform_dropped", "overlong_dropped", "count_trimmed"):
            for i in getattr(st, fate):
                status[at + i], step[at + i], touched[at + i] = fate, st.index, True
        for r, mbs in enumerate(st.plan.micro_batches):
            for j, positions in enumerate(mbs):
                for p in positions:
                    i = at + st.members[p]
                    status[i], step[i], rank[i], mb[i], touched[i] = "trained", st.index, r, j, True
                    weight[i], advantage[i] = st.weight[p], st.advantage[p]
    return dict(status=status, step=step, rank=rank, micro_batch=mb, weight=weight,
                advantage=advantage, touched=touched)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(
    seed=hs.integers(0, 2**31),
    dp=hs.integers(1, 4),
    order=hs.sampled_from(["input", "completion", "shuffle"]),
    uniform=hs.sampled_from(["keep", "drop"]),
    structure=hs.sampled_from([(1, 1), (2, 1), (1, 2), (3, 2)]),
    trim=hs.booleans(),
)
def test_compact_schedule_equals_the_planners_steps(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    dp: int,
    order: str,
    uniform: str,
    structure: tuple[int, int],
    trim: bool,
) -> None:
    rng = np.random.default_rng(seed)
    ro = _light(tmp_path_factory.mktemp("f"), rng)
    mini_batches, epochs = structure
    config = PackConfig(
        dp=dp,
        steps=StepConfig(batch_size=6, order=order, uniform=uniform, keep_last=True,
                         mini_batches=mini_batches, epochs=epochs),
        micro_batch_tokens=250,
        overlong="drop",
        equal_count=trim,
        equal_count_trim=trim,
    )  # fmt: skip
    kept: list[PlannedStep] = []

    def mapper(fn: Any, items: Any) -> list[Any]:
        out = [fn(x) for x in items]
        kept.extend(st for batch in out for st in batch)
        return out

    try:
        plan = schedule(ro, config, make_workload("tokens"), mapper=mapper)
    except RolltoolError as e:  # everything dropped: the only allowed refusal here
        assert "does not fill a single step" in str(e)
        return
    n = ro.num_samples
    assert len(plan.steps) == len(kept) > 0 and plan.num_samples == n and plan.epochs == epochs
    for got, want in zip(plan.steps, kept, strict=True):
        assert got.index == want.index and got.record == want.record and got.cut == want.cut
        assert got.members.dtype == np.int64 and np.array_equal(
            got.order, np.arange(len(got.order))
        )
        # What the writer lays out: samples, advantages, weights in row order, micro-batch sizes.
        assert np.array_equal(got.members[got.order], want.members[want.order])
        assert np.array_equal(got.advantage[got.order], want.advantage[want.order])
        # float32, as the shards and samples.parquet store them
        assert np.array_equal(got.weight[got.order], want.weight[want.order].astype(np.float32))
        sizes = [[len(m) for m in mbs] for mbs in got.plan.micro_batches]
        assert sizes == [[len(m) for m in mbs] for mbs in want.plan.micro_batches]
        for fate in ("uniform_dropped", "overlong_dropped", "count_trimmed"):
            assert np.array_equal(getattr(got, fate), getattr(want, fate))
    ref = _reference(n, epochs, kept, plan)
    assert ref["touched"].any()  # the reference really placed something
    for key in ("status", "step", "rank", "micro_batch"):
        assert np.array_equal(getattr(plan, key), ref[key]), key
    assert np.array_equal(plan.weight, ref["weight"].astype(np.float32))
    placed = ref["status"] == "trained"
    assert np.array_equal(plan.advantage[placed], ref["advantage"][placed])
    assert plan.status_code.dtype == np.int8 and set(plan.status.tolist()) <= set(STATUSES)
    assert np.array_equal(plan.steps[-1].members, plan.steps[len(plan.steps) - 1].members)
    assert [st.index for st in plan.steps[1:]] == [st.index for st in kept[1:]]


def test_group_index_equals_the_per_group_lists() -> None:
    for seed in range(20):
        rng = np.random.default_rng(seed)
        num_groups = int(rng.integers(1, 30))
        group = rng.integers(0, num_groups, int(rng.integers(0, 200)))
        ix = GroupIndex.of(group, num_groups)
        lists = [np.flatnonzero(group == g) for g in range(num_groups)]  # input order
        for g in range(num_groups):
            assert ix[g].dtype == np.int64 and np.array_equal(ix[g], lists[g])
        pick = rng.integers(0, num_groups, int(rng.integers(0, 10)))
        want = np.concatenate([lists[g] for g in pick]) if len(pick) else np.zeros(0)
        got = ix.samples(pick)
        assert got.dtype == np.int64 and np.array_equal(got, want)


def test_the_plan_holds_17_bytes_per_sample(tmp_path: Path) -> None:
    """The per-sample arrays the driver keeps (issue 12: 50 M samples in a few GB)."""
    ro = _light(tmp_path, np.random.default_rng(3))
    config = PackConfig(dp=2, steps=StepConfig(batch_size=4, keep_last=True))
    plan = schedule(ro, config, make_workload("tokens"))
    per_row = sum(a.itemsize for a in (plan.status_code, plan.step_code, plan.advantage,
                                       plan.weight, plan.rows))  # fmt: skip
    assert per_row == 17
    assert plan.nbytes <= (per_row + 4) * ro.num_samples  # + the whole input's advantages


def _assembly_groups_reference(ro: Rollouts, trained: np.ndarray) -> dict[str, np.ndarray]:
    """Per group: env, rollouts, samples and tokens of its trained samples, one Python loop."""
    G = ro.num_groups
    out = {k: np.zeros(G, dtype=np.int64) for k in ("env", "rollouts", "samples", "tokens")}
    seen: set[int] = set()
    for i in range(ro.num_samples):
        g = int(ro.group[i])
        out["env"][g] = ro.env[i]
        if trained[i]:
            out["samples"][g] += 1
            out["tokens"][g] += int(ro.length[i])
            if int(ro.rollout[i]) not in seen:
                seen.add(int(ro.rollout[i]))
                out["rollouts"][g] += 1
    return out


def test_assembly_groups_counted_by_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`assembly_groups` counts chunk by chunk: the counts of one obvious loop, whatever the
    chunk (smaller than a group, than the input, or the whole input)."""
    from rolltool.plan import groups as groups_mod

    rng = np.random.default_rng(3)
    for k in range(4):
        ro = _light(tmp_path, rng)
        trained = rng.random(ro.num_samples) < 0.8
        want = _assembly_groups_reference(ro, trained)
        chunk = [1, 3, 7, 1 << 20][k % 4]
        monkeypatch.setattr(groups_mod, "CHUNK", chunk)
        got = groups_mod.assembly_groups(ro, trained, np.zeros(ro.num_groups, dtype=bool))
        assert chunk > ro.num_samples or len(slices(ro.num_samples, groups_mod.CHUNK)) > 1
        for name, values in want.items():
            assert np.array_equal(getattr(got, name), values), name
