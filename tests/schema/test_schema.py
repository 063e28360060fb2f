"""Input resolution and validation, through `rolltool advantages`.

Every invalid input must exit 1 with `Error: ...` naming the file, the column and (for row-level
problems) the sample, list all problems at once and leave no output behind; no traceback.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.input.resolve import resolve_inputs
from rolltool.jobs.advantages import run_advantages
from rolltool.plan.advantages import AdvantageConfig
from rolltool.schema import scan


def rollouts(**overrides: Any) -> dict[str, Any]:
    """Four valid samples in two groups (every optional column but finished_at)."""
    cols: dict[str, Any] = {
        "group_id": ["g0", "g0", "g1", "g1"],
        "rollout_id": [0, 1, 0, 1],
        "sample_id": ["s0", "s1", "s2", "s3"],
        "env": ["math"] * 4,
        "reward": [1.0, 0.0, 0.5, 0.25],
        "input_ids": pa.array([[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 2]], pa.list_(pa.int32())),
        "loss_mask": pa.array([[0, 1, 1], [0, 1], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8())),
        "logprobs": pa.array(
            [[0, -0.1, -0.2], [0, -0.3], [0, 0, -0.1, -0.2], [0, -0.5]], pa.list_(pa.float32())
        ),
    }
    cols.update(overrides)
    return {k: v for k, v in cols.items() if v is not None}


def advantages(run_cli, inputs: list[Path | str], out: Path, *extra: str):
    return run_cli("advantages", *inputs, "-o", out, *extra)


def assert_rejected(result, out: Path, *needles: str) -> str:
    """Exit 1, `Error:` on stderr with every needle, no traceback, nothing written."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("Error: "), result.stderr
    assert result.stdout == ""
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))  # no half-written leftovers
    return result.stderr


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out" / "adv.parquet"


@pytest.fixture(autouse=True)
def _out_dir(out: Path) -> None:
    out.parent.mkdir()


def test_valid_input_passes(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out)
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows == 4


# ------------------------------------------------------------------------------------------
# Column-level problems.


@pytest.mark.parametrize("column", ["group_id", "reward"])
def test_missing_required_column(write_parquet, run_cli, out: Path, column: str) -> None:
    path = write_parquet(rollouts(**{column: None}))
    assert_rejected(
        advantages(run_cli, [path], out), out, str(path), f"column '{column}' is missing"
    )


def test_missing_token_columns(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts(loss_mask=None))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'loss_mask'", "prompt_ids")


@pytest.mark.parametrize(
    ("column", "value", "expected"),
    [
        ("reward", ["1", "0", "0.5", "1"], "float"),
        ("group_id", [0.5, 0.5, 1.5, 1.5], "string or integer"),
        ("input_ids", pa.array([["a"], ["b"], ["c"], ["d"]]), "list of int"),
        ("loss_mask", pa.array([[0.5] * 3, [1.0] * 2, [1.0] * 4, [1.0] * 2]), "list of bool/int"),
        ("logprobs", pa.array([["x"] * 3, ["x"] * 2, ["x"] * 4, ["x"] * 2]), "list of float"),
        ("finished_at", ["a", "b", "c", "d"], "timestamp or float"),
    ],
)
def test_mistyped_column(
    write_parquet, run_cli, out: Path, column: str, value: Any, expected: str
) -> None:
    path = write_parquet(rollouts(**{column: value}))
    assert_rejected(
        advantages(run_cli, [path], out), out, str(path), f"column '{column}'", expected
    )


# ------------------------------------------------------------------------------------------
# Row-level problems: each names the file, the column and the sample.


def test_loss_mask_length_differs(write_parquet, run_cli, out: Path) -> None:
    mask = pa.array([[0, 1, 1], [0, 1, 1], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8()))
    path = write_parquet(rollouts(loss_mask=mask))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'loss_mask'", "'s1'")


def test_logprobs_length_differs(write_parquet, run_cli, out: Path) -> None:
    lp = pa.array([[0, -0.1, -0.2], [0, -0.3], [0, 0, -0.1], [0, -0.5]], pa.list_(pa.float32()))
    path = write_parquet(rollouts(logprobs=lp))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'logprobs'", "'s2'")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_non_finite_reward(write_parquet, run_cli, out: Path, bad: float | None) -> None:
    path = write_parquet(rollouts(reward=pa.array([1.0, bad, 0.5, 0.25], pa.float64())))
    said = "is null" if bad is None else "not finite"  # a null is not called "nan"
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'reward'", "'s1'", said)


