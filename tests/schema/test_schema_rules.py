"""Each schema rule on its own: the rows it flags and the kind it reports them under.

A valid batch flags nothing; one broken value flags exactly its row under the rule's kind; the
row rules agree with an obvious pure-Python reference on random messy batches. The CLI-level
contract (messages, exit codes, nothing written) is in test_schema.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rolltool.schema as schema
from rolltool.errors import RolltoolError
from rolltool.input.parquet import InputFile
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import across, columns, rows
from rolltool.schema.rows import Flagged, row_batch

DOCUMENTED = set(re.findall(r"``([a-z_]+(?:\.[a-z_]+)?)``", schema.__doc__ or ""))


def good(**overrides: Any) -> dict[str, Any]:
    """Four valid samples, two groups, two rollouts each (one branch each)."""
    cols: dict[str, Any] = {
        "group_id": ["g0", "g0", "g1", "g1"],
        "rollout_id": [0, 1, 0, 1],
        "sample_id": ["s0", "s1", "s2", "s3"],
        "env": ["math"] * 4,
        "reward": [1.0, 0.0, 0.5, 0.25],
        "advantage": [0.5, -0.5, 0.125, -0.125],
        "finished_at": [1.0, 2.0, 3.0, 4.0],
        "input_ids": pa.array([[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 2]], pa.list_(pa.int32())),
        "loss_mask": pa.array([[0, 1, 1], [0, 1], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8())),
        "logprobs": pa.array(
            [[0, -0.1, -0.2], [0, -0.3], [0, 0, -0.1, -0.2], [0, -0.5]], pa.list_(pa.float32())
        ),
    }
    cols.update(overrides)
    return {k: v for k, v in cols.items() if v is not None}


def prompt_response(**overrides: Any) -> dict[str, Any]:
    cols = good(input_ids=None, loss_mask=None, logprobs=None)
    cols["prompt_ids"] = pa.array([[1], [2, 3], [4], [5]], pa.list_(pa.int64()))
    cols["response_ids"] = pa.array([[7], [8, 9], [1, 2, 3], [1]], pa.list_(pa.int64()))
    return {**cols, **overrides}


def batch(cols: dict[str, Any]) -> rows.RowBatch:
    table = pa.table(cols)
    return row_batch(table.to_batches()[0], columns.token_format(table.column_names) or "")


def flagged(found: Iterator[Flagged]) -> dict[str, list[int]]:
    """kind -> flagged rows (kinds with none left out); each listed row gets a sentence."""
    out: dict[str, list[int]] = {}
    for f in found:
        for i in f.rows:
            assert isinstance(f.text(int(i)), str) and f.text(int(i))
        if len(f.rows):
            out.setdefault(f.kind, []).extend(int(i) for i in f.rows)
    return out


def all_rows(b: rows.RowBatch) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for rule in rows.ROW_RULES:
        for kind, rs in flagged(rule(b)).items():
            found.setdefault(kind, []).extend(rs)
    return found


def _with(cols: dict[str, Any], name: str, i: int, value: Any) -> dict[str, Any]:
    """cols with row i of column `name` set to `value` (the column's type kept)."""
    arr = pa.array(cols[name]) if not isinstance(cols[name], pa.Array) else cols[name]
    values = arr.to_pylist()
    values[i] = value
    return {**cols, name: pa.array(values, arr.type)}


# -- row rules -----------------------------------------------------------------------------------

LIMIT = rows.FLOAT32_LIMIT
"""The smallest magnitude float32 cannot hold: one below it (float64's next value down) can."""


def _f64_logprobs() -> dict[str, Any]:
    lp = good()["logprobs"]
    return good(logprobs=pa.array(lp.to_pylist(), pa.list_(pa.float64())))


def test_the_float32_limit_is_where_float32_overflows() -> None:
    below = np.nextafter(LIMIT, 0.0)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(LIMIT)) and np.isinf(np.float32(-LIMIT))
        assert np.isfinite(np.float32(below)) and np.isfinite(np.float32(-below))
    edge = _with(_with(_f64_logprobs(), "logprobs", 3, [0.0, -below]), "advantage", 2, below)
    assert all_rows(batch(edge)) == {}


