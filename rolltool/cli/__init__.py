"""`rolltool` command line: a thin click layer over the Python API.

Each subcommand lives in its own module (options -> config -> job -> renderer) and is registered
here; ``rolltool --help`` lists what is registered, in data-flow order. Nothing here imports
torch; `bench` imports it inside the command.
"""

from __future__ import annotations

import click

from rolltool._version import __version__


class Commands(click.Group):
    """A group listing its commands in the order they were added (the data flow), not sorted."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(
    cls=Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "--version", prog_name="rolltool")
def main() -> None:
    """Prepare RL rollout datasets for LLM training."""


def _register() -> None:
    from rolltool.cli import advantages, bench, pack, stats, synth, verify

    for command in (synth.synth, advantages.advantages, pack.pack, verify.verify,
                    stats.stats, bench.bench):  # fmt: skip
        main.add_command(command)


_register()
