"""``rolltool bench --from-profile CSV``: a calibration fitted to a published latency profile.

A profile is a CSV of per-document latencies, one row per document length, e.g. the public H100
attention profile (64 query heads, 4 KV heads, head dim 128; hao-ai-lab/DistCA's
``compute-attn-megatron.csv``)::

    seq_len,latency(ms),tested_total_seqlen,tp,cp,gpu_type,op,hqo,hkv,d
    16,0.01098309364169836,32768,1,1,H100,attn,64,4,128
    ...
    32768,150.11590576171875,32768,1,1,H100,attn,64,4,128

Columns read: the length (``seq_len``, ``length`` or ``L``) and the latency (``latency(ms)`` or
``latency_ms`` in milliseconds, ``latency_s`` or ``seconds``); ``gpu_type``, ``op``, ``hqo``,
``hkv``, ``d`` and ``tested_total_seqlen`` are kept as notes when present. One row per length.

The fit is `rolltool.plan.cost_fit.fit_documents`: c + a·L + b·L² per document, every term
>= 0, each length counted alike (relative least squares). No torch, no packed directory: the
calibration file is the one ``--calibrate`` writes from timed rows, and ``pack --balance
calibrated --calibration`` reads either.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rolltool._version import __version__
from rolltool.bench.run import write_json
from rolltool.errors import RolltoolError
from rolltool.plan.cost_fit import CostFit, fit_documents
from rolltool.storage.outputs import check_target

LENGTH_COLUMNS = ("seq_len", "length", "L")
"""Names of a profile's length column (tokens), the first one present taken."""
LATENCY_COLUMNS = {"latency(ms)": 1e-3, "latency_ms": 1e-3, "latency_s": 1.0, "seconds": 1.0}
"""Names of a profile's latency column and their unit in seconds."""
NOTE_COLUMNS = ("gpu_type", "op", "hqo", "hkv", "d", "tested_total_seqlen", "tp", "cp")
"""Columns kept as notes of the calibration when the profile has them (one value each)."""
MIN_PROFILE_ROWS = 4
"""Fewer lengths than this leave c, a and b barely determined (3 terms)."""
MAX_PROFILE_ERROR = 0.25
"""A fit off by more than this at some profiled length is flagged unreliable: the quadratic
cannot follow the profile (the H100 attention profile's worst length is off by 16%)."""


@dataclass(frozen=True, kw_only=True)
class LatencyProfile:
    """A per-document latency profile: ``lengths[i]`` tokens take ``seconds[i]``."""

    lengths: np.ndarray
    """``[p]`` int64 document lengths, strictly increasing."""
    seconds: np.ndarray
    """``[p]`` float64 latency of one document of that length, > 0."""
    source: str
    """The CSV it was read from."""
    notes: dict[str, Any] = field(default_factory=dict)
    """The note columns' values (`NOTE_COLUMNS`), e.g. ``{"gpu_type": "H100", "hqo": 64}``."""