def test_branches_with_different_rewards(write_parquet, run_cli, out: Path) -> None:
    # s0 and s1 are branches of rollout 0 of g0 but disagree on the reward.
    path = write_parquet(rollouts(rollout_id=[0, 0, 0, 1]))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'reward'", "'s", "branches")


def test_branches_with_equal_rewards_are_fine(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts(rollout_id=[0, 0, 0, 1], reward=[1.0, 1.0, 0.5, 0.25]))
    result = advantages(run_cli, [path], out, "--estimator", "dr_grpo")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table["group_size"].to_pylist() == [1, 1, 2, 2]
    assert table["advantage"].to_pylist() == [1.0, 1.0, 0.125, -0.125]


def test_duplicate_sample_id(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts(sample_id=["s0", "s1", "s2", "s1"]))
    assert_rejected(
        advantages(run_cli, [path], out), out, str(path), "'sample_id'", "'s1'", "repeats"
    )


def test_duplicate_sample_id_across_files(write_parquet, run_cli, out: Path) -> None:
    a = write_parquet(rollouts(), "a.parquet")
    b = write_parquet(
        rollouts(group_id=["h0", "h0", "h1", "h1"], sample_id=["t0", "s2"] * 2), "b.parquet"
    )
    stderr = assert_rejected(advantages(run_cli, [a, b], out), out, str(b), "'sample_id'", "'s2'")
    assert "'t0'" in stderr  # t0 repeats within b as well


def test_group_spread_over_two_envs(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts(env=["math", "code", "math", "math"]))
    stderr = assert_rejected(
        advantages(run_cli, [path], out), out, str(path), "'env'", "'g0'", "math", "code"
    )
    assert "'s0'" in stderr


def test_empty_sequence(write_parquet, run_cli, out: Path) -> None:
    ids = pa.array([[1, 2, 3], [], [6, 7, 8, 9], [1, 2]], pa.list_(pa.int32()))
    mask = pa.array([[0, 1, 1], [], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8()))
    lp = pa.array([[0, -0.1, -0.2], [], [0, 0, -0.1, -0.2], [0, -0.5]], pa.list_(pa.float32()))
    path = write_parquet(rollouts(input_ids=ids, loss_mask=mask, logprobs=lp))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'s1'", "empty")


@pytest.mark.parametrize("column", ["group_id", "input_ids", "loss_mask"])
def test_null_in_required_column(write_parquet, run_cli, out: Path, column: str) -> None:
    values = rollouts()[column]
    values = values.to_pylist() if isinstance(values, pa.Array) else list(values)
    values[2] = None
    typ = rollouts()[column].type if column != "group_id" else pa.string()
    path = write_parquet(rollouts(**{column: pa.array(values, typ)}))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), f"'{column}'", "'s2'")


def test_loss_mask_values_other_than_0_1(write_parquet, run_cli, out: Path) -> None:
    mask = pa.array([[0, 1, 1], [0, 2], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8()))
    path = write_parquet(rollouts(loss_mask=mask))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'loss_mask'", "'s1'")


def test_sample_without_trainable_token_is_a_counted_warning(
    write_parquet, run_cli, out: Path
) -> None:
    mask = pa.array([[0, 1, 1], [0, 0], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8()))
    path = write_parquet(rollouts(loss_mask=mask))
    result = advantages(run_cli, [path], out)
    assert result.exit_code == 0, result.output
    assert "no trainable token" in result.stderr
    assert "no trainable token" not in result.stdout
    assert pq.read_table(out).num_rows == 4

    again = advantages(run_cli, [path], out, "--force", "--json")
    assert again.exit_code == 0, again.output
    report = json.loads(again.stdout)
    assert report["samples_without_trainable_tokens"] == 1
    assert any("no trainable token" in w for w in report["warnings"])


# ------------------------------------------------------------------------------------------
# All problems at once.


def test_a_file_with_several_problems_lists_them_all(write_parquet, run_cli, out: Path) -> None:
    mask = pa.array([[0, 1, 1], [0, 1, 1], [0, 0, 1, 1], [0, 1]], pa.list_(pa.int8()))
    path = write_parquet(
        rollouts(
            loss_mask=mask,  # s1: wrong length
            reward=[1.0, 0.0, float("nan"), 0.25],  # s2: not finite
            sample_id=["s0", "s1", "s2", "s0"],  # s0 repeats
            env=["math", "math", "math", "code"],  # g1 over two envs
        )
    )
    stderr = assert_rejected(
        advantages(run_cli, [path], out),
        out,
        "4 problems",
        "'loss_mask'",
        "not finite",
        "repeats",
        "spread over",
    )
    assert stderr.count(str(path)) >= 4


