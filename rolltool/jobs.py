"""One function per subcommand, wiring readers -> pure stages -> writers.

These are the Python API behind the CLI: they take config objects and paths and return a report
dict (the same document `--json` prints). They never print.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rolltool import __version__
from rolltool.advantages import AdvantageConfig, AdvantageInput, compute_advantages, summarize
from rolltool.errors import RolltoolError
from rolltool.outputs import atomic_path, check_target, parquet_marker
from rolltool.schema import scan
from rolltool.source import (
    InputFile,
    file_schema,
    invert_mapping,
    iter_row_groups,
    resolve_inputs,
)
from rolltool.synth import SynthConfig, generate

ADVANTAGE_COLUMNS = (
    "advantage",
    "group_size",
    "group_reward_mean",
    "group_reward_std",
    "group_uniform",
)


def run_synth(config: SynthConfig, output: str | os.PathLike[str], *, force: bool = False) -> dict:
    """Write `generate(config)` to `output` (Parquet, zstd) and describe what was written."""
    check_target(output, force)
    table = generate(config)
    with atomic_path(output, force=force, directory=False) as tmp:
        marked = table.replace_schema_metadata(parquet_marker("synth"))
        pq.write_table(marked, tmp, compression="zstd", row_group_size=4096)
    envs = table.column("env").value_counts().to_pylist()
    return {
        "output": str(output),
        "config": {
            "groups": config.groups,
            "seed": config.seed,
            "envs": list(config.envs),
            "max_len": config.max_len,
        },
        "rows": table.num_rows,
        "samples_per_env": {e["values"]: e["counts"] for e in envs},
        "bytes": os.path.getsize(output),
    }


ROW_GROUP = 65_536
"""Rows per output row group; the output is written one row group at a time."""


def run_advantages(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    config: AdvantageConfig,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
) -> dict:
    """Compute group advantages and write the input rows plus the advantage columns.

    `columns` maps schema names to the input's names (`--column NEW=OLD`). Memory is bounded by
    the light columns (a few numbers per sample) and one row group, not by the input: the input
    is scanned row group by row group for the light columns, then copied to the output
    ``ROW_GROUP`` rows at a time with the new columns appended (each input file starts a new
    row group).
    """
    check_target(output, force, inputs=inputs)
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    rollouts = scan(files, rename, ignore=ADVANTAGE_COLUMNS)  # replaced: neither read nor checked
    light = AdvantageInput.from_rollouts(rollouts)
    adv = compute_advantages(config, light)
    new = {
        "advantage": pa.array(adv.advantage, pa.float32()),
        "group_size": pa.array(adv.group_size, pa.int64()),
        "group_reward_mean": pa.array(adv.group_reward_mean, pa.float64()),
        "group_reward_std": pa.array(adv.group_reward_std, pa.float64()),
        "group_uniform": pa.array(adv.group_uniform, pa.bool_()),
    }
    replaced = sorted(set(ADVANTAGE_COLUMNS) & set(rollouts.columns))
    warnings = list(rollouts.warnings)
    if replaced:
        warnings.append(f"input columns {', '.join(replaced)} were replaced by the computed ones")
    schema = _output_schema(files, rename, replaced, new)
    with atomic_path(output, force=force, directory=False) as tmp:
        _copy_with_columns(tmp, files, rename, schema, replaced, new)
    envs, overall = summarize(adv, light)
    return {
        "rolltool": __version__,
        "output": str(output),
        "inputs": [{"path": f.path, "rows": f.rows} for f in files],
        "config": config.to_dict(),
        "samples": rollouts.num_samples,
        "groups": rollouts.num_groups,
        "samples_without_trainable_tokens": int(np.sum(rollouts.trainable == 0)),
        "warnings": warnings,
        "envs": envs,
        "overall": overall,
    }


def _batch_schema(file: InputFile, rename: Mapping[str, str]) -> pa.Schema:
    """The schema of the file's record batches (`iter_batches`): renamed, partition columns
    added, every field nullable; a file without rows keeps its own nullability."""
    schema = file_schema(file, rename)
    if file.rows == 0:
        return schema
    return pa.schema([pa.field(f.name, f.type) for f in schema])


def _output_schema(
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
) -> pa.Schema:
    """Every input column (types unified over the files) but the replaced ones, then ``new``."""
    schemas = []
    for file in files:
        schema = _batch_schema(file, rename)
        for name in replaced:
            if name in schema.names:
                schema = schema.remove(schema.get_field_index(name))
        schemas.append(schema)
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise RolltoolError(f"the input files have incompatible column types ({e})") from None
    for name, arr in new.items():
        schema = schema.append(pa.field(name, arr.type))
    return schema.with_metadata(parquet_marker("advantages"))


def _copy_with_columns(
    target: str | os.PathLike[str],
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    schema: pa.Schema,
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
) -> None:
    """Write the input's rows, in order, with ``new``'s (one entry per input row) appended."""
    start = 0
    with pq.ParquetWriter(target, schema, compression="zstd") as writer:
        for file in files:
            wrote = False
            for table in _regrouped(file, rename, ROW_GROUP):
                n = table.num_rows
                cols = {name: arr.slice(start, n) for name, arr in new.items()}
                writer.write_table(_conform(table, file, schema, replaced, cols), ROW_GROUP)
                del table  # before the next one is read: one output row group in memory
                start += n
                wrote = True
            if not wrote:  # an empty file is an empty row group, as pyarrow writes one
                writer.write_table(schema.empty_table())


def _regrouped(file: InputFile, rename: Mapping[str, str], rows: int) -> Iterator[pa.Table]:
    """The file's rows as tables of ``rows`` rows (the last one shorter), read row group by row
    group: memory holds one output row group, one input row group and one column's copy."""
    names: list[str] = []
    chunks: dict[str, list[pa.Array]] = {}
    held = 0
    for _, piece in iter_row_groups(file, rename):
        names = piece.column_names
        for name in names:
            chunks.setdefault(name, []).extend(piece.column(name).chunks)
        held += piece.num_rows
        del piece
        while held >= rows:
            yield _take_rows(names, chunks, rows)
            held -= rows
    if held:
        yield _take_rows(names, chunks, held)


def _take_rows(names: Sequence[str], chunks: dict[str, list[pa.Array]], rows: int) -> pa.Table:
    """The first ``rows`` rows of ``chunks``, removed from it, as one contiguous array per
    column (the bytes pyarrow writes depend on chunk boundaries: a dictionary falls back to
    plain encoding at a chunk's end). Copied column by column, so each input column is freed
    before the next is copied."""
    columns = []
    for name in names:
        head: list[pa.Array] = []
        rest: list[pa.Array] = []
        n = 0
        for c in chunks[name]:
            if n >= rows:
                rest.append(c)
            elif n + len(c) <= rows:
                head.append(c)
                n += len(c)
            else:
                head += [c.slice(0, rows - n)]
                rest += [c.slice(rows - n)]
                n = rows
        chunks[name] = rest
        columns.append(pa.concat_arrays(head))
        del head
    return pa.Table.from_arrays(columns, names=list(names))


def _conform(
    table: pa.Table,
    file: InputFile,
    schema: pa.Schema,
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
) -> pa.Table:
    """``table`` with the replaced columns dropped, ``new`` appended, columns the file lacks
    as nulls, in ``schema``'s order and types."""
    table = table.drop_columns([c for c in replaced if c in table.column_names])
    for name, arr in new.items():
        table = table.append_column(name, arr)
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise RolltoolError(
            f"{file.path}: columns do not match the other input files ({e})"
        ) from None
