"""Rich tables and lines of a bench report (``run_bench``'s document); nothing here prints.

``header(doc)``: what ran, for stderr; ``render(doc, rows=...)``: per directory its step times,
optionally every row, and a summary, then the comparison of several directories and the fit, for
stdout; ``warnings(doc)``: what the user should know, for stderr; ``check_failure(doc)``: the
error a failed ``--check`` is. Numbers through ``rolltool.util.numfmt`` (times in ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from rolltool.bench.report import noise_warning, winner_warning
from rolltool.errors import RolltoolError
from rolltool.util.numfmt import big, count, ms, num, pct
from rolltool.util.tables import Col, fit_table


def header(doc: dict[str, Any]) -> list[str]:
    """Backend, timed work and shape, device: the lines that say how the times were made."""
    c = doc["config"]
    what = (f"layer (hidden {c['hidden']}, MLP {c['intermediate']}, "
            f"{big(c['matmul_params'])} matmul params)" if c["what"] == "layer"
            else "attention only")  # fmt: skip
    return [
        f"backend {doc['backend']} ({doc['backend_choice']}): {doc['backend_detail']}",
        f"{what}: {c['heads']} heads ({c['kv_heads']} kv) x {c['head_dim']}, {c['layers']} "
        f"layer(s), {'forward+backward' if c['backward'] else 'forward'}; shape from "
        f"{c['shape_source']}",
        f"device {doc['device']}, torch {doc['torch']}, {c['dtype']}, median of {c['repeats']}",
    ]


def render(doc: dict[str, Any], *, rows: bool = False, width: int | None = None) -> RenderableType:
    """Every directory's step table (and row table with ``rows``) and summary, the comparison
    of several directories, and the fit of m + Σ (c + a·L + b·L²); tables fitted to ``width`` columns."""
    runs = doc.get("runs", [doc])
    parts: list[RenderableType] = []
    for run in runs:
        parts.append(steps_table(run))
        if "split" in run:
            parts.append(group_table(run))
        if rows:
            parts.append(rows_table(run, width))
        parts.append(summary(run, doc["config"]["what"]))
    if "comparison" in doc:
        parts.append(comparison_table(doc["comparison"], width))
    pooled = " (all directories)" if len(runs) > 1 else ""
    parts.append(f"fit{pooled}: {fit_line(doc['fit'])}")
    return Group(*parts)


def fit_line(f: dict[str, Any]) -> str:
    """The fitted cost in one line: ``t ≈ m + Σ (c + a·L + b·L²)`` with its terms in seconds.

    >>> fit_line({"a": 2e-8, "b": 1.5e-10, "c": 1e-5, "m": 0.0, "r2": 0.999, "rows": 12})
    't ≈ Σ (1.000e-05 + 2.000e-08·L + 1.500e-10·L²) s per segment, R² 0.9990 over 12 rows'
    """
    seg = " + ".join([*([f"{f['c']:.3e}"] if f.get("c") else []),
                      f"{f['a']:.3e}·L", f"{f['b']:.3e}·L²"])  # fmt: skip
    row = f"{f['m']:.3e} s per row + " if f.get("m") else ""
    return f"t ≈ {row}Σ ({seg}) s per segment, R² {num(f['r2'], '.4f')} over {f['rows']} rows"


PROFILE_COLS = [
    Col("L"),
    Col("measured ms", "meas-\nured ms"),
    Col("fitted ms", "fitted\nms"),
    Col("error"),
    Col("pure L² error", "pure L²\nerror", keep=1),
]


def profile_table(doc: dict[str, Any], width: int | None = None) -> Table:
    """``--from-profile``: per profiled length the measured and fitted latency and the error,
    beside pure L² through the longest length (attention FLOPs at its throughput)."""
    rows: list[Sequence[str] | None] = [
        [count(r["length"]), f"{r['measured'] * 1e3:.4g}", f"{r['fitted'] * 1e3:.4g}",
         f"{r['error']:+.1%}", f"{r['l2_error']:+.1%}"]
        for r in doc["lengths"]
    ]  # fmt: skip
    title = f"profile {PurePath(doc['profile']).name} (per document)"
    return fit_table(title, PROFILE_COLS, rows, width)


def profile_render(doc: dict[str, Any], width: int | None = None) -> Group:
    """The profile table and the fitted model (``c`` per document) in one line."""
    f = doc["fit"]
    line = (f"fit: t ≈ {f['c']:.3e} + {f['a']:.3e}·L + {f['b']:.3e}·L² s per document, "
            f"off by {f['rel_rmse']:.1%} rms, {f['max_rel_error']:.1%} at worst, over "
            f"{f['rows']} lengths")  # fmt: skip
    return Group(profile_table(doc, width), line)


def warnings(doc: dict[str, Any]) -> list[str]:
    """Directories that hold different samples; a fit too poor to trust (or calibrate with);
    efficiencies that timing noise moves as much as the imbalance they report."""
    found = []
    if "comparison" in doc and not doc["comparison"]["same_input"]:
        found.append("the directories hold different samples/tokens")
    if doc["fit_warning"] and doc["calibration_file"]:
        found.append(f"{doc['fit_warning']} (written anyway to {doc['calibration_file']}, "
                     "with this warning)")  # fmt: skip
    elif doc["fit_warning"]:
        found.append(doc["fit_warning"])
    for run in doc.get("runs", [doc]):
        noisy = noise_warning(run, str(doc["config"].get("device")))
        if noisy is not None:
            found.append(noisy)
    ranked = winner_warning(doc.get("runs", []))
    if ranked is not None:
        found.append(ranked)
    return found


def check_failure(doc: dict[str, Any]) -> RolltoolError | None:
    """The error a failed ``--check`` is (naming every row that failed), or None."""
    if doc["check_ok"] is not False:
        return None
    runs = doc.get("runs", [doc])
    bad = [r for run in runs for r in run["check"]["rows"] if not r["ok"]]
    where = ", ".join(f"step {r['step']} rank {r['rank']} mb {r['micro_batch']}" for r in bad)
    if any("what" in run["check"] for run in runs):
        return RolltoolError(
            f"--check failed: a token's attention output on its GPU of a --cp/--sp group differs "
            f"from its sample run alone ({where})",
            hint="the split layout, the reader's views or the backend's block attention is "
            "wrong; no calibration was written",
        )
    return RolltoolError(
        f"--check failed: a segment's output differs from its sequence run alone ({where})",
        hint="the backend mixes segments or mis-reads cu_seqlens; no calibration was written",
    )


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def steps_table(run: dict[str, Any]) -> Table:
    """Per step and in total: the data-parallel, lockstep and ideal times, and efficiencies
    (with a split pack, of each micro-batch's slowest GPU)."""
    kind = run["workload"]["kind"] if run.get("workload") else "?"
    split = run.get("split")
    layout = f", {_layout(split)}" if split else ""
    table = _table(f"bench {run['path']} ({kind} balance, dp {run['dp']}{layout}; ms)",
                   ("step", "mb/rank", "dp time", "lockstep", "ideal", "dp eff", "lockstep eff"))  # fmt: skip
    for s in [*run["steps"], {**run["total"], "step": "total", "micro_batches_per_rank": ""}]:
        table.add_row(str(s["step"]), str(s["micro_batches_per_rank"]), ms(s["dp_time"]),
                      ms(s["lockstep_time"]), ms(s["ideal_time"]), pct(s["dp_efficiency"]),
                      pct(s["lockstep_efficiency"]))  # fmt: skip
    return table


def group_table(run: dict[str, Any]) -> Table:
    """A split pack's group balance per step and in total: max / mean of the group's GPUs'
    times per micro-batch (median and max over the micro-batches), and the share of the
    group's time its GPUs compute (Σ mean / Σ max)."""
    sp = run["split"]
    table = _table(f"{_layout(sp)} balance",
                   ("step", "max/mean\nmedian", "max/mean\nmax", "GPUs\nbusy"))  # fmt: skip
    for s in [*run["steps"], {**run["total"], "step": "total"}]:
        table.add_row(str(s["step"]), num(s["group_imbalance_median"], ".3f"),
                      num(s["group_imbalance_max"], ".3f"), pct(s["group_efficiency"]))  # fmt: skip
    return table


ROW_COLS = [
    Col("step"),
    Col("rank"),
    Col("mb"),
    Col("segments", "seg-\nments", keep=2),
    Col("tokens"),
    Col("Σ L²", keep=3),
    Col("predicted", "pre-\ndicted", keep=1),
    Col("ms"),
    Col("TFLOP/s", "TFLOP\n/s", keep=4),
]


def rows_table(run: dict[str, Any], width: int | None = None) -> Table:
    """Every row: its segments and tokens, Σ L², the cost model's prediction, time, TFLOP/s;
    with a split pack one line per GPU (``gpu``; tokens and Σ L² of its share)."""
    split = "split" in run
    rows: list[Sequence[str] | None] = [
        [str(r["step"]), str(r["rank"]), str(r["micro_batch"]),
         *([str(r["gpu"])] if split else []), str(r["segments"]),
         count(r["tokens"]), num(r["sum_sq"], ".3g"), num(r["predicted"], ".3g"),
         ms(r["seconds"]), num(r["tflops"], ".2f")]
        for r in run["rows"]
    ]  # fmt: skip
    cols = [*ROW_COLS[:3], Col("gpu"), *ROW_COLS[3:]] if split else ROW_COLS
    return fit_table("rows", cols, rows, width)


def summary(run: dict[str, Any], what: str) -> str:
    """Throughput, how well each cost model explains the row times, and the check's outcome."""
    t = run["throughput"]
    peak = ("peak unknown" if t["peak_share"] is None
            else f"{pct(t['peak_share'])} of {t['peak_tflops']:.0f} peak")  # fmt: skip
    counted = "matmuls + causal attention" if what == "layer" else "causal attention"
    w = run["workload"]
    model = f"manifest workload ({w['kind']})" if w else "manifest workload (none)"
    fits = {k: run[k] for k in ("workload_fit", "flops_fit", "tokens_fit", "sum_sq_fit")}
    r2 = {k: num(f["r2"], ".3f") for k, f in fits.items()}
    rms = {k: pct(f["rel_rmse"]) for k, f in fits.items()}
    lines = [f"{what}: {t['tflops']:.3f} TFLOP/s ({counted}, FLOPs from lengths; {peak})",
             f"cost model: {model} explains R² {r2['workload_fit']} of row times "
             f"(rms error {rms['workload_fit']}); proportional to this run's FLOPs: R² "
             f"{r2['flops_fit']} ({rms['flops_fit']}), tokens {r2['tokens_fit']} "
             f"({rms['tokens_fit']}), Σ L² {r2['sum_sq_fit']} ({rms['sum_sq_fit']})"]  # fmt: skip
    if "split" in run:
        lines.append(group_line(run))
    if "check" in run:
        ch = run["check"]
        status = "OK" if ch["ok"] else "[red]FAILED[/red]"
        worst = max((r["max_abs_error"] for r in ch["rows"]), default=0.0)
        what, units = (ch["what"], "samples") if "what" in ch else ("attention", "segments")
        lines.append(f"check ({what}): {status}, {ch['segments_checked']} {units} in "
                     f"{ch['rows_checked']} rows, max |error| {worst:.2e} (tolerance "
                     f"{ch['tolerance']['atol']:g} + {ch['tolerance']['rtol']:g}·|ref|)")  # fmt: skip
    return "\n".join(lines)


def group_line(run: dict[str, Any]) -> str:
    """A split pack's group balance over the run (`rolltool.bench.report`)."""
    sp, t = run["split"], run["total"]
    return (f"{_layout(sp)} balance: per micro-batch the slowest of the group's "
            f"{sp['size']} GPUs over their mean is {num(t['group_imbalance_median'], '.3f')} "
            f"(median), {num(t['group_imbalance_max'], '.3f')} (max); the GPUs compute "
            f"{pct(t['group_efficiency'])} of the group's time (communication not timed); "
            f"counted in FLOPs the shares are {num(sp['flops_imbalance_max'], '.3f')} "
            "max/mean at worst")  # fmt: skip


COMPARISON_COLS = [
    Col("directory", left=True, wrap=True),
    Col("balance", left=True),
    Col("rows", keep=1),
    Col("tokens", keep=2),
    Col("dp time", "dp\ntime"),
    Col("lockstep", "lock-\nstep"),
    Col("ideal", keep=3),
    Col("dp eff", "dp\neff"),
    Col("lockstep eff", "lockstep\neff"),
]


def comparison_table(cmp: dict[str, Any], width: int | None = None) -> Table:
    """Several directories side by side; ``*`` marks the best dp and lockstep times."""
    rows: list[Sequence[str] | None] = []
    names = [PurePath(line["path"]).name for line in cmp["lines"]]  # each step table names its path
    if len(set(names)) < len(names) or not all(names):
        names = [line["path"] for line in cmp["lines"]]
    for name, line in zip(names, cmp["lines"], strict=True):
        star = {key: " *" if key in line["best"] else "" for key in ("dp_time", "lockstep_time")}
        rows.append([name, str(line["balance"]), str(line["rows"]), count(line["tokens"]),
                     ms(line["dp_time"]) + star["dp_time"],
                     ms(line["lockstep_time"]) + star["lockstep_time"], ms(line["ideal_time"]),
                     pct(line["dp_efficiency"]), pct(line["lockstep_efficiency"])])  # fmt: skip
    return fit_table("comparison (ms; * best)", COMPARISON_COLS, rows, width)


def _layout(split: dict[str, Any]) -> str:
    """A split pack's layout in words: ``cp 4``, ``sp 2``, ``hybrid cp 4``."""
    return f"{'hybrid ' if split.get('hybrid') else ''}{split['kind']} {split['size']}"
