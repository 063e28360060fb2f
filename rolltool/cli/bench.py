"""`rolltool bench`: replay packed directories through decoder layers (or varlen attention only)
and report balance.

torch is imported inside the command only (through rolltool.bench.run), never at CLI import.
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from rolltool.bench.backends import BACKENDS
from rolltool.bench.config import DEVICE_PATTERN, DTYPES, WHATS
from rolltool.cli._common import err, handle_errors, out, print_json, progress, warn
from rolltool.errors import RolltoolError
from rolltool.workload import MODEL_PRESETS


def parse_steps(text: str | None) -> list[int] | None:
    """``"0,2-4"`` -> ``[0, 2, 3, 4]``; None -> None (all steps). Bad syntax is a usage error."""
    if text is None:
        return None
    steps: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            steps.extend(range(first, last + 1))
    except ValueError:
        raise click.BadParameter(
            f"expected steps like 0,2-4, got {text!r}", param_hint="--steps"
        ) from None
    return sorted(set(steps))


@click.command()
@click.argument("packed", nargs=-1, required=True, type=click.Path())
@click.option(
    "--backend",
    type=click.Choice(["auto", *sorted(BACKENDS)]),
    default="auto",
    show_default=True,
    help="Attention kernel; auto: flash-attn, else torch-varlen (CUDA), else sdpa.",
)
@click.option(
    "--what",
    type=click.Choice(list(WHATS)),
    default="layer",
    show_default=True,
    help="Per row: a whole decoder layer (projections, attention, MLP) or attention only.",
)
@click.option(
    "--model",
    type=click.Choice(list(MODEL_PRESETS)),
    default=None,
    help="Take the layer shape from a preset [default: the packed model, else dense-7b].",
)
@click.option("--heads", type=click.IntRange(min=1), default=None, help="Query heads.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="Key/value heads (GQA).")
@click.option("--head-dim", type=click.IntRange(min=1), default=None, help="Width of one head.")
@click.option("--hidden", type=click.IntRange(min=1), default=None, help="Residual stream width.")
@click.option("--intermediate", type=click.IntRange(min=1), default=None, help="Gated MLP width.")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Layers (or attention calls) per row, chained, emulating depth.",
)
@click.option("--backward", is_flag=True, help="Time forward + backward, not forward only.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPES]),
    default="auto",
    show_default=True,
    help="auto: bf16 on CUDA, fp32 on CPU.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    callback=lambda ctx, param, value: _device(value),
    help="auto, cpu, cuda or cuda:N.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Timed passes over all rows (median per row; order shuffled each pass).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Untimed passes over all rows first.",
)
@click.option("--flush-l2", is_flag=True, help="Flush the GPU's L2 cache before each timed row.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of q, k, v and row order."
)
@click.option(
    "--steps", default=None, metavar="LIST", help="Steps to replay, e.g. 0,2-4 [default: all]."
)
@click.option(
    "--check", is_flag=True, help="Compare each segment with its sequence run alone; exit 1 if off."
)
@click.option(
    "--check-rows",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Rows --check samples per directory.",
)
@click.option(
    "--calibrate",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="OUT.json",
    help="Write the fitted a, b for pack --balance calibrated.",
)
@click.option("--force", is_flag=True, help="Replace an existing --calibrate file.")
@click.option("--rows", "show_rows", is_flag=True, help="Also print the per-row table.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Also write the JSON document to FILE (replaced), from the same run as the tables.",
)
@handle_errors
def bench(packed: tuple[str, ...], backend: str, what: str, model: str | None, heads: int | None,
          kv_heads: int | None, head_dim: int | None, hidden: int | None,
          intermediate: int | None, layers: int, backward: bool, dtype: str,
          device: str, repeats: int, warmup: int, flush_l2: bool, seed: int, steps: str | None,
          check: bool, check_rows: int, calibrate: str | None, force: bool, show_rows: bool,
          as_json: bool, json_out: str | None) -> None:  # fmt: skip
    """Replay PACKED directories through transformer layers and measure balance.

    Every (step, rank, micro-batch) row runs, timed, a whole decoder layer over its tokens
    (q/k/v projections, causal varlen attention over the row's cu_seqlens, output projection,
    SiLU-gated MLP; random input and weights) -- or, with --what attention, the attention call
    only. The report gives per step the plain data-parallel time (max over ranks of their sums),
    the lockstep time (sum over micro-batches of the slowest rank: FSDP/ZeRO-3/TP) and the ideal,
    with efficiencies; TFLOP/s; how well the packed cost model explains row times; and a fit of
    a·L + b·L² per segment (--calibrate writes it for pack --balance calibrated). Several
    directories are compared side by side, the best marked.

    The JSON document (--json, --json-out) has ``backend``, ``steps`` and ``total``; with several
    directories the top-level ``steps`` and ``total`` are the first directory's, and every
    directory's (the first included) are under ``runs``, next to ``comparison``.
    """
    from rolltool.bench.run import run_bench

    doc = run_bench(packed, backend=backend, what=what, device=device, dtype=dtype, model=model,
                    heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                    intermediate=intermediate, layers=layers, backward=backward,
                    repeats=repeats, warmup=warmup, flush_l2=flush_l2, seed=seed,
                    steps=parse_steps(steps), check=check_rows if check else 0,
                    calibrate=calibrate, force=force, progress=progress)  # fmt: skip
    if json_out is not None:
        from rolltool.bench.run import write_json

        write_json(json_out, doc, force=True)
    if as_json:
        print_json(doc)
    else:
        _render(doc, show_rows)
    if doc["fit_warning"] and doc["calibration_file"]:
        warn(f"{doc['fit_warning']} (written anyway to {calibrate}, with this warning)")
    if doc["check_ok"] is False:
        bad = [r for run in doc.get("runs", [doc]) for r in run["check"]["rows"] if not r["ok"]]
        where = ", ".join(f"step {r['step']} rank {r['rank']} mb {r['micro_batch']}" for r in bad)
        raise RolltoolError(
            f"--check failed: a segment's output differs from its sequence run alone ({where})",
            hint="the backend mixes segments or mis-reads cu_seqlens; no calibration was written",
        )


def _render(doc: dict[str, Any], show_rows: bool) -> None:
    c = doc["config"]
    err.print(f"backend {doc['backend']} ({doc['backend_choice']}): {doc['backend_detail']}")
    what = (f"layer (hidden {c['hidden']}, MLP {c['intermediate']}, "
            f"{_count(c['matmul_params'])} matmul params)" if c["what"] == "layer"
            else "attention only")  # fmt: skip
    err.print(f"{what}: {c['heads']} heads ({c['kv_heads']} kv) x {c['head_dim']}, "
              f"{c['layers']} layer(s), {'forward+backward' if c['backward'] else 'forward'}; "
              f"shape from {c['shape_source']}")  # fmt: skip
    err.print(f"device {doc['device']}, torch {doc['torch']}, {c['dtype']}, "
              f"median of {c['repeats']}")  # fmt: skip
    runs = doc.get("runs", [doc])
    for run in runs:
        out.print(_steps_table(run))
        if show_rows:
            out.print(_rows_table(run))
        out.print(_summary(run, c["what"]))
    if "comparison" in doc:
        out.print(_comparison_table(doc["comparison"]))
        if not doc["comparison"]["same_input"]:
            err.print("[yellow]Warning:[/yellow] the directories hold different samples/tokens")
    f = doc["fit"]
    pooled = " (all directories)" if len(runs) > 1 else ""
    out.print(f"fit{pooled}: t ≈ {f['a']:.3e}·L + {f['b']:.3e}·L² s per segment, "
              f"R² {_num(f['r2'], '.4f')} over {f['rows']} rows")  # fmt: skip
    if doc["calibration_file"]:
        err.print(f"wrote {doc['calibration_file']} (pack --balance calibrated --calibration ...)")


def _device(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N; anything else is a usage error (exit 2)."""
    if not DEVICE_PATTERN.fullmatch(value):
        raise click.BadParameter(
            f"expected auto, cpu, cuda or cuda:N, got {value!r}", param_hint="--device"
        )
    return value


