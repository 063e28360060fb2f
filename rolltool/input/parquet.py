"""Parquet I/O: one input file's footer, schema, batches and row groups, with schema names.

An `InputFile` is one resolved Parquet input (path, rows from its footer, hive partition values).
Its reads rename columns (``--column NEW=OLD``: `invert_mapping`, `check_mapping`,
`source_names`) and add partition values as string columns; row-group sizes are in rows
(`row_group_rows`) and compressed bytes (`row_group_bytes`), from the footer alone.

Open files are bounded: a Parquet file is opened for one read (its footer, a row group, a
stream of batches) and closed after it, never kept per input file, so any number of input files
fits a small ``ulimit -n``. The parsed footers of the last few files read are kept (keyed by
path, size and modification time), so reading a file's row groups one at a time parses its
footer once, not once per row group (with thousands of row groups that was quadratic: 96 s for
4,000 row groups). A file on a `pyarrow.fs` filesystem (a URI) is identified by its URI; its
footer is cached by size and modification time like a local file's.

Import order inside input/: hints < parquet < resolve (this module imports `hints` only).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.input.hints import unreadable
from rolltool.storage.fs import is_remote, locate_input


@dataclass(frozen=True)
class InputFile:
    path: str
    """Path as given or found (relative paths stay relative; sorted order defines the global row
    order); messages name files by it."""
    rows: int
    """Number of rows in the file (from the Parquet footer)."""
    partitions: Mapping[str, str] = field(default_factory=dict)
    """Hive partition values taken from `key=value` directory names under the input root."""
    resolved: str = ""
    """Absolute path with symlinks resolved (what a manifest records: valid from any directory);
    filled in from `path` when not given."""

    def __post_init__(self) -> None:
        if not self.resolved:
            resolved = self.path if is_remote(self.path) else str(Path(self.path).resolve())
            object.__setattr__(self, "resolved", resolved)


FOOTERS_KEPT = 4
"""Parsed footers kept (files, most recently read); a footer of 16,000 row groups is a few MB."""

_footers: OrderedDict[tuple[str, int, int, int], pq.FileMetaData] = OrderedDict()
_footers_lock = threading.Lock()


def footer(path: str | os.PathLike[str]) -> pq.FileMetaData:
    """The file's parsed footer, from the cache while the file (inode, size, mtime) is unchanged
    (pyarrow errors and OSError as they come)."""
    if is_remote(path):
        return _remote_footer(os.fspath(path))
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _footers_lock:
        if key in _footers:
            _footers.move_to_end(key)
            return _footers[key]
    return _keep(key, pq.read_metadata(path))


def _remote_footer(uri: str) -> pq.FileMetaData:
    """`footer` of a file on a filesystem (cached by URI, size and modification time)."""
    loc = locate_input(uri)
    info = loc.info()
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(2, "no such file", uri)
    key = (uri, 0, info.size, info.mtime_ns or 0)
    with _footers_lock:
        if key in _footers:
            _footers.move_to_end(key)
            return _footers[key]
    with loc.fs.open_input_file(loc.path) as f:
        return _keep(key, pq.read_metadata(f))


def _keep(key: tuple[str, int, int, int], meta: pq.FileMetaData) -> pq.FileMetaData:
    with _footers_lock:
        _footers[key] = meta
        while len(_footers) > FOOTERS_KEPT:
            _footers.popitem(last=False)
    return meta


@contextmanager
def _open(path: str | os.PathLike[str]) -> Iterator[pq.ParquetFile]:
    """The file opened for one read, its footer parsed at most once while it is unchanged."""
    meta = footer(path)
    if not is_remote(path):
        with pq.ParquetFile(path, metadata=meta) as pf:
            yield pf
        return
    loc = locate_input(os.fspath(path))
    with loc.fs.open_input_file(loc.path) as f, pq.ParquetFile(f, metadata=meta) as pf:
        yield pf


def _read_schema(file: InputFile) -> pa.Schema:
    try:
        with _open(file.path) as pf:
            return pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise unreadable(file.path, e) from None


def file_schema(file: InputFile, rename: Mapping[str, str]) -> pa.Schema:
    """The schema a file's batches will have after renaming and adding partition columns."""
    schema = _read_schema(file)
    names = [rename.get(n, n) for n in schema.names]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        pairs = [f"--column {new}={old}" for old, new in rename.items() if new in clashes]
        raise RolltoolError(
            f"{file.path}: column {', '.join(repr(c) for c in clashes)} appears twice"
            + (f" after {', '.join(pairs)}" if pairs else ""),
            hint=("drop the --column option, or " if pairs else "") + "rename one of the columns",
        )
    fields = [pa.field(new, f.type, f.nullable) for new, f in zip(names, schema, strict=True)]
    for key in file.partitions:
        if key not in names:
            fields.append(pa.field(key, pa.string()))
    return pa.schema(fields)


def invert_mapping(mapping: Mapping[str, str]) -> dict[str, str]:
    """`--column NEW=OLD` pairs to a rename dict OLD -> NEW (the file's name -> schema name).

    One input column can feed one schema column only: two NEWs from the same OLD are an error
    rather than a silent choice of one of them.
    """
    rename: dict[str, str] = {}
    for new, old in mapping.items():
        if old in rename:
            raise RolltoolError(
                f"--column {rename[old]}={old} and --column {new}={old} both read column {old!r}",
                hint="map each input column to one schema column",
            )
        rename[old] = new
    return rename


