"""Outputs on object storage (any non-local `rolltool.storage.fs.Location`): the manifest is the commit.

Object stores have no directory rename, so a packed directory cannot be written aside and
renamed into place (`rolltool.storage.outputs` does that for local paths). Instead the files are written
under their final names, which (step, rank, part) fix, and ``manifest.json`` is written last:
**a prefix with a manifest is a finished output; one without is not** (`rolltool verify` and
`rolltool.open_packed` refuse it). Layout while a run writes ``s3://b/packed``::

    s3://b/packed/.rolltool-tmp-<run id>.json   the run's claim: id, host, pid, start, heartbeat
    s3://b/packed/rank-0003/step-000012-00.safetensors, samples.parquet   (final names)
    s3://b/packed/manifest.json                 last: the commit; then the claim is deleted

A run is identified by its random run id, never by a pid (pids mean nothing across machines).
It rewrites its claim every `HEARTBEAT_S`; a claim not rewritten for `STALE_S` belongs to a dead
run. Before anything else a run cleans what dead runs left (`repair`): without a manifest every
file rolltool names (shards, samples.parquet) is a dead run's and is deleted; with one, only
the rolltool-named files the manifest does not list. The dead runs' claims go last, so a repair
cut short is done again by the next run. While another run's claim is live, a run refuses to
start (two runs would write the same names); two starting at once may both refuse.

``--force`` replaces only a finished rolltool output whose every file the manifest lists (or,
without a manifest, files rolltool names whose run's claim is gone): the previous manifest is
deleted first (from then on the prefix is not a finished output), then its files, then the new
run writes. So, unlike a local output, the previous output is gone from the
start of a --force run, not from its end (no rename swaps it in one step). Without --force any
file under the prefix refuses the run. A run that fails with an exception deletes what it wrote
and its claim; one that is killed leaves them to the next run's repair.

One file (``advantages``/``synth -o s3://b/out.parquet``, `rolltool.storage.outputs.atomic_file`)
follows the same rules in a stage of its own next to it, ``s3://b/.out.parquet.rolltool-tmp/``
(`file_stage`): the run's claim and its temporary object ``.rolltool-tmp-<run id>.part``,
streamed there and then copied to ``s3://b/out.parquet`` in one server-side copy, then deleted.
A run killed before the copy leaves no object under the output's name, and its claim and
temporary object are the next run's to delete (`repair`). A prefix without a manifest that
holds a claim or shards is an unfinished or killed run's (`unfinished` says so, and when the
next run may clean it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rolltool.errors import RolltoolError
from rolltool.format import MANIFEST, SAMPLES, SHARD_PATTERN, listed_files
from rolltool.storage.fs import Location, split_query

try:
    import fcntl
except ImportError:  # not POSIX: staging folders of killed runs are not swept
    fcntl = None  # type: ignore[assignment]

CLAIM_PREFIX = ".rolltool-tmp-"
"""A run's claim is ``<prefix>/.rolltool-tmp-<run id>.json``."""
HEARTBEAT_S = 30.0
"""A running run rewrites its claim this often."""
STALE_S = 600.0
"""A claim not rewritten for this long belongs to a dead run (clocks may differ a little)."""

STAGE_SUFFIX = ".rolltool-tmp"
"""A file output ``name``'s runs work under the prefix ``.<name>.rolltool-tmp/`` next to it
(`file_stage`)."""

_CLAIM = re.compile(re.escape(CLAIM_PREFIX) + r"([0-9a-f]+)\.json")
_PART = re.compile(re.escape(CLAIM_PREFIX) + r"([0-9a-f]+)\.part")
"""A file output's temporary object, ``.rolltool-tmp-<run id>.part`` in its stage."""


def rolltool_named(name: str) -> bool:
    """A file name a packed directory holds (manifest, samples, shard, a run's claim), or a
    file output's temporary object."""
    return name in (MANIFEST, SAMPLES) or bool(
        SHARD_PATTERN.fullmatch(name) or _CLAIM.fullmatch(name) or _PART.fullmatch(name)
    )


