"""`rolltool` command line: a thin click layer over the Python API.

Each subcommand lives in its own module (options -> config -> job -> renderer) and is registered
here, in data-flow order, by name, module and short help (`COMMANDS`): the module is imported only
when its command runs or shows its own help, so ``rolltool --version`` and ``rolltool --help``
import none of them (nor numpy, pyarrow, polars, rich or torch) and start in about the
interpreter's time (issue 25: importing every subcommand up front pulled in bench -> reader ->
``pyarrow.fs`` with its S3 module). ``rolltool --help`` lists every registered command with the
short help recorded here; tests/cli checks each one against its command's own. Nothing here
imports torch; `bench` imports it inside the command.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import click

from rolltool._version import __version__


@dataclass(frozen=True)
class Deferred:
    """A subcommand registered by where it is: ``module``'s click command ``attr``, and the
    short help ``rolltool --help`` lists for it (the command's own ``short_help``)."""

    module: str
    attr: str
    short_help: str

    def load(self) -> click.Command:
        command = getattr(importlib.import_module(self.module), self.attr)
        assert isinstance(command, click.Command), (self.module, self.attr)
        return command


COMMANDS: dict[str, Deferred] = {
    "synth": Deferred(
        "rolltool.cli.synth", "synth", "Write a realistic synthetic rollout dataset."
    ),
    "advantages": Deferred(
        "rolltool.cli.advantages",
        "advantages",
        "Compute group advantages (dr_grpo, grpo, opo, reinforce_pp_baseline, rloo).",
    ),
    "pack": Deferred(
        "rolltool.cli.pack",
        "pack",
        "Steps, balanced micro-batches, packed rows, sharded safetensors.",
    ),
    "verify": Deferred(
        "rolltool.cli.verify", "verify", "Check a packed directory's hashes and invariants."
    ),
    "stats": Deferred(
        "rolltool.cli.stats",
        "stats",
        "What rollout Parquet or a packed directory contains, at a glance.",
    ),
    "bench": Deferred(
        "rolltool.cli.bench",
        "bench",
        "Replay packed rows through transformer layers; measure balance.",
    ),
}
"""Every subcommand, in the order ``rolltool --help`` lists them (the data flow)."""


class CommandTable(MutableMapping[str, click.Command]):
    """A group's ``commands``: name -> command in registration order, where a `Deferred` entry
    is imported on its first lookup (``table[name]``, ``get``, ``values``); iterating the names,
    ``in`` and `short_help` import nothing."""

    def __init__(self, entries: dict[str, Deferred]) -> None:
        self._entries: dict[str, click.Command | Deferred] = dict(entries)

    def __getitem__(self, name: str) -> click.Command:
        entry = self._entries[name]
        if isinstance(entry, Deferred):
            entry = self._entries[name] = entry.load()
        return entry

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._entries[name] = command

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def short_help(self, name: str, limit: int) -> str | None:
        """The help line of command `name` (None for a hidden one), without importing it."""
        entry = self._entries[name]
        if isinstance(entry, Deferred):
            return entry.short_help
        return None if entry.hidden else entry.get_short_help_str(limit)


class Commands(click.Group):
    """A group listing its commands in the order they were added (the data flow), not sorted,
    whose help lists deferred commands without importing them (`CommandTable`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing (name, short help; hidden ones left out), from the table."""
        table = self.commands
        if not isinstance(table, CommandTable):  # pragma: no cover - a plain dict of commands
            super().format_commands(ctx, formatter)
            return
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, text) for n in names if (text := table.short_help(n, limit)) is not None]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=Commands,
    commands=CommandTable(COMMANDS),
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "--version", prog_name="rolltool")
def main() -> None:
    """Prepare RL rollout datasets for LLM training."""
