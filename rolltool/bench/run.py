"""The bench job: packed directories -> rows -> timings (+ check) -> report (+ calibration).

A row's work is a whole decoder layer (``what="layer"``, the default) or its attention only
(``what="attention"``); see ``rolltool.bench.config``.

``run_bench`` is the Python API behind ``rolltool bench``; it returns one JSON-able report and
raises RolltoolError for what a user can fix (no torch, no CUDA for a CUDA backend, a bad step).
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rolltool._version import __version__
from rolltool.bench import report as rp
from rolltool.bench.backends import Backend, make_backend
from rolltool.bench.check import check_rows
from rolltool.bench.compare import compare
from rolltool.bench.config import BenchConfig, BenchSetup, resolve_shape
from rolltool.bench.rows import ReplayRows, Row, load_rows, unshared_twin
from rolltool.bench.split_check import check_split_rows
from rolltool.bench.timing import Progress, time_rows
from rolltool.errors import RolltoolError
from rolltool.plan.workload import flops_coefficients
from rolltool.storage.outputs import atomic_path, check_target
from rolltool.util.jsonable import jsonable


def import_torch() -> Any:
    """torch, or a RolltoolError saying how to install it (bench is the only user of torch)."""
    try:
        import torch
    except ImportError:
        raise RolltoolError(
            "rolltool bench needs PyTorch, which is not installed",
            hint="pip install 'rolltool[torch]' (CPU: pip install torch first, from the CPU index)",
        ) from None
    return torch


def resolve_device(torch: Any, device: str, dtype: str) -> tuple[str, str]:
    """``auto`` device: cuda when available, else cpu; ``auto`` dtype: bf16 on CUDA, fp32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RolltoolError(
            f"device {device}: CUDA is not available in this torch build or machine",
            hint="use --device cpu --backend sdpa",
        )
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise RolltoolError(
            f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            hint="cuda:N counts from 0",
        )
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, dtype