def _count(n: int) -> str:
    return f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,}"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def _steps_table(run: dict[str, Any]) -> Table:
    kind = run["workload"]["kind"] if run.get("workload") else "?"
    table = Table(
        title=f"bench {run['path']} ({kind} balance, dp {run['dp']}; ms)", title_justify="left"
    )
    for col in ("step", "mb/rank", "dp time", "lockstep", "ideal", "dp eff", "lockstep eff"):
        table.add_column(col, justify="right")
    for s in [*run["steps"], {**run["total"], "step": "total", "micro_batches_per_rank": ""}]:
        table.add_row(str(s["step"]), str(s["micro_batches_per_rank"]), _ms(s["dp_time"]),
                      _ms(s["lockstep_time"]), _ms(s["ideal_time"]), _num(s["dp_efficiency"], ".1%"),
                      _num(s["lockstep_efficiency"], ".1%"))  # fmt: skip
    return table


def _rows_table(run: dict[str, Any]) -> Table:
    table = Table(title="rows", title_justify="left")
    for col in ("step", "rank", "mb", "segments", "tokens", "Σ L²", "predicted", "ms", "TFLOP/s"):
        table.add_column(col, justify="right")
    for r in run["rows"]:
        table.add_row(str(r["step"]), str(r["rank"]), str(r["micro_batch"]), str(r["segments"]),
                      f"{r['tokens']:,}", f"{r['sum_sq']:.3g}", _num(r["predicted"], ".3g"),
                      _ms(r["seconds"]), _num(r["tflops"], ".2f"))  # fmt: skip
    return table


