"""`scan`: check the input in one pass and return its light columns as a `Rollouts`."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rolltool.input.parquet import InputFile, check_mapping, file_schema, iter_row_groups
from rolltool.schema.across import CROSS_RULES
from rolltool.schema.columns import (
    DEFAULT_ENV,
    INPUT_RULES,
    STOPPING,
    FileColumns,
    file_columns,
    is_id_type,
)
from rolltool.schema.pieces import (
    MIN_ROW_GROUPS,
    DeferredProblem,
    Mapper,
    Piece,
    RowCheck,
    ScanJob,
    map_pieces,
    name_rows,
    scan_table,
    tasks,
)
from rolltool.schema.rows import Flagged
from rolltool.util.problems import Problem, Problems

HINT = "fix these rows or columns; map differently named columns with --column NEW=OLD"
ADVANTAGE_HINT = "; or drop the 'advantage' column to let --estimator compute advantages"


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """Light columns of the ordered input: one entry per row (= trainable sample).

    Row i is ``sample_index`` i: the row number over the input files in sorted path order.
    """

    files: list[InputFile]
    """Input files in order, with row counts."""
    file_index: np.ndarray  # [n] int32: which file row i came from
    sample_id: pa.Array  # [n] the user's sample ids (string or int64); default: sample_index
    group: np.ndarray  # [n] int32 (see below): dense group code, in order of first appearance
    group_ids: pa.Array  # [G] the original group_id of each group code
    rollout_ids: pa.Array  # [R] the original rollout_id of each rollout code (row number if none)
    rollout: np.ndarray  # [n] int32 (see below): dense rollout code over (group_id, rollout_id)
    env: np.ndarray  # [n] int32: code into env_names
    env_names: list[str]  # env names in order of first appearance
    reward: np.ndarray  # [n] float64
    length: np.ndarray  # [n] int32 (see below): tokens in the sample (prompt and all turns)
    trainable: np.ndarray  # [n] int32 (see below): targets, loss_mask 1 but the first token
    """Codes and counts are int32 where every value is below 2**31, else int64 (`narrow`): 48
    bytes a sample for the numeric columns, not 64. Their sums are int64 (NumPy sums int32 so);
    products such as L² must be taken in int64 or float64 (a step's lengths are cast first)."""
    finished_at: np.ndarray | None  # [n] float64 seconds since the epoch, or None
    advantage: np.ndarray | None = None
    """[n] float32: the input's own ``advantage`` column (finite, equal over a rollout's
    branches), or None when the input has none."""
    token_format: str  # "input_ids" (input_ids + loss_mask) or "prompt_response"
    has_logprobs: bool
    columns: list[str]  # every column of the input (schema names, after --column)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return len(self.group)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def label(self, i: int) -> str:
        """How messages name sample i: its sample_id and its file."""
        f = self.files[int(self.file_index[i])].path
        return f"sample {self.sample_id[i].as_py()!r} ({f})"


@dataclass
class _Columns:
    """The light columns of the scanned files, batch by batch."""

    rows: int = 0
    file_index: list[np.ndarray] = field(default_factory=list)
    ids: dict[str, list[pa.Array]] = field(default_factory=lambda: defaultdict(list))
    values: dict[str, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))

    def add(self, piece: Piece, problems: Problems) -> None:
        """Keep a piece's light columns and report its problems."""
        for found in piece.found:
            found.report(problems)
        for name, arr in piece.ids.items():
            self.ids[name].append(arr)
        for name, values in piece.values.items():
            self.values[name].append(values)
        self.rows += piece.rows

    def cat(self, name: str, dtype: type) -> np.ndarray:
        parts = self.values[name]
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def optional(self, name: str) -> np.ndarray | None:
        """A column present in every scanned row (and some), else None."""
        parts = self.values[name]
        if not parts or sum(len(p) for p in parts) != self.rows:
            return None
        return np.concatenate(parts)


def _describe(f: Flagged, where: Callable[[int], str]) -> Callable[[int], tuple[str, str]]:
    return lambda i: (where(int(i)), f.text(int(i)))


def _report(problems: Problems, flagged: Iterable[Flagged], where: Callable[[int], str]) -> None:
    for f in flagged:
        if len(f.rows):
            problems.many(f.kind, f.rows, _describe(f, where))


