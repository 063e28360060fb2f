"""Where files live: a path or URI -> a `Location` (a pyarrow filesystem and a path in it).

>>> locate("packed").local, locate("file:///tmp/packed").path
(True, '/tmp/packed')

Plain paths and ``file://`` URIs are local (`pyarrow.fs.LocalFileSystem`): outputs are renamed
into place (`rolltool.storage.outputs`) and shards memory-mapped, as always. Any other URI (``s3://``,
``gs://``, ``hdfs://``, ...) goes to `pyarrow.fs.FileSystem.from_uri`: S3, GCS and HDFS
support, and their credentials (the usual environment variables and config files), come from
pyarrow itself; rolltool imports no cloud SDK. `SCHEMES` adds schemes (tests register
filesystems without network there). A failure to reach a location is one line naming the URI,
with a hint for the usual causes (network, credentials, bucket, Java for HDFS).

S3 timeouts: ``?connect_timeout=SECONDS`` and ``?request_timeout=SECONDS`` in an ``s3://`` URI
(pyarrow's `S3FileSystem` takes them, its URI parser does not: `locate` takes them out and gives
them to the filesystem), by default `S3_TIMEOUTS`, so that an endpoint that accepts connections
and never answers fails in about half a minute instead of ~100 s (pyarrow's own defaults).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rolltool.errors import RolltoolError

T = TypeVar("T")

SCHEMES: dict[str, Callable[[str], tuple[pafs.FileSystem, str]]] = {}
"""Extra URI schemes: name -> function from the URI to (filesystem, path in it). Consulted
before pyarrow's own; for tests (a filesystem without rename, in memory or over a folder)."""

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")

_HINTS = (
    ("NETWORK_CONNECTION", "check the network and the endpoint (AWS_ENDPOINT_URL for S3)"),
    ("ACCESS_DENIED", "check the credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID, "
     "GOOGLE_APPLICATION_CREDENTIALS) and that they may read and write there"),
    ("credentials", "set credentials (AWS_PROFILE or AWS_ACCESS_KEY_ID, "
     "GOOGLE_APPLICATION_CREDENTIALS)"),
    ("NO_SUCH_BUCKET", "check the bucket name (it must exist; rolltool does not create buckets)"),
    ("libjvm", "HDFS needs Java and libhdfs (JAVA_HOME, HADOOP_HOME, CLASSPATH)"),
    ("Unrecognized filesystem", "use a local path or an s3://, gs://, hdfs:// or file:// URI"),
)  # fmt: skip


S3_TIMEOUTS = {"connect_timeout": 5.0, "request_timeout": 10.0}
"""Seconds an S3 request may take to connect, and may go without receiving a byte (each of
pyarrow's 3 attempts), unless the URI says otherwise (docs/storage.md)."""

_QUERY = re.compile(r"\?[\w.-]+=[^/?]*(?:&[\w.-]+=[^/?]*)*$")


def split_query(uri: str) -> tuple[str, str]:
    """A URI without and with its query string (``?region=us-east-1``; a ``?`` that starts
    none, as in a glob, stays in the path).

    >>> split_query("s3://b/x?region=eu-west-1"), split_query("s3://b/r?n/*")
    (('s3://b/x', '?region=eu-west-1'), ('s3://b/r?n/*', ''))
    """
    m = _QUERY.search(uri)
    return (uri[: m.start()], m.group()) if m else (uri, "")


def scheme(text: str) -> str | None:
    """The URI scheme of `text` (``"s3"``), or None for a plain path."""
    m = _SCHEME.match(text)
    return m.group(1).lower() if m else None