@dataclass(frozen=True)
class Claim:
    run_id: str
    host: str
    pid: int
    started: float
    beat: float
    """When the run last rewrote its claim (its clock, seconds since the epoch)."""

    @property
    def name(self) -> str:
        return f"{CLAIM_PREFIX}{self.run_id}.json"

    def alive(self, now: float) -> bool:
        return now - self.beat < STALE_S

    def dumps(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()


def _claims(loc: Location, names: Iterable[str]) -> list[Claim]:
    """The claims among `names`; one that cannot be parsed (being rewritten where writes are
    not atomic, or cut short) beats when it was last modified."""
    out = []
    for name in names:
        m = _CLAIM.fullmatch(name)
        if m is None:
            continue
        try:
            doc = json.loads(loc.read_bytes(name))
            out.append(Claim(**{k: doc[k] for k in ("run_id", "host", "pid", "started", "beat")}))
        except (RolltoolError, ValueError, KeyError, TypeError):
            with contextlib.suppress(RolltoolError):
                when = loc.info(name).mtime
                beat = when.timestamp() if when is not None else 0.0
                out.append(Claim(m.group(1), "?", -1, beat, beat))
    return out


def _listed(loc: Location, names: Sequence[str]) -> set[str] | None:
    """The files the prefix's manifest lists (with the manifest itself), or None when there is
    no manifest of rolltool's format."""
    return listed_files(loc.read_bytes(MANIFEST)) if MANIFEST in names else None


def repair(loc: Location) -> list[str]:
    """Delete what dead runs left under `loc` (module docstring) when no run is alive there;
    returns the files deleted, claims last."""
    names = loc.files()
    claims = _claims(loc, names)
    now = time.time()
    if not claims or any(c.alive(now) for c in claims):
        return []
    listed = _listed(loc, names)
    garbage = [
        n
        for n in names
        if rolltool_named(n) and not _CLAIM.fullmatch(n) and (listed is None or n not in listed)
    ]
    loc.delete_all(garbage)
    loc.delete_all(c.name for c in claims)  # last: a repair cut short is done again
    return [*garbage, *(c.name for c in claims)]


def _other_run(loc: Location, mine: str | None = None) -> Claim | None:
    now = time.time()
    return next((c for c in _claims(loc, loc.files()) if c.alive(now) and c.name != mine), None)


def _refuse_busy(loc: Location, other: Claim, shown: str | None = None) -> RolltoolError:
    return RolltoolError(
        f"{shown or loc.shown}: another rolltool run ({other.run_id} on {other.host}, pid {other.pid}) "
        "is writing here",
        hint=f"wait for it; a run that died is cleaned up {STALE_S:.0f} s after its last "
        f"heartbeat (or delete {loc.show(other.name)})",
    )


def check_target(loc: Location, force: bool) -> set[str]:
    """Everything about the output prefix that can fail, checked before any work: repair dead
    runs' leftovers, refuse a busy prefix, an existing output without `force`, and with it
    anything but a finished rolltool output. Returns the files a --force run deletes."""
    if loc.is_file():
        raise RolltoolError(f"{loc.shown}: is a file, not a folder", hint="choose another -o")
    repair(loc)
    other = _other_run(loc)
    if other is not None:
        raise _refuse_busy(loc, other)
    names = loc.files()
    if not names:
        return set()
    if not force:
        raise RolltoolError(f"{loc.shown} already exists", hint="pass --force to replace it")
    listed = _listed(loc, names)  # None: files of a run whose claim is gone
    foreign = [n for n in names if not (rolltool_named(n) if listed is None else n in listed)]
    if foreign:
        raise RolltoolError(
            f"{loc.shown} exists and is not an output rolltool wrote (it holds {foreign[0]}): "
            "--force replaces only finished packed directories",
            hint="choose another -o, or delete it yourself if you mean to replace it",
        )
    return set(names)


@dataclass
class RemoteRun:
    """One run writing a packed directory at `loc` (module docstring): `start` claims the
    prefix, `upload` puts files in place, `commit` writes the manifest, `abort` undoes."""

    loc: Location
    force: bool
    claim: Claim = field(init=False)
    written: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _beating: threading.Thread | None = None

    def start(self) -> None:
        previous = check_target(self.loc, self.force)
        now = time.time()
        self.claim = Claim(uuid.uuid4().hex[:16], socket.gethostname(), os.getpid(), now, now)
        self.loc.write_bytes(self.claim.name, self.claim.dumps())
        other = _other_run(self.loc, self.claim.name)
        if other is not None:  # started at the same time: both may refuse, never both write
            self.loc.delete(self.claim.name)
            raise _refuse_busy(self.loc, other)
        self._beating = threading.Thread(target=self._heartbeat, daemon=True, name="rolltool-claim")
        self._beating.start()
        try:
            if MANIFEST in previous:  # first: from here on the prefix is no finished output
                self.loc.delete(MANIFEST)
            self.loc.delete_all(previous - {MANIFEST})
        except BaseException:
            self.abort()
            raise

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            beat = Claim(**{**self.claim.__dict__, "beat": time.time()})
            with contextlib.suppress(RolltoolError):
                self.loc.write_bytes(beat.name, beat.dumps())

    def upload(self, local: Path, name: str) -> None:
        """Put the local file at `name` (its final name) under the prefix."""
        with self._lock:
            self.written.add(name)
        self.loc.upload(local, name)

    def adopt(self, names: Iterable[str]) -> None:
        """Files another process uploaded for this run (`rolltool.packed.writer.DirectWriter`)."""
        with self._lock:
            self.written.update(names)

    def commit(self, manifest: bytes) -> None:
        """Write ``manifest.json`` (the commit), then drop the claim."""
        self.loc.write_bytes(MANIFEST, manifest)
        self.finish()

    def finish(self) -> None:
        """Drop the claim (the run's output is in place)."""
        self._stop_heartbeat()
        with contextlib.suppress(RolltoolError):
            self.loc.delete(self.claim.name)

    @property
    def part(self) -> str:
        """The name of this run's temporary object (a file output's, `file_stage`)."""
        return f"{CLAIM_PREFIX}{self.claim.run_id}.part"

    def _stop_heartbeat(self) -> None:
        """Stop rewriting the claim (waiting for a rewrite under way, which would otherwise
        put a deleted claim back)."""
        self._stop.set()
        if self._beating is not None:
            self._beating.join()

    def abort(self) -> None:
        """Delete what this run wrote, then its claim (best effort: what is left, the next
        run's `repair` deletes). What this run wrote includes shards that worker processes
        uploaded and never reported (a task failed after its upload): the prefix held no
        rolltool file but the claims when the run started (`start`), so every other
        rolltool-named file in it now is this run's."""
        self._stop_heartbeat()
        with contextlib.suppress(RolltoolError):
            ours = {n for n in self.loc.files() if rolltool_named(n) and not _CLAIM.fullmatch(n)}
            self.loc.delete_all(sorted(self.written | ours))
            self.loc.delete(self.claim.name)


STAGE_PREFIX = "rolltool-stage-"
"""Local staging folders are ``<tmp>/rolltool-stage-<pid>-<random>``, each holding `STAGE_LOCK`
for as long as its run lives, so a later run can delete the folder of a run that was killed
before it could (`sweep_dead_stages`)."""

STAGE_LOCK = ".lock"
"""The file in a staging folder its run holds an exclusive ``flock`` on. A lock, not the pid in
the name: processes in another pid namespace (containers sharing /tmp) or on another host (a
shared TMPDIR) have pids this process cannot see, but their locks it can."""


@contextmanager
def staged(run: RemoteRun) -> Iterator[Path]:
    """Claim the prefix, yield a local folder (to create) where files are staged before
    `RemoteRun.upload`; when the block ends without an exception, commit the manifest the
    folder then holds; on one, abort. Staging folders that killed runs left are deleted first."""
    run.start()
    try:
        sweep_dead_stages(Path(tempfile.gettempdir()))
        with tempfile.TemporaryDirectory(prefix=f"{STAGE_PREFIX}{os.getpid()}-") as stage:
            with _held(Path(stage) / STAGE_LOCK):
                work = Path(stage) / "packed"
                yield work
                run.commit((work / MANIFEST).read_bytes())
    except BaseException:
        run.abort()
        raise


@contextmanager
def _held(lock: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on `lock` for the block: made under another name, locked,
    then renamed, so a sweep never finds it unlocked while its run lives (nothing where the
    system has no ``fcntl``: such folders are never swept)."""
    making = lock.with_name(lock.name + ".new")
    fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(making, lock)
        yield
    finally:
        os.close(fd)


def sweep_dead_stages(tmp: Path) -> list[Path]:
    """Delete this user's staging folders under `tmp` whose run is gone (a SIGKILL or the OOM
    killer leaves its folder, which can hold a pack's shards not yet uploaded); returns them.

    A folder goes only when its `STAGE_LOCK` exists and nobody holds it: a live run holds it
    (in any pid namespace, on any host sharing the folder where ``flock`` works across hosts),
    and a folder without one (being made this instant, or by rolltool before 0.2) stays, as do
    other users' folders and symlinks."""
    if fcntl is None:
        return []
    gone = []
    for path in tmp.glob(f"{STAGE_PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            fd = os.open(path / STAGE_LOCK, os.O_RDWR | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live run's
                shutil.rmtree(path)
                gone.append(path)
            finally:
                os.close(fd)
    return gone


# -- one file on object storage (``advantages``/``synth`` -o s3://.../x.parquet) ---------------


def file_stage(loc: Location) -> Location:
    """Where runs writing the file output `loc` keep their claim and temporary object: the
    prefix ``.<name>.rolltool-tmp/`` next to it, a packed directory's rules applied to it (the
    module docstring): a dead run's claim and ``.rolltool-tmp-<run id>.part`` there are
    deleted by the next run to the same output once the claim is `STALE_S` old."""
    parent, _, name = loc.path.rpartition("/")
    base, query = split_query(loc.shown)
    shown = base.rstrip("/").rpartition("/")[0]
    return Location(
        loc.fs, f"{parent}/.{name}{STAGE_SUFFIX}", f"{shown}/.{name}{STAGE_SUFFIX}{query}"
    )


def check_stage(stage: Location, shown: str) -> None:
    """Repair what dead runs left in a file output's `stage`; refuse while another run writes
    the same output (`shown`)."""
    repair(stage)
    other = _other_run(stage)
    if other is not None:
        raise _refuse_busy(stage, other, shown)


# -- what a prefix without a manifest is ----------------------------------------------------------


def unfinished(loc: Location, names: Sequence[str]) -> RolltoolError | None:
    """The error for a prefix without ``manifest.json`` that holds a run's claim or shards (an
    unfinished or killed `rolltool pack`), saying when its leftovers can be cleaned up; None
    for a prefix that holds neither."""
    if MANIFEST in names or not any(
        _CLAIM.fullmatch(n) or SHARD_PATTERN.fullmatch(n) for n in names
    ):
        return None
    claims = sorted(_claims(loc, names), key=lambda c: -c.beat)
    now = time.time()
    if claims and claims[0].alive(now):
        c = claims[0]
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(c.beat + STALE_S))
        when = (
            f"run {c.run_id} on {c.host} (pid {c.pid}) last wrote its claim "
            f"{max(now - c.beat, 0):.0f} s ago: if it is still running, wait for it; if it "
            f"was killed, the next `rolltool pack` to this prefix deletes its files from {at} "
            f"({STALE_S:.0f} s after its last heartbeat)"
        )
    else:
        when = "its run is dead: the next `rolltool pack` to this prefix deletes its files"
    return RolltoolError(
        f"{loc.shown}: no {MANIFEST}: not a finished rolltool output (files of an unfinished "
        f"or killed run; {when})",
        hint="on object storage the manifest, written last, marks a finished output; an "
        "interrupted `rolltool pack` leaves none: run it again",
    )