def _summary(run: dict[str, Any], what: str) -> str:
    t = run["throughput"]
    peak = (
        "peak unknown"
        if t["peak_share"] is None
        else f"{t['peak_share']:.1%} of {t['peak_tflops']:.0f} peak"
    )
    counted = "matmuls + causal attention" if what == "layer" else "causal attention"
    w = run["workload"]
    model = f"manifest workload ({w['kind']})" if w else "manifest workload (none)"
    fits = {k: run[k] for k in ("workload_fit", "flops_fit", "tokens_fit", "sum_sq_fit")}
    r2 = {k: _num(f["r2"], ".3f") for k, f in fits.items()}
    rms = {k: _num(f["rel_rmse"], ".1%") for k, f in fits.items()}
    lines = [f"{what}: {t['tflops']:.3f} TFLOP/s ({counted}, FLOPs from lengths; {peak})",
             f"cost model: {model} explains R² {r2['workload_fit']} of row times "
             f"(rms error {rms['workload_fit']}); proportional to this run's FLOPs: R² "
             f"{r2['flops_fit']} ({rms['flops_fit']}), tokens {r2['tokens_fit']} "
             f"({rms['tokens_fit']}), Σ L² {r2['sum_sq_fit']} ({rms['sum_sq_fit']})"]  # fmt: skip
    if "check" in run:
        ch = run["check"]
        status = "OK" if ch["ok"] else "[red]FAILED[/red]"
        worst = max((r["max_abs_error"] for r in ch["rows"]), default=0.0)
        lines.append(f"check (attention): {status}, {ch['segments_checked']} segments in "
                     f"{ch['rows_checked']} rows, max |error| {worst:.2e} (tolerance "
                     f"{ch['tolerance']['atol']:g} + {ch['tolerance']['rtol']:g}·|ref|)")  # fmt: skip
    return "\n".join(lines)


def _comparison_table(cmp: dict[str, Any]) -> Table:
    table = Table(title="comparison (ms; * best)", title_justify="left")
    for col in ("directory", "balance", "rows", "tokens", "dp time", "lockstep", "ideal",
                "dp eff", "lockstep eff"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("directory", "balance") else "left")
    for line in cmp["lines"]:
        star = {key: " *" if key in line["best"] else "" for key in ("dp_time", "lockstep_time")}
        table.add_row(line["path"], str(line["balance"]), str(line["rows"]), f"{line['tokens']:,}",
                      _ms(line["dp_time"]) + star["dp_time"],
                      _ms(line["lockstep_time"]) + star["lockstep_time"], _ms(line["ideal_time"]),
                      _num(line["dp_efficiency"], ".1%"), _num(line["lockstep_efficiency"], ".1%"))  # fmt: skip
    return table
