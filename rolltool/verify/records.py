"""Invariants of the records alone: the files, samples.parquet, the ranks' file lists."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from rolltool.format import SAMPLES, STATUSES, Manifest
from rolltool.format.shards import file_record
from rolltool.plan.minibatches import recorded_structure
from rolltool.util.problems import Problem
from rolltool.verify.context import Context


def files_and_hashes(root: Path, manifest: Manifest, *, hashes: bool) -> Iterator[Problem]:
    """Every listed file exists with its recorded size and sha256 (``hashes``); every shard the
    steps name and samples.parquet are listed. Runs before anything is read."""
    for name, rec in manifest.files.items():
        f = root / name
        if not f.is_file():
            yield Problem("file.missing", name, "listed in the manifest but missing")
        elif f.stat().st_size != rec.bytes:
            yield Problem(
                "file.size", name, f"{f.stat().st_size} bytes, the manifest says {rec.bytes}"
            )
        elif hashes and file_record(f).sha256 != rec.sha256:
            yield Problem(
                "file.hash", name, "sha256 differs from the manifest (file changed or corrupt)"
            )
    named = [ref.path for step in manifest.steps for rank in step.ranks for ref in rank.files]
    for name in [SAMPLES, *named]:
        if name not in manifest.files:
            yield Problem("file.unlisted", name, "not in the manifest's file list (no hash)")


def samples_table(ctx: Context) -> Iterator[Problem]:
    """samples.parquet is in sample order, its token counts are possible, its statuses and
    rows add up to the manifest's counts and inputs, and trained samples sit inside the run."""
    s, m = ctx.samples, ctx.manifest
    if not np.array_equal(s.index, np.arange(s.n)):
        yield Problem("samples.order", SAMPLES, "sample_index is not 0, 1, 2, ... in row order")
    for i in np.flatnonzero((s.trainable < 0) | (s.trainable > s.length) | (s.length <= 0)):
        yield Problem(
            "samples.tokens",
            f"{SAMPLES}: sample {i}",
            f"{s.trainable[i]} trainable of {s.length[i]} tokens",
        )
    epochs, _ = recorded_structure(m.config) or (1, 1)  # rows per input sample
    rows_in = sum(r.rows for r in m.inputs) * epochs
    for n, what in ((m.samples.total, "the manifest says"), (rows_in, "the input files have")):
        if s.n != n:
            yield Problem("samples.total", SAMPLES, f"{s.n} rows, {what} {n}")
    off = [
        f"{s.status_counts.get(k, 0)} {k} (the manifest says {getattr(m.samples, k)})"
        for k in STATUSES
        if s.status_counts.get(k, 0) != getattr(m.samples, k)
    ]
    off += [f"{n} {k!r} (unknown status)" for k, n in s.status_counts.items() if k not in STATUSES]
    if off:
        yield Problem("samples.status", SAMPLES, "samples by status: " + ", ".join(off))
    for i in np.flatnonzero(s.trained & ~s.inside_run(m.num_steps, m.dp)):
        yield Problem(
            "samples.place",
            f"{SAMPLES}: sample {i}",
            f"trained at step {s.step[i]} rank {s.rank[i]} micro-batch {s.micro_batch[i]}, the "
            f"run has {m.num_steps} steps of {m.dp} ranks",
        )


def rank_files(ctx: Context) -> Iterator[Problem]:
    """A rank's shard files hold its micro-batches in order, as many as its record says; every
    rank of a step has the same number of micro-batches."""
    for s, step in enumerate(ctx.manifest.steps):
        counts = [rank.micro_batches for rank in step.ranks]
        if len(set(counts)) > 1:
            yield Problem(
                "step.ranks", f"step {s}", f"ranks have different micro-batch counts {counts}"
            )
        for r, rank in enumerate(step.ranks):
            rows = 0
            for ref in rank.files:
                if ref.first_row != rows:
                    yield Problem(
                        "rank.files",
                        f"step {s} rank {r}",
                        f"{ref.path} starts at row {ref.first_row}, the files before it hold {rows}",
                    )
                rows += ref.rows
            if rows != rank.micro_batches:
                yield Problem(
                    "rank.files",
                    f"step {s} rank {r}",
                    f"{rows} rows in files, the manifest says {rank.micro_batches} micro-batches",
                )
