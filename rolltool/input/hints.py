"""Conversion hints: the exact command that turns another format into the Parquet rolltool reads.

rolltool reads Parquet only (row groups on demand, by the footer), so an input in JSON Lines,
JSON, Arrow IPC or a Hugging Face ``datasets`` directory is refused with the one-line command that
converts it (by file suffix; a folder by its ``*.arrow`` shards), and a file that is not
readable Parquet gets that hint too (`unreadable`). Why a module of its own: both the input
resolution (`rolltool.input.resolve`) and the Parquet reads (`rolltool.input.parquet`) raise
these errors. Import order inside input/: hints < parquet < resolve; this module imports no
sibling.
"""

from __future__ import annotations

import os

from rolltool.errors import RolltoolError

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


def _hf_hint(folder: str) -> str:
    shards = os.path.join(folder, "*.arrow")
    return (
        "a Hugging Face datasets directory: write Parquet next to its shards once with "
        'python -c "import glob, pyarrow as pa, pyarrow.parquet as pq; '
        "[pq.write_table(pa.ipc.open_stream(f).read_all(), f[:-6] + '.parquet') "
        f'for f in sorted(glob.glob({shards!r}))]" and give the directory again '
        "(or, with the datasets package: datasets.load_from_disk(DIR).to_parquet(FILE))"
    )


def convert_hint(path: str | os.PathLike[str]) -> str | None:
    """The exact command that converts a JSON Lines or JSON file, an Arrow file or a Hugging
    Face ``datasets`` directory (``save_to_disk``: ``*.arrow`` shards) to Parquet; None for
    other paths. rolltool reads Parquet only (it reads row groups on demand by the footer).

    >>> print(convert_hint("r.jsonl"))
    convert it once: python -c "import polars as pl; pl.scan_ndjson('r.jsonl').sink_parquet('r.parquet')"
    """
    text = os.fspath(path)
    if os.path.isdir(text):
        return _hf_hint(text) if any(f.endswith(".arrow") for f in os.listdir(text)) else None
    suffix = next((x for x in (*JSON_SUFFIXES, *ARROW_SUFFIXES) if text.lower().endswith(x)), "")
    if not suffix:
        return None
    out = text[: -len(suffix)] + ".parquet"
    if suffix == ".json":  # one JSON array of objects
        return (
            f'convert it once: python -c "import polars as pl; pl.read_json({text!r})'
            f'.write_parquet({out!r})" (one object per line: pl.scan_ndjson instead)'
        )
    if suffix in JSON_SUFFIXES:
        return (
            f'convert it once: python -c "import polars as pl; pl.scan_ndjson({text!r})'
            f'.sink_parquet({out!r})"'
        )
    return (
        'convert it once: python -c "import pyarrow as pa, pyarrow.parquet as pq; '
        f'pq.write_table(pa.ipc.open_stream({text!r}).read_all(), {out!r})" '
        "(an Arrow file rather than a stream: pa.ipc.open_file)"
    )


def unreadable(path: str, e: Exception) -> RolltoolError:
    """The error for a file pyarrow could not read as Parquet (`e`), with the conversion hint
    where one applies."""
    hint = convert_hint(path)
    if hint is not None:
        return RolltoolError(f"{path}: not a Parquet file (rolltool reads Parquet)", hint=hint)
    return RolltoolError(f"{path}: not a readable Parquet file ({e})")
