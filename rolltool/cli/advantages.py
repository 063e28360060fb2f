"""`rolltool advantages`: group advantages written next to the input columns."""

from __future__ import annotations

import click
from rich.table import Table

from rolltool.advantages import ESTIMATORS, AdvantageConfig
from rolltool.cli._common import (
    column_option,
    err,
    handle_errors,
    out,
    parse_columns,
    parse_mapping,
    print_json,
    warn,
)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="Parquet file to write."
)
@click.option(
    "--estimator",
    type=click.Choice(sorted(ESTIMATORS)),
    default="grpo",
    show_default=True,
    help="Advantage estimator.",
)
@click.option(
    "--env-estimator", multiple=True, metavar="ENV=NAME", help="Estimator for one env (repeatable)."
)
@click.option(
    "--std-eps",
    default=1e-6,
    show_default=True,
    type=float,
    help="Epsilon added to the std (grpo).",
)
@column_option
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@handle_errors
def advantages(
    inputs: tuple[str, ...],
    output: str,
    estimator: str,
    env_estimator: tuple[str, ...],
    std_eps: float,
    column: tuple[str, ...],
    force: bool,
    as_json: bool,
) -> None:
    """Compute group advantages for rollout Parquet INPUTS (files, directories or globs).

    Writes every input row plus advantage, group_size, group_reward_mean, group_reward_std and
    group_uniform.
    """
    from rolltool.jobs import run_advantages

    overrides = parse_mapping(env_estimator, "--env-estimator")
    for env, name in overrides.items():
        if name not in ESTIMATORS:
            raise click.BadParameter(
                f"unknown estimator {name!r} for env {env!r} (choose from {', '.join(sorted(ESTIMATORS))})",
                param_hint="--env-estimator",
            )
    config = AdvantageConfig(estimator=estimator, env_estimators=overrides, std_eps=std_eps)
    report = run_advantages(inputs, output, config, columns=parse_columns(column), force=force)
    for w in report["warnings"]:  # to stderr, with --json too (the report also lists them)
        warn(w)
    if as_json:
        print_json(report)
        return
    table = Table(title=f"advantages -> {output}", title_justify="left")
    for name in (
        "env",
        "estimator",
        "groups",
        "rollouts",
        "samples",
        "uniform",
        "reward mean±std",
        "adv mean±std",
        "adv min",
        "adv max",
    ):
        table.add_column(name, justify="left" if name in ("env", "estimator") else "right")
    rows = report["envs"] + ([report["overall"]] if len(report["envs"]) > 1 else [])
    for r in rows:
        table.add_row(
            "(all)" if r["env"] is None else r["env"],
            r["estimator"] or "",
            f"{r['groups']:,}",
            f"{r['rollouts']:,}",
            f"{r['samples']:,}",
            f"{r['uniform_groups']:,} ({r['uniform_share']:.0%})",
            f"{_fmt(r['reward_mean'])}±{_fmt(r['reward_std'])}",
            f"{_fmt(r['advantage_mean'])}±{_fmt(r['advantage_std'])}",
            _fmt(r["advantage_min"]),
            _fmt(r["advantage_max"]),
        )
    out.print(table)
    err.print(f"wrote {report['samples']:,} samples to {output}")
