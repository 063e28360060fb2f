"""Column rules: what the input's Parquet schemas alone decide, before a row is read.

Per file: required columns present (`missing_columns`), every known column of its type
(`mistyped_columns`). Across files (`INPUT_RULES`): one token format, one type kind per id
column, optional columns in every file or in none. Each rule yields `Problem`s of its own kind.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from rolltool.format import MAX_TOKEN_ID
from rolltool.input.parquet import InputFile
from rolltool.util.problems import Problem

ID_COLUMNS = ("group_id", "rollout_id", "sample_id")
TOKEN_COLUMNS = ("input_ids", "loss_mask", "logprobs", "prompt_ids", "response_ids")
LIGHT_COLUMNS = ("group_id", "rollout_id", "sample_id", "env", "reward", "finished_at", "advantage")
SCAN_COLUMNS = LIGHT_COLUMNS + TOKEN_COLUMNS
OPTIONAL_EVERYWHERE = ("rollout_id", "env", "finished_at", "advantage")
"""Optional columns that must be in every file or in none (a per-input meaning)."""
FORMAT_COLUMNS = {"input_ids": ("input_ids", "loss_mask"), "prompt_response": TOKEN_COLUMNS[3:]}
"""Token format -> the token columns it is read from."""
DEFAULT_ENV = "default"
MAX_ID = MAX_TOKEN_ID  # token ids are packed as int32


def token_format(names: Collection[str]) -> str | None:
    """The token format of a file with these columns, or None when it has neither.

    ``"input_ids"`` (``input_ids`` + ``loss_mask``), else ``"prompt_response"`` (``prompt_ids``
    + ``response_ids``), else ``"input_ids"`` again for a lone ``loss_mask``: `rolltool stats`
    reads only the mask, the full scan reports ``input_ids`` missing.

    >>> token_format(["loss_mask", "input_ids"]), token_format(["prompt_ids", "response_ids"])
    ('input_ids', 'prompt_response')
    """
    if {"input_ids", "loss_mask"} <= set(names):
        return "input_ids"
    if {"prompt_ids", "response_ids"} <= set(names):
        return "prompt_response"
    return "input_ids" if "loss_mask" in names else None


def plain_type(t: pa.DataType) -> pa.DataType:
    """The type values are read as: a dictionary's value type (pandas categoricals), ``string``
    for ``string_view``; any other type as it is."""
    if pa.types.is_dictionary(t):
        return plain_type(t.value_type)
    if pa.types.is_string_view(t):
        return pa.string()
    return t


def plain_columns(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with dictionary and string_view columns decoded to `plain_type` (no copy when
    there are none)."""
    types = [plain_type(f.type) for f in batch.schema]
    if all(t == f.type for t, f in zip(types, batch.schema, strict=True)):
        return batch
    arrays = [
        col if t == col.type else col.cast(t) for t, col in zip(types, batch.columns, strict=True)
    ]
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def is_id_type(t: pa.DataType) -> bool:
    t = plain_type(t)
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list_of(t: pa.DataType, pred: Callable[[pa.DataType], bool]) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pred(t.value_type)


