"""Input resolution: files, folders, globs and URIs -> a sorted, deduplicated list of `InputFile`s.

Inputs are files, directories (searched recursively for ``*.parquet``; ``key=value`` directory
names become string columns, as in hive partitioning) or glob patterns. The file order is the
sorted path order, so the row order ("sample_index") is deterministic.

A file named twice (``a.parquet`` and its absolute path, or through a glob and a directory, or
a symlink) is read once: inputs are deduplicated by resolved path, keeping the first spelling.

A directory walk skips names starting with ``.`` or ``_`` (Spark/Hive bookkeeping such as
``_SUCCESS``, ``_temporary/``, ``.tmp`` files) and any folder written by ``rolltool pack`` (it
holds rolltool's ``manifest.json``), so packing into a folder inside the input directory does not
read its own ``samples.parquet`` back next time.

Example: ``data/env=math/part-0.parquet`` read through the input ``data`` gets a column
``env = "math"`` unless the file already has one.

Inputs may be URIs on any `pyarrow.fs` filesystem (``s3://bucket/rollouts/``, ``gs://...``,
``hdfs://...``; `rolltool.storage.fs`): files, folders (listed recursively, with the same skips and
hive partitions) and globs (``*``, ``?``, ``[...]`` within a name, ``**`` across folders). A
file's URI is its identity (no symlinks there). Each file's row count comes from its footer
(`rolltool.input.parquet`, cached), so a bad file is refused here, with a conversion hint where
one applies (`rolltool.input.hints`).

Import order inside input/: hints < parquet < resolve (this module imports both).
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from rolltool.errors import RolltoolError
from rolltool.format import FORMAT, MANIFEST, is_packed_dir
from rolltool.input.hints import convert_hint, unreadable
from rolltool.input.parquet import InputFile, footer
from rolltool.storage.fs import Location, is_remote, local_path, locate_input, split_query


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


def _rows(path: str) -> int:
    """Rows of a Parquet file from its footer (the file is closed again at once)."""
    try:
        return footer(path).num_rows
    except (pa.ArrowException, OSError) as e:
        raise unreadable(path, e) from None


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