ROW_CASES: list[tuple[Callable, Callable[[], dict[str, Any]], str, list[int]]] = [
    (rows.nulls, lambda: _with(good(), "group_id", 2, None), "null", [2]),
    (rows.nulls, lambda: _with(good(), "reward", 1, None), "null", [1]),
    (rows.nulls, lambda: _with(good(), "input_ids", 3, None), "null", [3]),
    (rows.nulls, lambda: _with(good(), "advantage", 0, None), "null", [0]),
    (rows.nulls, lambda: _with(prompt_response(), "response_ids", 1, None), "null", [1]),
    (rows.reward_values, lambda: _with(good(), "reward", 1, float("inf")), "reward.value", [1]),
    (rows.finished_at_values, lambda: _with(good(), "finished_at", 3, float("nan")),
     "finished_at.value", [3]),
    (rows.advantage_values, lambda: _with(good(), "advantage", 2, float("-inf")),
     "advantage.value", [2]),
    (rows.mask_length, lambda: _with(good(), "loss_mask", 1, [0, 1, 1]), "loss_mask.length", [1]),
    (rows.mask_values, lambda: _with(good(), "loss_mask", 2, [0, 0, 2, 1]), "loss_mask.value", [2]),
    (rows.mask_values, lambda: _with(good(), "loss_mask", 0, [0, None, 1]), "loss_mask.value", [0]),
    (rows.token_ids, lambda: _with(good(), "input_ids", 0, [1, -2, 3]), "token.range", [0]),
    (rows.token_ids, lambda: _with(good(), "input_ids", 3, [1, None]), "token.range", [3]),
    (rows.token_ids, lambda: _with(prompt_response(), "prompt_ids", 2, [2**31]), "token.range", [2]),
    (rows.logprobs_length, lambda: _with(good(), "logprobs", 2, [0.0]), "logprobs.length", [2]),
    (rows.logprobs_values, lambda: _with(good(), "logprobs", 1, [0.0, float("nan")]),
     "logprobs.value", [1]),
    (rows.logprobs_values, lambda: _with(good(), "logprobs", 0, [0.0, None, -1.0]),
     "logprobs.value", [0]),
    (rows.logprobs_values, lambda: _with(_f64_logprobs(), "logprobs", 3, [0.0, -1e39]),
     "logprobs.range", [3]),
    (rows.logprobs_values, lambda: _with(_f64_logprobs(), "logprobs", 1, [0.0, -LIMIT]),
     "logprobs.range", [1]),
    (rows.advantage_values, lambda: _with(good(), "advantage", 1, 1e39), "advantage.range", [1]),
    (rows.advantage_values, lambda: _with(good(), "advantage", 0, -LIMIT), "advantage.range", [0]),
    (rows.empty_sequence, lambda: _with(_with(_with(good(), "input_ids", 1, []), "loss_mask", 1, []),
                                        "logprobs", 1, []), "sequence.empty", [1]),
    (rows.empty_sequence, lambda: _with(_with(prompt_response(), "prompt_ids", 0, []),
                                        "response_ids", 0, []), "sequence.empty", [0]),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "cols", "kind", "want"), ROW_CASES)
def test_a_row_rule_flags_its_row_under_its_kind(
    rule: Callable, cols: Callable[[], dict[str, Any]], kind: str, want: list[int]
) -> None:
    assert rule in rows.ROW_RULES
    assert kind in DOCUMENTED  # the schema's docstring lists every kind
    assert flagged(rule(batch(good()))) == {}
    assert flagged(rule(batch(prompt_response()))) == {}
    b = batch(cols())
    assert flagged(rule(b)) == {kind: want}
    assert all_rows(b) == {kind: want}  # and no other rule reports it again


def test_every_row_rule_has_a_case() -> None:
    assert {case[0] for case in ROW_CASES} == set(rows.ROW_RULES)


@pytest.mark.parametrize("column", ["input_ids", "loss_mask"])
def test_a_null_token_list_is_one_problem(column: str) -> None:
    """Not also a length mismatch (0 vs 3) and an empty sequence."""
    b = batch(_with(good(), column, 0, None))
    assert all_rows(b) == {"null": [0]}


def test_a_null_logprobs_list_is_no_problem() -> None:
    assert all_rows(batch(_with(good(), "logprobs", 1, None))) == {}


def test_null_reward_is_null_not_non_finite() -> None:
    assert all_rows(batch(_with(good(), "reward", 0, None))) == {"null": [0]}


