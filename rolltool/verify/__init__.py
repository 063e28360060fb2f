"""`rolltool verify`: check a packed directory against its own records, independently and exactly.

A pack has three records that must agree: the shards (what a trainer reads), ``samples.parquet``
(where every sample went, its length, trainable tokens, advantage and weight) and
``manifest.json`` (config, per-step counts and denominators, file hashes). Hashes only show that
files were not changed after the manifest was written; the invariants below also catch files
edited with the hashes updated, because each value is recomputed from another record. Each
invariant is a function ``(Context) -> Iterator[Problem]`` with stable problem kinds:

==================  ===========================================================================
invariant           kinds
==================  ===========================================================================
files_and_hashes    file.missing, file.size, file.hash, file.unlisted (gates everything else)
(reading)           samples.unreadable (nothing else can be judged), input.mismatch,
                    input.unreadable (the input is not the one packed, or cannot be read)
samples_table       samples.order, samples.tokens, samples.total, samples.status, samples.place
rank_files          step.ranks, rank.files
denominators        loss.formula, step.denominators (T, S, scale factor, weight sum)
weight_formula      sample.formula (token_loss_weight against the aggregation, float32 rounding)
step_structure      step.structure (batch -> epoch -> mini-batch numbering, --mini-batches/--epochs)
step_metadata       step.counts, step.reward, step.weight_sum, step.advantage (overall and
                    per env: every figure of the step's record), step.status (nominal size,
                    status, full = nominal, partial only last)
step_plans          step.plan (dp, samples, samples per rank, tokens, empty micro-batches,
                    token fill, lower bound, imbalance and lockstep overhead)
rank_counts         rank.counts (samples, real tokens, tokens)
shards_readable     shard.corrupt
row_structure       row.budget, row.size, row.length, row.mask
group_split         row.split (--sp/--cp: rows split evenly, samples padded for the CP split,
                    every --cp row and padding segment a multiple of 2 x cp: valid THD)
hybrid_layout       row.hybrid, row.budget (--hybrid-cp: each row's aligned sub-groups, each
                    segment in one, split samples padded to 2k, every GPU under its budget)
shared_layout       row.shared (--share-prefix: parents, each prefix's sample, branch token,
                    summed weight and advantage; samples are judged reassembled, see
                    `rolltool.verify.shared`)
padding             row.padding
placement           segment.index, sample.placement, sample.repeated, sample.missing
sample_fields       sample.length, sample.trainable, sample.advantage, sample.weight
hybrid_samples      sample.cp (--hybrid-cp: samples.parquet's cp_start/cp_degree, as the rows)
content             input.length, input.input_ids, input.loss_mask, input.logprobs,
                    input.unreadable
==================  ===========================================================================

The record invariants (samples.parquet against the manifest and the formula) run first; the
row invariants judge tables read in one pass over the shards (`rolltool.verify.segments`); the
content invariant reads the shards once more with the input. One defect is reported once: a
value is compared where it is first wrong, and the checks downstream of it are skipped (a step
with wrong denominators is not judged by the formula, a misplaced segment not by its record's
fields, a segment that disagrees with its record not against the input).

Modules: ``context`` (what is read: samples.parquet, layout settings, the input), ``segments``
(the pass over the shards), ``records``, ``steps``, ``rows`` and ``content`` (the invariants).

The input is the one given (``inputs``), else the input files the manifest records when they
are all found (``recorded_inputs``); the report's ``input`` says what happened: "compared",
"skipped", "not found: <paths>" or "not compared: see problems".
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rolltool.errors import RolltoolError
from rolltool.fetch.tokens import TokenReader
from rolltool.format import SAMPLES
from rolltool.packed.reader import open_packed
from rolltool.storage.fs import is_remote
from rolltool.util.problems import Problem, Problems
from rolltool.verify.content import compared, content
from rolltool.verify.context import (
    Context,
    Samples,
    by_epoch,
    input_rewards,
    layout_settings,
    load_samples,
    open_input,
)
from rolltool.verify.hybrid import hybrid_layout, hybrid_samples
from rolltool.verify.records import files_and_hashes, rank_files, samples_table
from rolltool.verify.rows import (
    group_split,
    padding,
    placement,
    row_structure,
    sample_fields,
    shards_readable,
)
from rolltool.verify.segments import read_segments
from rolltool.verify.shared import shared_layout
from rolltool.verify.steps import (
    denominators,
    rank_counts,
    step_metadata,
    step_plans,
    step_structure,
    weight_formula,
)

Invariant = Callable[[Context], Iterator[Problem]]

INVARIANTS: tuple[Invariant, ...] = (
    samples_table,
    rank_files,
    denominators,
    weight_formula,
    step_structure,
    step_metadata,
    step_plans,
    rank_counts,
    shards_readable,
    row_structure,
    group_split,
    hybrid_layout,
    shared_layout,
    padding,
    placement,
    sample_fields,
    hybrid_samples,
    content,
)
"""In the order they run, the cheap record checks first (files_and_hashes runs before all)."""


@dataclass(frozen=True)
class VerifyReport:
    """What `run_verify` found (``problems``), what it looked at (``checked``) and whether the
    tokens were compared with the input (``input``: see the module docstring)."""

    problems: Problems
    checked: Mapping[str, int]
    input: str
    notes: tuple[str, ...] = ()
    """What was not checked and why (e.g. rewards of a pack written before samples.parquet
    had a ``reward`` column)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems.listed()],
            "counts": dict(self.problems.counts),
            "checked": dict(self.checked),
            "input": self.input,
            "notes": list(self.notes),
        }


