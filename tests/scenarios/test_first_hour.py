"""Issue 13, "first hour": what a new user meets at an 80-column terminal and on the first
mistakes (tables that fit, token step sizes, the figure without matplotlib, verify on a file)."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rolltool.cli import main

NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?%?")


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _assert_fits(text: str, width: int) -> None:
    """Every line within ``width`` and no cell cut (rich marks a cut with an ellipsis)."""
    lines = _table_lines(text)
    assert lines, "nothing printed"
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, too_wide
    cut = [line for line in lines if re.search(r"\w…", line)]
    assert not cut, cut


@pytest.fixture
def columns_80(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def test_pack_tables_fit_80_columns_and_name_what_is_hidden(
    run_cli, synth_path: Path, tmp_path: Path, columns_80: None
) -> None:
    result = run_cli("pack", synth_path, "-o", tmp_path / "p", "--dp", "2", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    _assert_fits(result.stdout, 80)
    assert "hidden at this width:" in result.stdout
    # every figure the full table has is still in --json
    doc = json.loads(run_cli("pack", synth_path, "-o", tmp_path / "p", "--dp", "2",
                             "--batch-size", "16", "--force", "--json").stdout)  # fmt: skip
    assert all("groups" in s and "plan" in s for s in doc["steps"])


def test_columns_widens_piped_output(
    run_cli, synth_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COLUMNS is honoured when the output is not a terminal: 200 columns keep every column."""
    monkeypatch.setenv("COLUMNS", "200")
    result = run_cli("pack", synth_path, "-o", tmp_path / "p", "--dp", "2", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    assert "hidden at this width" not in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) > 80


def test_advantages_table_fits_80_columns(
    run_cli, synth_path: Path, tmp_path: Path, columns_80: None
) -> None:
    result = run_cli("advantages", synth_path, "-o", tmp_path / "a.parquet")
    assert result.exit_code == 0, result.output
    _assert_fits(result.stdout, 80)


def _step_rows(stdout: str) -> list[str]:
    """The first cell of each body row of the first table (the step table)."""
    table = stdout.split("\n\n")[0]
    return [m.group(1) for m in re.finditer(r"^│\s*(\S+)\s*│", table, flags=re.M)]