def check_mapping(files: Sequence[InputFile], rename: Mapping[str, str]) -> None:
    """Every `--column NEW=OLD` must name a column OLD of at least one input file.

    A mapping that matches nothing is a typo or the wrong input; ignoring it would read the
    schema column from somewhere else (or nowhere) without a word.
    """
    unseen = set(rename)
    for f in files:
        if not unseen:
            return
        unseen -= set(_read_schema(f).names)
    if unseen:
        pairs = ", ".join(f"--column {rename[old]}={old}" for old in rename if old in unseen)
        raise RolltoolError(
            f"{pairs}: no input file has a column "
            + " or ".join(repr(old) for old in rename if old in unseen),
            hint="check the column names (OLD is the name in the input files, NEW the schema's)",
        )


def _named(
    batch: pa.RecordBatch | pa.Table,
    file: InputFile,
    rename: Mapping[str, str],
    columns: Sequence[str] | None,
) -> tuple[list[str], list]:
    names = [rename.get(n, n) for n in batch.schema.names]
    arrays = list(batch.columns)
    for key, value in file.partitions.items():
        if key not in names and (columns is None or key in columns):
            names.append(key)
            arrays.append(pa.array([value] * batch.num_rows, pa.string()))
    return names, arrays


def _wanted(
    pf: pq.ParquetFile, rename: Mapping[str, str], columns: Sequence[str] | None
) -> list[str] | None:
    if columns is None:
        return None
    source = source_names(pf.schema_arrow.names, rename)
    return [source[c] for c in columns if c in source]


def source_names(file_columns: Sequence[str], rename: Mapping[str, str]) -> dict[str, str]:
    """Schema name -> the file column it is read from, for one file (as `file_schema` names it).

    >>> source_names(["score", "reward_old"], {"score": "reward"})
    {'reward': 'score', 'reward_old': 'reward_old'}
    """
    return {rename.get(n, n): n for n in file_columns}


def iter_batches(
    file: InputFile,
    rename: Mapping[str, str],
    columns: Sequence[str] | None = None,
    batch_rows: int = 65_536,
) -> Iterator[pa.RecordBatch]:
    """Stream a file's rows as record batches with schema names (after `rename`).

    `columns` are schema names; columns the file lacks are skipped (the caller validates).
    """
    try:
        with _open(file.path) as pf:
            wanted = _wanted(pf, rename, columns)
            for batch in pf.iter_batches(batch_size=batch_rows, columns=wanted):
                names, arrays = _named(batch, file, rename, columns)
                yield pa.RecordBatch.from_arrays(arrays, names=names)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None


def iter_row_groups(
    file: InputFile, rename: Mapping[str, str], columns: Sequence[str] | None = None
) -> Iterator[tuple[int, pa.Table]]:
    """(row group number, its rows as a table with schema names), like `iter_batches`."""
    try:
        with _open(file.path) as pf:
            wanted = _wanted(pf, rename, columns)
            for rg in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(rg, columns=wanted)
                names, arrays = _named(table, file, rename, columns)
                yield rg, pa.Table.from_arrays(arrays, names=names)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None


def read_row_group(
    file: InputFile, rename: Mapping[str, str], columns: Sequence[str] | None, row_group: int
) -> pa.Table:
    """One row group as a table with schema names; the file is closed again before returning."""
    try:
        with _open(file.path) as pf:
            table = pf.read_row_group(row_group, columns=_wanted(pf, rename, columns))
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None
    names, arrays = _named(table, file, rename, columns)
    return pa.Table.from_arrays(arrays, names=names)


def read_row_groups(
    file: InputFile,
    rename: Mapping[str, str],
    columns: Sequence[str] | None,
    row_groups: Sequence[int],
) -> list[pa.Table]:
    """Several row groups of one file (in the order given) as tables with schema names, the
    file opened once for all of them and closed before returning: a reader that needs many
    row groups of a file asks for them together."""
    try:
        with _open(file.path) as pf:
            wanted = _wanted(pf, rename, columns)
            tables = [pf.read_row_group(rg, columns=wanted) for rg in row_groups]
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None
    named = [_named(t, file, rename, columns) for t in tables]
    return [pa.Table.from_arrays(arrays, names=names) for names, arrays in named]


def row_group_rows(file: InputFile) -> list[int]:
    """Rows in each row group of a file, from its footer."""
    try:
        meta = footer(file.path)
    except (pa.ArrowException, OSError) as e:
        raise unreadable(file.path, e) from None
    return [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]


def row_group_bytes(
    file: InputFile, rename: Mapping[str, str], columns: Sequence[str]
) -> list[int]:
    """Compressed bytes of `columns` (schema names) in each row group of a file, from its
    footer: what reading those columns of a row group costs."""
    try:
        meta = footer(file.path)
    except (pa.ArrowException, OSError) as e:
        raise unreadable(file.path, e) from None
    names = source_names(meta.schema.to_arrow_schema().names, rename)
    wanted = {names[c] for c in columns if c in names}
    out = []
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        out.append(
            sum(
                group.column(j).total_compressed_size
                for j in range(group.num_columns)
                if group.column(j).path_in_schema.split(".")[0] in wanted
            )
        )
    return out
