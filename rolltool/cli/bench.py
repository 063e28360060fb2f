"""`rolltool bench`: options -> `BenchConfig` -> `run_bench` -> `rolltool.bench.render`.

torch is imported inside the command only (through rolltool.bench.run), never at CLI import.
"""

from __future__ import annotations

import click

from rolltool.bench.backends import BACKENDS
from rolltool.bench.config import (
    DEFAULT_CHECK_ROWS,
    DTYPES,
    WHATS,
    BenchConfig,
    parse_device,
    parse_steps,
)
from rolltool.cli._common import err, handle_errors, out, print_json, progress, warn
from rolltool.cli.options import POSITIVE, force_option, json_option, parsed
from rolltool.cli.sections import SectionedCommand, opt, section
from rolltool.cli.terminal import table_width
from rolltool.plan.workload import DEFAULT_PRESET, MODEL_PRESETS

D = BenchConfig()
"""Every default, as the API has it."""


@click.command(cls=SectionedCommand, short_help="Replay packed rows through transformer layers; measure balance.")  # fmt: skip
@click.argument("packed", nargs=-1, type=click.Path())
@section(
    "Work",
    opt("--what", WHATS, D.what, "Per row: a whole decoder layer (projections, attention, MLP) or attention only."),
    opt("--model", tuple(MODEL_PRESETS), None, f"Layer shape from a preset [default: the packed model, else {DEFAULT_PRESET}]."),
    opt("--heads", POSITIVE, None, "Query heads [default: from --model]."),
    opt("--kv-heads", POSITIVE, None, "Key/value heads (GQA) [default: from --model]."),
    opt("--head-dim", POSITIVE, None, "Width of one head [default: from --model]."),
    opt("--hidden", POSITIVE, None, "Residual stream width [default: from --model]."),
    opt("--intermediate", POSITIVE, None, "Gated MLP width [default: from --model]."),
    opt("--layers", POSITIVE, D.layers, "Layers (or attention calls) per row, chained, emulating depth."),
    opt("--backward", bool, D.backward, "Time forward + backward, not forward only."),
    opt("--steps", str, None, "Steps to replay, e.g. 0,2-4 [default: all].", metavar="LIST", callback=parsed(parse_steps)),
)  # fmt: skip
@section(
    "Timing",
    opt("--backend", ("auto", *sorted(BACKENDS)), D.backend, "Attention kernel; auto: flash-attn, else torch-varlen (CUDA), else sdpa."),
    opt("--dtype", ("auto", *DTYPES), D.dtype, "auto: bf16 on CUDA, fp32 on CPU."),
    opt("--device", str, D.device, "auto, cpu, cuda or cuda:N.", callback=parsed(parse_device)),
    opt("--repeats", POSITIVE, D.repeats, "Timed passes over all rows (median per row; order shuffled each pass)."),
    opt("--warmup", click.IntRange(min=0), D.warmup, "Untimed passes over all rows first."),
    opt("--flush-l2", bool, D.flush_l2, "Flush the GPU's L2 cache before each timed row."),
    opt("--seed", int, D.seed, "Seed of q, k, v and row order."),
)  # fmt: skip
@section(
    "Check and calibration",
    opt("--check", bool, False, "Compare each segment with its sequence run alone (--cp/--sp packs: each GPU's share, fed from its view); exit 1 if off."),
    opt("--check-rows", POSITIVE, DEFAULT_CHECK_ROWS, "Rows --check samples per directory."),
    opt("--calibrate", click.Path(dir_okay=False), None, "Write the fitted a, b, c, m for pack --balance calibrated.", metavar="OUT.json"),
    opt("--from-profile", click.Path(dir_okay=False), None, "Fit c + a·L + b·L² to a per-document latency profile (seq_len, latency(ms)) instead of timing PACKED; no torch.", metavar="CSV"),
    force_option("an existing --calibrate file"),
)  # fmt: skip
@section(
    "Output",
    opt("--rows show_rows", bool, False, "Also print the per-row table."),
    json_option("one JSON document"),
    opt("--json-out", click.Path(dir_okay=False), None, "Also write the JSON document to FILE (replaced), from the same run as the tables.", metavar="FILE"),
)  # fmt: skip
@handle_errors
def bench(packed: tuple[str, ...], check: bool, check_rows: int, calibrate: str | None, force: bool,
          from_profile: str | None, show_rows: bool, as_json: bool, json_out: str | None,
          **settings: object) -> None:  # fmt: skip
    """Replay PACKED directories through transformer layers and measure balance.

    Every (step, rank, micro-batch) row runs, timed, a whole decoder layer over its tokens
    (q/k/v projections, causal varlen attention over the row's cu_seqlens, output projection,
    SiLU-gated MLP; random input and weights) -- or, with --what attention, the attention call
    only. The report gives per step the plain data-parallel time (max over ranks of their sums),
    the lockstep time (sum over micro-batches of the slowest rank: FSDP/ZeRO-3/TP) and the ideal,
    with efficiencies; TFLOP/s; how well the packed cost model explains row times; and a fit of
    m + Σ (c + a·L + b·L²) per row of segments L (--calibrate writes it for pack --balance
    calibrated; --from-profile fits it to a per-document latency CSV instead, without torch or
    PACKED). Several directories are compared side by side, the best marked.

    A directory packed with --cp C or --sp S is replayed per GPU of each group: a CP rank times
    its two zigzag chunks of every sample against the keys they see causally (gathered from
    the group: ring attention), an SP rank the whole row with heads/S (Ulysses), each the
    layer's linear part on its 1/C (1/S) of the tokens; communication is not timed. A
    micro-batch takes its slowest GPU's time (the DP figures use it), and the group balance,
    max/mean over its GPUs, is reported per step (median and max over micro-batches). With
    --check each GPU's attention, fed from its reader view, must equal every sample run alone.

    The JSON document (--json, --json-out) has the keys backend, steps and total (and, for a
    --cp/--sp directory, split, with the group_imbalance_median/max and group_efficiency of
    every step and the total, and gpu in every row); with several
    directories the top-level steps and total are the first directory's, and every directory's
    (the first included) are under runs, next to comparison.
    """
    from rolltool.bench import render
    from rolltool.bench.run import run_bench, write_json

    if from_profile is not None:
        _from_profile(packed, from_profile, calibrate, force, as_json, json_out)
        return
    if not packed:
        raise click.UsageError("give PACKED directories to replay, or --from-profile CSV")
    config = BenchConfig(**settings, check_rows=check_rows if check else 0)  # type: ignore[arg-type]
    doc = run_bench(packed, config, calibrate=calibrate, force=force, progress=progress)
    if json_out is not None:
        write_json(json_out, doc, force=True)
    if as_json:
        print_json(doc)
    else:
        for line in render.header(doc):
            err.print(line)
        width = table_width()
        out.print(render.render(doc, rows=show_rows, width=width), width=width)
    for w in render.warnings(doc):
        warn(w)
    if doc["calibration_file"]:
        err.print(f"wrote {doc['calibration_file']} (pack --balance calibrated --calibration ...)")
    failure = render.check_failure(doc)
    if failure is not None:
        raise failure


def _from_profile(packed: tuple[str, ...], path: str, calibrate: str | None, force: bool,
                  as_json: bool, json_out: str | None) -> None:  # fmt: skip
    """``--from-profile``: the calibration fitted to a latency profile, no timing."""
    from rolltool.bench import render
    from rolltool.bench.profile import run_profile
    from rolltool.bench.run import write_json

    if packed:
        raise click.UsageError("--from-profile fits a profile: give no PACKED directories")
    doc = run_profile(path, calibrate=calibrate, force=force)
    if json_out is not None:
        write_json(json_out, doc, force=True)
    if as_json:
        print_json(doc)
    else:
        width = table_width()
        out.print(render.profile_render(doc, width), width=width)
    if doc["fit_warning"]:
        warn(doc["fit_warning"])
    if doc["calibration_file"]:
        err.print(f"wrote {doc['calibration_file']} (pack --balance calibrated --calibration ...)")