def test_long_step_table_is_summarised_unless_per_step(
    run_cli, synth_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolltool.stats import render
    from rolltool.stats.render import EDGE_STEPS

    MAX_STEP_ROWS = 2 * EDGE_STEPS + 2  # the fixture has 12 groups: at most 12 steps
    monkeypatch.setattr(render, "MAX_STEP_ROWS", MAX_STEP_ROWS)

    args = ("pack", synth_path, "-o", tmp_path / "p", "--dp", "2", "--batch-size", "1",
            "--force")  # fmt: skip
    full = run_cli(*args, "--per-step")
    assert full.exit_code == 0, full.output
    steps = json.loads(run_cli(*args, "--json").stdout)["num_steps"]
    assert steps > MAX_STEP_ROWS  # the summary really applies
    every = _step_rows(full.stdout)
    assert every == [*map(str, range(steps)), "all"]
    short = _step_rows(run_cli(*args).stdout)
    first = [str(i) for i in range(EDGE_STEPS)]
    last = [str(i) for i in range(steps - EDGE_STEPS, steps)]
    assert short == [*first, "…", *last, "all"]


def test_token_unit_needs_a_batch_size(run_cli, synth_path: Path, tmp_path: Path) -> None:
    result = run_cli("pack", synth_path, "-o", tmp_path / "p", "--dp", "2",
                     "--batch-unit", "tokens")  # fmt: skip
    assert result.exit_code == 2
    assert "--batch-size" in result.stderr
    assert not (tmp_path / "p").exists()


def test_token_unit_with_a_tiny_step_warns(run_cli, synth_path: Path, tmp_path: Path) -> None:
    base = ("pack", synth_path, "-o", tmp_path / "p", "--dp", "2", "--batch-unit", "tokens",
            "--force", "--batch-size")  # fmt: skip
    tiny = run_cli(*base, "128")
    assert tiny.exit_code == 0, tiny.output
    assert "whole groups do not fit this step size" in tiny.stderr
    fine = run_cli(*base, "60000")
    assert fine.exit_code == 0, fine.output
    assert "do not fit this step size" not in fine.stderr


def test_step_size_warning_counts_steps_off_size() -> None:
    from types import SimpleNamespace as S

    from rolltool.plan.step_warnings import step_size_warning

    def steps(*actual: int, status: str = "short") -> list[Any]:
        return [S(status=status, actual=a, nominal=100) for a in actual]

    assert step_size_warning(steps(90, 80, 60, 210), "tokens") is None  # one of four off
    assert step_size_warning(steps(40, 30, 90), "tokens") is not None  # two of three short
    assert "less than half" in (step_size_warning(steps(40, 30, 90), "tokens") or "")
    assert step_size_warning(steps(10, status="partial") + steps(100), "rollouts") is None


@pytest.fixture
def packed(run_cli, synth_path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "packed"
    result = run_cli("pack", synth_path, "-o", out, "--dp", "2", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    return out


def test_stats_plot_without_matplotlib_keeps_the_tables(
    run_cli, packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__
    tried: list[str] = []

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            tried.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = run_cli("stats", packed, "--plot", tmp_path / "fig.png")
    assert tried  # the import was really attempted
    assert result.exit_code == 1
    assert "per step" in result.stdout  # the tables came first, complete
    assert "Traceback" not in result.output
    hint = [line for line in result.stderr.splitlines() if "rolltool[plot]" in line]
    assert len(hint) == 1 and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "fig.png").exists()


def test_stats_plot_names_the_file_written(run_cli, packed: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = run_cli("stats", packed, "--plot", tmp_path / "fig")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fig.png").is_file()
    assert not (tmp_path / "fig").exists()
    assert f"wrote {tmp_path / 'fig.png'}" in result.stderr


def test_verify_a_file_says_it_is_a_file(run_cli, synth_path: Path) -> None:
    result = run_cli("verify", synth_path)
    assert result.exit_code == 1
    assert f"{synth_path}: is a file, not a packed directory" in result.stderr
    assert "no such directory" not in result.stderr
    assert "rolltool stats" in result.stderr  # what to do with a rollout Parquet instead


def test_verify_bad_input_path_is_one_consistent_error(
    run_cli, packed: Path, tmp_path: Path
) -> None:
    result = run_cli("verify", packed, "--input", tmp_path / "missing.parquet")
    assert result.exit_code == 1
    assert "missing.parquet" in result.stderr
    assert "give --input" not in result.stderr  # it was given: no advice to give it
    assert "OK" not in result.stdout


def test_help_fits_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    monkeypatch.setenv("COLUMNS", "80")
    runner = CliRunner()
    checked = 0
    for name in ["", *main.commands]:
        args = [name, "--help"] if name else ["--help"]
        result = runner.invoke(main, args, terminal_width=80)
        assert result.exit_code == 0, result.output
        wide = [line for line in result.output.splitlines() if len(line) > 80]
        assert not wide, (name, wide)
        assert "``" not in result.output and ":func:" not in result.output, name
        checked += 1
    assert checked == len(main.commands) + 1
    pack_help = runner.invoke(main, ["pack", "--help"], terminal_width=80).output
    from rolltool.plan.loss import LOSS_AGGS

    for name in LOSS_AGGS:  # long choice lists: in the help, never broken at a hyphen
        assert re.search(rf"(^|[\s,]){re.escape(name)}[,.]", pack_help), name
    repeatable = ["--env-weight", "--env-estimator", "--column"]
    for flag in repeatable:
        block = pack_help.split(flag, 1)[1].split("\n  -", 1)[0]
        assert "(repeatable)" in " ".join(block.split()), flag


def _samples(path: Path) -> Any:
    import polars as pl

    return pl.read_parquet(path / "samples.parquet")


def test_equal_count_hint_names_a_way_that_works(run_cli, synth_path: Path, tmp_path: Path) -> None:
    """--dp 3 with --equal-count: the error's hint names --equal-count-trim, and following it
    works: every step trains a multiple of 3 samples, the same number on every rank, and the few
    left out are counted (status count_trimmed, fewer than dp per step, in the manifest)."""
    args = ("pack", synth_path, "-o", tmp_path / "p", "--dp", "3", "--batch-size", "16")
    refused = run_cli(*args, "--equal-count")
    assert refused.exit_code == 1
    assert "--equal-count-trim" in refused.stderr
    result = run_cli(*args, "--equal-count-trim", "--json")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    s = _samples(tmp_path / "p")
    trimmed = s.filter(s["status"] == "count_trimmed")
    assert len(trimmed) == manifest["samples"]["count_trimmed"] > 0  # trimming really happened
    assert "--equal-count-trim" in result.stderr
    trained = s.filter(s["status"] == "trained")
    for step in range(manifest["num_steps"]):
        here = trained.filter(trained["step"] == step)
        per_rank = here.group_by("rank").len()["len"].to_list()
        assert len(per_rank) == 3 and len(set(per_rank)) == 1, (step, per_rank)
        assert len(trimmed.filter(trimmed["step"] == step)) < 3
        assert manifest["steps"][step]["samples"] == len(here)
    assert sum(manifest["samples"][k] for k in manifest["samples"] if k != "total") == len(s)
    verified = run_cli("verify", tmp_path / "p")
    assert verified.exit_code == 0, verified.output


def test_equal_count_trim_changes_nothing_when_dp_divides(
    run_cli, synth_path: Path, tmp_path: Path
) -> None:
    args = ("--dp", "1", "--batch-size", "16")
    a = run_cli("pack", synth_path, "-o", tmp_path / "a", *args, "--equal-count")
    b = run_cli("pack", synth_path, "-o", tmp_path / "b", *args, "--equal-count-trim")
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    shards = sorted(
        str(p.relative_to(tmp_path / "a")) for p in (tmp_path / "a").rglob("*.safetensors")
    )
    assert shards
    for name in [*shards, "samples.parquet"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