def _is_mask_value(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


def _is_string(t: pa.DataType) -> bool:
    t = plain_type(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_int_list(t: pa.DataType) -> bool:
    return _is_list_of(t, pa.types.is_integer)


# column -> (type check, description for the message)
COLUMN_TYPES: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "group_id": (is_id_type, "string or integer"),
    "rollout_id": (is_id_type, "string or integer"),
    "sample_id": (is_id_type, "string or integer"),
    "env": (_is_string, "string"),
    "reward": (_is_number, "float"),
    "advantage": (_is_number, "float"),
    "input_ids": (_is_int_list, "list of int"),
    "prompt_ids": (_is_int_list, "list of int"),
    "response_ids": (_is_int_list, "list of int"),
    "loss_mask": (lambda t: _is_list_of(t, _is_mask_value), "list of bool/int"),
    "logprobs": (lambda t: _is_list_of(t, _is_number), "list of float"),
    "finished_at": (lambda t: pa.types.is_timestamp(t) or _is_number(t), "timestamp or float"),
}


@dataclass(frozen=True)
class FileColumns:
    """What the schema rules decided about one file."""

    file: InputFile
    schema: pa.Schema
    """After --column renames and hive partition columns (`source.file_schema`)."""
    token_format: str | None
    """None when a required column is missing or mistyped: the file's rows are not scanned."""
    skip: frozenset[str]
    """Columns left out of the row scan: those of the wrong type and those ignored."""


# -- per file ------------------------------------------------------------------------------------


def missing_columns(file: InputFile, schema: pa.Schema) -> Iterator[Problem]:
    """``column.missing``: ``group_id``, ``reward`` and a token format's columns are required."""
    names = set(schema.names)
    for col in ("group_id", "reward"):
        if col not in names:
            yield Problem("column.missing", file.path, f"column '{col}' is missing (required)")
    fmt = token_format(names)
    if fmt is None:
        have = sorted(names & set(TOKEN_COLUMNS))
        yield Problem(
            "column.missing",
            file.path,
            "needs columns 'input_ids' and 'loss_mask' (or 'prompt_ids' and 'response_ids'); "
            f"found {have or 'none of them'}",
        )
        return
    for col in FORMAT_COLUMNS[fmt]:
        if col not in names:
            yield Problem("column.missing", file.path, f"column '{col}' is missing (required)")


def _mistyped(schema: pa.Schema) -> list[str]:
    return [
        name
        for name, (check, _) in COLUMN_TYPES.items()
        if name in schema.names and not check(schema.field(name).type)
    ]


def mistyped_columns(file: InputFile, schema: pa.Schema) -> Iterator[Problem]:
    """``column.type``: a known column whose Arrow type is not the one it must have."""
    for name in _mistyped(schema):
        t, desc = schema.field(name).type, COLUMN_TYPES[name][1]
        yield Problem("column.type", file.path, f"column '{name}' has type {t}, expected {desc}")


def file_columns(
    file: InputFile, schema: pa.Schema, out: list[Problem], ignore: Collection[str] = ()
) -> FileColumns:
    """Run the per-file rules, appending their problems to `out`; columns in `ignore` are
    neither checked nor scanned (nor seen by the rules across files)."""
    schema = pa.schema([f for f in schema if f.name not in ignore])
    missing = list(missing_columns(file, schema))
    out += missing
    out += mistyped_columns(file, schema)
    bad = frozenset(_mistyped(schema))
    fmt = token_format(schema.names)
    required = {"group_id", "reward", *FORMAT_COLUMNS.get(fmt or "", ())}
    ok = not missing and not (bad & required)
    return FileColumns(file, schema, fmt if ok else None, bad | frozenset(ignore))


# -- across files --------------------------------------------------------------------------------


def id_type_conflicts(schemas: Iterable[tuple[str, pa.Schema]]) -> list[str]:
    """Id columns that are integers in one file and strings in another, one message each.

    `schemas`: (path, schema after --column) per file. Reading 1 and "1" as one id (or as two)
    would be a guess either way, so the input is refused; files without the column don't count.

    >>> a = pa.schema([("group_id", pa.int64())]); b = pa.schema([("group_id", pa.string())])
    >>> id_type_conflicts([("a.parquet", a), ("b.parquet", b)])
    ["column 'group_id' is integer in a.parquet but string in b.parquet"]
    """
    first: dict[tuple[str, str], str] = {}  # (column, kind) -> first file with it
    for path, schema in schemas:
        for col in ID_COLUMNS:
            if col in schema.names and is_id_type(t := schema.field(col).type):
                kind = "integer" if pa.types.is_integer(plain_type(t)) else "string"
                first.setdefault((col, kind), path)
    return [
        f"column '{col}' is integer in {first[(col, 'integer')]} but string in "
        f"{first[(col, 'string')]}"
        for col in ID_COLUMNS
        if (col, "integer") in first and (col, "string") in first
    ]


def id_types(files: Sequence[FileColumns]) -> Iterator[Problem]:
    """``id.type``: an id column integer in one file and string in another."""
    for text in id_type_conflicts((f.file.path, f.schema) for f in files):
        yield Problem("id.type", "", text)


def one_token_format(files: Sequence[FileColumns]) -> Iterator[Problem]:
    """``input.format``: every scanned file in the same token format."""
    if len({f.token_format for f in files if f.token_format}) > 1:
        yield Problem(
            "input.format",
            "",
            "some files have 'input_ids'/'loss_mask' and others only 'prompt_ids'/'response_ids'; "
            "use one token format for the whole input",
        )


def everywhere_or_nowhere(files: Sequence[FileColumns]) -> Iterator[Problem]:
    """``column.partial``: an optional column of per-input meaning in some files but not all
    (empty files don't count)."""
    rows = [f for f in files if f.file.rows]
    for col in OPTIONAL_EVERYWHERE:
        have = [f.file.path for f in rows if col in f.schema.names]
        lack = [f.file.path for f in rows if col not in f.schema.names]
        if have and lack:
            yield Problem(
                "column.partial",
                "",
                f"column '{col}' is in {have[0]} but not in {lack[0]}"
                + (f" (nor in {len(lack) - 1} more)" if len(lack) > 1 else "")
                + "; give it in every file or in none",
            )


INPUT_RULES: tuple[Callable[[Sequence[FileColumns]], Iterator[Problem]], ...] = (
    one_token_format,
    id_types,
    everywhere_or_nowhere,
)
STOPPING = frozenset({"input.format", "id.type"})
"""Kinds after which rows are not read: the files cannot be read as one input."""
