"""`steps.assemble` as a pure function: hand-built `Groups` records, no files, no CLI.

Hand examples pin each rule of the module docstring (closing short, --exact, oversize groups,
uniform drop that keeps filling, env shares, unweighted envs, order, keep_last). Random inputs
are checked twice: against invariants that hold for any options (`_check_invariants`) and against
`_reference`, a slow filling loop written straight from the docstring's rules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.plan.batches import Assembly, Groups, StepConfig, assemble, quotas

ENVS = ["a", "b", "c"]


def make_groups(
    units: Sequence[int],
    *,
    env: Sequence[int] | None = None,
    uniform: Sequence[bool] | None = None,
    completed_at: Sequence[float] | None = None,
) -> Groups:
    """Groups whose rollouts, samples and tokens are all `units` (the unit does not matter)."""
    n = len(units)
    u = np.asarray(units, dtype=np.int64)
    return Groups(
        env=np.asarray(env if env is not None else [0] * n, dtype=np.int32),
        rollouts=u,
        samples=u.copy(),
        tokens=u.copy(),
        uniform=np.asarray(uniform if uniform is not None else [False] * n, dtype=bool),
        completed_at=None if completed_at is None else np.asarray(completed_at, dtype=np.float64),
    )


def taken(a: Assembly) -> list[list[int]]:
    return [s.groups.tolist() for s in a.steps]


# --- hand examples ---------------------------------------------------------------------------


def test_docstring_example_closes_short_and_drops_the_partial_step() -> None:
    a = assemble(make_groups([16, 16, 8, 16, 16]), ENVS, StepConfig(batch_size=32))
    assert taken(a) == [[0, 1], [2, 3]]
    assert [(s.actual, s.status) for s in a.steps] == [(32, "full"), (24, "short")]
    assert a.partial_dropped is not None and a.partial_dropped.groups.tolist() == [4]
    assert a.partial_dropped.status == "partial" and a.partial_dropped.actual == 16
    assert a.leftover.tolist() == [4]
    kept = assemble(
        make_groups([16, 16, 8, 16, 16]), ENVS, StepConfig(batch_size=32, keep_last=True)
    )
    assert taken(kept) == [[0, 1], [2, 3], [4]]
    assert kept.steps[-1].status == "partial" and kept.partial_dropped is None
    assert kept.leftover.tolist() == []


@pytest.mark.parametrize("unit", ["rollouts", "samples"])
def test_exact_refuses_a_short_step(unit: str) -> None:
    groups = make_groups([16, 16, 8, 16, 16])
    with pytest.raises(RolltoolError, match=f"step 1 holds 24 {unit}, not --batch-size 32"):
        assemble(groups, ENVS, StepConfig(batch_size=32, batch_unit=unit, exact=True))


def test_exact_refuses_an_oversize_group_but_not_in_token_units() -> None:
    groups = make_groups([4, 4, 40, 4])
    with pytest.raises(RolltoolError, match="step 1 holds 40 rollouts"):
        assemble(groups, ENVS, StepConfig(batch_size=8, exact=True))
    a = assemble(groups, ENVS, StepConfig(batch_size=8, batch_unit="tokens", exact=True))
    assert [(s.groups.tolist(), s.status) for s in a.steps] == [([0, 1], "full"), ([2], "oversize")]


def test_a_group_over_the_whole_step_goes_alone() -> None:
    a = assemble(make_groups([3, 50, 3, 5]), ENVS, StepConfig(batch_size=8))
    assert [(s.groups.tolist(), s.actual, s.status) for s in a.steps] == [
        ([0], 3, "short"),
        ([1], 50, "oversize"),
        ([2, 3], 8, "full"),
    ]


def test_uniform_drop_keeps_filling_from_later_groups() -> None:
    groups = make_groups([8, 8, 8, 8, 8, 8], uniform=[True, False, True, False, False, True])
    a = assemble(groups, ENVS, StepConfig(batch_size=16, uniform="drop"))
    assert taken(a) == [[1, 3]]
    assert [s.status for s in a.steps] == ["full"]
    assert a.steps[0].dropped.tolist() == [0, 2]
    # Group 4 opens a step that runs dry; the partial step reports the uniform group it skipped.
    assert a.partial_dropped is not None
    assert a.partial_dropped.groups.tolist() == [4] and a.partial_dropped.dropped.tolist() == [5]
    assert a.leftover.tolist() == [4, 5]
    kept = assemble(groups, ENVS, StepConfig(batch_size=16, uniform="keep"))
    assert taken(kept) == [[0, 1], [2, 3], [4, 5]]


def test_a_partial_step_of_only_dropped_groups_is_still_reported() -> None:
    groups = make_groups([4, 4, 4], uniform=[False, False, True])
    a = assemble(groups, ENVS, StepConfig(batch_size=8, uniform="drop", keep_last=True))
    assert taken(a) == [[0, 1]]
    assert a.partial_dropped is not None and a.partial_dropped.dropped.tolist() == [2]
    assert a.partial_dropped.groups.tolist() == []


def test_groups_with_nothing_to_train_are_skipped_not_counted() -> None:
    a = assemble(make_groups([4, 0, 4, 0, 4]), ENVS, StepConfig(batch_size=8))
    assert taken(a) == [[0, 2]]
    assert a.steps[0].skipped.tolist() == [1]
    assert a.leftover.tolist() == [3, 4]


def test_env_weights_give_each_env_its_share_of_every_step() -> None:
    env = [0, 1, 0, 0, 1, 0, 0, 0, 1, 2, 2]
    groups = make_groups([2] * len(env), env=env)
    a = assemble(groups, ENVS, StepConfig(batch_size=8, env_weights={"a": 3, "b": 1}))
    assert taken(a) == [[0, 2, 3, 1], [5, 6, 7, 4]]
    for s in a.steps:
        per_env = np.bincount(groups.env[s.groups], weights=groups.rollouts[s.groups], minlength=3)
        assert per_env.tolist() == [6, 2, 0]
    assert a.unweighted.tolist() == [9, 10]  # env c has no weight: never queued
    assert a.leftover.tolist() == [8]  # env a ran dry before b's last group was used


def test_env_weights_reject_unknown_envs_and_a_share_under_one_unit() -> None:
    groups = make_groups([1, 1], env=[0, 1])
    with pytest.raises(RolltoolError, match="not in the input: zz"):
        assemble(groups, ENVS, StepConfig(batch_size=4, env_weights={"a": 1, "zz": 1}))
    with pytest.raises(RolltoolError, match="gives b less than one rollout per step of 4"):
        assemble(groups, ENVS, StepConfig(batch_size=4, env_weights={"a": 100, "b": 1}))


def test_completion_order_takes_groups_as_they_finished_ties_by_input() -> None:
    groups = make_groups([4, 4, 4, 4], completed_at=[3.0, 1.0, 2.0, 1.0])
    a = assemble(groups, ENVS, StepConfig(batch_size=8, order="completion"))
    assert taken(a) == [[1, 3], [2, 0]]
    with pytest.raises(RolltoolError, match="needs a 'finished_at' column"):
        assemble(make_groups([4, 4]), ENVS, StepConfig(batch_size=8, order="completion"))


def test_shuffle_is_a_seeded_permutation() -> None:
    groups = make_groups([1] * 40)

    def run(seed: int) -> list[int]:
        a = assemble(groups, ENVS, StepConfig(batch_size=40, order="shuffle", seed=seed))
        (only,) = a.steps
        return only.groups.tolist()

    assert sorted(run(0)) == list(range(40))
    assert run(0) == run(0)
    assert run(0) != run(1)
    assert run(0) != list(range(40))


def test_quotas_split_by_largest_remainder() -> None:
    assert quotas({0: 0.7, 1: 0.3}, 10) == {0: 7, 1: 3}
    assert quotas({0: 1, 1: 1, 2: 1}, 4) == {0: 2, 1: 1, 2: 1}  # ties go to the lower code
    assert quotas({5: 1, 2: 3}, 2) == {2: 2, 5: 0}


@settings(max_examples=200, deadline=None)
@given(
    weights=st.dictionaries(st.integers(0, 5), st.integers(1, 9), min_size=1, max_size=6),
    size=st.integers(1, 50),
)
def test_quotas_are_within_one_of_the_exact_share(weights: dict[int, int], size: int) -> None:
    q = quotas(weights, size)
    assert sorted(q) == sorted(weights) and sum(q.values()) == size
    total = sum(weights.values())
    exact = {k: Fraction(w * size, total) for k, w in weights.items()}
    for k in q:
        assert exact[k] - 1 < q[k] < exact[k] + 1
    # Whoever got the rounding-up unit had a remainder at least as large as whoever did not.
    up = [exact[k] - int(exact[k]) for k in q if q[k] > exact[k]]
    down = [exact[k] - int(exact[k]) for k in q if q[k] <= exact[k] and exact[k] != q[k]]
    assert not up or not down or min(up) >= max(down)


# --- random inputs: invariants and a slow reference ------------------------------------------


@dataclass(frozen=True)
class RefStep:
    groups: list[int]
    dropped: list[int]
    skipped: list[int]
    actual: int
    status: str


@dataclass(frozen=True)
class RefResult:
    steps: list[RefStep]
    partial: RefStep | None
    leftover: list[int]
    unweighted: list[int]


def _reference_order(groups: Groups, config: StepConfig) -> list[int]:
    n = len(groups.env)
    if config.order == "shuffle":
        return [int(g) for g in np.random.default_rng(config.seed).permutation(n)]
    if config.order == "completion":
        assert groups.completed_at is not None
        return sorted(range(n), key=lambda g: (groups.completed_at[g], g))  # type: ignore[index]
    return list(range(n))


def _reference(groups: Groups, config: StepConfig) -> RefResult | str:
    """Fill steps one group at a time from per-env deques; an error is returned as its text."""
    units = [int(u) for u in groups.units(config.batch_unit)]
    order = _reference_order(groups, config)
    if config.env_weights:
        share = quotas({ENVS.index(e): w for e, w in config.env_weights.items()}, config.batch_size)
        if min(share.values()) == 0:
            return "less than one"
        queues = {e: deque(g for g in order if groups.env[g] == e) for e in share}
    else:
        share = {-1: config.batch_size}
        queues = {-1: deque(order)}
    unweighted = [g for g in order if config.env_weights and int(groups.env[g]) not in share]
    steps: list[RefStep] = []
    while True:
        step_groups, dropped, skipped, size, statuses = [], [], [], 0, []
        for e in sorted(share):
            queue, filled, status = queues[e], 0, None
            while status is None:
                if not queue:
                    status = "partial"
                    continue
                g = queue[0]
                if units[g] == 0:
                    skipped.append(queue.popleft())
                elif config.uniform == "drop" and groups.uniform[g]:
                    dropped.append(queue.popleft())
                elif filled + units[g] <= share[e]:
                    step_groups.append(queue.popleft())
                    filled += units[g]
                    status = "full" if filled == share[e] else None
                elif filled == 0:
                    step_groups.append(queue.popleft())
                    filled += units[g]
                    status = "oversize"
                else:
                    status = "short"
            size += filled
            statuses.append(status)
        if "partial" in statuses:
            status = "partial"
        else:
            status = ([s for s in statuses if s != "full"] or ["full"])[0]
        step = RefStep(step_groups, dropped, skipped, size, status)
        if status == "partial":
            break
        if status != "full" and config.exact and config.batch_unit != "tokens":
            return "--exact"
        steps.append(step)
    partial = None
    if step.groups and config.keep_last:
        steps.append(step)
    elif step.groups or step.dropped:
        partial = step
    placed = {g for s in steps for g in s.groups + s.dropped + s.skipped}
    leftover = sorted(g for g in order if g not in placed and g not in unweighted)
    return RefResult(steps, partial, leftover, unweighted)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Groups, StepConfig]:
    n = draw(st.integers(0, 24))
    unit_values = st.one_of(st.just(0), st.integers(1, 9), st.integers(10, 30))
    groups = Groups(
        env=np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int32),
        rollouts=np.array(draw(st.lists(unit_values, min_size=n, max_size=n)), dtype=np.int64),
        samples=np.array(draw(st.lists(unit_values, min_size=n, max_size=n)), dtype=np.int64),
        tokens=np.array(draw(st.lists(unit_values, min_size=n, max_size=n)), dtype=np.int64),
        uniform=np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
        completed_at=np.array(
            draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=np.float64
        ),
    )
    config = StepConfig(
        batch_size=draw(st.one_of(st.integers(1, 3), st.integers(1, 24))),
        batch_unit=draw(st.sampled_from(["rollouts", "samples", "tokens"])),
        exact=draw(st.booleans()),
        uniform=draw(st.sampled_from(["keep", "drop"])),
        order=draw(st.sampled_from(["input", "completion", "shuffle"])),
        seed=draw(st.integers(0, 3)),
        env_weights=draw(
            st.one_of(
                st.just({}),
                st.dictionaries(st.sampled_from(ENVS), st.integers(1, 4), min_size=1),
            )
        ),
        keep_last=draw(st.booleans()),
    )
    return groups, config


def _check_invariants(groups: Groups, config: StepConfig, a: Assembly) -> None:
    n = len(groups.env)
    units = groups.units(config.batch_unit)
    weighted = {ENVS.index(e) for e in config.env_weights}
    share = quotas({ENVS.index(e): w for e, w in config.env_weights.items()}, config.batch_size)
    # Every group is in exactly one place: a kept step (trained, dropped or skipped), leftover,
    # or unweighted.
    places = [g for s in a.steps for g in [*s.groups, *s.dropped, *s.skipped]]
    places += [*a.leftover.tolist(), *a.unweighted.tolist()]
    assert sorted(places) == list(range(n))
    assert set(a.unweighted.tolist()) == {
        g for g in range(n) if weighted and int(groups.env[g]) not in weighted
    }
    if a.partial_dropped is not None:
        p = a.partial_dropped
        assert p.status == "partial" and len(p.groups) + len(p.dropped) > 0
        assert set([*p.groups, *p.dropped, *p.skipped]) <= set(a.leftover.tolist())
    for i, s in enumerate(a.steps):
        assert s.index == i and s.nominal == config.batch_size
        assert s.actual == int(units[s.groups].sum())
        assert (units[s.groups] > 0).all() and (units[s.skipped] == 0).all()
        assert groups.uniform[s.dropped].all()
        if config.uniform == "drop":
            assert not groups.uniform[s.groups].any()
        else:
            assert len(s.dropped) == 0
        # Only the last step may be partial, and only when kept on purpose.
        assert s.status != "partial" or (i == len(a.steps) - 1 and config.keep_last)
        if config.exact and config.batch_unit != "tokens":
            assert s.status in ("full", "partial")
        queues = {e: s.groups[groups.env[s.groups] == e] for e in weighted} or {-1: s.groups}
        for e, in_env in queues.items():
            q = share.get(e, config.batch_size)
            got = int(units[in_env].sum())
            # Each env's share is met exactly in a full step, never exceeded except by one group.
            assert got <= q or len(in_env) == 1
            if s.status == "full":
                assert got == q
        if s.status == "full":
            assert s.actual == config.batch_size
        if s.status == "oversize" and not weighted:
            assert len(s.groups) == 1 and s.actual > config.batch_size
    # Each queue's groups are consumed in fill order: steps in sequence take a prefix.
    order = _reference_order(groups, config)
    pos = {g: i for i, g in enumerate(order)}
    for e in weighted or {-1}:
        trained = [int(g) for s in a.steps for g in s.groups if e == -1 or groups.env[g] == e]
        assert trained == sorted(trained, key=pos.__getitem__)


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_assemble_meets_invariants_and_equals_the_reference(
    case: tuple[Groups, StepConfig],
) -> None:
    groups, config = case
    expected = _reference(groups, config)
    if isinstance(expected, str):
        with pytest.raises(RolltoolError, match=expected):
            assemble(groups, ENVS, config)
        return
    a = assemble(groups, ENVS, config)
    _check_invariants(groups, config, a)

    def as_ref(s: object) -> RefStep:
        return RefStep(
            s.groups.tolist(),  # type: ignore[attr-defined]
            s.dropped.tolist(),  # type: ignore[attr-defined]
            s.skipped.tolist(),  # type: ignore[attr-defined]
            s.actual,  # type: ignore[attr-defined]
            s.status,  # type: ignore[attr-defined]
        )

    got = RefResult(
        [as_ref(s) for s in a.steps],
        None if a.partial_dropped is None else as_ref(a.partial_dropped),
        a.leftover.tolist(),
        a.unweighted.tolist(),
    )
    assert got == expected


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_keep_last_only_appends_the_partial_step(case: tuple[Groups, StepConfig]) -> None:
    groups, config = case
    try:
        dropped = assemble(groups, ENVS, replace(config, keep_last=False))
    except RolltoolError:
        return
    kept = assemble(groups, ENVS, replace(config, keep_last=True))
    assert taken(kept)[: len(dropped.steps)] == taken(dropped)
    p = dropped.partial_dropped
    if p is not None and len(p.groups):
        assert taken(kept)[-1] == p.groups.tolist() and kept.partial_dropped is None
    else:
        assert len(kept.steps) == len(dropped.steps)


def test_random_cases_reach_every_status_and_error() -> None:
    """Guard against a strategy that never exercises a branch (a test that cannot fail).

    Derandomized in every profile: it checks the draws CI makes, not a lucky fresh run."""
    seen: set[str] = set()

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(case=cases())
    def collect(case: tuple[Groups, StepConfig]) -> None:
        groups, config = case
        try:
            a = assemble(groups, ENVS, config)
        except RolltoolError as e:
            seen.add("exact" if "--exact" in str(e) else "error")
            return
        seen.update(s.status for s in a.steps)
        seen.update(["partial_dropped"] if a.partial_dropped is not None else [])
        seen.update(["dropped"] if any(len(s.dropped) for s in a.steps) else [])
        seen.update(["skipped"] if any(len(s.skipped) for s in a.steps) else [])
        seen.update(["unweighted"] if len(a.unweighted) else [])

    collect()
    assert seen >= {
        "full", "short", "oversize", "partial", "partial_dropped", "exact", "error",
        "dropped", "skipped", "unweighted",
    }  # fmt: skip
