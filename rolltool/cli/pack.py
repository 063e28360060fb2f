"""`rolltool pack`: packed, sharded tensor files (verify lives in cli/verify.py)."""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource
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
    progress,
    warn,
)
from rolltool.loss import LOSS_AGGS
from rolltool.steps import BATCH_UNITS, ORDERS, UNIFORM_POLICIES, StepConfig
from rolltool.workload import MODEL_PRESETS, WORKLOADS


def _weights(pairs: tuple[str, ...]) -> dict[str, float]:
    result = {}
    for env, value in parse_mapping(pairs, "--env-weight").items():
        try:
            result[env] = float(value)
        except ValueError:
            raise click.BadParameter(
                f"{env}={value}: the weight must be a number", param_hint="--env-weight"
            ) from None
    return result


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option(
    "-o", "--output", required=True, type=click.Path(file_okay=False), help="Directory to write."
)
@click.option("--dp", required=True, type=click.IntRange(min=1), help="Data-parallel ranks.")
@click.option(
    "--batch-unit",
    type=click.Choice(BATCH_UNITS),
    default="rollouts",
    show_default=True,
    help="What --batch-size counts.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Step size in batch units (whole groups only).",
)
@click.option("--exact", is_flag=True, help="Error when whole groups cannot fill a step exactly.")
@click.option(
    "--uniform",
    type=click.Choice(UNIFORM_POLICIES),
    default="keep",
    show_default=True,
    help="drop: skip uniform groups (no gradient signal) and keep filling the step.",
)
@click.option(
    "--order",
    type=click.Choice(ORDERS),
    default="input",
    show_default=True,
    help="Order groups are taken in (completion: by finished_at).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --order shuffle.")