def _serial(job: ScanJob, run: ScanRun) -> Iterator[tuple[int, Piece]]:
    """(file index, piece) of every scanned file, read here row group by row group; skipped
    files keep their place in the row numbering."""
    table_iter = iter(run.tables) if run.tables is not None else None
    first = 0
    for k, fc in enumerate(job.checked):
        table = next(table_iter) if table_iter is not None else None
        if fc.token_format is None:
            first += fc.file.rows
            continue
        if table is not None:
            read: Iterable[tuple[int, pa.Table]] = [(-1, table)]
        else:
            read = iter_row_groups(fc.file, job.rename, job.columns(fc))
        for rg, t in read:
            if run.on_row_group is not None and rg >= 0:
                run.on_row_group(k, rg, t)
            for piece in scan_table(t, fc, first):
                yield k, piece
                first += piece.rows


def _pieces(job: ScanJob, run: ScanRun) -> Iterator[tuple[int, Piece]]:
    """(file index, piece) in input order: by the mapper when it has enough row groups to pay."""
    if run.mapper is not None and run.tables is None:
        todo = tasks(job)
        if len(todo) >= MIN_ROW_GROUPS:
            return ((task.file, piece) for task, piece in map_pieces(job, todo, run.mapper))
    return _serial(job, run)


def _scan_rows(job: ScanJob, run: ScanRun, problems: Problems) -> _Columns:
    """Fold the pieces of every file whose columns passed, in order, keeping their light
    columns and reporting their problems; skipped files keep their place in the numbering."""
    acc = _Columns()
    by_file = itertools.groupby(_pieces(job, run), key=lambda kp: kp[0])
    group = next(by_file, None)
    for k, fc in enumerate(job.checked):
        if fc.token_format is None:
            acc.rows += fc.file.rows
            continue
        start = acc.rows
        if group is not None and group[0] == k:
            for _, piece in group[1]:
                acc.add(piece, problems)
            group = next(by_file, None)
        acc.file_index.append(np.full(acc.rows - start, k, dtype=np.int32))
    return acc


def _concat_ids(parts: list[pa.Array]) -> pa.Array:
    """Concatenate id arrays from several files (of one kind: the ``id.type`` rule).

    Integer widths become int64, string kinds one string type; integers still meet strings
    where a file without ``sample_id`` (default ids: row numbers) meets one with string ids:
    those become strings (and a clash is reported as a duplicate sample_id).
    """
    types = {a.type for a in parts}
    if len(types) > 1:
        if all(is_id_type(t) for t in types) and any(pa.types.is_integer(t) for t in types):
            if any(not pa.types.is_integer(t) for t in types):
                parts = [pc.cast(a, pa.string()) for a in parts]
            else:
                parts = [pc.cast(a, pa.int64()) for a in parts]
        else:
            parts = [pc.cast(a, pa.large_string()) for a in parts]
    if not parts:
        return pa.array([], pa.int64())
    return pa.concat_arrays(parts)


def _id_column(acc: _Columns, col: str, default: pl.Series) -> pl.Series:
    """An id column over the input; `default` when some scanned file lacks it."""
    parts = acc.ids[col]
    if not parts or sum(len(a) for a in parts) != acc.rows:
        return default
    return pl.Series(_concat_ids(parts))


def _codes(df: pl.DataFrame, keys: list[str]) -> tuple[np.ndarray, pl.DataFrame]:
    """Dense codes of the key tuple per row, numbered in order of first appearance."""
    uniques = df.select(keys).unique(maintain_order=True).with_row_index("_code")
    joined = df.select(keys).join(
        uniques, on=keys, how="left", maintain_order="left", nulls_equal=True
    )
    return narrow(joined["_code"].to_numpy()), uniques


def narrow(values: np.ndarray) -> np.ndarray:
    """Whole numbers >= 0 as int32 where every one is below 2**31, else int64."""
    if len(values) == 0 or int(values.max()) < 2**31:
        return values.astype(np.int32)
    return values.astype(np.int64, copy=False)


