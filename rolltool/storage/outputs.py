"""Atomic outputs: write into a hidden sibling, rename into place when complete.

This is for local paths (and ``file://`` URIs). An output on object storage (``s3://``, ...)
cannot be renamed into place: `rolltool.storage.remote` writes a packed directory under its final
names with ``manifest.json`` last as the commit marker, and `check_target` hands it the checks.
A single file there (`atomic_file`: ``advantages``/``synth -o s3://.../x.parquet``) is written
to a temporary object under the claim rules of `rolltool.storage.remote` (`remote.file_stage`),
then copied to its name (one server-side copy: the object appears complete or not at all) and
the temporary object deleted: never streamed to its final name, as an upload closed after an
error completes, leaving a cut object that looks whole.

What may be replaced. An existing output is refused unless ``force``, and ``force`` replaces
only what rolltool wrote (`rolltool_output`): a packed directory, a Parquet file whose footer
carries rolltool's ``OUTPUT_KEY`` (``advantages``, ``synth``), a bench calibration file. An
output path that is a symbolic link is refused (replacing the link or its target would both
surprise someone), as is one that equals, contains or lies inside an input, or contains the
current directory. All of this is checked before any work (`check_target`).

Siblings of an output ``name`` (same folder, hidden), both named by one random id::

    .name.tmp-<id>/         a run's working directory
        lock                 flock-ed by the run for as long as it lives
        name                 the output being written
    .name.old-<id>           the previous output, moved aside while --force swaps

Whether a run is alive is decided by its lock, never by a pid (pids mean nothing across
containers): the kernel drops the lock when the process dies, however it dies. A lock file that
is empty and young belongs to a run that is about to lock it, and is left alone.

Replacing an existing output takes these steps, all holding the lock::

    1. rename name -> .name.old-<id>              (the previous output, aside and complete)
    2. rename .name.tmp-<id>/name -> name         (the new output in place)
    3. rename .name.old-<id> -> .name.tmp-<id>/discard   (the previous output is now garbage)
    4. delete .name.tmp-<id>

A file replacing a file is one atomic ``os.replace`` instead. SIGINT and SIGTERM are held
(and SIGHUP) during the steps and delivered after them.

**Guarantee.** Whenever a run is killed (even by SIGKILL), either ``name`` holds a complete
output (the previous or the new one), or ``name`` is missing and ``.name.old-<id>`` holds the
previous complete output (killed between steps 1 and 2). The next run for the same output
repairs this before anything else (`repair`): for each dead run, its ``.old`` is renamed back
to ``name`` when ``name`` is missing, else discarded; its ``.tmp`` is deleted. Live runs'
siblings are never touched. A run that fails with an exception undoes step 1 itself, and
before committing checks that its own temporary directory is still there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeAlias

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.format import is_packed_dir
from rolltool.storage import remote
from rolltool.storage.fs import (
    Location,
    is_remote,
    local_path,
    locate,
    location_error,
    split_query,
)

LOCK = "lock"
"""The lock file inside a run's temporary directory."""
YOUNG_S = 60.0
"""A temporary directory with an empty or missing lock file is left alone this long (its run
may be between creating it and locking it)."""
OUTPUT_KEY = b"rolltool"
"""Parquet footer key whose value (``advantages``, ``synth``) marks a file rolltool wrote."""
PARQUET_KINDS = (b"advantages", b"synth")
CALIBRATION_KEYS = frozenset({"a", "b", "r2", "rows"})
"""Keys a bench calibration file (JSON) holds."""

committed: list[Path | str] = []
"""Outputs this process has put in place (the CLI says so when interrupted afterwards)."""


def parquet_marker(kind: str) -> dict[bytes, bytes]:
    """Schema metadata that marks a Parquet file as rolltool's `kind` output (in its footer)."""
    return {OUTPUT_KEY: kind.encode()}


# -- what may be replaced ------------------------------------------------------------------------


def rolltool_output(path: Path) -> str | None:
    """What rolltool output `path` is ("a packed directory", "an advantages file", ...), or None
    for anything rolltool did not write."""
    if path.is_symlink():
        return None
    if path.is_dir():
        return "a packed directory" if is_packed_dir(path) else None
    if not path.is_file():
        return None
    try:
        meta = pq.read_metadata(path).metadata
    except (pa.ArrowException, OSError):
        try:
            small = path.stat().st_size <= CALIBRATION_MAX_BYTES
            return _calibration(path.read_bytes()) if small else None
        except OSError:
            return None
    return _marked(meta)


