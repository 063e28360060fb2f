"""Where rollouts come from: resolve input paths and stream Parquet record batches.

Inputs are files, directories (searched recursively for ``*.parquet``; ``key=value`` directory
names become string columns, as in hive partitioning) or glob patterns. The file order is the
sorted path order, so the row order ("sample_index") is deterministic.

A file named twice (``a.parquet`` and its absolute path, or through a glob and a directory, or
a symlink) is read once: inputs are deduplicated by resolved path, keeping the first spelling.

A directory walk skips names starting with ``.`` or ``_`` (Spark/Hive bookkeeping such as
``_SUCCESS``, ``_temporary/``, ``.tmp`` files) and any folder written by ``rolltool pack`` (it
holds rolltool's ``manifest.json``), so packing into a folder inside the input directory does not
read its own ``samples.parquet`` back next time.

Open files are bounded: a Parquet file is opened for one read (its footer, a row group, a
stream of batches) and closed after it, never kept per input file, so any number of input files
fits a small ``ulimit -n``. The parsed footers of the last few files read are kept (keyed by
path, size and modification time), so reading a file's row groups one at a time parses its
footer once, not once per row group (with thousands of row groups that was quadratic: 96 s for
4,000 row groups).

Example: ``data/env=math/part-0.parquet`` read through the input ``data`` gets a column
``env = "math"`` unless the file already has one.

Inputs may be URIs on any `pyarrow.fs` filesystem (``s3://bucket/rollouts/``, ``gs://...``,
``hdfs://...``; `rolltool.storage.fs`): files, folders (listed recursively, with the same skips and
hive partitions) and globs (``*``, ``?``, ``[...]`` within a name, ``**`` across folders). A
file's URI is its identity (no symlinks there); its footer is cached by size and modification
time like a local file's.
"""

from __future__ import annotations

import fnmatch
import glob
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
from rolltool.format import FORMAT, MANIFEST, is_packed_dir
from rolltool.storage.fs import Location, is_remote, local_path, locate_input, split_query


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


def _skipped(name: str) -> bool:
    return name.startswith((".", "_"))


def _unlistable(e: OSError) -> None:
    """os.walk's onerror: a folder it cannot list would drop its inputs silently; refuse."""
    raise RolltoolError(
        f"{e.filename}: cannot read this folder of the input ({e.strerror})",
        hint="make it readable, or give the input files or folders without it",
    ) from None


def _packed(folder: Path) -> bool:
    try:
        return is_packed_dir(folder)
    except OSError as e:  # a folder that cannot be entered (no x permission)
        _unlistable(e)
        raise  # not reached


def _walk(root: Path) -> list[Path]:
    """The *.parquet files under `root`, sorted; hidden, `_`-prefixed and packed folders skipped."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unlistable):
        folder = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not _skipped(d) and not _packed(folder / d)]
        files.extend(
            folder / f
            for f in filenames
            if f.endswith(".parquet") and not _skipped(f) and (folder / f).is_file()
        )
    return sorted(files)


def _expand(text: str) -> list[tuple[Path, dict[str, str]]]:
    """One input (file, directory or glob) -> its Parquet files with their hive partitions."""
    path = Path(text)
    if path.is_dir():
        if is_packed_dir(path):
            raise RolltoolError(
                f"{text}: is a directory written by `rolltool pack`, not rollout Parquet",
                hint="give the rollout files it was packed from; `rolltool stats` reads it",
            )
        files = _walk(path)
        if not files:
            raise RolltoolError(
                f"{text}: directory holds no *.parquet files "
                "(names starting with '.' or '_' and folders written by `rolltool pack` "
                "are skipped)",
                hint=convert_hint(path),
            )
        return [(f, _partitions(path, f)) for f in files]
    if path.is_file():
        return [(path, {})]
    if glob.has_magic(text):
        matches = sorted(m for m in glob.glob(text, recursive=True) if Path(m).is_file())
        if not matches:
            raise RolltoolError(f"{text}: no file matches this pattern")
        return [(Path(m), {}) for m in matches]
    raise RolltoolError(f"{text}: no such file or directory")


def _packed_remote(loc: Location, manifest: str) -> bool:
    """`is_packed_dir` on a filesystem: `manifest` (a path under `loc`) is rolltool's."""
    try:
        return b'"format":"' + FORMAT.encode() + b'"' in loc.read_bytes(manifest)[:4096]
    except RolltoolError:
        return False


def _remote_partitions(rel: str) -> dict[str, str]:
    parts: dict[str, str] = {}
    for piece in rel.split("/")[:-1]:
        key, sep, value = piece.partition("=")
        if sep and key:
            parts[key] = value
    return parts


