"""The scan's per-row-group work: a pure function of (file, row group), so it can run anywhere.

`scan_piece(job, task)` reads one row group of one file, runs the row rules on it and returns
what the scan keeps of it: its light columns and its problems, described (`Piece`). The scan
folds the pieces in input order, so the `Rollouts` and every problem message are the same
whether the pieces were scanned here, one after another, in forked worker processes
(``--workers``: `rolltool.engine.local.local_mapper`) or as Ray tasks: any `Mapper`, a callable
``mapper(fn, items) -> [fn(x) for x in items]`` (results in order) runs them.

Deferred (``ScanJob.deferred``): the scan reads only the light columns and the token columns
the light values need (``loss_mask`` for the trainable tokens, whose length is the sequence's
once `mask_length` has compared it with ``input_ids``; both id lists of the prompt_response
format); ``input_ids`` and ``logprobs`` (`DEFERRED`) are left to a job that decodes them anyway:
``rolltool advantages`` runs `RowCheck` on every row group it copies. The row rules that need
them find nothing on the light columns alone, so a deferred scan flags only rows the full scan
flags too; `RowCheck` runs every row rule and raises `DeferredProblem` at the first flagged
row, and the job then runs the full scan for the message (which lists every problem).
``rolltool pack`` defers its scan the same way and runs `RowCheck` where it fetches the token
columns (`rolltool.fetch.tokens`), so they are decoded once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from rolltool.errors import RolltoolError
from rolltool.input.parquet import footer, read_row_group
from rolltool.schema.columns import SCAN_COLUMNS, FileColumns, plain_columns
from rolltool.schema.rows import ROW_RULES, Flagged, row_batch
from rolltool.util.mapping import Mapper
from rolltool.util.problems import MAX_LISTED, Problem, Problems

DEFERRED = {"input_ids": ("input_ids", "logprobs"), "prompt_response": ("logprobs",)}
"""Token format -> the columns a deferred scan leaves to `RowCheck`."""

BATCH_ROWS = 65_536
"""Rows per record batch the rules see (a row group of more rows is checked in pieces)."""

MIN_ROW_GROUPS = 8
"""A scan of fewer row groups runs here whatever mapper it is given (a pool costs ~0.1 s)."""


@dataclass(frozen=True)
class Found:
    """The rows one rule flagged in one batch: how many, and the first few described."""

    kind: str
    count: int
    listed: tuple[Problem, ...]  # the first min(count, MAX_LISTED) of them

    def report(self, problems: Problems) -> None:
        """Add them to `problems` as ``problems.many`` over the rows would have."""
        problems.many(self.kind, range(self.count), lambda i: _parts(self.listed[i]))


def _parts(p: Problem) -> tuple[str, str]:
    return p.where, p.text


@dataclass(frozen=True)
class Piece:
    """What the scan keeps of one record batch: its light columns and its problems."""

    rows: int
    ids: dict[str, pa.Array]  # sample_id (default: sample_index), group_id, rollout_id, env
    values: dict[
        str, np.ndarray
    ]  # reward, length, trainable, first_cleared[, finished_at, advantage] (float64/int64)
    found: tuple[Found, ...]


@dataclass(frozen=True)
class ScanJob:
    """What every piece of one scan shares."""

    checked: tuple[FileColumns, ...]
    """The input files in order, as the column rules left them."""
    rename: Mapping[str, str]
    """Input name -> schema name (``--column``)."""
    deferred: bool = False
    """Read only the light columns (module docstring)."""

    def columns(self, fc: FileColumns) -> list[str]:
        """The columns read from file `fc`."""
        later = DEFERRED.get(fc.token_format or "", ()) if self.deferred else ()
        return [c for c in SCAN_COLUMNS if c not in fc.skip and c not in later]


@dataclass(frozen=True)
class Task:
    """One row group to scan."""

    file: int  # index into ScanJob.checked
    row_group: int
    first_row: int  # the sample_index of its first row


def name_rows(path: str, sid: pa.Array, first_row: int) -> Callable[[int], str]:
    """Where row i of a batch is: its file and sample_id (its row number if it has none)."""

    def name(i: int) -> str:
        if not sid[i].is_valid:
            return f"{path}: row {first_row + int(i)} of the ordered input"
        return f"{path}: sample {sid[i].as_py()!r}"

    return name


def _found(f: Flagged, where: Callable[[int], str]) -> Found:
    listed = tuple(Problem(f.kind, where(int(i)), f.text(int(i))) for i in f.rows[:MAX_LISTED])
    return Found(f.kind, len(f.rows), listed)


def scan_batch(batch: pa.RecordBatch, fc: FileColumns, first_row: int) -> Piece:
    """Run the row rules on one batch of file `fc` and keep its light columns."""
    b = row_batch(batch, fc.token_format or "", fc.skip)
    if "sample_id" in b.cols:
        sid = b.cols["sample_id"]
    else:
        sid = pa.array(np.arange(first_row, first_row + batch.num_rows, dtype=np.int64))
    where = name_rows(fc.file.path, sid, first_row)
    found = tuple(_found(f, where) for rule in ROW_RULES for f in rule(b) if len(f.rows))
    ids = {"sample_id": sid} | {
        c: b.cols[c] for c in ("group_id", "rollout_id", "env") if c in b.cols
    }
    values = {"reward": b.reward, "length": b.length, "trainable": b.trainable,
              "first_cleared": b.first_cleared.astype(np.int64)}  # fmt: skip
    for col in ("finished_at", "advantage"):
        if (v := b.floats(col)) is not None:
            values[col] = v
    return Piece(batch.num_rows, ids, values, found)


def scan_table(table: pa.Table, fc: FileColumns, first_row: int) -> list[Piece]:
    """`scan_batch` over a table (one row group, or a whole file) in batches of BATCH_ROWS."""
    pieces = []
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        pieces.append(scan_batch(plain_columns(batch), fc, first_row))
        first_row += batch.num_rows
    return pieces


def scan_piece(job: ScanJob, task: Task) -> list[Piece]:
    """Read and scan one row group: a pure function of the job and the task."""
    fc = job.checked[task.file]
    table = read_row_group(fc.file, job.rename, job.columns(fc), task.row_group)
    return scan_table(table, fc, task.first_row)


def tasks(job: ScanJob) -> list[Task]:
    """Every row group of the files whose columns passed, in input order (from the footers);
    a file whose rows are not scanned keeps its place in the row numbering."""
    out: list[Task] = []
    first = 0
    for k, fc in enumerate(job.checked):
        if fc.token_format is None:
            first += fc.file.rows
            continue
        meta = _footer(fc)
        for rg in range(meta.num_row_groups):
            out.append(Task(k, rg, first))
            first += meta.row_group(rg).num_rows
    return out


def _footer(fc: FileColumns) -> Any:
    try:
        return footer(fc.file.path)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{fc.file.path}: could not be read ({e})") from None


def map_pieces(job: ScanJob, todo: Sequence[Task], mapper: Mapper) -> Iterator[tuple[Task, Piece]]:
    """Every task's pieces, scanned by `mapper`, in task order."""
    for task, pieces in zip(todo, mapper(partial(scan_piece, job), todo), strict=True):
        for piece in pieces:
            yield task, piece


class DeferredProblem(RolltoolError):
    """A row the deferred scan did not read breaks a rule. The job scans the input in full for
    the message; this one is seen only if the full scan accepts the row (a bug in rolltool)."""


@dataclass(frozen=True)
class RowCheck:
    """The row rules on a row group of file `file` read with every column (the copy's) or with
    its token columns (pack's fetch, `rolltool.fetch.tokens.TokenReader`): raises
    `DeferredProblem` at the first flagged row. ``check(file, table)``. Picklable: it travels
    to pack's worker processes and Ray tasks with the reader."""

    job: ScanJob

    def __call__(self, file: int, table: pa.Table) -> None:
        fc = self.job.checked[file]
        wanted = [c for c in SCAN_COLUMNS if c not in fc.skip and c in table.column_names]
        for batch in table.select(wanted).to_batches(max_chunksize=BATCH_ROWS):
            b = row_batch(plain_columns(batch), fc.token_format or "", fc.skip)
            for rule in ROW_RULES:
                for f in rule(b):
                    if len(f.rows):
                        raise DeferredProblem(
                            f"{fc.file.path}: {f.kind} in a row the first pass did not read, "
                            "but the full scan accepts it (a bug in rolltool)"
                        )
