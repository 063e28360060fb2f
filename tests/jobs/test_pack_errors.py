"""Bad input and bad options for `rolltool pack`, existing outputs, and runs that die midway.

A known problem is `Error: ...` (plus a hint) on stderr and exit 1, a usage mistake exit 2, never
a traceback, and the folder holding OUT is left exactly as it was (no OUT, no hidden temp dir).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts

import rolltool.packed.writer
from rolltool.jobs.pack import PackConfig, run_pack
from rolltool.plan.batches import StepConfig

BASE = ("--dp", 2, "--batch-size", 4, "--micro-batch-tokens", 256)


def _groups(n: int = 4) -> list[G]:
    return [G("math", [0.0, 1.0, 0.5, 0.25], [20, 30, 40, 50], finished=[1, 2, 3, 4]) for _ in range(n)]  # fmt: skip


@pytest.fixture
def inp(tmp_path: Path) -> Path:
    """Four groups of four rollouts (one env, finish times) in tmp_path/in/in.parquet."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "in.parquet"
    pq.write_table(rollouts(_groups()), path)
    return path


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _fails_cleanly(result: Any, code: int, *words: str) -> str:
    text = result.stderr
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    assert result.stdout == ""
    if code == 1:
        assert text.startswith("Error: "), text
    for w in words:
        assert w in text, (w, text)
    return text


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (("--env-weight", "math=abc"), 2, ["--env-weight", "number"]),
        (("--env-weight", "math"), 2, ["--env-weight", "KEY=VALUE"]),
        (("--env-weight", "math=0"), 1, ["--env-weight", "positive"]),
        (("--env-weight", "math=-1"), 1, ["--env-weight", "positive"]),
        (("--env-weight", "math=nan"), 1, ["--env-weight", "positive"]),
        (("--env-weight", "nope=1"), 1, ["nope", "math"]),
        (("--env-weight", "math=1", "--env-weight", "nope=1"), 1, ["nope"]),
        (("--row-len", 100), 1, ["--row-len", "--micro-batch-tokens"]),
        (("--loss-agg", "seq-mean-token-sum-norm"), 1, ["--loss-scale-factor"]),
        (("--loss-agg", "seq-mean-token-sum-norm", "--loss-scale-factor", -2), 1, ["--loss-scale-factor"]),
        (("--loss-agg", "nope"), 2, ["--loss-agg"]),
        (("--batch-size", 100), 1, ["--keep-last"]),
        (("--batch-size", 0), 2, ["--batch-size"]),
        (("--dp", 0), 2, ["--dp"]),
        (("--balance", "nope"), 2, ["--balance"]),
        (("--model", "dense-7b", "--model-config", "x.json"), 2, ["--model"]),
        (("--model", "nope"), 1, ["nope"]),
        (("--estimator", "nope"), 2, ["--estimator"]),
        (("--env-estimator", "nope=grpo"), 1, ["nope"]),
        (("--shard-mb", 0), 1, ["--shard-mb"]),
        (("--equal-count", "--dp", 3), 1, ["divisible", "--exact"]),
        (("--pad-id", 3_000_000_000), 1, ["--pad-id", "2**31 - 1"]),
        (("--pad-id", -1), 1, ["--pad-id"]),
        (("--order", "shuffle", "--seed", -1), 1, ["--seed", ">= 0"]),
        (("--loss-scale-factor", 2.0), 2, ["--loss-scale-factor", "seq-mean-token-sum-norm"]),
        (("--loss-agg", "seq-mean-token-mean", "--loss-scale-factor", 2.0), 2, ["--loss-scale-factor"]),
        (("--column", "reward=nope"), 1, ["--column reward=nope", "'nope'"]),
        (("--column", "a=reward", "--column", "b=reward"), 2, ["--column", "'reward'"]),
        (("--env-weight", "math=0.5", "--env-weight", "math=0.7"), 2, ["--env-weight", "twice"]),
        (("--micro-batch-tokens", 30), 1, ["math/g000/r2/b0", "40 tokens", "--overlong drop"]),
    ],
)  # fmt: skip
def test_bad_options_fail_cleanly_and_write_nothing(
    inp: Path, args: tuple[Any, ...], code: int, words: list[str]
) -> None:
    before = _listing(inp.parent)
    result = cli("pack", inp, "-o", inp.parent / "out", *BASE, *args)
    _fails_cleanly(result, code, *words)
    assert _listing(inp.parent) == before


def test_both_micro_batch_modes_is_refused(inp: Path) -> None:
    result = cli("pack", inp, "-o", inp.parent / "out", *BASE, "--micro-batch-size", 2)
    assert result.exit_code in (1, 2) and "--micro-batch-size" in result.stderr
    assert "Traceback" not in result.output and not (inp.parent / "out").exists()


