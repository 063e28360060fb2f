"""`rolltool stats`: what a rollout dataset or a packed run contains, at a glance."""

from __future__ import annotations

import sys

import click

from rolltool.cli._common import err, handle_errors, out, print_json, progress
from rolltool.cli.options import POSITIVE, column_option, engine_options, json_option
from rolltool.cli.sections import SectionedCommand, opt, section
from rolltool.cli.terminal import table_width


@click.command(
    cls=SectionedCommand,
    short_help="What rollout Parquet or a packed directory contains, at a glance.",
)
@click.argument("paths", nargs=-1, required=True)
@section(
    "Input",
    opt("--limit", POSITIVE, None, "Read only the first N rows (rollouts) or steps (packed run)."),
    column_option(),
    *engine_options("reads the pieces of the input (rollouts) or computes the steps (packed run)"),
)
@section(
    "Packed run",
    opt("--per-step", bool, False, "Add the table of every step."),
    opt("--step", click.IntRange(min=0), None, "Details of step S.", metavar="S"),
)
@section(
    "Output",
    json_option(),
    opt("--plot plot_path", click.Path(dir_okay=False), None,
        "Also draw a one-page figure (needs matplotlib: pip install 'rolltool[plot]').",
        metavar="FILE.png"),
)  # fmt: skip
@handle_errors
def stats(
    paths: tuple[str, ...],
    as_json: bool,
    per_step: bool,
    step: int | None,
    limit: int | None,
    plot_path: str | None,
    columns: dict[str, str],
    engine: str,
    ray_address: str | None,
) -> None:
    """Statistics of rollout Parquet PATHS (files, directories, globs) or of one packed directory.

    Rollout Parquet: per env, groups and group sizes, rollouts, branches, sampled and trainable
    tokens (total, mean, p50/p90/p99/max), reward, uniform groups, completion order.

    Packed directory: per step and env, counts and shares; packing efficiency and padding; rank
    imbalance and lockstep overhead, next to a token-count and a count-based split. Packed with
    --sp/--cp: the world (dp x sp|cp GPUs, the per-GPU and the group's budget), the samples over
    the per-GPU budget that the split made trainable, and the CP padding.

    With --engine ray the pieces of the input (runs of row groups) or the steps are computed
    by Ray tasks and merged in order: the same output.
    """
    from rolltool.engine.config import ExecutionConfig, open_mapper
    from rolltool.stats import compute_stats
    from rolltool.stats.render import render

    # stats reads in this process with --engine local (one worker), on the cluster with ray
    execution = ExecutionConfig(
        engine=engine, ray_address=ray_address, workers=1 if engine == "local" else None
    )
    with open_mapper(execution, "reading pieces of the input or steps") as mapper:
        result = compute_stats(
            execution.task_paths(paths),
            columns=columns,
            step=step,
            limit=limit,
            progress=progress,
            mapper=mapper,
        )
    if as_json:
        print_json(result.report)
    else:
        w = table_width()
        out.print(render(result.report, per_step=per_step, step=step, width=w), width=w)
    if plot_path is not None:  # after the tables: a missing matplotlib loses none of them
        from rolltool.stats.plot import PlotUnavailable, save_figure

        try:
            written = save_figure(result, plot_path, step=step)
        except PlotUnavailable as e:
            err.print(f"No figure: {e.message}; {e.hint}.", markup=False)
            sys.exit(1)
        err.print(f"wrote {written}", markup=False)