def location_error(
    shown: str, e: Exception, doing: str = "cannot reach this location"
) -> RolltoolError:
    """A filesystem failure as one line naming `shown`, with a hint for the usual causes."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = next((h for key, h in _HINTS if key.lower() in str(e).lower()), None)
    return RolltoolError(f"{shown}: {doing} ({text})", hint=hint)


@dataclass(frozen=True)
class Location:
    """A directory or file on a pyarrow filesystem."""

    fs: pafs.FileSystem
    """The filesystem (`pyarrow.fs.LocalFileSystem` for plain paths)."""
    path: str
    """The path in `fs`, without a trailing slash (absolute for local paths)."""
    shown: str
    """The path or URI as given: what messages name."""

    @property
    def local(self) -> bool:
        """On this machine's filesystem: rename and memory maps work."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def join(self, rel: str) -> str:
        """The path in `fs` of `rel` (``a/b``) under this location."""
        return f"{self.path}/{rel}" if rel else self.path

    def show(self, rel: str = "") -> str:
        """How messages name `rel` under this location (a URI's query string stays last)."""
        if not rel:
            return self.shown
        base, query = split_query(self.shown)
        return f"{base.rstrip('/')}/{rel}{query}"

    def info(self, rel: str = "") -> pafs.FileInfo:
        return self._do(rel, "cannot read", lambda p: self.fs.get_file_info(p))

    def is_file(self, rel: str = "") -> bool:
        return bool(self.info(rel).type == pafs.FileType.File)

    def is_dir(self, rel: str = "") -> bool:
        return bool(self.info(rel).type == pafs.FileType.Directory)

    def files(self, rel: str = "") -> list[str]:
        """Every file under `rel` (recursively), as sorted paths relative to this location."""
        return sorted(self.sizes(rel))

    def sizes(self, rel: str = "") -> dict[str, int]:
        """Bytes of every file under `rel` (recursively; one listing), by path relative to
        this location."""
        selector = pafs.FileSelector(self.join(rel), recursive=True, allow_not_found=True)
        found = self._do(rel, "cannot list", lambda _: self.fs.get_file_info(selector))
        base = len(self.path) + 1
        return {f.path[base:]: f.size for f in found if f.type == pafs.FileType.File}

    @contextlib.contextmanager
    def parquet(self, rel: str, **options: Any) -> Iterator[Any]:
        """`rel` as a ``pyarrow.parquet.ParquetFile(source, **options)`` for the ``with`` block,
        which reads only the column chunks asked for: a local file by its path as given, a remote
        one through the filesystem, that file closed on leaving (ParquetFile leaves a file it is
        handed open). Not ``read_table``: that imports pyarrow.dataset (~0.5 s). Raises what pyarrow
        raises (OSError, ValueError) for the caller to name."""
        import pyarrow.parquet as pq

        with contextlib.ExitStack() as stack:
            source: Any = (
                self.show(rel)
                if self.local
                else stack.enter_context(self.fs.open_input_file(self.join(rel)))
            )
            yield stack.enter_context(pq.ParquetFile(source, **options))

    def read_bytes(self, rel: str) -> bytes:
        def read(p: str) -> bytes:
            with self.fs.open_input_stream(p) as f:
                return bytes(f.read())

        return self._do(rel, "cannot read", read)

    def write_bytes(self, rel: str, data: bytes) -> None:
        def write(p: str) -> None:
            with self.fs.open_output_stream(p) as f:
                f.write(data)

        self._do(rel, "cannot write", write)

    def upload(self, local: Path, rel: str) -> None:
        """Copy the local file `local` to `rel` (streamed, never whole in memory)."""

        def copy(p: str) -> None:
            with open(local, "rb") as src, self.fs.open_output_stream(p) as dst:
                for chunk in iter(lambda: src.read(1 << 24), b""):
                    dst.write(chunk)

        self._do(rel, "cannot write", copy)

    def download(self, dest: Path) -> list[str]:
        """Copy every file under this location into the local folder `dest` (created), keeping
        relative paths; returns them."""
        names = self.files()

        def copy(rel: str, path: str) -> None:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_input_stream(path) as src, open(dest / rel, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 24), b""):
                    out.write(chunk)

        for rel in names:
            self._do(rel, "cannot read", functools.partial(copy, rel))
        return names

    def delete_all(self, names: Iterable[str], threads: int = 16) -> None:
        """Delete the files `names`, several at a time (an object store takes one request per
        file); the first failure is raised once the others are done."""
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for _ in pool.map(self.delete, list(names)):
                pass

    def delete(self, rel: str) -> None:
        """Delete the file `rel`; one already gone is fine."""

        def delete(p: str) -> None:
            if self.fs.get_file_info(p).type != pafs.FileType.NotFound:
                self.fs.delete_file(p)

        self._do(rel, "cannot delete", delete)

    def _do(self, rel: str, doing: str, op: Callable[[str], T]) -> T:
        try:
            return op(self.join(rel))
        except (pa.ArrowException, OSError) as e:
            raise location_error(self.show(rel), e, doing) from None