MASK = st.one_of(st.none(), st.lists(st.one_of(st.none(), st.sampled_from([0, 1, 2])), max_size=4))
IDS = st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(-1, 3)), max_size=4))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_row_rules_match_a_python_reference(data: st.DataObject) -> None:
    """Over random messy token lists: which rows each rule flags, by the obvious definition."""
    n = data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(IDS, min_size=n, max_size=n))
    mask = data.draw(st.lists(MASK, min_size=n, max_size=n))
    mask_type = data.draw(st.sampled_from([pa.int8(), pa.bool_()]))
    if mask_type == pa.bool_():
        mask = [None if m is None else [None if v is None else v % 2 == 1 for v in m] for m in mask]
    b = batch(
        {
            "group_id": ["g"] * n,
            "reward": [0.0] * n,
            "input_ids": pa.array(ids, pa.list_(pa.int64())),
            "loss_mask": pa.array(mask, pa.list_(mask_type)),
        }
    )
    null = [i for i in range(n) if ids[i] is None or mask[i] is None]
    want = {
        "null": [i for i in range(n) if ids[i] is None] + [i for i in range(n) if mask[i] is None],
        "loss_mask.length": [
            i for i in range(n) if i not in null and len(mask[i] or []) != len(ids[i] or [])
        ],
        "loss_mask.value": [
            i for i in range(n) if any(v is None or v not in (0, 1) for v in mask[i] or [])
        ],
        "token.range": [i for i in range(n) if any(v is None or v < 0 for v in ids[i] or [])],
        "sequence.empty": [i for i in range(n) if i not in null and not ids[i]],
    }
    assert all_rows(b) == {k: v for k, v in want.items() if v}
    # the targets: loss_mask ones but the first token's (never a target: issue 21, defect 3)
    trainable = [sum(v == 1 for v in (m or [])[1:]) for m in mask]
    assert b.trainable.tolist() == trainable
    assert b.first_cleared.tolist() == [bool(m) and m[0] == 1 for m in mask]
    assert b.length.tolist() == [len(x or []) for x in ids]


# -- cross-row rules -----------------------------------------------------------------------------


def frame(**overrides: Any) -> pl.DataFrame:
    cols = {
        "group_id": ["g0", "g0", "g0", "g1", "g1"],
        "rollout_id": [0, 0, 1, 0, 1],
        "sample_id": ["a", "b", "c", "d", "e"],
        "env": ["math"] * 5,
        "reward": [1.0, 1.0, 0.0, 0.5, 0.5],
        "advantage": [0.5, 0.5, -0.5, 0.0, 0.0],
        **overrides,
    }
    df = pl.DataFrame(cols).with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    codes = df.select("group_id", "rollout_id").rows()
    first: dict[tuple, int] = {}
    return df.with_columns(pl.Series("rollout", [first.setdefault(k, len(first)) for k in codes]))


CROSS_CASES: list[tuple[Callable, dict[str, Any], str, list[int]]] = [
    (across.duplicate_sample_ids, {"sample_id": ["a", "b", "a", "d", "a"]},
     "sample_id.duplicate", [2]),
    (across.duplicate_sample_ids, {"sample_id": ["a", "b", "c", "b", "c"]},
     "sample_id.duplicate", [3, 4]),
    (across.rollout_rewards, {"reward": [1.0, 0.0, 0.0, 0.5, 0.5]}, "rollout.reward", [0]),
    (across.rollout_advantages, {"advantage": [0.5, 0.5, -0.5, 0.0, 1.0]},
     "rollout.advantage", []),  # g1's rollouts are one branch each: nothing to disagree
    (across.rollout_advantages, {"advantage": [0.5, 0.25, -0.5, 0.0, 0.0]},
     "rollout.advantage", [1]),
    (across.group_envs, {"env": ["math", "math", "code", "code", "code"]}, "group.env", [0]),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "edit", "kind", "want"), CROSS_CASES)
def test_a_cross_row_rule_flags_its_row_under_its_kind(
    rule: Callable, edit: dict[str, Any], kind: str, want: list[int]
) -> None:
    assert rule in across.CROSS_RULES and kind in DOCUMENTED
    assert flagged(rule(frame())) == {}
    assert flagged(rule(frame(**edit))) == ({kind: want} if want else {})


def test_every_cross_row_rule_has_a_case() -> None:
    assert {case[0] for case in CROSS_CASES} == set(across.CROSS_RULES)


def test_branch_rules_skip_non_finite_values() -> None:
    """A nan is the row rules' to report, not a disagreement with every other branch."""
    df = frame(reward=[1.0, float("nan"), 0.0, 0.5, 0.5], advantage=[0.5, np.inf, 0, 0, 0])
    assert flagged(across.rollout_rewards(df)) == {}
    assert flagged(across.rollout_advantages(df)) == {}


def test_advantage_disagreement_names_the_first_differing_branch_once() -> None:
    df = frame(
        group_id=["g"] * 5, rollout_id=[0] * 5, advantage=[1.0, 1.0, 2.0, 3.0, 1.0], env=["m"] * 5
    )
    (f,) = across.rollout_advantages(df)
    assert f.rows.tolist() == [2]
    assert "1.0 in its first branch, 2.0 here" in f.text(2)


