"""`rolltool synth`: options -> `SynthConfig` -> `run_synth` -> one line."""

from __future__ import annotations

import click

from rolltool.cli._common import handle_errors, out, print_json
from rolltool.cli.options import force_option, json_option
from rolltool.cli.sections import SectionedCommand, opt, section
from rolltool.input.synth import ENVS, SynthConfig

D = SynthConfig()
"""Every default, as the API has it."""


@click.command(cls=SectionedCommand, short_help="Write a realistic synthetic rollout dataset.")
@section(
    "Dataset",
    opt("--groups", int, D.groups, "Number of groups (tasks)."),
    opt("--seed", int, D.seed, "Random seed."),
    opt("--envs", str, ",".join(D.envs), f"Comma-separated environments ({', '.join(sorted(ENVS))})."),
    opt("--max-len", int, D.max_len, "Longest sample, tokens."),
)  # fmt: skip
@section(
    "Output",
    opt("-o --output", click.Path(dir_okay=False), None, "Parquet file to write.", required=True),
    force_option(),
    json_option("one JSON document instead of a summary"),
)
@handle_errors
def synth(
    output: str, groups: int, seed: int, envs: str, max_len: int, force: bool, as_json: bool
) -> None:
    """Write a deterministic multi-environment rollout dataset (math, code, agent)."""
    from rolltool.jobs.synth import run_synth

    config = SynthConfig(
        groups=groups,
        seed=seed,
        envs=tuple(e.strip() for e in envs.split(",") if e.strip()),
        max_len=max_len,
    )
    report = run_synth(config, output, force=force)
    if as_json:
        print_json(report)
        return
    per_env = ", ".join(f"{k} {v:,}" for k, v in report["samples_per_env"].items())
    out.print(
        f"wrote {report['rows']:,} samples ({per_env}) to {output} ({report['bytes'] / 1e6:.1f} MB)"
    )