def test_a_non_finite_reward_does_not_hide_branch_disagreements(
    write_parquet, run_cli, out: Path
) -> None:
    path = write_parquet(rollouts(rollout_id=[0, 0, 0, 1], reward=[1.0, 0.0, 0.5, float("nan")]))
    assert_rejected(advantages(run_cli, [path], out), out, "2 problems", "not finite", "branches")


def test_a_mistyped_optional_column_does_not_hide_row_problems(
    write_parquet, run_cli, out: Path
) -> None:
    path = write_parquet(
        rollouts(finished_at=["a", "b", "c", "d"], reward=[1.0, float("inf"), 0.5, 0.25])
    )
    assert_rejected(
        advantages(run_cli, [path], out), out, "'finished_at'", "'reward'", "'s1'", "not finite"
    )


def test_problems_in_several_files_are_all_listed(write_parquet, run_cli, out: Path) -> None:
    a = write_parquet(rollouts(group_id=None), "a.parquet")
    b = write_parquet(
        rollouts(reward=[1.0, 0.0, float("inf"), 0.5], sample_id=["b0", "b1", "b2", "b3"]),
        "b.parquet",
    )
    assert_rejected(
        advantages(run_cli, [a, b], out), out, f"{a}: column 'group_id' is missing", str(b), "'b2'"
    )


def test_long_lists_of_problems_are_counted(write_parquet, run_cli, out: Path) -> None:
    n = 30
    path = write_parquet(
        {
            "group_id": ["g"] * n,
            "reward": [float("nan")] * n,
            "input_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
            "loss_mask": pa.array([[0, 1]] * n, pa.list_(pa.int8())),
        }
    )
    stderr = assert_rejected(advantages(run_cli, [path], out), out, "30 problems", "22 more")
    assert len(stderr.splitlines()) < 20
    nulls = write_parquet(
        {
            "group_id": pa.array([None] * n, pa.string()),
            "reward": [1.0] * n,
            "input_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
            "loss_mask": pa.array([[0, 1]] * n, pa.list_(pa.int8())),
        },
        "nulls.parquet",
    )
    assert_rejected(advantages(run_cli, [nulls], out), out, "30 problems", "22 more")


# ------------------------------------------------------------------------------------------
# Formats and column mapping.


def test_prompt_response_format(write_parquet, run_cli, out: Path) -> None:
    cols = rollouts(input_ids=None, loss_mask=None, logprobs=None)
    cols["prompt_ids"] = pa.array([[1], [2, 3], [4], [5]], pa.list_(pa.int64()))
    cols["response_ids"] = pa.array([[7], [8, 9, 10], [11, 12, 13], [1]], pa.list_(pa.int64()))
    path = write_parquet(cols)
    result = advantages(run_cli, [path], out, "--estimator", "opo")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table["prompt_ids"].to_pylist() == cols["prompt_ids"].to_pylist()
    # opo weighs by trainable tokens = the response: g0: b = (1*1 + 3*0)/4; g1: (3*.5 + .25)/4
    want = [1 - 0.25, 0 - 0.25, 0.5 - 1.75 / 4, 0.25 - 1.75 / 4]
    assert table["advantage"].to_pylist() == pytest.approx(want)
    # the logprobs length is checked against prompt + response
    cols["logprobs"] = pa.array([[0.0] * 2, [0.0] * 5, [0.0] * 4, [0.0]], pa.list_(pa.float32()))
    path = write_parquet(cols, "bad.parquet")
    bad_out = out.parent / "bad.parquet"
    assert_rejected(advantages(run_cli, [path], bad_out), bad_out, "'logprobs'", "'s3'")


def test_mixed_token_formats_are_rejected(write_parquet, run_cli, out: Path) -> None:
    a = write_parquet(rollouts(), "a.parquet")
    cols = rollouts(
        input_ids=None, loss_mask=None, logprobs=None, sample_id=["t0", "t1", "t2", "t3"]
    )
    cols["prompt_ids"] = pa.array([[1]] * 4, pa.list_(pa.int64()))
    cols["response_ids"] = pa.array([[2]] * 4, pa.list_(pa.int64()))
    b = write_parquet(cols, "b.parquet")
    assert_rejected(advantages(run_cli, [a, b], out), out, "token format")