# -- schema rules --------------------------------------------------------------------------------


def _file(path: str, n: int = 4) -> InputFile:
    return InputFile(path=path, rows=n)


def _schema(cols: dict[str, Any]) -> pa.Schema:
    return pa.table(cols).schema


def kinds(found: Iterator[Any]) -> list[str]:
    return [p.kind for p in found]


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        ({"group_id": None}, ["column.missing"]),
        ({"reward": None}, ["column.missing"]),
        ({"loss_mask": None}, ["column.missing"]),
        ({"input_ids": None}, ["column.missing"]),
    ],
)
def test_missing_columns(edit: dict[str, Any], want: list[str]) -> None:
    assert kinds(columns.missing_columns(_file("a"), _schema(good()))) == []
    assert kinds(columns.missing_columns(_file("a"), _schema(good(**edit)))) == want


@pytest.mark.parametrize(
    "edit",
    [
        {"reward": ["x"] * 4},
        {"advantage": ["x"] * 4},
        {"group_id": [0.5] * 4},
        {"env": [1, 2, 3, 4]},
        {"finished_at": ["a"] * 4},
        {"logprobs": pa.array([["x"]] * 4)},
    ],
)
def test_mistyped_columns(edit: dict[str, Any]) -> None:
    assert kinds(columns.mistyped_columns(_file("a"), _schema(good()))) == []
    (problem,) = columns.mistyped_columns(_file("a"), _schema(good(**edit)))
    assert problem.kind == "column.type" and f"'{next(iter(edit))}'" in problem.text


def _checked(*tables: dict[str, Any], rows: int = 4) -> list[columns.FileColumns]:
    out: list = []
    return [
        columns.file_columns(_file(f"f{i}", rows), _schema(t), out) for i, t in enumerate(tables)
    ]


def test_one_token_format() -> None:
    assert kinds(columns.one_token_format(_checked(good(), good()))) == []
    assert kinds(columns.one_token_format(_checked(good(), prompt_response()))) == ["input.format"]


def test_id_types() -> None:
    assert kinds(columns.id_types(_checked(good(), good()))) == []
    mixed = _checked(good(), good(group_id=[1, 1, 2, 2]))
    (problem,) = columns.id_types(mixed)
    assert problem.kind == "id.type" and problem.text.startswith("column 'group_id' is integer")


@pytest.mark.parametrize("column", columns.OPTIONAL_EVERYWHERE)
def test_optional_columns_everywhere_or_nowhere(column: str) -> None:
    assert kinds(columns.everywhere_or_nowhere(_checked(good(), good()))) == []
    lacking = {column: None}
    assert kinds(columns.everywhere_or_nowhere(_checked(good(**lacking), good(**lacking)))) == []
    (problem,) = columns.everywhere_or_nowhere(_checked(good(), good(**lacking)))
    assert problem.kind == "column.partial" and f"'{column}' is in f0 but not in f1" in problem.text
    # an empty file does not count
    out: list = []
    empty = columns.file_columns(_file("e", 0), _schema(good(**lacking)), out)
    assert kinds(columns.everywhere_or_nowhere([*_checked(good()), empty])) == []


def test_input_rules_are_all_tested() -> None:
    assert set(columns.INPUT_RULES) == {
        columns.one_token_format,
        columns.id_types,
        columns.everywhere_or_nowhere,
    }
    assert {"column.missing", "column.type", "input.format", "id.type"} <= DOCUMENTED
    assert "column.partial" in DOCUMENTED


def test_token_format() -> None:
    tf = columns.token_format
    assert tf(["input_ids", "loss_mask"]) == "input_ids"
    assert tf(["prompt_ids", "response_ids", "loss_mask"]) == "prompt_response"
    assert tf(["loss_mask"]) == "input_ids"  # stats reads only the mask
    assert tf(["input_ids"]) is None and tf(["prompt_ids"]) is None


# -- scan: the given advantage, and schema problems before any row -------------------------------


def _write(tmp_path: Path, name: str, cols: dict[str, Any]) -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(cols), path)
    return path