def run_verify(
    path: str | os.PathLike[str],
    *,
    hashes: bool = True,
    inputs: Sequence[str | os.PathLike[str]] | None = None,
    recorded_inputs: bool = True,
) -> VerifyReport:
    """Check a packed directory; never raises on bad data (a missing or malformed manifest, or
    a given input that does not exist, is a `RolltoolError`). A directory on object storage
    (a URI, `rolltool.storage.fs`) without a manifest is refused, like the reader does; one with a
    manifest is copied into a local temporary folder and checked there (verify reads every
    byte anyway)."""
    if is_remote(os.fspath(path)):
        remote = open_packed(path)  # refuses a prefix without a manifest
        if not remote.location.local:
            with tempfile.TemporaryDirectory(prefix="rolltool-verify-") as tmp:
                remote.location.download(Path(tmp) / "packed")
                return _run_verify(Path(tmp) / "packed", hashes, inputs, recorded_inputs)
    return _run_verify(path, hashes, inputs, recorded_inputs)


def _run_verify(
    path: str | os.PathLike[str],
    hashes: bool,
    inputs: Sequence[str | os.PathLike[str]] | None,
    recorded_inputs: bool,
) -> VerifyReport:
    ds = open_packed(path)
    m = ds.manifest
    problems = Problems()
    problems.extend(files_and_hashes(ds.path, m, hashes=hashes))
    checked = {"files": sum((ds.path / name).is_file() for name in m.files)}
    if problems:
        return VerifyReport(problems, checked, "not compared: see problems")
    row_len, pad_id, split = layout_settings(m)
    input_rows = sum(r.rows for r in m.inputs)
    state, found = open_input(m, ds.path, inputs, recorded_inputs)
    problems.extend(found)
    try:
        samples = load_samples(ds.path / SAMPLES, m.num_steps, input_rows)
    except RolltoolError as e:
        problems.add("samples.unreadable", SAMPLES, e.message)
        return VerifyReport(problems, checked, state.status)
    samples, notes = _with_rewards(samples, state.reader)
    segments = by_epoch(m, read_segments(ds.path, m, pad_id), input_rows)
    ctx = Context(ds.path, m, samples, segments, row_len, pad_id, state.reader, split, input_rows)
    for invariant in INVARIANTS:
        problems.extend(invariant(ctx))
    checked |= {
        "steps": m.num_steps,
        "rows": len(segments.row_tokens),
        "segments": int((segments.sample >= 0).sum()),
    }
    status = state.status
    if "input.unreadable" in problems.counts:
        status = "not compared: see problems"
    elif state.reader is not None:
        checked["input_samples"] = compared(ctx)
    return VerifyReport(problems, checked, status, notes)


def _with_rewards(samples: Samples, reader: TokenReader | None) -> tuple[Samples, tuple[str, ...]]:
    """Rewards for a pack whose samples.parquet has no reward column (written before it had
    one): the input's when it is read, else none, and a note saying which."""
    if samples.reward is not None:
        return samples, ()
    old = f"{SAMPLES} has no reward column (written by an older rolltool)"
    rewards = input_rewards(reader, samples.n)
    if rewards is not None:
        return replace(samples, reward=rewards), (f"{old}: rewards read from the input",)
    return samples, (
        f"{old} and the input is not read: the steps' reward_mean and uniform_groups_kept "
        "were not checked",
    )


def verify(
    path: str | os.PathLike[str],
    *,
    hashes: bool = True,
    inputs: Sequence[str | os.PathLike[str]] | None = None,
    recorded_inputs: bool = True,
) -> dict[str, Any]:
    """`run_verify`'s report as one JSON document: ``{"ok", "problems": [{"kind", "where",
    "text"}] (the first few of each kind), "counts": {kind: n}, "checked": {...}, "input"}``;
    ``checked["input_samples"]`` (only when the input was read) counts the samples compared."""
    report = run_verify(path, hashes=hashes, inputs=inputs, recorded_inputs=recorded_inputs)
    return report.to_json()
