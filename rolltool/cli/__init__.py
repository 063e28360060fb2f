"""`rolltool` command line: a thin click layer over the Python API.

Each subcommand lives in its own module and is registered here. Nothing here imports torch;
`bench` imports it inside the command.
"""

from __future__ import annotations

import click

from rolltool import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="rolltool")
def main() -> None:
    """Prepare RL rollout datasets for LLM training.

    \b
    synth       write a realistic synthetic rollout dataset
    advantages  compute group advantages (grpo, dr_grpo, rloo, opo, reinforce_pp_baseline)
    pack        steps, balanced micro-batches, packed rows, sharded safetensors
    verify      check a packed directory's hashes and invariants
    stats       what rollout Parquet or a packed directory contains, at a glance
    """


def _register() -> None:
    from rolltool.cli import advantages, bench, pack, stats, synth, verify

    main.add_command(synth.synth)
    main.add_command(advantages.advantages)
    main.add_command(pack.pack)
    main.add_command(verify.verify)
    main.add_command(bench.bench)
    main.add_command(stats.stats)


_register()