def locate(given: str | os.PathLike[str]) -> Location:
    """The `Location` of a path or URI (module docstring); an unknown scheme or an unreachable
    filesystem is a `RolltoolError` naming it."""
    text = os.fspath(given)
    name = scheme(text)
    if name is None:
        return Location(pafs.LocalFileSystem(), os.path.abspath(text), text)
    try:
        if name in SCHEMES:
            fs, path = SCHEMES[name](text)
        elif name == "s3":
            fs, path = _s3_from_uri(text)
        else:
            fs, path = pafs.FileSystem.from_uri(text)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise location_error(text, e) from None
    return Location(fs, path.rstrip("/") or path, text)


def _s3_from_uri(text: str) -> tuple[pafs.FileSystem, str]:
    """`FileSystem.from_uri` for an ``s3://`` URI, with its timeouts (`S3_TIMEOUTS`, or the
    URI's ``connect_timeout=`` and ``request_timeout=``, which pyarrow's parser refuses)."""
    base, query = split_query(text)
    kept, timeouts = [], dict(S3_TIMEOUTS)
    for piece in query[1:].split("&") if query else []:
        key, _, value = piece.partition("=")
        if key not in S3_TIMEOUTS:
            kept.append(piece)
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise RolltoolError(
                f"{text}: {key}={value!r} is not a number of seconds",
                hint=f"give {key}= a positive number of seconds (5, 0.5)",
            )
        timeouts[key] = seconds
    fs, path = pafs.FileSystem.from_uri(base + ("?" + "&".join(kept) if kept else ""))
    if isinstance(fs, pafs.S3FileSystem):
        rebuild, (options,) = fs.__reduce__()
        fs = rebuild({**options, **timeouts})
    return fs, path


_ROOTS: dict[str, tuple[pafs.FileSystem, str]] = {}
"""Filesystems of input URIs by ``scheme://authority?query``: one `FileSystem.from_uri` (for S3
a network round trip to find the bucket's region) per bucket, not per file. Emptied in every
forked child (`_forget_after_fork`): pyarrow's S3 client is not fork-safe (a forked scan worker
reading through its parent's read corrupted pages), so no process uses a filesystem made before
it was forked; the child makes its own on first use."""


def _forget_after_fork() -> None:
    _ROOTS.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def locate_input(uri: str) -> Location:
    """`locate` for URIs of input files: the filesystem made once per bucket (`_ROOTS`)."""
    parts = urlsplit(uri)
    if scheme(uri) is None or scheme(uri) in SCHEMES:
        return locate(uri)
    key = f"{parts.scheme}://{parts.netloc}?{parts.query}"
    if key not in _ROOTS:
        loc = locate(uri)
        if not loc.path.endswith(parts.path.rstrip("/")):
            return loc  # a filesystem that maps paths its own way: no sharing
        _ROOTS[key] = (loc.fs, loc.path[: len(loc.path) - len(parts.path.rstrip("/"))])
    fs, prefix = _ROOTS[key]
    return Location(fs, (prefix + parts.path).rstrip("/"), uri)


def local_path(given: str | os.PathLike[str]) -> str:
    """A plain path as given; a ``file://`` URI's path (``file:///tmp/x`` -> ``/tmp/x``)."""
    text = os.fspath(given)
    return locate(text).path if scheme(text) == "file" else text


def is_remote(given: str | os.PathLike[str]) -> bool:
    """A URI whose filesystem is not this machine's (``file://`` is local)."""
    text = os.fspath(given)
    return scheme(text) not in (None, "file")