def device_name(torch: Any, device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def load_all(paths: Sequence[str | Path], steps: Sequence[int] | None) -> list[ReplayRows]:
    if not paths:
        raise RolltoolError("bench: give at least one packed directory")
    out = []
    for p in paths:
        rows = load_rows(p, steps)
        out.append(rows)
        if any(r.prefix is not None for r in rows.rows):  # --share-prefix: and unshared
            out.append(unshared_twin(rows))
    return out


def report_one(
    torch: Any,
    backend: Backend,
    packed: ReplayRows,
    times: np.ndarray,
    setup: BenchSetup,
    dev_name: str,
) -> tuple[dict[str, Any], np.ndarray]:
    """One directory's report from its rows' ``[repeats, n]`` times; also [n, 4] fit inputs
    (segments, tokens, Σ L², seconds).
    A row is one GPU's work: the whole row, or with ``--cp``/``--sp`` one GPU's share (its
    tokens and Σ L² are the share's, `Row.work_tokens` / `Row.work_sum_sq`)."""
    rows = packed.rows
    seconds = np.median(times, axis=0)
    tokens = np.array([r.work_tokens for r in rows], dtype=np.float64)
    sum_sq = np.array([r.work_sum_sq for r in rows])
    segments = np.array([len(r.lengths) for r in rows], dtype=np.float64)
    predicted = np.array([r.predicted for r in rows])
    flops = np.array([work_flops(r, setup) for r in rows])
    groups = [r for r in rows if r.gpu == 0]  # each group row once
    timing = _timing(packed, times, seconds, flops)
    report = {
        "path": str(packed.path),
        "dp": packed.dp,
        "workload": packed.workload.to_dict() if packed.workload else None,
        "samples": sum(r.samples for r in groups),
        "tokens": sum(r.tokens for r in groups),
        **({"split": timing["split"]} if "split" in timing else {}),
        "steps": timing["steps"],
        "total": timing["total"],
        "throughput": rp.throughput(
            float(flops.sum()), float(seconds.sum()), dev_name, setup.dtype
        ),
        "noise": timing["noise"],
        "fit": rp.fit_cost(segments, tokens, sum_sq, seconds),
        "workload_fit": rp.proportional_fit(predicted, seconds),
        "flops_fit": rp.proportional_fit(flops, seconds),
        "tokens_fit": rp.proportional_fit(tokens, seconds),
        "sum_sq_fit": rp.proportional_fit(sum_sq, seconds),
        "rows": _row_table(rows, times, seconds, sum_sq, predicted, flops),
    }
    if setup.check_rows and packed.split.size > 1:
        report["check"] = check_split_rows(torch, backend, packed, setup)
    elif setup.check_rows:
        report["check"] = check_rows(torch, backend, rows, setup)
    return report, np.stack([segments, tokens, sum_sq, seconds], axis=1)


def _timing(
    packed: ReplayRows, times: np.ndarray, seconds: np.ndarray, flops: np.ndarray
) -> dict[str, Any]:
    """Steps, total and noise; with a split, of each micro-batch's slowest GPU, with the
    group's balance (`rolltool.bench.report`), timed and as counted in FLOPs (what the layout
    itself makes uneven; the timed figure adds the kernels' and the device's share)."""
    step = np.array([r.step for r in packed.rows])
    rank = np.array([r.rank for r in packed.rows])
    mb = np.array([r.micro_batch for r in packed.rows])
    split = packed.split
    if split.size == 1:
        steps = rp.step_times(step, rank, mb, seconds, packed.dp)
        return {"steps": steps, "total": rp.total_times(steps),
                "noise": rp.repeat_spread(step, rank, mb, times, packed.dp)}  # fmt: skip
    g = rp.group_times(step, rank, mb, seconds)
    steps = rp.group_step_times(g, packed.dp)
    per_pass = rp.group_times(step, rank, mb, times)
    real = sum(int(np.sum(r.lengths[r.sample_index >= 0])) for r in packed.rows if r.gpu == 0)
    counted = rp.group_times(step, rank, mb, flops).imbalance[0]
    return {
        "split": {
            "kind": split.kind,
            "size": split.size,
            **({"hybrid": True} if split.hybrid else {}),
            "real_tokens": real,
            "flops_imbalance_median": float(np.median(counted)),
            "flops_imbalance_max": float(counted.max()),
        },
        "steps": steps,
        "total": {**rp.total_times(steps), **rp.group_figures(g)},
        "noise": rp.repeat_spread(g.step, g.rank, g.micro_batch, per_pass.slowest, packed.dp),
    }


def _row_table(
    rows: Sequence[Row],
    times: np.ndarray,
    seconds: np.ndarray,
    sum_sq: np.ndarray,
    predicted: np.ndarray,
    flops: np.ndarray,
) -> list[dict[str, Any]]:
    """One line per timed row (with a split, per GPU: ``gpu``, its share's tokens)."""
    table = []
    for i, r in enumerate(rows):
        line = {
            "step": r.step,
            "rank": r.rank,
            "micro_batch": r.micro_batch,
            **({"gpu": r.gpu} if r.share is not None else {}),
            "segments": len(r.lengths),
            "tokens": r.work_tokens,
            "sum_sq": sum_sq[i],
            "predicted": predicted[i],
            "seconds": float(seconds[i]),
            "seconds_min": float(times[:, i].min()),
            "seconds_max": float(times[:, i].max()),
            "tflops": flops[i] / seconds[i] / 1e12 if seconds[i] > 0 else None,
        }
        table.append(line)
    return table


def work_flops(row: Row, setup: BenchSetup) -> float:
    """FLOPs of one timed row: `row_flops` of a whole row; of a GPU's share (or a shared-prefix
    row), a·tokens + b·Σ L² with its tokens and Σ L² equivalent (`Row.work_sum_sq`)."""
    if row.share is None and row.prefix is None:
        return row_flops(row.lengths, setup)
    s = setup.shape
    a, b = flops_coefficients(
        matmul_params=s.matmul_params * s.layers if setup.what == "layer" else 0,
        attention_width=s.heads * s.head_dim,
        layers=s.layers,
        backward=setup.backward,
    )
    return a * row.work_tokens + b * row.work_sum_sq


def row_flops(lengths: np.ndarray, setup: BenchSetup) -> float:
    """FLOPs of one row's timed work: whole layers (matmuls + causal attention) or attention."""
    s = setup.shape
    if setup.what == "layer":
        return rp.layer_flops(lengths, matmul_params=s.matmul_params, heads=s.heads,
                              head_dim=s.head_dim, layers=s.layers, backward=setup.backward)  # fmt: skip
    return rp.attention_flops(lengths, heads=s.heads, head_dim=s.head_dim, layers=s.layers,
                              backward=setup.backward)  # fmt: skip


def resolve(torch: Any, config: BenchConfig, first: ReplayRows) -> tuple[BenchSetup, Backend, str]:
    """``config`` resolved on this machine (device, dtype, backend) and for the packed
    directory ``first`` (the layer shape of its model unless ``config`` names one); also the
    backend itself and why it was chosen."""
    device, dtype = resolve_device(torch, config.device, config.dtype)
    shape, shape_source = resolve_shape(
        model=config.model,
        manifest_model=first.workload.model if first.workload else None,
        heads=config.heads,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        hidden=config.hidden,
        intermediate=config.intermediate,
        layers=config.layers,
    )
    be, reason = make_backend(config.backend, torch, device=device, dtype=dtype)
    setup = BenchSetup(backend=be.name, shape=shape, what=config.what, dtype=dtype, device=device,
                       backward=config.backward, repeats=config.repeats, warmup=config.warmup,
                       flush_l2=config.flush_l2, seed=config.seed, steps=config.steps,
                       check_rows=config.check_rows, shape_source=shape_source)  # fmt: skip
    return setup, be, reason


def run_bench(
    paths: Sequence[str | Path],
    config: BenchConfig | None = None,
    *,
    calibrate: str | Path | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Replay every row of each packed directory in ``paths`` as ``config`` says (default:
    ``BenchConfig()``) and report (see ``rolltool bench``).

    Several directories are benched with the same setup, their rows timed together in one
    shuffled order per pass, and compared; the fit and the calibration pool all their rows
    (more length variety, a better-determined fit).
    ``calibrate`` names a JSON file to write the calibration to (refused if it exists unless
    ``force``; not written when ``config.check_rows`` rows were compared and one failed).
    """
    config = config or BenchConfig()
    if calibrate is not None:
        check_target(calibrate, force, inputs=paths)
    torch = import_torch()
    packed = load_all(paths, config.steps)
    setup, be, reason = resolve(torch, config, packed[0])
    dev_name = device_name(torch, setup.device)
    runs, fit = time_and_report(torch, be, packed, setup, dev_name, progress)
    notes = _notes(setup, be, dev_name, torch, paths)
    warning = fit_warning(fit)
    notes["reliable"] = warning is None  # pack --balance calibrated warns on False
    if warning is not None:
        notes["warning"] = warning
    checks_ok = all(r.get("check", {}).get("ok", True) for r in runs)
    doc: dict[str, Any] = {
        "backend": be.name,
        "backend_detail": be.detail,
        "backend_choice": reason,
        "device": dev_name,
        "torch": str(torch.__version__),
        "rolltool_version": __version__,
        "config": _config_dict(setup),
        "fit": fit,
        "calibration": rp.calibration(fit, notes),
        "fit_warning": warning,
        "check_ok": checks_ok if setup.check_rows else None,
        "calibration_file": None,
    }
    if calibrate is not None and checks_ok:
        write_json(calibrate, doc["calibration"], force=force)
        doc["calibration_file"] = str(calibrate)
    if len(runs) == 1:
        return {**doc, **runs[0]}
    # The documented schema (backend, steps, total) holds for any number of directories: the
    # top-level steps and total are the first directory's; every directory's are under runs.
    first = {"steps": runs[0]["steps"], "total": runs[0]["total"]}
    return {**doc, **first, "runs": runs, "comparison": compare(runs)}


def time_and_report(
    torch: Any,
    be: Backend,
    packed: Sequence[ReplayRows],
    setup: BenchSetup,
    dev_name: str,
    progress: Progress | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time every directory's rows together, shuffled across directories in every pass (a drift
    of the machine, clocks or other jobs, hits every directory alike); one report per directory
    and the m + Σ (c + a·L + b·L²) fit over all their rows."""
    all_rows = [row for p in packed for row in p.rows]
    label = packed[0].path.name if len(packed) == 1 else f"{len(packed)} directories"
    times = time_rows(torch, be, all_rows, setup, progress=progress, label=label)
    runs, fit_rows = [], []
    start = 0
    for p in packed:
        n = len(p.rows)
        rep, xs = report_one(torch, be, p, times[:, start : start + n], setup, dev_name)
        start += n
        runs.append(rep)
        fit_rows.append(xs)
    pooled = np.concatenate(fit_rows)
    return runs, rp.fit_cost(pooled[:, 0], pooled[:, 1], pooled[:, 2], pooled[:, 3])


MIN_FIT_R2 = 0.9
"""Below this R², the fit of m + Σ (c + a·L + b·L²) explains too little of the row times."""
MIN_FIT_ROWS = 8
"""Fewer rows than this leave the coefficients barely determined."""


def fit_warning(fit: dict[str, Any]) -> str | None:
    """Why the fit should not be trusted as a cost model (R² < 0.9, < 8 rows), or None."""
    problems = []
    r2 = fit["r2"]
    if r2 is None or not math.isfinite(r2) or r2 < MIN_FIT_R2:
        shown = "undefined" if r2 is None or not math.isfinite(r2) else f"{r2:.3f}"
        problems.append(f"R² {shown} < {MIN_FIT_R2}")
    if fit["rows"] < MIN_FIT_ROWS:
        problems.append(f"only {fit['rows']} rows (< {MIN_FIT_ROWS})")
    if not problems:
        return None
    return (
        f"the fit of m + Σ (c + a·L + b·L²) is unreliable ({'; '.join(problems)}): timing noise "
        "or too few rows; bench more rows (several directories, all steps) or more --repeats, on a quiet "
        "device, before packing with it"
    )


def write_json(path: str | Path, doc: dict[str, Any], *, force: bool) -> None:
    """Write one JSON document atomically (temporary sibling renamed into place)."""
    with atomic_path(path, force=force, directory=False) as tmp:
        tmp.write_text(json.dumps(jsonable(doc), indent=2) + "\n")


def _config_dict(setup: BenchSetup) -> dict[str, Any]:
    return {
        "backend": setup.backend,
        "what": setup.what,
        **setup.shape.to_dict(),
        "matmul_params": setup.shape.matmul_params if setup.what == "layer" else None,
        "shape_source": setup.shape_source,
        "dtype": setup.dtype,
        "device": setup.device,
        "backward": setup.backward,
        "repeats": setup.repeats,
        "warmup": setup.warmup,
        "flush_l2": setup.flush_l2,
        "seed": setup.seed,
        "steps": list(setup.steps) if setup.steps is not None else None,
        "check_rows": setup.check_rows,
    }


def _notes(
    setup: BenchSetup, be: Backend, dev_name: str, torch: Any, paths: Sequence[str | Path]
) -> dict[str, Any]:
    s = setup.shape
    passes = "forward + backward" if setup.backward else "forward"
    if setup.what == "layer":
        measures = (f"{s.layers} whole decoder layer(s) (projections, causal attention, "
                    f"SiLU-gated MLP), {passes}")  # fmt: skip
        shape = s.to_dict()
    else:
        measures = f"causal attention only ({s.layers} call(s)), {passes}"
        shape = {k: v for k, v in s.to_dict().items() if k not in ("hidden", "intermediate")}
    return {
        "units": "seconds (a per token, b per token squared, c per segment, m per row)",
        "what": setup.what,
        "measures": measures,
        "device": dev_name,
        "backend": be.name,
        "dtype": setup.dtype,
        "shape": shape,
        "shape_source": setup.shape_source,
        "torch": str(torch.__version__),
        "rolltool_version": __version__,
        "sources": [str(p) for p in paths],
    }
