"""The command line as a user meets it: version, one JSON document, stdout vs stderr, no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolltool._version import __version__
from rolltool.cli import main


def _python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_version(run_cli) -> None:
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"rolltool, version {__version__}"


def test_python_dash_m_version() -> None:
    proc = _python("-m", "rolltool", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rolltool, version {__version__}"


def test_console_script_version() -> None:
    script = Path(sys.executable).parent / "rolltool"
    if not script.exists():
        pytest.skip("the rolltool console script is not installed next to this python")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert __version__ in proc.stdout


def _listed_commands(help_text: str) -> list[str]:
    block = help_text.split("Commands:\n", 1)[1]
    return [line.split()[0] for line in block.splitlines() if re.match(r"  \S", line)]


def test_help_lists_every_registered_subcommand(run_cli) -> None:
    """Defect #15: the list was written by hand and left out bench; now it is generated, in the
    order the commands are registered (the data flow)."""
    result = run_cli("--help")
    assert result.exit_code == 0
    listed = _listed_commands(result.stdout)
    assert (
        listed == list(main.commands) == ["synth", "advantages", "pack", "verify", "stats", "bench"]
    )
    extra = click.Command("zzz-extra", help="A command registered later.")
    main.add_command(extra)
    try:
        assert _listed_commands(run_cli("--help").stdout)[-1] == "zzz-extra"
    finally:
        del main.commands["zzz-extra"]


def test_usage_errors_exit_2(run_cli, tmp_path: Path) -> None:
    for args in (["nope"], ["advantages", "-o", tmp_path / "x.parquet"], ["synth"]):
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


# ------------------------------------------------------------------------------------------
# --json: exactly one JSON document on stdout.


def test_synth_json(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    result = run_cli("synth", "-o", out, "--groups", 4, "--max-len", 2048, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the whole of stdout is one document
    assert report["output"] == str(out)
    assert report["rows"] == pq.read_metadata(out).num_rows
    assert result.stderr == ""


def test_advantages_json(run_cli, synth_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.parquet"
    result = run_cli("advantages", synth_path, "-o", out, "--estimator", "rloo", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["rolltool"] == __version__
    assert report["output"] == str(out)
    assert report["config"]["estimator"] == "rloo"
    assert report["inputs"] == [{"path": str(synth_path), "rows": report["samples"]}]
    envs = {r["env"]: r for r in report["envs"]}
    assert set(envs) == {"math", "code", "agent"}
    overall = report["overall"]
    for row in [*envs.values(), overall]:
        for key in (
            "groups",
            "rollouts",
            "samples",
            "uniform_groups",
            "uniform_share",
            "reward_mean",
            "reward_std",
            "advantage_mean",
            "advantage_std",
            "advantage_min",
            "advantage_max",
        ):
            assert key in row
        assert row["rollouts"] <= row["samples"]
        assert 0 <= row["uniform_share"] <= 1
    assert overall["samples"] == sum(envs[e]["samples"] for e in ("math", "code", "agent"))
    assert overall["groups"] == report["groups"]


def _with_untrainable_sample(write_parquet) -> Path:
    return write_parquet(
        {
            "group_id": ["g", "g", "h"],
            "reward": [1.0, 0.0, 0.5],
            # (a lone [1] would be untrainable too: the first token is never a target)
            "input_ids": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int32())),
            "loss_mask": pa.array([[0, 1], [0, 0], [0, 1]], pa.list_(pa.int8())),
        }
    )


def test_results_on_stdout_warnings_on_stderr(run_cli, write_parquet, tmp_path: Path) -> None:
    path = _with_untrainable_sample(write_parquet)
    result = run_cli("advantages", path, "-o", tmp_path / "a.parquet")
    assert result.exit_code == 0, result.output
    assert "advantages" in result.stdout and "grpo" in result.stdout  # the summary table
    assert "Warning" in result.stderr and "no trainable token" in result.stderr
    assert "Warning" not in result.stdout

    result = run_cli("advantages", path, "-o", tmp_path / "b.parquet", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["samples_without_trainable_tokens"] == 1
    assert "no trainable token" in result.stderr  # warnings go to stderr with --json too


def test_errors_on_stderr_with_json(run_cli, tmp_path: Path) -> None:
    result = run_cli(
        "advantages", tmp_path / "missing.parquet", "-o", tmp_path / "a.parquet", "--json"
    )
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ")


def test_json_in_a_real_process(synth_path: Path, tmp_path: Path) -> None:
    """Through a real process and pipes: stdout is one JSON document, stderr has no progress."""
    out = tmp_path / "a.parquet"
    proc = _python("-m", "rolltool", "advantages", str(synth_path), "-o", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["output"] == str(out)
    assert proc.stderr == ""


def test_debug_variable_shows_the_traceback(tmp_path: Path) -> None:
    args = [
        "-m",
        "rolltool",
        "advantages",
        str(tmp_path / "missing.parquet"),
        "-o",
        str(tmp_path / "a.parquet"),
    ]
    proc = _python(*args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ")
    proc = _python(*args, env={"ROLLTOOL_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RolltoolError" in proc.stderr


# ------------------------------------------------------------------------------------------
# The core subcommands never import torch (`import torch` costs seconds).

NO_TORCH = """
import json, sys
from rolltool.cli import main
after_import = "torch" in sys.modules
for args in ({commands}):
    try:
        main(args, standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (args, e.code)
sys.stderr.write(json.dumps({{"after_import": after_import, "after_run": "torch" in sys.modules}}))
"""


def test_core_subcommands_do_not_import_torch(synth_path: Path, tmp_path: Path) -> None:
    commands = [
        ["synth", "-o", str(tmp_path / "s.parquet"), "--groups", "3", "--max-len", "1024"],
        ["advantages", str(synth_path), "-o", str(tmp_path / "a.parquet"), "--json"],
        [
            "advantages",
            str(synth_path),
            "-o",
            str(tmp_path / "b.parquet"),
            "--estimator",
            "reinforce_pp_baseline",
        ],
    ]
    proc = _python("-c", NO_TORCH.format(commands=repr(commands)))
    assert proc.returncode == 0, proc.stderr
    flags = json.loads(proc.stderr.strip().splitlines()[-1])
    assert flags == {"after_import": False, "after_run": False}
    assert (tmp_path / "a.parquet").exists() and (tmp_path / "b.parquet").exists()


def test_cli_import_is_light() -> None:
    """`rolltool --help` starts fast: importing the CLI (every command's options, defaults from
    the config records) loads neither torch nor polars."""
    code = "import sys, rolltool.cli; print(sorted({'torch', 'polars'} & set(sys.modules)))"
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