def test_completion_order_without_finished_at(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(rollouts([G("math", [0, 1], [20, 20])]), path)  # no finish times
    result = cli("pack", path, "-o", tmp_path / "out", *BASE, "--order", "completion")
    _fails_cleanly(result, 1, "finished_at", "--order")
    assert _listing(tmp_path) == ["in.parquet"]


def _replace(t: pa.Table, name: str, values: list[Any]) -> pa.Table:
    return t.set_column(
        t.column_names.index(name), name, pa.array(values, t.schema.field(name).type)
    )


def _tokens(t: pa.Table, row: int, token: int) -> pa.Table:
    """input_ids as int64 lists, with `token` as the last token of sample `row`."""
    ids = t.column("input_ids").to_pylist()
    ids[row][-1] = token
    return t.set_column(t.column_names.index("input_ids"), "input_ids", pa.array(ids, pa.list_(pa.int64())))  # fmt: skip


def _logprob(t: pa.Table, row: int, value: float) -> pa.Table:
    lp = t.column("logprobs").to_pylist()
    lp[row][-1] = value
    return _replace(t, "logprobs", lp)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda t: t.drop_columns(["reward"]), ["reward"]),
        (lambda t: t.drop_columns(["input_ids", "loss_mask"]), ["input_ids"]),
        (lambda t: _replace(t, "loss_mask", [m[1:] for m in t.column("loss_mask").to_pylist()]), ["loss_mask"]),
        (lambda t: _replace(t, "reward", [float("nan")] * t.num_rows), ["reward"]),
        (lambda t: _tokens(t, 3, 2**31), ["math/g000/r3/b0", "'input_ids'", "2**31 - 1"]),
        (lambda t: _logprob(t, 5, float("nan")), ["math/g001/r1/b0", "'logprobs'", "non-finite"]),
        (lambda t: _logprob(t, 6, float("inf")), ["math/g001/r2/b0", "'logprobs'", "non-finite"]),
    ],
)  # fmt: skip
def test_bad_input_fails_cleanly_and_writes_nothing(
    tmp_path: Path, edit: Any, words: list[str]
) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(edit(rollouts(_groups(2))), path)
    result = cli("pack", path, "-o", tmp_path / "out", *BASE)
    _fails_cleanly(result, 1, *words)
    assert _listing(tmp_path) == ["in.parquet"]


def test_branches_with_different_given_advantages(tmp_path: Path) -> None:
    table = rollouts([G("math", [0.0, 1.0], [20, 30], branches=[3, 2])] * 2, advantage=True)
    adv = table.column("advantage").to_pylist()
    adv[2] += 0.5  # the third branch of rollout 0 of group 0
    adv[9] = -adv[9]  # the second branch of rollout 1 of group 1
    path = tmp_path / "in.parquet"
    pq.write_table(_replace(table, "advantage", adv), path)
    text = _fails_cleanly(
        cli("pack", path, "-o", tmp_path / "out", *BASE),
        1,
        "the input has 2 problems",
        "math/g000/r0/b2",
        "math/g001/r1/b1",
        "'advantage'",
        "branches of one rollout have different advantages",
    )
    assert "r0/b1" not in text  # the branches that agree are not named
    assert _listing(tmp_path) == ["in.parquet"]


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        ((), False),
        (("--estimator", "grpo"), True),  # explicit, even though it is the default
        (("--env-estimator", "math=rloo"), True),
    ],
)
def test_an_estimator_given_with_an_advantage_column_is_warned_about(
    tmp_path: Path, args: tuple[str, ...], warned: bool
) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(rollouts(_groups(2), advantage=True), path)
    for mode in ((), ("--json",)):  # warnings go to stderr with --json too
        out = tmp_path / f"out{len(mode)}"
        result = cli("pack", path, "-o", out, *BASE, *args, *mode)
        assert result.exit_code == 0, result.output
        assert ("estimator" in result.stderr and "ignored" in result.stderr) is warned
        manifest = json.loads((out / "manifest.json").read_text())
        assert any("ignored" in w for w in manifest["warnings"]) is warned


