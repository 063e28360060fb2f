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
    "Groups",
    opt("--shared-prompts", bool, D.shared_prompts, "A group's rollouts share their prompt tokens (what pack --share-prefix computes once); off: every sample's tokens drawn on their own."),
    opt("--group-size", int, None, "Rollouts per group in every env (default: math 16, code 8, agent 8)."),
    opt("--prompt-len", int, None, "Every prompt (agent: system prompt) exactly this many tokens (default: each env's range)."),
)  # fmt: skip
@section(
    "Output",
    opt("-o --output", click.Path(dir_okay=False), None, "Parquet file to write.", required=True),
    force_option(),
    json_option("one JSON document instead of a summary"),
)
@handle_errors
def synth(
    output: str,
    groups: int,
    seed: int,
    envs: str,
    max_len: int,
    shared_prompts: bool,
    group_size: int | None,
    prompt_len: int | None,
    force: bool,
    as_json: bool,
) -> None:
    """Write a deterministic multi-environment rollout dataset (math, code, agent)."""
    from rolltool.jobs.synth import run_synth

    config = SynthConfig(
        groups=groups,
        seed=seed,
        envs=tuple(e.strip() for e in envs.split(",") if e.strip()),
        max_len=max_len,
        shared_prompts=shared_prompts,
        group_size=group_size,
        prompt_len=prompt_len,
    )
    report = run_synth(config, output, force=force)
    if as_json:
        print_json(report)
        return
    per_env = ", ".join(f"{k} {v:,}" for k, v in report["samples_per_env"].items())
    out.print(
        f"wrote {report['rows']:,} samples ({per_env}) to {output} ({report['bytes'] / 1e6:.1f} MB)"
    )