def _frame(acc: _Columns, sample_id: pa.Array, advantage: np.ndarray | None) -> pl.DataFrame:
    """One row per sample: ids, env, reward, row number (and the given advantage)."""
    n = acc.rows
    df = pl.DataFrame(
        {
            "group_id": pl.Series(_concat_ids(acc.ids["group_id"])),
            "rollout_id": _id_column(acc, "rollout_id", pl.Series(np.arange(n))),
            "sample_id": pl.Series(sample_id),
            "env": _id_column(acc, "env", pl.Series([DEFAULT_ENV] * n, dtype=pl.String)),
            "reward": acc.cat("reward", np.float64),
            "row": np.arange(n, dtype=np.int64),
        }
    )
    if advantage is not None:
        df = df.with_columns(pl.Series("advantage", advantage))
    return df


def _check_schemas(
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    ignore: Collection[str],
    problems: Problems,
) -> tuple[list[FileColumns], list[str], bool]:
    """The column rules on every file's schema, before a row is read: (files, every column of
    the input, whether the problems leave rows that cannot be compared across the input).
    Raises at once on a problem of the whole input (mixed token formats, an id column typed
    two ways)."""
    found: list[Problem] = []
    schemas = [file_schema(f, rename) for f in files]
    checked = [file_columns(f, s, found, ignore) for f, s in zip(files, schemas, strict=True)]
    for rule in INPUT_RULES:
        found += rule(checked)
    problems.extend(found)
    if any(p.kind in STOPPING for p in found):
        problems.raise_if_any("the input", hint=HINT)
    blocking = any(p.kind in ("column.missing", "column.type") for p in found)
    return checked, list(dict.fromkeys(n for s in schemas for n in s.names)), blocking


def _raise_if_any(problems: Problems, deferred: bool) -> None:
    if deferred and problems:
        raise DeferredProblem(
            "the input has problems the deferred scan does not list", hint="scan it in full"
        )
    about_advantage = any("'advantage'" in p.text for p in problems.listed())
    problems.raise_if_any("the input", hint=HINT + ADVANTAGE_HINT * about_advantage)


def scan(
    files: Sequence[InputFile],
    rename: Mapping[str, str] | None = None,
    tables: Iterable[pa.Table] | None = None,
    on_row_group: Callable[[int, int, pa.Table], None] | None = None,
    *,
    ignore: Collection[str] = (),
    mapper: Mapper | None = None,
) -> Rollouts:
    """Check the input and return its light columns; raises RolltoolError listing every problem.

    `tables` (one per file, already read) skips reading the files again. Otherwise files are
    read row group by row group, and `on_row_group(file_index, row_group, table)` sees each one
    (the packer keeps the token columns of as many as its cache allows, to avoid a second read).
    Problems of one file's columns do not stop the others' rows being checked; problems of the
    whole input's schemas stop before any row is read. Columns in `ignore` are neither read nor
    checked (``rolltool advantages`` replaces an input 'advantage' column: ``{"advantage"}``);
    `Rollouts.columns` still lists them.

    `mapper` scans the row groups (`rolltool.schema.pieces`: ``--workers``, Ray tasks) when
    there are at least ``MIN_ROW_GROUPS``: the result and every message are the serial scan's.
    It cannot feed `on_row_group`.
    """
    if mapper is not None and on_row_group is not None:
        raise ValueError("on_row_group sees row groups read here: pass no mapper")
    return _scan(files, rename, ScanRun(tables, on_row_group, mapper), ignore, deferred=False)[0]


def scan_deferred(
    files: Sequence[InputFile],
    rename: Mapping[str, str] | None = None,
    *,
    ignore: Collection[str] = (),
    mapper: Mapper | None = None,
    on_row_group: Callable[[int, int, pa.Table], None] | None = None,
) -> tuple[Rollouts, RowCheck]:
    """`scan` reading only the light columns (`rolltool.schema.pieces.DEFERRED`), and the row
    rules it left undone as a ``check(file_index, table)`` for a job that reads every column
    anyway (`rolltool.jobs.rewrite.append_columns`) or its token columns (``pack``'s fetch,
    `rolltool.fetch.tokens.TokenReader`). The Rollouts equal `scan`'s once the check has
    passed on every row group. Where a row breaks a rule, the deferred scan or the check raises
    `DeferredProblem`, not the listing: the caller runs `scan` for that. `on_row_group` as in
    `scan` (the row groups it sees hold the light columns only; not with a mapper).
    """
    if mapper is not None and on_row_group is not None:
        raise ValueError("on_row_group sees row groups read here: pass no mapper")
    run = ScanRun(None, on_row_group, mapper)
    ro, job = _scan(files, rename, run, ignore, deferred=True)
    return ro, RowCheck(replace(job, deferred=False))