@click.option(
    "--env-weight", multiple=True, metavar="ENV=W", help="Env share of every step (repeatable)."
)
@click.option("--keep-last", is_flag=True, help="Keep a final step the input could not fill.")
@click.option(
    "--micro-batch-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Hard token budget per micro-batch [default: 32768 unless --micro-batch-size].",
)
@click.option(
    "--micro-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Fixed samples per micro-batch instead of a token budget.",
)
@click.option(
    "--row-len", type=click.IntRange(min=1), default=None, help="Pad every row to this length."
)
@click.option("--pad-id", type=int, default=0, show_default=True, help="Token id used for padding.")
@click.option(
    "--balance",
    type=click.Choice(sorted(WORKLOADS)),
    default="flops",
    show_default=True,
    help="Cost model the ranks and micro-batches are balanced on.",
)
@click.option(
    "--model", default=None, help=f"Model preset for --balance flops ({', '.join(MODEL_PRESETS)})."
)
@click.option(
    "--model-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="A model config.json for --balance flops.",
)
@click.option(
    "--calibration",
    type=click.Path(dir_okay=False),
    default=None,
    help="Coefficients for --balance calibrated (written by rolltool bench --calibrate).",
)
@click.option(
    "--align",
    type=click.Choice(["lockstep", "total"]),
    default="lockstep",
    show_default=True,
    help="lockstep: ranks meet at every micro-batch (FSDP/ZeRO-3/TP); total: plain DDP.",
)
@click.option("--equal-count", is_flag=True, help="Give every rank the same number of samples.")
@click.option(
    "--overlong",
    type=click.Choice(["error", "drop"]),
    default="error",
    show_default=True,
    help="A sample longer than the budget: error, or leave it out of training.",
)
@click.option(
    "--estimator",
    type=click.Choice(sorted(ESTIMATORS)),
    default="grpo",
    show_default=True,
    help="Advantage estimator when the input has no 'advantage' column.",
)
@click.option("--env-estimator", multiple=True, metavar="ENV=NAME", help="Estimator for one env.")
@click.option(
    "--std-eps", type=float, default=1e-6, show_default=True, help="Epsilon of grpo's std."
)
@click.option(
    "--loss-agg",
    type=click.Choice(LOSS_AGGS),
    default="token-mean",
    show_default=True,
    help="Loss aggregation the per-token loss weights implement.",
)
@click.option(
    "--loss-scale-factor", type=float, default=None, help="Constant for seq-mean-token-sum-norm."
)
@click.option(
    "--shard-mb", type=float, default=256.0, show_default=True, help="Largest shard file, MB."
)
@click.option(
    "--cache-mb",
    type=float,
    default=1024.0,
    show_default=True,
    help="Decoded input kept in memory, MB (input that fits is read from disk once).",
)
@column_option
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as one JSON document.")
@handle_errors
def pack(inputs: tuple[str, ...], output: str, dp: int, batch_unit: str, batch_size: int, exact: bool,
         uniform: str, order: str, seed: int, env_weight: tuple[str, ...], keep_last: bool,
         micro_batch_tokens: int | None, micro_batch_size: int | None, row_len: int | None, pad_id: int,
         balance: str, model: str | None, model_config: str | None, calibration: str | None, align: str,
         equal_count: bool, overlong: str, estimator: str, env_estimator: tuple[str, ...], std_eps: float,
         loss_agg: str, loss_scale_factor: float | None, shard_mb: float, cache_mb: float, column: tuple[str, ...],
         force: bool, as_json: bool) -> None:  # fmt: skip
    """Pack rollout Parquet INPUTS into sharded, balanced, pre-packed tensor files.

    Every optimizer step gives each of the --dp ranks the same number of micro-batches; each
    micro-batch is one packed row with explicit boundaries (cu_seqlens) and per-token loss weights
    that do not depend on the layout.
    """
    from rolltool.pack import PackConfig, run_pack

    if model is not None and model_config is not None:
        raise click.UsageError("give --model or --model-config, not both")
    if micro_batch_tokens is not None and micro_batch_size is not None:
        raise click.UsageError("give --micro-batch-tokens or --micro-batch-size, not both")
    if micro_batch_tokens is None and micro_batch_size is None:
        micro_batch_tokens = 32_768 if row_len is None else row_len
    if loss_scale_factor is not None and loss_agg != "seq-mean-token-sum-norm":
        raise click.UsageError(
            f"--loss-scale-factor applies to --loss-agg seq-mean-token-sum-norm only, "
            f"not to {loss_agg}"
        )
    ctx = click.get_current_context()
    estimator_chosen = any(  # given by the user, not click's default
        ctx.get_parameter_source(p) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
        for p in ("estimator", "env_estimator")
    )
    config = PackConfig(
        dp=dp,
        steps=StepConfig(batch_size=batch_size, batch_unit=batch_unit, exact=exact, uniform=uniform,
                         order=order, seed=seed, env_weights=_weights(env_weight), keep_last=keep_last),
        advantages=AdvantageConfig(estimator=estimator, env_estimators=parse_mapping(env_estimator, "--env-estimator"),
                                   std_eps=std_eps),
        micro_batch_tokens=micro_batch_tokens,
        micro_batch_size=micro_batch_size,
        row_len=row_len,
        pad_id=pad_id,
        balance=balance,
        model=model if model is not None else model_config,
        calibration=calibration,
        align=align,
        equal_count=equal_count,
        overlong=overlong,
        loss_agg=loss_agg,
        loss_scale_factor=loss_scale_factor,
        shard_mb=shard_mb,
        cache_mb=cache_mb,
    )  # fmt: skip
    manifest = run_pack(
        inputs,
        output,
        config,
        columns=parse_columns(column),
        force=force,
        command=["rolltool", *sys.argv[1:]],
        progress=progress,
        estimator_chosen=estimator_chosen,
    ).to_json()
    for w in manifest["warnings"]:  # to stderr, with --json too (the manifest also lists them)
        warn(w)
    if as_json:
        print_json(manifest)
        return
    out.print(_steps_table(manifest, output))
    out.print(_envs_table(manifest))
    s = manifest["samples"]
    err.print(
        f"wrote {manifest['num_steps']} steps x {manifest['dp']} ranks to {output}: "
        f"{s['trained']:,} of {s['total']:,} samples trained, {s['uniform_dropped']:,} in dropped uniform groups, "
        f"{s['overlong_dropped']:,} over-long, {s['leftover']:,} left over"
    )


