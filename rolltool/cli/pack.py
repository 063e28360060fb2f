"""`rolltool pack`: options -> `PackConfig` -> `run_pack` -> the stats renderer's tables.

Defaults come from `PackConfig` (and the records it holds) and choices from the modules' own
constants; every rule between options lives in `PackConfig`, so the API and the CLI agree.
"""

from __future__ import annotations

import sys

import click

from rolltool.cli._common import err, handle_errors, out, print_json, progress, warn
from rolltool.cli.options import (
    POSITIVE,
    column_option,
    estimator_options,
    force_option,
    given_by_user,
    json_option,
    mapping_callback,
)
from rolltool.cli.sections import SectionedCommand, opt, section
from rolltool.cli.terminal import table_width
from rolltool.engine.base import ENGINES
from rolltool.engine.config import EXCHANGE_CHOICES, ExecutionConfig
from rolltool.plan.advantages import ESTIMATORS
from rolltool.plan.batches import BATCH_UNITS, ORDERS, UNIFORM_POLICIES
from rolltool.plan.config import (
    DEFAULT_CP_LINK_BANDWIDTH,
    DEFAULT_GPU_TFLOPS,
    DEFAULT_MICRO_BATCH_TOKENS,
    OVERLONG,
    PackConfig,
)
from rolltool.plan.loss import LOSS_AGGS
from rolltool.plan.partition import ALIGNS
from rolltool.plan.prefix import SHARE_MIN
from rolltool.plan.workload import DEFAULT_PRESET, MODEL_PRESETS, WORKLOADS

D = PackConfig(dp=1)
"""Every default, as the API resolves it."""
BUDGET = (f"Hard token budget per micro-batch and GPU [default: --row-len when given, else "
          f"{DEFAULT_MICRO_BATCH_TOKENS}; none with --micro-batch-size].")  # fmt: skip