def test_json_mode_prints_warnings_to_stderr(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(rollouts(_groups(3)), path)  # 12 rollouts, steps of 8: 4 left over
    result = cli("pack", path, "-o", tmp_path / "out", *BASE, "--batch-size", 8, "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["warnings"] and "left over" in manifest["warnings"][0]
    assert "Warning:" in result.stderr and "left over" in result.stderr


def test_missing_input_file(tmp_path: Path) -> None:
    result = cli("pack", tmp_path / "nope.parquet", "-o", tmp_path / "out", *BASE)
    _fails_cleanly(result, 1, "nope.parquet")
    assert _listing(tmp_path) == []


def test_micro_batch_size_rows_longer_than_row_len(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(rollouts([G("math", [0, 1, 0.5, 0.2], [300, 300, 300, 300])]), path)
    result = cli("pack", path, "-o", tmp_path / "out", "--dp", 1, "--batch-size", 4,
                 "--micro-batch-size", 4, "--row-len", 512)  # fmt: skip
    _fails_cleanly(result, 1, "--row-len", "--micro-batch-size")
    assert _listing(tmp_path) == ["in.parquet"]


# --- existing outputs ----------------------------------------------------------------------


def test_existing_output_is_refused_without_force(inp: Path) -> None:
    out = inp.parent / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("pack", inp, "-o", out, *BASE)
    _fails_cleanly(result, 1, "already exists", "--force")
    assert _listing(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert _listing(inp.parent) == ["in.parquet", "out"]


def test_force_replaces_the_output(inp: Path) -> None:
    out = inp.parent / "out"
    pack(inp, out, *BASE, "--batch-size", 8)
    (out / "keep.txt").write_text("old")  # still a packed directory: replaced whole
    manifest = pack(inp, out, *BASE, "--force")
    assert "keep.txt" not in _listing(out) and (out / "manifest.json").is_file()
    assert manifest["num_steps"] == 4
    assert cli("verify", out).exit_code == 0
    assert _listing(inp.parent) == ["in.parquet", "out"]  # nothing old or temporary left beside


def test_force_refuses_what_rolltool_did_not_write(inp: Path) -> None:
    notes = inp.parent / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    _fails_cleanly(cli("pack", inp, "-o", notes, *BASE, "--force"), 1, "not an output rolltool")
    _fails_cleanly(cli("pack", inp, "-o", inp.parent, *BASE, "--force"), 1, "contains the input")
    assert (notes / "keep.txt").read_text() == "mine" and inp.is_file()


# --- runs that die midway ------------------------------------------------------------------


def _fail_on_call(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    calls = [0]
    real = rolltool.packed.writer.write_shard

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] >= n:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(rolltool.packed.writer, "write_shard", flaky)
    return calls


def _config() -> PackConfig:
    return PackConfig(dp=2, steps=StepConfig(batch_size=4), micro_batch_tokens=256)


@pytest.mark.parametrize("existing", [False, True])
def test_a_failing_write_leaves_no_output(
    inp: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    out = inp.parent / "out"
    if existing:
        pack(inp, out, *BASE, "--batch-size", 8)
        old = json.loads((out / "manifest.json").read_text())
    calls = _fail_on_call(monkeypatch, 4)
    with pytest.raises(OSError, match="No space"):
        run_pack([str(inp)], out, _config(), force=True)
    assert calls[0] >= 4  # it really was writing when it failed
    assert not list(inp.parent.glob(".*"))  # the temp dir is gone
    if existing:
        assert json.loads((out / "manifest.json").read_text()) == old  # untouched
    else:
        assert _listing(inp.parent) == ["in.parquet"]


_DIE = """
import os, signal, sys
import rolltool.packed.writer
from rolltool.cli import main
real, calls = rolltool.packed.writer.write_shard, [0]
def dying(*args, **kwargs):
    # Die right after the third shard write has finished (writes run on worker threads, so
    # dying before it could leave no shard on disk yet).
    result = real(*args, **kwargs)
    calls[0] += 1
    if calls[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
rolltool.packed.writer.write_shard = dying
main(sys.argv[1:])
"""


@pytest.mark.parametrize("existing", [False, True])
def test_a_killed_run_leaves_nothing_that_looks_complete(inp: Path, existing: bool) -> None:
    out = inp.parent / "out"
    if existing:
        pack(inp, out, *BASE, "--batch-size", 8)
        old = (out / "manifest.json").read_text()
    args = ["pack", str(inp), "-o", str(out), *map(str, BASE), "--force"]
    proc = subprocess.run([sys.executable, "-c", _DIE, *args], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    hidden = [p for p in inp.parent.iterdir() if p.name.startswith(".")]
    assert hidden and list(hidden[0].rglob("*.safetensors"))  # it died with shards written
    manifests = [p for p in inp.parent.rglob("manifest.json") if not any(x in hidden for x in p.parents)]  # fmt: skip
    if existing:
        assert manifests == [out / "manifest.json"] and (out / "manifest.json").read_text() == old
    else:
        assert not out.exists() and manifests == []
        assert not any(list(p.rglob("manifest.json")) for p in hidden)
    # The next run ignores the stale temp dir and produces a complete output.
    manifest = pack(inp, out, *BASE, *(("--force",) if existing else ()))
    assert manifest["num_steps"] == 4 and cli("verify", out).exit_code == 0


def test_verify_of_a_missing_path(tmp_path: Path) -> None:
    result = cli("verify", tmp_path / "nope")
    _fails_cleanly(result, 1, "nope")