CALIBRATION_MAX_BYTES = 1_000_000
"""A file larger than this is no bench calibration file (not read to find out)."""


def _marked(meta: dict[bytes, bytes] | None) -> str | None:
    """What rolltool output a Parquet footer's metadata marks (`parquet_marker`), or None."""
    kind = (meta or {}).get(OUTPUT_KEY)
    return f"an {kind.decode()} file" if kind in PARQUET_KINDS else None


def _calibration(text: bytes) -> str | None:
    """ "a bench calibration file" when `text` is one (`rolltool bench --calibrate`), else None."""
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return (
        "a bench calibration file"
        if isinstance(doc, dict) and CALIBRATION_KEYS <= set(doc)
        else None
    )


def _unremovable(target: Path) -> Path | None:
    """A path that keeps this process from moving `target` aside and deleting it, or None."""
    parent = target.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return parent
    st, pst = target.lstat(), parent.stat()
    if pst.st_mode & stat.S_ISVTX and os.geteuid() not in (0, st.st_uid, pst.st_uid):
        return target  # a sticky folder (/tmp): only the owner may move it
    if not target.is_dir():
        return None
    problems: list[OSError] = []
    for root, _, _ in os.walk(target, onerror=problems.append):
        if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
            return Path(root)
    return Path(problems[0].filename) if problems else None


def _not_ours(shown: str) -> RolltoolError:
    return RolltoolError(
        f"{shown} exists and is not an output rolltool wrote: --force replaces only "
        "packed directories, advantages/synth Parquet files and calibration files",
        hint="choose another -o, or move it away yourself if you mean to replace it",
    )


def _check_replaceable(target: Path, shown: str) -> None:
    what = rolltool_output(target)
    if what is None:
        raise _not_ours(shown)
    blocked = _unremovable(target)
    if blocked is not None:
        raise RolltoolError(
            f"{blocked}: permission denied: cannot replace {shown} ({what})",
            hint="it may belong to another user; choose another -o",
        )


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _input_paths(raw: str | os.PathLike[str]) -> list[Path]:
    text = os.fspath(raw)
    if os.path.lexists(text):
        return [_real(Path(text))]
    return [_real(Path(p)) for p in glob.glob(text, recursive=True)]