def test_column_mapping(write_parquet, run_cli, out: Path) -> None:
    cols = rollouts()
    cols["score"] = cols.pop("reward")
    cols["uid"] = cols.pop("group_id")
    path = write_parquet(cols)
    assert_rejected(
        advantages(run_cli, [path], out),
        out,
        "column 'reward' is missing",
        "column 'group_id' is missing",
        "--column",
    )
    result = advantages(
        run_cli, [path], out, "--column", "reward=score", "--column", "group_id=uid", "--json"
    )
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.num_rows == 4
    assert table["group_size"].to_pylist() == [2, 2, 2, 2]
    assert json.loads(result.stdout)["groups"] == 2


def test_malformed_column_mapping_is_a_usage_error(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out, "--column", "reward")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "KEY=VALUE" in result.stderr
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# Inputs: several files, directories with hive partitions, globs.


def _two_files(write_parquet, sub: str = "") -> tuple[Path, Path]:
    """Files a and b without sample_id: the default id is the row number over sorted paths."""
    a = write_parquet(rollouts(sample_id=None), f"{sub}a.parquet")
    ids = pa.array([[1, 2], [], [3], [4]], pa.list_(pa.int32()))
    mask = pa.array([[0, 1], [], [1], [1]], pa.list_(pa.int8()))
    lp = pa.array([[0, 0], [], [0], [0]], pa.list_(pa.float32()))
    b = write_parquet(
        rollouts(
            sample_id=None,
            group_id=["h0", "h0", "h1", "h1"],
            input_ids=ids,
            loss_mask=mask,
            logprobs=lp,
        ),
        f"{sub}b.parquet",
    )
    return a, b


def test_several_files_in_sorted_order(write_parquet, run_cli, out: Path) -> None:
    a, b = _two_files(write_parquet)
    # b's second row is empty: as sample 5 (4 rows of a before it) whatever the argument order.
    for inputs in ([a, b], [b, a]):
        assert_rejected(advantages(run_cli, inputs, out), out, str(b), "sample 5", "empty")
    # Valid files come out in sorted path order too.
    ok_b = write_parquet(
        rollouts(sample_id=["t0", "t1", "t2", "t3"], group_id=["h0", "h0", "h1", "h1"]), "b.parquet"
    )
    result = advantages(run_cli, [ok_b, a], out)
    assert result.exit_code == 0, result.output
    assert pq.read_table(out)["group_id"].to_pylist() == [
        "g0",
        "g0",
        "g1",
        "g1",
        "h0",
        "h0",
        "h1",
        "h1",
    ]


def test_glob_in_sorted_order(write_parquet, run_cli, out: Path, tmp_path: Path) -> None:
    a, b = _two_files(write_parquet, "data/")
    assert_rejected(
        advantages(run_cli, [str(tmp_path / "data" / "*.parquet")], out), out, str(b), "sample 5"
    )
    files = resolve_inputs([str(tmp_path / "data" / "*.parquet")])
    assert [f.path for f in files] == [str(a), str(b)]
    assert [f.rows for f in files] == [4, 4]


def test_directory_with_hive_partitions(write_parquet, run_cli, out: Path, tmp_path: Path) -> None:
    math = rollouts(env=None)
    code = rollouts(env=None, group_id=["c0", "c0", "c1", "c1"], sample_id=["t0", "t1", "t2", "t3"])
    write_parquet(math, "data/env=math/part-0.parquet")
    write_parquet(code, "data/env=code/part-0.parquet")
    result = advantages(run_cli, [tmp_path / "data"], out, "--env-estimator", "code=rloo", "--json")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    # env=code sorts before env=math
    assert table["env"].to_pylist() == ["code"] * 4 + ["math"] * 4
    assert table["sample_id"].to_pylist() == ["t0", "t1", "t2", "t3", "s0", "s1", "s2", "s3"]
    report = json.loads(result.stdout)
    assert {r["env"]: r["estimator"] for r in report["envs"]} == {"code": "rloo", "math": "grpo"}
    rollouts_ = scan(resolve_inputs([tmp_path / "data"]))
    assert rollouts_.env_names == ["code", "math"]


def test_hive_partitions_catch_a_group_over_two_envs(
    write_parquet, run_cli, out: Path, tmp_path: Path
) -> None:
    write_parquet(rollouts(env=None), "data/env=math/part-0.parquet")
    write_parquet(
        rollouts(env=None, sample_id=["t0", "t1", "t2", "t3"]), "data/env=code/part-0.parquet"
    )
    assert_rejected(advantages(run_cli, [tmp_path / "data"], out), out, "spread over", "'g0'")


