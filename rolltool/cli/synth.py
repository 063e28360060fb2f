"""`rolltool synth`: write a realistic synthetic rollout dataset."""

from __future__ import annotations

import click

from rolltool.cli._common import handle_errors, out, print_json
from rolltool.synth import ENVS, SynthConfig


@click.command()
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Parquet file to write."
)
@click.option("--groups", default=64, show_default=True, type=int, help="Number of groups (tasks).")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option(
    "--envs",
    default="math,code,agent",
    show_default=True,
    help=f"Comma-separated environments ({', '.join(sorted(ENVS))}).",
)
@click.option(
    "--max-len", default=32_768, show_default=True, type=int, help="Longest sample, tokens."
)
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document instead of a summary."
)
@handle_errors
def synth(
    output: str, groups: int, seed: int, envs: str, max_len: int, force: bool, as_json: bool
) -> None:
    """Write a deterministic multi-environment rollout dataset (math, code, agent)."""
    from rolltool.jobs import run_synth

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