def test_scan_returns_the_given_advantage(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.parquet", good())
    b = _write(
        tmp_path,
        "b.parquet",
        good(sample_id=["t0", "t1", "t2", "t3"], group_id=["h0", "h0", "h1", "h1"]),
    )
    ro = schema.scan(resolve_inputs([a, b]))
    assert ro.advantage is not None and ro.advantage.dtype == np.float32
    assert ro.advantage.tolist() == good()["advantage"] * 2
    assert (
        schema.scan(resolve_inputs([_write(tmp_path, "c.parquet", good(advantage=None))])).advantage
        is None
    )


def test_scan_accepts_integer_advantages(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.parquet", good(advantage=[1, -1, 0, 0]))
    ro = schema.scan(resolve_inputs([path]))
    assert ro.advantage is not None and ro.advantage.tolist() == [1.0, -1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        ({"advantage": ["x"] * 4}, ["'advantage' has type string, expected float"]),
        ({"advantage": [0.5, float("nan"), 0.0, 0.0]}, ["'s1'", "'advantage' is not finite (nan)"]),
        (
            {"rollout_id": [0, 0, 1, 1], "advantage": [0.5, 0.25, 0.0, 0.0]},
            ["'s1'", "branches of one rollout have different advantages"],
        ),
    ],
)
def test_scan_refuses_a_bad_advantage_column(
    tmp_path: Path, edit: dict[str, Any], needles: list[str]
) -> None:
    path = _write(tmp_path, "a.parquet", good(**edit, reward=[1.0] * 4))
    with pytest.raises(RolltoolError) as e:
        schema.scan(resolve_inputs([path]))
    for needle in needles:
        assert needle in e.value.message
    assert "drop the 'advantage' column" in (e.value.hint or "")


def test_scan_refuses_an_advantage_column_in_some_files_only(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.parquet", good())
    b = _write(tmp_path, "b.parquet", good(advantage=None, sample_id=["t0", "t1", "t2", "t3"]))
    with pytest.raises(RolltoolError, match=f"column 'advantage' is in {a} but not in {b}"):
        schema.scan(resolve_inputs([a, b]))


def test_all_problems_at_once_include_the_advantage(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "a.parquet",
        good(reward=[1.0, float("inf"), 0.0, 0.0], advantage=[0.0, 0.0, float("nan"), 0.0]),
    )
    with pytest.raises(RolltoolError, match="the input has 2 problems") as e:
        schema.scan(resolve_inputs([path]))
    assert "'reward' is not finite" in e.value.message
    assert "'advantage' is not finite" in e.value.message


def test_id_type_conflicts_stop_before_any_row_is_read(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.parquet", good(group_id=[1, 1, 2, 2]))
    b = _write(tmp_path, "b.parquet", good(sample_id=["t0", "t1", "t2", "t3"]))
    read: list[tuple[int, int]] = []
    with pytest.raises(RolltoolError, match=f"column 'group_id' is integer in {a}"):
        schema.scan(resolve_inputs([a, b]), on_row_group=lambda k, rg, t: read.append((k, rg)))
    assert read == []
    ok = _write(
        tmp_path,
        "c.parquet",
        good(sample_id=["u0", "u1", "u2", "u3"], group_id=["h0", "h0", "h1", "h1"]),
    )
    schema.scan(resolve_inputs([b, ok]), on_row_group=lambda k, rg, t: read.append((k, rg)))
    assert read == [(0, 0), (1, 0)]  # the counter does count reads


def test_stats_with_limit_refuses_an_id_type_conflict_in_a_file_it_does_not_read(
    tmp_path: Path,
) -> None:
    """`stats --limit 2` reads only a.parquet, but the schemas already show the conflict."""
    from rolltool.stats import rollout_stats

    a = _write(tmp_path, "a.parquet", good(group_id=[1, 1, 2, 2]))
    b = _write(tmp_path, "b.parquet", good(sample_id=["t0", "t1", "t2", "t3"]))
    with pytest.raises(
        RolltoolError, match=f"column 'group_id' is integer in {a} but string in {b}"
    ):
        rollout_stats([str(a), str(b)], limit=2)
    assert rollout_stats([str(a)], limit=2).report["rows"] == 2


def test_an_ignored_column_is_neither_read_nor_checked(tmp_path: Path) -> None:
    """`rolltool advantages` replaces an input 'advantage' column: a bad one is no problem."""
    bad = _write(tmp_path, "a.parquet", good(advantage=["x", "y", None, "z"]))
    with pytest.raises(RolltoolError, match="'advantage' has type string"):
        schema.scan(resolve_inputs([bad]))
    tables: list[pa.Table] = []
    ro = schema.scan(
        resolve_inputs([bad]), on_row_group=lambda k, rg, t: tables.append(t), ignore={"advantage"}
    )
    assert ro.advantage is None and "advantage" in ro.columns
    assert tables and all("advantage" not in t.column_names for t in tables)
