"""`rolltool advantages`: options -> `AdvantageConfig` -> `run_advantages` -> one table."""

from __future__ import annotations

import click

from rolltool.cli._common import err, handle_errors, out, print_json, warn
from rolltool.cli.options import (
    POSITIVE,
    column_option,
    engine_options,
    estimator_options,
    force_option,
    json_option,
)
from rolltool.cli.sections import SectionedCommand, opt, section
from rolltool.cli.terminal import table_width
from rolltool.plan.advantages import ESTIMATORS, AdvantageConfig


@click.command(
    cls=SectionedCommand,
    short_help=f"Compute group advantages ({', '.join(sorted(ESTIMATORS))}).",
)
@click.argument("inputs", nargs=-1, required=True)
@section("Advantages", *estimator_options(ESTIMATORS, AdvantageConfig()))
@section(
    "Input",
    column_option(),
    opt("--workers", POSITIVE, None, "Processes that scan the input's row groups, when it has 8 or more (the same output whatever the number) [default: the cores available]."),
    *engine_options("scans the input's row groups"),
)  # fmt: skip
@section(
    "Output",
    opt("-o --output", click.Path(dir_okay=False), None, "Parquet file to write.", required=True),
    force_option(),
    json_option(),
)
@handle_errors
def advantages(
    inputs: tuple[str, ...],
    output: str,
    estimator: str,
    env_estimators: dict[str, str],
    std_eps: float,
    columns: dict[str, str],
    workers: int | None,
    engine: str,
    ray_address: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Compute group advantages for rollout Parquet INPUTS (files, directories or globs).

    Writes every input row plus advantage, group_size, group_reward_mean, group_reward_std and
    group_uniform. Reads the input twice, one row group at a time (light columns, then the
    copy, which checks the token columns): memory holds the light columns and one output row
    group, not the input.
    """
    from rolltool.engine.config import ExecutionConfig, open_mapper
    from rolltool.jobs.advantages import run_advantages
    from rolltool.stats.render import render_advantages

    config = AdvantageConfig(estimator=estimator, env_estimators=env_estimators, std_eps=std_eps)
    execution = ExecutionConfig(workers=workers, engine=engine, ray_address=ray_address)
    with open_mapper(execution, "scanning row groups") as mapper:
        report = run_advantages(
            execution.task_paths(inputs), output, config, columns=columns, force=force,
            mapper=mapper,
        )  # fmt: skip
    for w in report["warnings"]:  # to stderr, with --json too (the report also lists them)
        warn(w)
    if as_json:
        print_json(report)
        return
    w = table_width()
    out.print(render_advantages(report, width=w), width=w)
    err.print(f"wrote {report['samples']:,} samples to {output}")