@dataclass(frozen=True)
class ScanRun:
    """How the rows are read: given tables, a row-group callback, a mapper (see `scan`)."""

    tables: Iterable[pa.Table] | None
    on_row_group: Callable[[int, int, pa.Table], None] | None
    mapper: Mapper | None


def _scan(
    files: Sequence[InputFile],
    rename: Mapping[str, str] | None,
    run: ScanRun,
    ignore: Collection[str],
    *,
    deferred: bool,
) -> tuple[Rollouts, ScanJob]:
    rename = dict(rename or {})
    check_mapping(files, rename)
    problems = Problems()
    checked, columns, blocking = _check_schemas(files, rename, ignore, problems)
    job = ScanJob(checked=tuple(checked), rename=rename, deferred=deferred)
    acc = _scan_rows(job, run, problems)
    if blocking:  # rows can't be compared across the input: stop here
        _raise_if_any(problems, deferred)
    sample_id = _concat_ids(acc.ids["sample_id"])
    advantage = acc.optional("advantage")
    df = _frame(acc, sample_id, advantage)
    rollout, rollout_uniques = _codes(df, ["group_id", "rollout_id"])
    df = df.with_columns(pl.Series("rollout", rollout))
    for rule in CROSS_RULES:
        _report(problems, rule(df), _input_name(checked, acc, sample_id))
    _raise_if_any(problems, deferred)
    light = (rollout, rollout_uniques)
    return _rollouts(checked, columns, acc, df, sample_id, light, advantage), job


def _input_name(
    checked: Sequence[FileColumns], acc: _Columns, sample_id: pa.Array
) -> Callable[[int], str]:
    """Where row i of the input is (as `name_rows` says it for a batch)."""
    fidx = np.concatenate(acc.file_index) if acc.file_index else np.zeros(0, np.int32)
    return lambda i: name_rows(checked[int(fidx[i])].file.path, sample_id, 0)(i)


def _rollouts(
    checked: Sequence[FileColumns],
    columns: list[str],
    acc: _Columns,
    df: pl.DataFrame,
    sample_id: pa.Array,
    rollouts: tuple[np.ndarray, pl.DataFrame],
    advantage: np.ndarray | None,
) -> Rollouts:
    rollout, rollout_uniques = rollouts
    group, group_uniques = _codes(df, ["group_id"])
    env, env_uniques = _codes(df, ["env"])
    trainable = narrow(acc.cat("trainable", np.int64))
    cleared = int(acc.cat("first_cleared", np.int64).sum())
    no_train = int((trainable == 0).sum())
    warnings = [
        f"{cleared} sample(s) have loss_mask 1 on their first token: nothing precedes it, so it "
        f"is never a target; {cleared} token(s) not trained (weight 0, not counted in T)"
    ] * (cleared > 0)
    warnings += [f"{no_train} sample(s) have no trainable token (loss_mask all 0)"] * (no_train > 0)
    formats = {fc.token_format for fc in checked if fc.token_format}
    scanned = [fc for fc in checked if fc.token_format]
    return Rollouts(
        files=[fc.file for fc in checked],
        file_index=np.concatenate(acc.file_index) if acc.file_index else np.zeros(0, np.int32),
        sample_id=sample_id,
        group=group,
        group_ids=group_uniques["group_id"].to_arrow(),
        rollout_ids=rollout_uniques["rollout_id"].to_arrow(),
        rollout=rollout,
        env=env.astype(np.int32),
        env_names=[str(v) for v in env_uniques["env"].to_list()],
        reward=acc.cat("reward", np.float64),
        length=narrow(acc.cat("length", np.int64)),
        trainable=trainable,
        finished_at=acc.optional("finished_at"),
        advantage=None if advantage is None else advantage.astype(np.float32),
        token_format=formats.pop() if formats else "input_ids",
        has_logprobs=bool(scanned) and all("logprobs" in fc.schema.names for fc in scanned),
        columns=columns,
        warnings=warnings,
    )