def _steps_table(manifest: dict, output: str) -> Table:
    """One row per step: size in batch units (and why it is not full), counts, layout, balance."""
    cfg = manifest["config"]
    unit = cfg["steps"]["batch_unit"]
    table = Table(
        title=f"pack -> {output} ({manifest['workload']['kind']} balance, {cfg['align']})",
        title_justify="left",
    )
    cols = ["step", f"{unit} (status)", "groups", "rollouts", "samples", "tokens", "trainable",
            "uniform kept/drop", "over-long", "mb/rank", "fill", "lockstep", "imbalance"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for st in manifest["steps"]:
        p = st["plan"]
        fill = "-" if p.get("token_fill") is None else f"{p['token_fill']:.1%}"
        size = f"{st['actual']:,}/{st['nominal']:,}" + (
            "" if st["status"] == "full" else f" {st['status']}"
        )
        table.add_row(
            str(st["step"]),
            size,
            f"{st['groups']:,}",
            f"{st['rollouts']:,}",
            f"{st['samples']:,}",
            f"{st['sampled_tokens']:,}",
            f"{st['trainable_tokens']:,}",
            f"{st['uniform_groups_kept']}/{st['uniform_groups_dropped']}",
            f"{st['overlong_dropped']:,}",
            str(p["micro_batches_per_rank"]),
            fill,
            f"{p['lockstep_overhead_cost']:.4f}",
            f"{p['imbalance_cost']:.4f}",
        )
    return table


MAX_ENV_STEPS = 20  # beyond this many steps the per-env table shows run totals only


def _num(x: float | None, spec: str = "+.3f") -> str:
    return "-" if x is None else format(x, spec)


def _envs_table(manifest: dict) -> Table:
    """Per step and env (or per env over the run, for long runs): what each env contributes."""
    steps = manifest["steps"]
    per_step = len(steps) <= MAX_ENV_STEPS
    title = (
        "per step and env"
        if per_step
        else f"per env, all {len(steps)} steps (rolltool stats --per-step for each)"
    )
    table = Table(title=title, title_justify="left")
    cols = ["step", "env", "groups", "rollouts", "samples", "tokens", "trainable", "uniform kept/drop",
            "over-long", "reward mean", "adv mean", "adv std", "loss weight"]  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c == "env" else "right")
    keys = ("groups", "rollouts", "samples", "sampled_tokens", "trainable_tokens", "uniform_groups_kept",
            "uniform_groups_dropped", "overlong_dropped", "loss_weight_sum")  # fmt: skip
    if per_step:
        rows = [(str(st["step"]), env, e) for st in steps for env, e in st["envs"].items()]
    else:
        totals: dict[str, dict] = {}
        for st in steps:
            for env, e in st["envs"].items():
                t = totals.setdefault(env, dict.fromkeys(keys, 0))
                for k in keys:
                    t[k] += e[k]
        rows = [("all", env, {**t, "reward_mean": None, "advantage_mean": None, "advantage_std": None})
                for env, t in totals.items()]  # fmt: skip
    for step, env, e in rows:
        table.add_row(
            step,
            env,
            f"{e['groups']:,}",
            f"{e['rollouts']:,}",
            f"{e['samples']:,}",
            f"{e['sampled_tokens']:,}",
            f"{e['trainable_tokens']:,}",
            f"{e['uniform_groups_kept']}/{e['uniform_groups_dropped']}",
            f"{e['overlong_dropped']:,}",
            _num(e["reward_mean"], ".3f"),
            _num(e["advantage_mean"]),
            _num(e["advantage_std"], ".3f"),
            f"{e['loss_weight_sum']:.3f}",
        )
    return table
