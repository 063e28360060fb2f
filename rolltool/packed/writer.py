"""`PackedWriter`: the one way a packed directory is written (the format is in rolltool.format).

>>> with PackedWriter("packed", force=False) as w:             # doctest: +SKIP
...     rank = w.write_rank(step=0, rank=3, rows=rows)          # RankRecord; shards queued
...     w.write_samples(table)                                  # samples.parquet
...     manifest = w.finish(manifest)                           # waits, adds files, writes it last

Everything goes into a hidden temporary sibling that is renamed into place when the block ends
without an exception (`rolltool.storage.outputs.atomic_path`); on an exception, or without `finish`,
nothing that looks complete is left. ``manifest.json`` is written last, once every shard is
written and hashed, and lists every file with its size and sha256.

An output URI on object storage (``s3://...``, `rolltool.storage.fs`) has no rename: files are staged
in a local temporary folder, uploaded under their final names by the same worker threads
(and deleted locally), and ``manifest.json`` is uploaded last as the commit
(`rolltool.storage.remote`). The bytes are those of a local output.

Shards are written and hashed on worker threads while the caller lays out the next rows. Memory
bound: rows handed to `write_rank` stay alive until written, and `write_rank` blocks while more
than ``max_pending_bytes`` of shard data are queued, so at most that much plus one rank's rows
are in flight. A shard's name and row range are fixed when it is queued, so `write_rank` returns
the rank's record at once; the files' sizes and hashes join the manifest in `finish`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType

import pyarrow as pa
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.format import (
    MANIFEST,
    SAMPLES,
    FileRecord,
    Manifest,
    RankRecord,
    ShardRef,
    shard_name,
)
from rolltool.format.layout import PackedRows
from rolltool.format.shards import file_record, row_bytes, split_rows, write_shard
from rolltool.storage.fs import Location, is_remote, local_path, locate
from rolltool.storage.outputs import atomic_path
from rolltool.storage.remote import RemoteRun, staged

DEFAULT_PENDING_BYTES = 256_000_000


def rank_record(
    rows: PackedRows, step: int, rank: int, shard_bytes: int
) -> tuple[RankRecord, list[tuple[int, int]]]:
    """A (step, rank)'s record and its shards' row ranges (part k holds rows [a, b))."""
    parts = split_rows(rows, shard_bytes)
    refs = [
        ShardRef(path=shard_name(step, rank, part), first_row=a, rows=b - a)
        for part, (a, b) in enumerate(parts)
    ]
    real = rows.sample_index >= 0
    record = RankRecord(
        micro_batches=len(rows.row_offsets) - 1,
        samples=int(real.sum()),
        tokens=int(rows.row_offsets[-1]),
        real_tokens=int(rows.seq_lens[real].sum()),
        files=tuple(refs),
    )
    return record, parts


class DirectWriter:
    """Writes a (step, rank)'s shards at once into an existing directory and keeps their
    records: how a worker process (`rolltool.engine.local`, a Ray task) writes into its driver's
    `PackedWriter` directory, which then `adopt`s the records.

    With `upload` (a remote output's location, `PackedWriter.remote`) each shard is written
    to a temporary folder of this machine, uploaded under its final name and deleted here: a
    worker on another node needs no filesystem shared with the driver."""

    def __init__(self, root: Path, shard_bytes: int, upload: Location | None = None) -> None:
        self.root, self.shard_bytes, self.upload = root, shard_bytes, upload
        self.files: dict[str, FileRecord] = {}

    def write_rank(self, step: int, rank: int, rows: PackedRows) -> RankRecord:
        record, parts = rank_record(rows, step, rank, self.shard_bytes)
        if self.upload is None:
            for part, (a, b) in enumerate(parts):
                name, file = write_shard(self.root, step, rank, part, rows, a, b)
                self.files[name] = file
            return record
        with tempfile.TemporaryDirectory(prefix="rolltool-part-") as tmp:
            for part, (a, b) in enumerate(parts):
                name, file = write_shard(Path(tmp), step, rank, part, rows, a, b)
                self.upload.upload(Path(tmp) / name, name)
                (Path(tmp) / name).unlink()
                self.files[name] = file
        return record


class PackedWriter:
    """Writes one packed directory (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        force: bool = False,
        shard_bytes: int = 256_000_000,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        threads: int = 2,
    ) -> None:
        self.shown = os.fspath(root)
        self.target = Path(local_path(self.shown))
        self.force = force
        self.shard_bytes = shard_bytes
        self.max_pending_bytes = max_pending_bytes
        self.threads = threads
        self._files: dict[str, FileRecord] = {}
        self._pending: deque[tuple[int, Future[tuple[str, FileRecord]]]] = deque()
        self._pending_bytes = 0
        self._finished = False
        self._stack = ExitStack()
        self.root: Path | None = None
        self._remote: RemoteRun | None = None

    def __enter__(self) -> PackedWriter:
        loc = locate(self.shown) if is_remote(self.shown) else None
        if loc is not None and not loc.local:
            self._remote = RemoteRun(loc, self.force)
            root = self._stack.enter_context(staged(self._remote))
        else:
            root = self._stack.enter_context(
                atomic_path(self.target, force=self.force, directory=True)
            )
        root.mkdir(parents=True, exist_ok=True)
        self._pool = self._stack.enter_context(ThreadPoolExecutor(max_workers=self.threads))
        self.root = root
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        unfinished = None
        if kind is None and not self._finished:
            unfinished = RuntimeError("PackedWriter: the block ended without finish(manifest)")
            kind, exc = RuntimeError, unfinished
        if kind is not None:
            for _, fut in self._pending:
                fut.cancel()
        self.root = None
        # The pool waits for running writes, then atomic_path renames the directory into place
        # or, on an exception, removes it.
        self._stack.__exit__(kind, exc, tb)
        if unfinished is not None:
            raise unfinished

    def write_rank(self, step: int, rank: int, rows: PackedRows) -> RankRecord:
        """Queue rank `rank`'s rows of step `step` (one row per micro-batch) for writing."""
        root = self._root()
        sizes = row_bytes(rows)
        record, parts = rank_record(rows, step, rank, self.shard_bytes)
        for part, (a, b) in enumerate(parts):
            nbytes = int(sizes[a:b].sum())
            self._wait_for_room(nbytes)
            fut = self._pool.submit(self._write_shard, root, step, rank, part, rows, a, b)
            self._pending.append((nbytes, fut))
            self._pending_bytes += nbytes
        return record

    def _write_shard(
        self, root: Path, step: int, rank: int, part: int, rows: PackedRows, a: int, b: int
    ) -> tuple[str, FileRecord]:
        name, record = write_shard(root, step, rank, part, rows, a, b)
        return self._put(root, name, record)

    def _put(self, root: Path, name: str, record: FileRecord) -> tuple[str, FileRecord]:
        """A remote output's file uploaded under its final name, then deleted here."""
        if self._remote is not None:
            self._remote.upload(root / name, name)
            (root / name).unlink()
        return name, record

    @property
    def remote(self) -> Location | None:
        """The output's location when it is remote (object storage), else None."""
        return None if self._remote is None else self._remote.loc

    def adopt(self, files: dict[str, FileRecord], *, uploaded: bool = False) -> None:
        """Shards another process wrote into `root` (`DirectWriter`), or uploaded itself to
        the remote output (`uploaded`): listed like this writer's own, and checked the same way
        in `finish` (a remote output's local ones are uploaded on the worker threads first)."""
        root = self._root()
        if self._remote is None or uploaded:
            if self._remote is not None:
                self._remote.adopt(files)
            self._files.update(files)
            return
        for name, record in files.items():
            self._wait_for_room(record.bytes)
            self._pending.append((record.bytes, self._pool.submit(self._put, root, name, record)))
            self._pending_bytes += record.bytes

    def write_samples(self, table: pa.Table) -> None:
        """``samples.parquet``: one row per input sample."""
        root = self._root()
        pq.write_table(table, root / SAMPLES, compression="zstd")
        (root / SAMPLES).chmod(0o644)
        self._files[SAMPLES] = self._put(root, SAMPLES, file_record(root / SAMPLES))[1]

    def finish(self, manifest: Manifest) -> Manifest:
        """Wait for every shard, check the manifest names exactly the files written, add their
        records and write ``manifest.json`` (last). Returns the manifest as written."""
        root = self._root()
        self._wait_for_room(None)
        named = {f.path for st in manifest.steps for r in st.ranks for f in r.files}
        written = set(self._files) - {SAMPLES}
        if named != written or SAMPLES not in self._files:
            raise RuntimeError(  # a bug in the caller: never commit such a directory
                f"manifest and files disagree: {sorted(named ^ written)[:3]} "
                f"(samples.parquet written: {SAMPLES in self._files})"
            )
        self._check_on_disk(root)
        final = dataclasses.replace(manifest, files=dict(sorted(self._files.items())))
        (root / MANIFEST).write_text(final.dumps())
        (root / MANIFEST).chmod(0o644)
        self._finished = True
        return final

    @staticmethod
    def _missing(root: Path, files: dict[str, FileRecord]) -> list[str]:
        out = []
        for name, record in files.items():
            try:
                if (root / name).stat().st_size != record.bytes:
                    out.append(name)
            except FileNotFoundError:
                out.append(name)
        return out

    def _check_on_disk(self, root: Path) -> None:
        """Every file written is still there with its size (nobody deleted or cut it)."""
        if self._remote is not None:
            sizes = self._remote.loc.sizes()
            missing = [n for n, r in self._files.items() if sizes.get(n) != r.bytes]
            where = self._remote.loc.shown
        else:
            missing, where = self._missing(root, self._files), str(root)
        if missing:
            shown = self.shown if self._remote is not None else self.target
            raise RolltoolError(
                f"{where}: {len(missing)} written file(s) vanished or changed before the commit "
                f"(first: {missing[0]}); nothing was written to {shown}",
                hint="another process removed this run's temporary files; run again",
            )

    def _root(self) -> Path:
        if self.root is None:
            raise RuntimeError("PackedWriter used outside its with-block")
        return self.root

    def _wait_for_room(self, nbytes: int | None) -> None:
        """Collect finished writes (oldest first) until `nbytes` more fit (None: all of them)."""
        while self._pending and (
            nbytes is None or self._pending_bytes + nbytes > self.max_pending_bytes
        ):
            size, fut = self._pending.popleft()
            name, record = fut.result()
            self._files[name] = record
            self._pending_bytes -= size