def test_nonexistent_path(run_cli, out: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    assert_rejected(advantages(run_cli, [missing], out), out, str(missing), "no such file")


def test_glob_matching_nothing(run_cli, out: Path, tmp_path: Path) -> None:
    pattern = str(tmp_path / "nothing-*.parquet")
    assert_rejected(advantages(run_cli, [pattern], out), out, pattern)


def test_directory_without_parquet_files(run_cli, out: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_rejected(advantages(run_cli, [tmp_path / "empty"], out), out, "no *.parquet")


@pytest.mark.parametrize("name", ["notes.txt", "fake.parquet"])
def test_non_parquet_file(run_cli, out: Path, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("group_id,reward\ng0,1.0\n")
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "not a readable Parquet")


# ------------------------------------------------------------------------------------------
# Outputs and options.


def test_existing_output_needs_force(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    out.write_bytes(b"keep me")
    result = advantages(run_cli, [path], out)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "already exists" in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"keep me"

    result = advantages(run_cli, [path], out, "--force")  # not rolltool's: refused
    assert result.exit_code == 1 and "not an output rolltool wrote" in result.stderr
    assert out.read_bytes() == b"keep me"

    out.unlink()
    assert advantages(run_cli, [path], out).exit_code == 0
    result = advantages(run_cli, [path], out, "--force")
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows == 4
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no leftovers


def test_invalid_input_leaves_an_existing_output_alone(write_parquet, run_cli, out: Path) -> None:
    good = write_parquet(rollouts(), "good.parquet")
    assert advantages(run_cli, [good], out).exit_code == 0
    before = out.read_bytes()
    path = write_parquet(rollouts(reward=[1.0, float("nan"), 0.5, 0.25]))
    result = advantages(run_cli, [path], out, "--force")
    assert result.exit_code == 1 and "reward" in result.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_missing_output_folder(write_parquet, run_cli, tmp_path: Path) -> None:
    path = write_parquet(rollouts())
    target = tmp_path / "no" / "such" / "out.parquet"
    result = advantages(run_cli, [path], target)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "does not exist" in result.stderr


@pytest.mark.parametrize("value", ["math", "math=", "=grpo"], ids=["no-eq", "no-name", "no-env"])
def test_malformed_env_estimator_is_a_usage_error(
    write_parquet, run_cli, out: Path, value: str
) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out, "--env-estimator", value)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "--env-estimator" in result.stderr
    assert not out.exists()


def test_an_unknown_env_estimator_is_an_error_as_in_pack(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out, "--env-estimator", "math=ppo")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "unknown estimator 'ppo'" in result.stderr
    assert not out.exists()


def test_env_estimator_for_an_unknown_env(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    assert_rejected(
        advantages(run_cli, [path], out, "--env-estimator", "chess=rloo"), out, "chess", "math"
    )


def test_negative_std_eps(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    assert_rejected(advantages(run_cli, [path], out, "--std-eps", "-1"), out, "--std-eps")


def test_unknown_estimator_is_a_usage_error(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out, "--estimator", "ppo")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert not out.exists()


def test_reinforce_pp_baseline_without_enough_tokens(write_parquet, run_cli, out: Path) -> None:
    mask = pa.array([[0, 0, 0], [0, 0], [0, 0, 0, 0], [0, 1]], pa.list_(pa.int8()))
    path = write_parquet(rollouts(loss_mask=mask))
    assert_rejected(
        advantages(run_cli, [path], out, "--estimator", "reinforce_pp_baseline"),
        out,
        "reinforce_pp_baseline",
    )


# ------------------------------------------------------------------------------------------
# scan() on its own: the light columns.


def test_scan_light_columns(synth_path: Path, synth_table: pa.Table) -> None:
    r = scan(resolve_inputs([synth_path]))
    n = synth_table.num_rows
    assert r.num_samples == n
    assert r.num_groups == len(set(synth_table["group_id"].to_pylist()))
    assert r.token_format == "input_ids" and r.has_logprobs
    assert r.length.tolist() == [len(x) for x in synth_table["input_ids"].to_pylist()]
    assert r.trainable.tolist() == [sum(m) for m in synth_table["loss_mask"].to_pylist()]
    assert r.sample_id.to_pylist() == synth_table["sample_id"].to_pylist()
    assert r.finished_at is not None
    want = [t.timestamp() for t in synth_table["finished_at"].to_pylist()]
    assert r.finished_at.tolist() == pytest.approx(want, abs=1e-6)
    # rollout codes: one per (group_id, rollout_id), dense, in order of first appearance
    pairs = list(
        zip(synth_table["group_id"].to_pylist(), synth_table["rollout_id"].to_pylist(), strict=True)
    )
    first: dict[tuple, int] = {}
    assert r.rollout.tolist() == [first.setdefault(p, len(first)) for p in pairs]
    assert r.env_names == list(dict.fromkeys(synth_table["env"].to_pylist()))
    assert r.warnings == []


@pytest.mark.parametrize("column", ["env", "sample_id", "rollout_id"])
def test_null_in_optional_id_column(write_parquet, run_cli, out: Path, column: str) -> None:
    values = list(rollouts()[column])
    values[1] = None
    path = write_parquet(rollouts(**{column: values}))
    assert_rejected(advantages(run_cli, [path], out), out, str(path), f"'{column}'", "null")


# ------------------------------------------------------------------------------------------
# Whatever a user feeds in: success or a RolltoolError, never another exception.

MAYBE_NULL_ID = st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))
TOKENS = st.one_of(st.none(), st.lists(st.integers(-1, 5), max_size=4))
MASK = st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 2)), max_size=4))


