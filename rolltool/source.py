"""Where rollouts come from: resolve input paths and stream Parquet record batches.

Inputs are files, directories (searched recursively for ``*.parquet``; ``key=value`` directory
names become string columns, as in hive partitioning) or glob patterns. The file order is the
sorted path order, so the row order ("sample_index") is deterministic.

Example: ``data/env=math/part-0.parquet`` read through the input ``data`` gets a column
``env = "math"`` unless the file already has one.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError


@dataclass(frozen=True)
class InputFile:
    path: str
    """Path as resolved (sorted order defines the global row order)."""
    rows: int
    """Number of rows in the file (from the Parquet footer)."""
    partitions: Mapping[str, str] = field(default_factory=dict)
    """Hive partition values taken from `key=value` directory names under the input root."""


def _partitions(root: Path, file: Path) -> dict[str, str]:
    parts: dict[str, str] = {}
    try:
        rel = file.parent.relative_to(root)
    except ValueError:
        return parts
    for piece in rel.parts:
        key, sep, value = piece.partition("=")
        if sep and key:
            parts[key] = value
    return parts


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[InputFile]:
    """Expand files, directories and globs into a sorted, de-duplicated list of Parquet files."""
    if not inputs:
        raise RolltoolError(
            "no input given", hint="pass one or more Parquet files, directories or globs"
        )
    found: dict[str, dict[str, str]] = {}
    for raw in inputs:
        text = os.fspath(raw)
        path = Path(text)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
            if not files:
                raise RolltoolError(f"{text}: directory holds no *.parquet files")
            for f in files:
                found.setdefault(str(f), _partitions(path, f))
        elif path.is_file():
            found.setdefault(str(path), {})
        elif glob.has_magic(text):
            matches = sorted(m for m in glob.glob(text, recursive=True) if Path(m).is_file())
            if not matches:
                raise RolltoolError(f"{text}: no file matches this pattern")
            for m in matches:
                found.setdefault(m, {})
        else:
            raise RolltoolError(f"{text}: no such file or directory")
    result = []
    for path_str in sorted(found):
        try:
            rows = pq.ParquetFile(path_str).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise RolltoolError(f"{path_str}: not a readable Parquet file ({e})") from None
        result.append(InputFile(path=path_str, rows=rows, partitions=found[path_str]))
    return result


def file_schema(file: InputFile, rename: Mapping[str, str]) -> pa.Schema:
    """The schema a file's batches will have after renaming and adding partition columns."""
    try:
        schema = pq.read_schema(file.path)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: not a readable Parquet file ({e})") from None
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
    """`--column NEW=OLD` pairs to a rename dict OLD -> NEW (the file's name -> schema name)."""
    return {old: new for new, old in mapping.items()}


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
    reverse = {new: old for old, new in rename.items()}
    present = set(pf.schema_arrow.names)
    return [reverse.get(c, c) for c in columns if reverse.get(c, c) in present]


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
        pf = pq.ParquetFile(file.path)
        for batch in pf.iter_batches(batch_size=batch_rows, columns=_wanted(pf, rename, columns)):
            names, arrays = _named(batch, file, rename, columns)
            yield pa.RecordBatch.from_arrays(arrays, names=names)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None


def iter_row_groups(
    file: InputFile,
    rename: Mapping[str, str],
    columns: Sequence[str] | None = None,
    only: int | None = None,
) -> Iterator[tuple[int, pa.Table]]:
    """(row group number, its rows as a table with schema names), like `iter_batches`;
    `only` reads just that row group."""
    try:
        pf = pq.ParquetFile(file.path)
        wanted = _wanted(pf, rename, columns)
        groups = range(pf.metadata.num_row_groups) if only is None else [only]
        for rg in groups:
            table = pf.read_row_group(rg, columns=wanted)
            names, arrays = _named(table, file, rename, columns)
            yield rg, pa.Table.from_arrays(arrays, names=names)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None