def _check_inputs(target: Path, shown: str, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse an output that equals, contains or lies inside an input (files and folders)."""
    out = _real(target)
    for raw in inputs:
        for inp in _input_paths(raw):
            if out == inp or out in inp.parents:
                how = "is one of" if out == inp else "contains"
                raise RolltoolError(
                    f"-o {shown} {how} the inputs ({os.fspath(raw)}): refusing to overwrite "
                    "an input",
                    hint="write the output somewhere else",
                )
            if inp in out.parents:
                raise RolltoolError(
                    f"-o {shown} lies inside the input {os.fspath(raw)}: a later run on that "
                    "input would read the output as input",
                    hint="write the output somewhere else",
                )


def _check_remote_inputs(out: Location, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """`_check_inputs` for an output on object storage: the same refusals, by path prefix on
    the same kind of filesystem (a glob counts from its first folder with a wildcard)."""
    for raw in inputs:
        text = os.fspath(raw)
        if not is_remote(text):
            continue
        base, query = split_query(text)  # the URI options stay (endpoint_override=...)
        inp = locate(base.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0] + query)
        if inp.fs.type_name != out.fs.type_name:
            continue
        a, b = out.path.rstrip("/"), inp.path.rstrip("/")
        if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
            raise RolltoolError(
                f"-o {out.shown} is, contains or lies inside the input {text}: refusing to "
                "overwrite an input",
                hint="write the output somewhere else",
            )


def _check_path(target: Path, shown: str) -> None:
    """Refusals that depend on the path alone (no name, a symlink, the current directory)."""
    if target.name in ("", ".", ".."):
        raise RolltoolError(f"-o {shown}: not a path rolltool can write to")
    if target.is_symlink():
        raise RolltoolError(
            f"-o {shown} is a symbolic link (to {os.readlink(target)}): rolltool does not "
            "write through links",
            hint="pass the link's target as -o, or remove the link",
        )
    if not target.parent.is_dir():
        why = "is not a folder" if os.path.lexists(target.parent) else "does not exist"
        raise RolltoolError(f"cannot write {shown}: the output folder {target.parent} {why}")
    if target.exists() and _real(target) in (Path.cwd(), *Path.cwd().parents):
        raise RolltoolError(
            f"-o {shown} is or contains the current directory: refusing to replace it",
            hint="write the output to a new path, e.g. -o packed",
        )


def check_target(
    path: str | os.PathLike[str],
    force: bool,
    *,
    inputs: Sequence[str | os.PathLike[str]] = (),
    file: bool = False,
) -> None:
    """Everything about the output path that can fail, checked before any work: repair what
    killed runs left (the module docstring), then refuse a path that is not writable as asked.

    `inputs` (files, folders or globs as given) may not equal, contain or hold the output.
    `file`: the output is one file (`atomic_file`), not a packed directory (this matters only
    on object storage, where a prefix is no file).
    """
    shown = os.fspath(path)
    if is_remote(shown) and not (loc := locate(shown)).local:
        _check_remote_inputs(loc, inputs)
        if file:
            _check_remote_file(loc, force)
        else:
            remote.check_target(loc, force)  # object storage: no rename (`rolltool.storage.remote`)
        return
    target = Path(os.path.abspath(local_path(shown)))
    _check_path(target, shown)
    repair(target)
    _check_inputs(target, shown, inputs)
    if os.path.lexists(target):
        if not force:
            raise RolltoolError(f"{shown} already exists", hint="pass --force to replace it")
        _check_replaceable(target, shown)


def _remote_output(loc: Location) -> str | None:
    """`rolltool_output` of one object (its footer, or its text for a calibration file)."""
    try:
        with loc.fs.open_input_file(loc.path) as f:
            meta = pq.read_metadata(f).metadata
    except (pa.ArrowException, OSError):
        try:
            small = (loc.info().size or 0) <= CALIBRATION_MAX_BYTES
            return _calibration(loc.read_bytes("")) if small else None
        except RolltoolError:
            return None
    return _marked(meta)


def _check_remote_existing(loc: Location, force: bool, *, appeared: bool = False) -> None:
    """The local rules on an existing output, for one object: refused without `force`, and
    with it unless rolltool wrote it. A prefix holding objects is no file to replace."""
    found = loc.info().type
    if found == pafs.FileType.Directory:
        raise RolltoolError(
            f"{loc.shown} is a folder (it holds objects): a file output cannot replace it",
            hint="choose another -o",
        )
    if found == pafs.FileType.NotFound:
        return
    if not force:
        if appeared:
            raise RolltoolError(f"{loc.shown} appeared while this run was writing it")
        raise RolltoolError(f"{loc.shown} already exists", hint="pass --force to replace it")
    if _remote_output(loc) is None:
        raise _not_ours(loc.shown)


def _check_remote_file(loc: Location, force: bool) -> None:
    """`check_target` of one file on object storage: repair and refuse as
    `rolltool.storage.remote` does for its runs' stage (`remote.file_stage`), then the local
    rules on an existing output."""
    if "/" not in loc.path.strip("/") or loc.path.rsplit("/", 1)[1] in ("", ".", ".."):
        raise RolltoolError(f"-o {loc.shown}: not a path rolltool can write to")
    remote.check_stage(remote.file_stage(loc), loc.shown)
    _check_remote_existing(loc, force)


# -- leftovers of dead runs ----------------------------------------------------------------------


def _siblings(target: Path, kind: str) -> list[Path]:
    """``.<name>.<kind>-*`` next to `target`, newest first."""
    prefix = f".{target.name}.{kind}-"
    found = list(target.parent.glob(f"{glob.escape(prefix)}*"))
    return sorted(found, key=lambda p: (-_ctime(p), p.name))


def _ctime(path: Path) -> float:
    try:
        return path.lstat().st_ctime
    except FileNotFoundError:
        return 0.0  # gone meanwhile (another run cleaning up)


def _young(path: Path) -> bool:
    try:
        return time.time() - path.lstat().st_mtime < YOUNG_S
    except FileNotFoundError:
        return False


def _lock_if_dead(tmp: Path) -> int | None:
    """The locked lock of `tmp` when the run that made it is gone (-1: gone, and it had no lock
    file); None while it lives, or when this cannot be told (then it is left alone)."""
    try:
        fd = os.open(tmp / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _bare(tmp)
    except OSError:
        return None  # not ours to open (another user's): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_size == 0 and _young(tmp / LOCK):
            raise BlockingIOError(errno.EAGAIN, "about to be locked")
    except OSError:
        os.close(fd)
        return None
    return fd


def _bare(tmp: Path) -> int | None:
    """A temporary directory without a lock file: just made (its run is about to create the
    lock), or left by a removal cut short. Removed when empty (a run that was about to lock it
    makes another), or when old; -1 when it is gone or to be removed."""
    try:
        os.rmdir(tmp)
        return -1
    except FileNotFoundError:
        return -1
    except OSError:
        return None if _young(tmp) or not tmp.is_dir() else -1


def _make_temp(target: Path) -> tuple[Path, int]:
    """A fresh ``.name.tmp-<id>`` next to `target` and its lock, held (closing it releases)."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            fd = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            break
        except FileNotFoundError:
            continue  # a cleaner removed it while empty (`_lock_if_dead`): make another
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        pass  # no locks on this file system: others cannot lock it either, so they leave it
    os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    return tmp, fd


def _remove(tmp: Path, fd: int) -> None:
    """Delete a temporary directory whose lock `fd` this process holds (the lock file last, so
    that a removal cut short still looks like a dead run's), then release the lock."""
    try:
        entries = [p for p in tmp.iterdir() if p.name != LOCK]
    except FileNotFoundError:
        entries = []
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        os.unlink(tmp / LOCK)
    with contextlib.suppress(OSError):
        os.rmdir(tmp)
    if fd >= 0:
        os.close(fd)


def _settle(target: Path, old: Path, garbage: Path) -> None:
    """A dead run's previous output: back in place when `target` is missing, else garbage.
    One this process may not move (another user's) is left where it is."""
    try:
        if not os.path.lexists(target):
            os.rename(old, target)
        else:
            os.rename(old, garbage / "discard")
    except OSError:
        pass  # settled by another run meanwhile, or not ours to move


def repair(target: Path) -> list[Path]:
    """Settle what dead runs left next to `target` (module docstring); returns the siblings
    handled: each dead run's ``.old`` (if any), then its ``.tmp``."""
    tmp_prefix, old_prefix = f".{target.name}.tmp-", f".{target.name}.old-"
    handled: list[Path] = []
    try:
        for tmp in _siblings(target, "tmp"):
            fd = _lock_if_dead(tmp)
            if fd is None:
                continue
            old = target.parent / f"{old_prefix}{tmp.name[len(tmp_prefix) :]}"
            if os.path.lexists(old):
                _settle(target, old, tmp)
                handled.append(old)
            _remove(tmp, fd)
            handled.append(tmp)
        for old in _siblings(target, "old"):  # orphans: their run's .tmp is gone
            if os.path.lexists(target.parent / f"{tmp_prefix}{old.name[len(old_prefix) :]}"):
                continue  # a live run's, mid-swap
            garbage, fd = _make_temp(target)
            _settle(target, old, garbage)
            _remove(garbage, fd)
            handled.append(old)
    except OSError as e:
        raise RolltoolError(f"{target}: cannot repair a previous run's leftovers ({e})") from None
    return handled


def remove_stale(target: Path) -> list[Path]:
    """Same as `repair` (kept for callers of the former name)."""
    return repair(target)


# -- writing -------------------------------------------------------------------------------------


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block and deliver them after it (main thread
    only; an ignored signal stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {
        s: signal.signal(s, lambda n, _: caught.append(n))
        for s in sigs
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


@contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    """Hold a lock on `folder` (flock on the directory itself) so that two runs' swaps in it
    never interleave; best effort where the file system has no such locks."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_own(tmp: Path, fd: int, work: Path, shown: str) -> None:
    try:
        still = os.path.samestat(os.stat(tmp / LOCK), os.fstat(fd)) and os.path.lexists(work)
    except FileNotFoundError:
        still = False
    if not still:
        raise RolltoolError(
            f"{tmp}: this run's temporary directory was removed by another process; "
            f"{shown} was not written",
            hint="run again, and do not delete .*.tmp-* folders of running jobs",
        )


def _discard(old: Path, tmp: Path) -> None:
    """After the new output is in place nothing may fail: the previous one becomes garbage in
    `tmp` (deleted with it), or, if even that rename is refused, is deleted where it is."""
    try:
        os.rename(old, tmp / "discard")
    except OSError:
        shutil.rmtree(old, ignore_errors=True)


def _commit(work: Path, target: Path, tmp: Path, force: bool, shown: str) -> None:
    """Move the complete `work` to `target`, replacing what is there (module docstring)."""
    with _signals_held(), _folder_locked(target.parent):
        if os.path.lexists(target):
            if not force:
                raise RolltoolError(f"{shown} appeared while this run was writing it")
            _check_replaceable(target, shown)
        if not os.path.lexists(target):
            os.rename(work, target)
        elif work.is_file() and target.is_file() and not target.is_symlink():
            os.replace(work, target)  # one atomic step
        else:
            old = target.parent / f".{target.name}.old-{tmp.name.split('.tmp-', 1)[1]}"
            os.rename(target, old)
            try:
                os.rename(work, target)
            except BaseException:
                os.rename(old, target)  # put the previous output back
                raise
            _discard(old, tmp)
        committed.append(target)


def _named(e: OSError, shown: str) -> OSError:
    """`e` naming the output when it names no file (a failed write deep in a library)."""
    if e.filename is not None:
        return e
    reason = e.strerror or str(e).splitlines()[0]
    return OSError(e.errno, reason, shown)


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, force: bool, directory: bool) -> Iterator[Path]:
    """Yield a path to write the output to (a directory to create when `directory`); when the
    block ends without an exception, move it to `path` (module docstring).

    An OSError that names no file (a full disk, a file-size limit) is raised again naming
    `path`.
    """
    shown = os.fspath(path)
    target = Path(os.path.abspath(local_path(shown)))
    check_target(shown, force)
    try:
        tmp, fd = _make_temp(target)
    except OSError as e:
        raise RolltoolError(f"{shown}: cannot write here ({e.strerror})") from None
    work = tmp / target.name
    try:
        yield work
        _check_own(tmp, fd, work, shown)
        if directory:
            os.chmod(work, 0o755)
        _commit(work, target, tmp, force, shown)
    except OSError as e:
        raise _named(e, shown) from e
    finally:
        _remove(tmp, fd)


Sink: TypeAlias = Path | pa.NativeFile
"""Where `atomic_file` has the output written: a local path, or an output stream."""


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, force: bool) -> Iterator[Sink]:
    """Yield where to write the one-file output `path` (a pyarrow writer's ``where``): a
    local path from `atomic_path`, or, on object storage, a stream to a temporary object under
    a claim (`remote.file_stage`, rewritten every `remote.HEARTBEAT_S`). When the block ends
    without an exception, the temporary object is copied to `path` (its previous object, under
    --force, stays whole until then) and deleted; on one, or when the copy fails, the
    temporary object and the claim are deleted and `path` is untouched. A killed run leaves
    them to the next run to `path`, which deletes them once the claim is `remote.STALE_S` old.
    """
    shown = os.fspath(path)
    if not is_remote(shown) or (loc := locate(shown)).local:
        with atomic_path(path, force=force, directory=False) as tmp:
            yield tmp
        return
    check_target(shown, force, file=True)
    stage = remote.file_stage(loc)
    run = remote.RemoteRun(stage, force=True)  # force: dead runs' orphans there are deleted
    run.start()
    try:
        part = stage.join(run.part)
        run.adopt([run.part])
        try:
            sink = stage.fs.open_output_stream(part)
        except (pa.ArrowException, OSError) as e:
            raise location_error(shown, e, "cannot write") from None
        try:
            yield sink
        except BaseException:
            with contextlib.suppress(pa.ArrowException, OSError):
                sink.close()  # completes the temporary object, deleted below: never the output
            raise
        sink.close()
        with _signals_held():
            _check_remote_existing(loc, force, appeared=True)
            try:
                loc.fs.copy_file(part, loc.path)
            except (pa.ArrowException, OSError) as e:
                raise location_error(shown, e, "cannot write") from None
            committed.append(shown)
        with contextlib.suppress(RolltoolError):
            stage.delete(run.part)
        run.finish()
    except (pa.ArrowException, OSError) as e:
        run.abort()
        raise location_error(shown, e, "cannot write") from None
    except BaseException:
        run.abort()
        raise


def output_bytes(path: str | os.PathLike[str]) -> int:
    """The size of the one-file output `path` (local or on object storage)."""
    shown = os.fspath(path)
    if not is_remote(shown):
        return os.path.getsize(local_path(shown))
    return int(locate(shown).info().size or 0)