@st.composite
def messy_tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 6))

    def col(strategy: st.SearchStrategy) -> list:
        return draw(st.lists(strategy, min_size=n, max_size=n))

    cols: dict[str, Any] = {
        "group_id": col(MAYBE_NULL_ID),
        "reward": col(st.one_of(st.none(), st.sampled_from([0.0, 1.0, float("nan")]))),
        "input_ids": pa.array(col(TOKENS), pa.list_(pa.int64())),
        "loss_mask": pa.array(col(MASK), pa.list_(pa.int8())),
    }
    for name, strategy in [
        ("rollout_id", MAYBE_NULL_ID),
        ("sample_id", MAYBE_NULL_ID),
        ("env", st.one_of(st.none(), st.sampled_from(["math", "code"]))),
    ]:
        if draw(st.booleans()):
            cols[name] = col(strategy)
    if draw(st.booleans()):
        cols["logprobs"] = pa.array(
            col(st.one_of(st.none(), st.lists(st.just(-0.5), max_size=4))), pa.list_(pa.float32())
        )
    return pa.table(cols)


@settings(max_examples=60, deadline=None)
@given(
    tables=st.lists(messy_tables(), min_size=1, max_size=2),
    estimator=st.sampled_from(["grpo", "reinforce_pp_baseline"]),
)
def test_messy_input_never_escapes_as_a_bug(tables: list[pa.Table], estimator: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, table in enumerate(tables):
            paths.append(Path(tmp) / f"part-{i}.parquet")
            pq.write_table(table, paths[-1])
        dst = Path(tmp) / "out.parquet"
        try:
            run_advantages(paths, dst, AdvantageConfig(estimator=estimator))
        except RolltoolError:
            assert not dst.exists()
        else:
            assert pq.read_table(dst).num_rows == sum(t.num_rows for t in tables)


def test_output_that_is_a_directory_is_a_usage_error(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out.parent, "--force")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert out.parent.is_dir()


def test_empty_input_file(write_parquet, run_cli, out: Path) -> None:
    empty = pa.table(rollouts()).slice(0, 0)
    path = write_parquet(empty)
    result = advantages(run_cli, [path], out, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["samples"] == 0
    table = pq.read_table(out)
    assert table.num_rows == 0 and "advantage" in table.column_names


def test_column_mapping_onto_an_existing_column(write_parquet, run_cli, out: Path) -> None:
    cols = rollouts()
    cols["score"] = [0.5, 0.5, 0.5, 0.5]
    path = write_parquet(cols)
    assert_rejected(
        advantages(run_cli, [path], out, "--column", "reward=score"),
        out,
        str(path),
        "'reward' appears twice",
        "--column reward=score",
    )


def test_a_file_with_a_duplicated_column_name(run_cli, out: Path, tmp_path: Path) -> None:
    table = pa.table(rollouts())
    table = table.append_column("env", pa.array(["code"] * 4))
    path = tmp_path / "dup.parquet"
    pq.write_table(table, path)
    assert_rejected(advantages(run_cli, [path], out), out, str(path), "'env' appears twice")


def test_output_under_a_file(write_parquet, run_cli, tmp_path: Path) -> None:
    path = write_parquet(rollouts())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = advantages(run_cli, [path], blocker / "out.parquet")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.stderr.startswith("Error: ") and "cannot write" in result.stderr


# ------------------------------------------------------------------------------------------
# Token ids must fit the packed int32; logprobs must be finite numbers.


@pytest.mark.parametrize("column", ["input_ids", "prompt_ids", "response_ids"])
def test_token_ids_above_int32_max(write_parquet, run_cli, out: Path, column: str) -> None:
    big = 2**31  # int32 max + 1: packed as int32 it would wrap to -2**31
    if column == "input_ids":
        ids = pa.array([[1, 2, 3], [4, 5], [6, big, 8, 9], [1, -2]], pa.list_(pa.int64()))
        path = write_parquet(rollouts(input_ids=ids))
    else:
        cols = rollouts(input_ids=None, loss_mask=None, logprobs=None)
        cols["prompt_ids"] = pa.array([[1]] * 4, pa.list_(pa.int64()))
        cols["response_ids"] = pa.array([[2]] * 4, pa.list_(pa.int64()))
        cols[column] = pa.array([[1], [2], [big], [-2]], pa.list_(pa.int64()))
        path = write_parquet(cols)
    text = assert_rejected(
        advantages(run_cli, [path], out), out, str(path), f"column '{column}'", "2**31 - 1"
    )
    # one report with every problem: the big id in s2 and the negative one in s3
    assert "'s2'" in text and "'s3'" in text and "negative" in text
    assert "'s2'" not in next(line for line in text.splitlines() if "negative" in line)


@pytest.mark.parametrize("dtype", [pa.int64(), pa.uint64(), pa.uint32()])
def test_token_ids_up_to_int32_max_pass(write_parquet, run_cli, out: Path, dtype) -> None:
    ids = pa.array([[1, 2, 3], [4, 5], [6, 2**31 - 1, 8, 9], [0, 1]], pa.list_(dtype))
    path = write_parquet(rollouts(input_ids=ids))
    result = advantages(run_cli, [path], out)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_non_finite_logprobs(write_parquet, run_cli, out: Path, bad: float | None) -> None:
    lp = pa.array(
        [[0, -0.1, -0.2], [0, bad], [0, 0, -0.1, -0.2], [0, -0.5]], pa.list_(pa.float32())
    )
    path = write_parquet(rollouts(logprobs=lp))
    text = assert_rejected(advantages(run_cli, [path], out), out, str(path), "'logprobs'", "'s1'")
    assert "non-finite" in text and "'s0'" not in text


def test_a_null_logprobs_list_is_fine(write_parquet, run_cli, out: Path) -> None:
    lp = pa.array([[0, -0.1, -0.2], None, [0, 0, -0.1, -0.2], [0, -0.5]], pa.list_(pa.float32()))
    path = write_parquet(rollouts(logprobs=lp))
    result = advantages(run_cli, [path], out)
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------
# --column NEW=OLD must name a column of the input.


def test_column_mapping_from_a_column_no_file_has(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    text = assert_rejected(
        advantages(run_cli, [path], out, "--column", "reward=nope"),
        out,
        "--column reward=nope",
        "'nope'",
    )
    assert "Traceback" not in text


def test_column_mapping_from_a_column_only_some_files_have(
    write_parquet, run_cli, out: Path
) -> None:
    a = rollouts()
    a["score"] = a.pop("reward")
    pa_ = write_parquet(a, "a.parquet")
    pb = write_parquet(rollouts(sample_id=["t0", "t1", "t2", "t3"]), "b.parquet")
    result = advantages(run_cli, [pa_, pb], out, "--column", "reward=score")
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows == 8
    files = resolve_inputs([pa_, pb])
    assert scan(files, {"score": "reward"}).reward.tolist() == [1.0, 0.0, 0.5, 0.25] * 2


def test_two_mappings_from_one_column_is_a_usage_error(write_parquet, run_cli, out: Path) -> None:
    path = write_parquet(rollouts())
    result = advantages(run_cli, [path], out, "--column", "a=reward", "--column", "b=reward")
    assert result.exit_code == 2, result.output
    assert "'reward'" in result.stderr and "Traceback" not in result.output
    assert not out.exists()
    with pytest.raises(RolltoolError, match="both read column 'reward'"):
        run_advantages([path], out, AdvantageConfig(), columns={"a": "reward", "b": "reward"})


# ------------------------------------------------------------------------------------------
# An id column typed integer in one file and string in another: 1 and "1" are not merged.


@pytest.mark.parametrize("column", ["group_id", "rollout_id", "sample_id"])
def test_id_column_integer_in_one_file_and_string_in_another(
    write_parquet, run_cli, out: Path, column: str
) -> None:
    ints = {"group_id": [1, 1, 2, 2], "rollout_id": [0, 1, 0, 1], "sample_id": [10, 11, 12, 13]}
    strs = {"group_id": ["1", "1", "2", "2"], "rollout_id": ["0", "1", "0", "1"]}
    strs["sample_id"] = ["s0", "s1", "s2", "s3"]
    a = write_parquet(rollouts(**{**strs, column: ints[column]}), "a.parquet")
    b = write_parquet(rollouts(**{**strs, "sample_id": ["t0", "t1", "t2", "t3"]}), "b.parquet")
    if column == "sample_id":
        b = write_parquet(rollouts(**strs), "b.parquet")
    assert_rejected(
        advantages(run_cli, [a, b], out),
        out,
        f"column '{column}' is integer in {a} but string in {b}",
    )
    # pack refuses it the same way
    result = run_cli("pack", a, b, "-o", out.parent / "packed", "--dp", 1, "--batch-size", 2)
    assert result.exit_code == 1 and f"column '{column}' is integer in {a}" in result.stderr
    assert not (out.parent / "packed").exists()


def test_default_sample_ids_next_to_string_ids(write_parquet, run_cli, out: Path) -> None:
    """A file without sample_id (row numbers) next to one with string ids is not a type clash."""
    a = write_parquet(rollouts(sample_id=None), "a.parquet")
    b = write_parquet(rollouts(group_id=["h0", "h0", "h1", "h1"]), "b.parquet")
    result = advantages(run_cli, [a, b], out)
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------
# Directory walks skip hidden and `_` names and rolltool's own packed outputs.


def _pack_into(run_cli, inputs: Path, dst: Path) -> dict[str, Any]:
    result = run_cli(
        "pack", inputs, "-o", dst, "--dp", 1, "--batch-size", 2, "--keep-last", "--json"
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_directory_skips_hidden_underscore_and_packed_folders(
    write_parquet, run_cli, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    good = [write_parquet(rollouts(), "data/a.parquet")]
    good.append(write_parquet(rollouts(sample_id=["t0", "t1", "t2", "t3"]), "data/sub/b.parquet"))
    other = write_parquet(
        rollouts(sample_id=["u0", "u1", "u2", "u3"], group_id=["h0", "h0", "h1", "h1"]),
        "data/other/c.parquet",
    )
    (other.parent / "manifest.json").write_text('{"format": "not-rolltool"}')  # someone else's
    good.append(other)
    for junk in ("_SUCCESS", "_temporary/0/part-0.parquet", ".part-0.parquet", ".staging/x.parquet",
                 "_part-9.parquet"):  # fmt: skip
        if junk.endswith(".parquet"):
            write_parquet(rollouts(), f"data/{junk}")
        else:
            (data / junk).write_text("")
    assert [f.path for f in resolve_inputs([data])] == [str(p) for p in sorted(good)]

    # Packing into a folder inside the input directory is refused before any work; a packed
    # folder put there is not read back (its samples.parquet is not rollout input).
    (other.parent / "manifest.json").unlink()
    inside = run_cli("pack", data, "-o", data / "packed", "--dp", 1, "--batch-size", 2)
    assert inside.exit_code == 1 and "lies inside the input" in inside.stderr
    first = _pack_into(run_cli, data, tmp_path / "packed")
    (tmp_path / "packed").rename(data / "packed")
    assert (data / "packed" / "samples.parquet").is_file()
    second = _pack_into(run_cli, data, tmp_path / "packed-again")
    assert first["samples"]["total"] == second["samples"]["total"] == 12
    assert [f.path for f in resolve_inputs([data])] == [str(p) for p in sorted(good)]

    # The packed folder itself is not rollout input.
    result = run_cli("advantages", data / "packed", "-o", tmp_path / "adv.parquet")
    assert result.exit_code == 1 and "rolltool pack" in result.stderr


def test_light_columns_are_int32_where_they_fit(write_parquet) -> None:
    """`scan` keeps codes and counts in 4 bytes (`narrow`), with the values int64 would hold;
    `narrow` keeps int64 from 2**31 on, where int32 would wrap."""
    import numpy as np

    from rolltool.schema.rollouts import narrow

    ro = scan(resolve_inputs([str(write_parquet(rollouts()))]))
    for name in ("group", "rollout", "length", "trainable"):
        assert getattr(ro, name).dtype == np.int32, name
    assert ro.group.tolist() == [0, 0, 1, 1] and ro.rollout.tolist() == [0, 1, 2, 3]
    assert ro.length.tolist() == [3, 2, 4, 2] and ro.trainable.tolist() == [2, 1, 2, 1]
    big = np.array([0, 2**31 - 1, 2**31], dtype=np.int64)
    assert narrow(big[:2]).dtype == np.int32 and narrow(big[:2]).tolist() == big[:2].tolist()
    assert narrow(big).dtype == np.int64 and narrow(big).tolist() == big.tolist()
    assert narrow(np.zeros(0, np.int64)).dtype == np.int32