def read_profile(path: str | Path) -> LatencyProfile:
    """Read a latency profile CSV (see the module docstring); sorted by length."""
    p = Path(path)
    try:
        with p.open(newline="") as f:
            table = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise RolltoolError(f"cannot read latency profile {p}: {e}") from None
    columns = set(table[0]) if table else set()
    length_col = next((c for c in LENGTH_COLUMNS if c in columns), None)
    latency_col = next((c for c in LATENCY_COLUMNS if c in columns), None)
    if length_col is None or latency_col is None:
        raise RolltoolError(
            f"latency profile {p} needs a length column ({', '.join(LENGTH_COLUMNS)}) and a "
            f"latency column ({', '.join(LATENCY_COLUMNS)}); it has {sorted(columns)}",
            hint="one row per document length, e.g. seq_len,latency(ms)",
        )
    try:
        lengths = np.array([float(r[length_col]) for r in table])
        seconds = np.array([float(r[latency_col]) for r in table]) * LATENCY_COLUMNS[latency_col]
    except (TypeError, ValueError) as e:
        raise RolltoolError(f"latency profile {p}: a value is not a number ({e})") from None
    bad = ~(np.isfinite(lengths) & (lengths >= 1) & (lengths == np.round(lengths)))
    bad |= ~(np.isfinite(seconds) & (seconds > 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RolltoolError(
            f"latency profile {p}, row {i + 2}: a length must be a whole number >= 1 and a "
            f"latency > 0, got {table[i][length_col]!r}, {table[i][latency_col]!r}"
        )
    order = np.argsort(lengths, kind="stable")
    lengths, seconds = lengths[order].astype(np.int64), seconds[order]
    if np.any(np.diff(lengths) == 0):
        dup = int(lengths[np.flatnonzero(np.diff(lengths) == 0)[0]])
        raise RolltoolError(
            f"latency profile {p} has several rows for L = {dup}",
            hint="keep one configuration (one tp, cp, op...) per file: one row per length",
        )
    return LatencyProfile(lengths=lengths, seconds=seconds, source=str(p),
                          notes=_notes(table, columns))  # fmt: skip


def _notes(table: list[dict[str, str]], columns: set[str]) -> dict[str, Any]:
    notes: dict[str, Any] = {}
    for col in NOTE_COLUMNS:
        values = {r[col] for r in table} if col in columns else set()
        if len(values) == 1:
            value = values.pop()
            notes[col] = int(value) if value.isdigit() else value
    return notes


def profile_warning(fit: CostFit) -> str | None:
    """Why a profile fit should not be trusted as a cost model, or None."""
    problems = []
    if fit.rows < MIN_PROFILE_ROWS:
        problems.append(f"only {fit.rows} lengths (< {MIN_PROFILE_ROWS})")
    if not math.isfinite(fit.max_rel_error) or fit.max_rel_error > MAX_PROFILE_ERROR:
        problems.append(f"off by up to {fit.max_rel_error:.0%} at a profiled length "
                        f"(> {MAX_PROFILE_ERROR:.0%})")  # fmt: skip
    if not problems:
        return None
    return (
        f"the fit of c + a·L + b·L² to the profile is unreliable ({'; '.join(problems)}): "
        "profile more lengths, or check that the file holds one configuration"
    )


def fit_profile(profile: LatencyProfile) -> dict[str, Any]:
    """The fit, a per-length table and the calibration file's document, JSON-able.

    Each table row: ``length``, ``measured`` and ``fitted`` seconds, ``error`` (fitted /
    measured − 1) and ``l2_error``, the error of pure L² through the longest length (the
    attention FLOPs at the throughput measured there).
    """
    fit = fit_documents(profile.lengths, profile.seconds)
    length = profile.lengths.astype(np.float64)
    fitted = fit.predict(np.ones(len(length)), length, length * length)
    l2 = profile.seconds[-1] * (length / length[-1]) ** 2
    table = [
        {"length": int(n), "measured": float(t), "fitted": float(f), "error": float(f / t - 1),
         "l2_error": float(q / t - 1)}
        for n, t, f, q in zip(profile.lengths, profile.seconds, fitted, l2, strict=True)
    ]  # fmt: skip
    warning = profile_warning(fit)
    summary = {**fit.coefficients(), "r2": fit.r2, "rows": fit.rows,
               "rel_rmse": fit.rel_rmse, "max_rel_error": fit.max_rel_error}  # fmt: skip
    notes: dict[str, Any] = {
        "units": "seconds (a per token, b per token squared, c per document, m per micro-batch)",
        "what": "attention" if profile.notes.get("op") == "attn" else "profile",
        "measures": (
            f"per-document latency profile {Path(profile.source).name} ({fit.rows} lengths, "
            f"{int(length[0])}-{int(length[-1])} tokens), fitted per document by relative "
            "least squares; m is not identifiable from such a profile (0: inside a)"
        ),
        **({"device": profile.notes["gpu_type"]} if "gpu_type" in profile.notes else {}),
        "profile": profile.notes,
        "max_rel_error": fit.max_rel_error,
        "rel_rmse": fit.rel_rmse,
        "rolltool_version": __version__,
        "sources": [profile.source],
        "reliable": warning is None,
    }
    if warning is not None:
        notes["warning"] = warning
    calibration = {**fit.coefficients(), "r2": fit.r2, "rows": fit.rows, **notes}
    return {"profile": profile.source, "fit": summary, "lengths": table,
            "fit_warning": warning, "calibration": calibration}  # fmt: skip


def run_profile(
    path: str | Path, *, calibrate: str | Path | None = None, force: bool = False
) -> dict[str, Any]:
    """`fit_profile` of the CSV at ``path``; ``calibrate``: also write the calibration file
    there (refused if it exists unless ``force``). Adds ``calibration_file`` (None if none)."""
    if calibrate is not None:
        check_target(calibrate, force, inputs=[path])
    doc = {**fit_profile(read_profile(path)), "calibration_file": None}
    if calibrate is not None:
        write_json(calibrate, doc["calibration"], force=force)
        doc["calibration_file"] = str(calibrate)
    return doc