@click.command(cls=SectionedCommand, short_help="Steps, balanced micro-batches, packed rows, sharded safetensors.")  # fmt: skip
@click.argument("inputs", nargs=-1, required=True)
@section(
    "Steps",
    opt("--batch-unit", BATCH_UNITS, D.steps.batch_unit, "What --batch-size counts."),
    opt("--batch-size", POSITIVE, None, f"Step size in batch units (whole groups only) [default: {D.steps.batch_size} rollouts or samples; required with --batch-unit tokens]."),
    opt("--exact", bool, D.steps.exact, "Error when whole groups cannot fill a step exactly."),
    opt("--uniform", UNIFORM_POLICIES, D.steps.uniform, "drop: skip uniform groups (no signal), keep filling."),
    opt("--order", ORDERS, D.steps.order, "Order groups are taken in (completion: by finished_at)."),
    opt("--seed", int, D.steps.seed, "Seed for --order shuffle."),
    opt("--env-weight env_weights", str, (), "Env share of every step (repeatable).", multiple=True,
        metavar="ENV=W", callback=mapping_callback("--env-weight", float, "the weight must be a number")),
    opt("--keep-last", bool, D.steps.keep_last, "Keep a final step the input could not fill."),
    opt("--mini-batches", POSITIVE, D.steps.mini_batches, "Optimizer steps per batch: cut each batch into M mini-batches (whole groups where it can), advantages once over the batch."),
    opt("--epochs", POSITIVE, D.steps.epochs, "Passes over each batch (PPO epochs), each after the first in a seeded shuffled group order."),
)  # fmt: skip
@section(
    "Partition",
    opt("--dp", POSITIVE, None, "Data-parallel ranks (groups of GPUs with --sp/--cp).", required=True),
    opt("--sp", POSITIVE, D.sp, "Sequence-parallel (Ulysses) GPUs per rank: a micro-batch holds --micro-batch-tokens x sp, each GPU a contiguous 1/sp of the row."),
    opt("--cp", POSITIVE, D.cp, "Context-parallel GPUs per rank: samples up to --micro-batch-tokens x cp long, split zigzag into 2 x cp chunks."),
    opt("--hybrid-cp", bool, D.hybrid_cp, "With --cp C (a power of two): per micro-batch the C GPUs form aligned sub-groups of 1, 2, 4 ... C; each sample is whole on one GPU or zigzag-split over one sub-group, the degree the plan finds cheapest (format version 3)."),
    opt("--cp-link-bandwidth", click.FloatRange(min=0, min_open=True), None, f"GB/s of one ring link, what --hybrid-cp prices CP communication with [default: {DEFAULT_CP_LINK_BANDWIDTH:g}]."),
    opt("--gpu-tflops", click.FloatRange(min=0, min_open=True), None, f"TFLOP/s one GPU sustains, what --hybrid-cp weighs exposed communication against [default: {DEFAULT_GPU_TFLOPS:g}]."),
    opt("--balance", tuple(sorted(WORKLOADS)), D.balance, "Cost model ranks and micro-batches are balanced on."),
    opt("--model", str, None, f"Model preset for --balance flops ({', '.join(MODEL_PRESETS)}) [default: {DEFAULT_PRESET}]."),
    opt("--model-config", click.Path(dir_okay=False), None, "A model config.json for --balance flops."),
    opt("--calibration", click.Path(dir_okay=False), None, "Coefficients for --balance calibrated (bench --calibrate)."),
    opt("--align", ALIGNS, D.align, "lockstep: ranks meet at every micro-batch (FSDP/ZeRO-3/TP); total: DDP."),
    opt("--equal-count", bool, D.equal_count, "Give every rank the same number of samples (error when --dp does not divide a step's samples)."),
    opt("--equal-count-trim", bool, D.equal_count_trim, "--equal-count, leaving out the last few samples of a step that --dp does not divide (counted, status count_trimmed)."),
)  # fmt: skip
@section(
    "Rows",
    opt("--micro-batch-tokens", POSITIVE, None, BUDGET),
    opt("--micro-batch-size", POSITIVE, None, "Fixed samples per micro-batch instead of a token budget."),
    opt("--row-len", POSITIVE, None, "Pad every row to this length (per GPU)."),
    opt("--pad-id", int, D.pad_id, "Token id used for padding."),
    opt("--overlong", OVERLONG, D.overlong, "A sample longer than the budget: error, or leave it out of training."),
    opt("--share-prefix", bool, D.share_prefix, "Store each group's shared prefixes (prompt, common trajectory) once: a prefix and its continuations on one micro-batch, exact attention through a K/V gather index (format version 4; not with --sp/--cp yet)."),
    opt("--share-min", click.IntRange(min=2), None, f"Tokens a prefix must share beyond its parent's to be stored once [default: {SHARE_MIN}; --share-prefix only]."),
)  # fmt: skip
@section(
    "Loss",
    opt("--loss-agg", LOSS_AGGS, D.loss_agg, "Loss aggregation the per-token loss weights implement."),
    opt("--loss-scale-factor", float, None, "Constant of seq-mean-token-sum-norm (required with that --loss-agg, refused with any other)."),
)  # fmt: skip
@section("Advantages", *estimator_options(ESTIMATORS, D.advantages, " (without an input 'advantage' column)"))  # fmt: skip
@section(
    "Input",
    column_option(),
    opt("--cache-mb", float, D.cache_mb, "Decoded input kept in memory, MB (input that fits is read once)."),
    opt("--workers", POSITIVE, None, "Processes that plan batches (the same output whatever the number) [default: the cores available]."),
    opt("--exchange exchange_path", EXCHANGE_CHOICES, "auto", "Scattered steps (--order completion/shuffle): read the input once into step buckets when fetching step by step would read it 4x over (auto), always, or never; the same output either way."),
    opt("--engine", ENGINES, "local", "What plans batches and packs steps: this machine's processes (--workers), or Ray tasks (the [ray] extra; on several machines the input and output are URIs on object storage, e.g. s3://, or on a filesystem every node mounts); the same output either way."),
    opt("--ray-address", str, None, "The Ray cluster --engine ray attaches to (auto, HOST:6379, ray://HOST:10001) [default: RAY_ADDRESS, else one `ray start` began on this machine, else a new local cluster]."),
)  # fmt: skip
@section(
    "Output",
    opt("-o --output", click.Path(file_okay=False), None, "Directory to write: a path, or a URI (s3://, gs://, hdfs://; manifest.json written last marks it finished).", required=True),
    opt("--shard-mb", float, D.shard_mb, "Largest shard file, MB."),
    force_option("an existing output directory"),
    json_option("the manifest as one JSON document"),
    opt("--per-step", bool, False, "Every step in the tables (else more than 12 steps are summarised)."),
)  # fmt: skip
@handle_errors
def pack(inputs: tuple[str, ...], output: str, columns: dict[str, str], force: bool, as_json: bool,
         per_step: bool, workers: int | None, engine: str, ray_address: str | None, exchange_path: str,
         **settings: object) -> None:  # fmt: skip
    """Pack rollout Parquet INPUTS into sharded, balanced, pre-packed tensor files.

    Every optimizer step gives each of the --dp ranks the same number of micro-batches; each
    micro-batch is one packed row with explicit boundaries (cu_seqlens) and per-token loss weights
    that do not depend on the layout.
    """
    from rolltool.jobs.pack import run_pack
    from rolltool.stats.render import pack_summary, render_pack

    config = PackConfig.from_options(**settings)
    execution = ExecutionConfig(workers=workers, engine=engine, ray_address=ray_address,
                                exchange=exchange_path)  # fmt: skip
    # An unreliable calibration is said before the run too (it reads a small JSON file).
    said = {config.workload().unreliable()} if config.balance == "calibrated" else set()
    for w in said - {None}:
        warn(str(w))
    manifest = run_pack(inputs, output, config, execution=execution, columns=columns, force=force,
                        command=["rolltool", *sys.argv[1:]], progress=progress,
                        warn_ignored_estimator=given_by_user("estimator", "env_estimators"))  # fmt: skip
    for w in manifest.warnings:  # to stderr, with --json too (the manifest also lists them)
        if w not in said:
            warn(w)
    if as_json:
        print_json(manifest.to_json())
        return
    width = table_width()
    out.print(render_pack(manifest, output, width=width, per_step=per_step), width=width)
    err.print(pack_summary(manifest, output))
