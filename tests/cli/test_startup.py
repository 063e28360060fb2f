"""Start-up: the group's --help and --version import no subcommand, one command imports itself.

Issue 25: ``rolltool --version`` took twice ``python -c "import polars, json"`` because the CLI
imported every subcommand up front (bench -> reader -> fs -> ``pyarrow.fs`` with its S3 module).
The subcommands are registered by name, module and short help (`rolltool.cli.COMMANDS`) and
imported when one runs or shows its own help; each check runs in a fresh interpreter, so no
import of this test process hides one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from pack_helpers import pack

from rolltool.cli import COMMANDS, CommandTable, main

HEAVY = ("torch", "polars", "pyarrow", "pyarrow._s3fs", "pyarrow.fs", "numpy", "rich")
"""What the group's own options never need (a subcommand's run may)."""

_PROBE = """
import json, sys
from rolltool.cli import main
code = main({args!r}, standalone_mode=False)
sys.stdout.flush()
sys.stderr.write(json.dumps(sorted(sys.modules)))
"""


def _imported(*args: str) -> set[str]:
    """The modules a fresh interpreter holds after ``rolltool ARGS`` (in-process, not exiting)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(args=list(args))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


def _subcommand_modules(modules: set[str]) -> set[str]:
    return {COMMANDS[n].module for n in COMMANDS} & modules


@pytest.mark.parametrize("args", [["--version"], ["--help"]])
def test_the_group_imports_no_subcommand_and_nothing_heavy(args: list[str]) -> None:
    modules = _imported(*args)
    assert _subcommand_modules(modules) == set()
    assert [m for m in HEAVY if m in modules] == []
    assert not any(m.startswith(("rolltool.packed", "rolltool.bench", "rolltool.storage"))
                   for m in modules)  # fmt: skip


def test_stats_help_imports_stats_only_and_no_data_library() -> None:
    modules = _imported("stats", "--help")
    assert _subcommand_modules(modules) == {"rolltool.cli.stats"}
    assert [
        m for m in ("torch", "polars", "pyarrow", "pyarrow._s3fs", "numpy") if m in modules
    ] == []


def test_stats_of_a_pack_imports_neither_polars_nor_the_rollout_reader(tmp_path: Path) -> None:
    """``stats PACKED`` reads the manifest and samples.parquet (pyarrow, from the columns'
    buffers): polars, pandas, the rollout schema rules, the pack pool and torch stay out (they
    took ~0.3 s of a ~0.8 s CPU start)."""
    out = tmp_path / "packed"
    pack(Path(__file__).parents[2] / "examples" / "rollouts.parquet", out, "--dp", 2)
    modules = _imported("stats", str(out), "--json")
    assert "rolltool.stats.packed" in modules and "pyarrow.parquet" in modules  # it ran
    unwanted = ("torch", "polars", "pandas", "rolltool.schema", "rolltool.stats.rollouts",
                "rolltool.engine.local", "rolltool.input.parquet")  # fmt: skip
    assert [m for m in unwanted if m in modules] == []


def test_every_deferred_command_has_its_own_short_help() -> None:
    """The help lines recorded in COMMANDS are the commands' own (a changed short_help must
    be changed in both), and every command a module defines is the one registered."""
    for name, deferred in COMMANDS.items():
        command = main.commands[name]
        assert command.name == name
        assert not command.hidden
        assert command.get_short_help_str(1000) == deferred.short_help, name


def test_the_listing_is_clicks_own(run_cli) -> None:
    """The group's --help lists exactly what click lists once every command is imported."""
    lazy = run_cli("--help").stdout
    table = CommandTable(COMMANDS)
    group = type(main)(name="rolltool", commands=table)
    ctx = click.Context(group, info_name="rolltool", max_content_width=100, terminal_width=100)
    before = ctx.make_formatter()
    group.format_commands(ctx, before)  # deferred: nothing imported for it
    assert all(not isinstance(table._entries[n], click.Command) for n in COMMANDS)
    for name in COMMANDS:
        table[name]  # import each
    after = ctx.make_formatter()
    click.Group.format_commands(group, ctx, after)
    assert before.getvalue() == after.getvalue()
    assert _listed(lazy) == list(COMMANDS)  # rolltool --help itself, through click's runner


def _listed(help_text: str) -> list[str]:
    block = help_text.split("Commands:\n", 1)[1]
    return [
        line.split()[0] for line in block.splitlines() if line.startswith("  ") and line[2] != " "
    ]


def test_a_hidden_or_later_command_is_listed_as_click_would() -> None:
    table = CommandTable(COMMANDS)
    group = type(main)(name="rolltool", commands=table)
    group.add_command(click.Command("zzz-hidden", hidden=True, short_help="never shown"))
    group.add_command(click.Command("zzz-later", short_help="A command added later."))
    ctx = click.Context(group, info_name="rolltool", max_content_width=100, terminal_width=100)
    f = ctx.make_formatter()
    group.format_commands(ctx, f)
    text = f.getvalue()
    assert "zzz-hidden" not in text and text.rstrip().endswith("zzz-later   A command added later.")
    assert list(table) == [*COMMANDS, "zzz-hidden", "zzz-later"]