def _expand_folder(text: str, loc: Location) -> list[tuple[str, dict[str, str]]]:
    """`_walk` on a filesystem: the folder's *.parquet files by URI with their partitions."""
    names = loc.files()
    if MANIFEST in names and _packed_remote(loc, MANIFEST):
        raise RolltoolError(
            f"{text}: is a directory written by `rolltool pack`, not rollout Parquet",
            hint="give the rollout files it was packed from; `rolltool stats` reads it",
        )
    packed = [
        n[: -len(MANIFEST)] for n in names if n.endswith(f"/{MANIFEST}") and _packed_remote(loc, n)
    ]
    files = [
        n
        for n in names
        if n.endswith(".parquet")
        and not any(_skipped(piece) for piece in n.split("/"))
        and not any(n.startswith(folder) for folder in packed)
    ]
    if not files:
        raise RolltoolError(
            f"{text}: directory holds no *.parquet files "
            "(names starting with '.' or '_' and folders written by `rolltool pack` are skipped)"
        )
    return [(loc.show(n), _remote_partitions(n)) for n in files]


def _glob_match(pattern: Sequence[str], name: Sequence[str]) -> bool:
    """`name`'s folders and file match `pattern`'s (``**``: any number of folders; a name
    starting with ``.`` only where the pattern's does, as `glob.glob` does)."""
    if not pattern:
        return not name
    if pattern[0] == "**":
        hidden = next((i for i, n in enumerate(name) if n.startswith(".")), len(name))
        return any(_glob_match(pattern[1:], name[i:]) for i in range(hidden + 1))
    return bool(
        name
        and (not name[0].startswith(".") or pattern[0].startswith("."))
        and fnmatch.fnmatchcase(name[0], pattern[0])
        and _glob_match(pattern[1:], name[1:])
    )


def _expand_remote(text: str) -> list[tuple[str, dict[str, str]]]:
    """`_expand` for a URI: a file, a folder or a glob on its filesystem."""
    loc = locate_input(text)
    kind = loc.info().type
    if kind == pafs.FileType.File:
        return [(text, {})]
    if kind == pafs.FileType.Directory:
        return _expand_folder(text, loc)
    base, query = split_query(text)
    if glob.has_magic(base):
        magic = min(base.index(c) for c in "*?[" if c in base)
        root = base[: base.rindex("/", 0, magic)]
        pattern = base[len(root) + 1 :].split("/")
        where = locate_input(root + query)
        matches = [n for n in where.files() if _glob_match(pattern, n.split("/"))]
        if not matches:
            raise RolltoolError(f"{text}: no file matches this pattern")
        return [(where.show(n), {}) for n in matches]
    raise RolltoolError(f"{text}: no such file or directory")


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


def _unreadable(path: str, e: Exception) -> RolltoolError:
    hint = convert_hint(path)
    if hint is not None:
        return RolltoolError(f"{path}: not a Parquet file (rolltool reads Parquet)", hint=hint)
    return RolltoolError(f"{path}: not a readable Parquet file ({e})")


def _rows(path: str) -> int:
    """Rows of a Parquet file from its footer (the file is closed again at once)."""
    try:
        return footer(path).num_rows
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[InputFile]:
    """Expand files, directories and globs into a sorted list of Parquet files, each once.

    A file reached twice (``a.parquet`` and its absolute path, a glob and a directory, a
    symlink) keeps its first spelling and partitions; the list is sorted by that spelling.
    """
    if not inputs:
        raise RolltoolError(
            "no input given", hint="pass one or more Parquet files, directories or globs"
        )
    found: dict[str, tuple[str, dict[str, str]]] = {}  # resolved -> (first spelling, partitions)
    for raw in inputs:
        if is_remote(raw):
            for uri, partitions in _expand_remote(os.fspath(raw)):
                found.setdefault(uri, (uri, partitions))
            continue
        for path, partitions in _expand(local_path(raw)):
            found.setdefault(str(path.resolve()), (str(path), partitions))
    return [
        InputFile(path=path, rows=_rows(path), partitions=partitions, resolved=resolved)
        for resolved, (path, partitions) in sorted(found.items(), key=lambda kv: kv[1][0])
    ]


def _read_schema(file: InputFile) -> pa.Schema:
    try:
        with _open(file.path) as pf:
            return pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(file.path, e) from None


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
        raise _unreadable(file.path, e) from None
    return [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]


def row_group_bytes(
    file: InputFile, rename: Mapping[str, str], columns: Sequence[str]
) -> list[int]:
    """Compressed bytes of `columns` (schema names) in each row group of a file, from its
    footer: what reading those columns of a row group costs."""
    try:
        meta = footer(file.path)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(file.path, e) from None
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
