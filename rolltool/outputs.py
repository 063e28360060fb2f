"""Atomic outputs: write into a temporary sibling, rename into place when complete.

An existing output is refused unless ``force``. Hidden siblings of an output ``name`` say what
a run was doing, by the pid of the process that made them:

- ``.name.tmp-<pid>-*``: work in progress or garbage; never complete, never restored.
- ``.name.old-<pid>``: the previous, complete output, moved aside while ``--force`` replaces it.

Replacing an existing output takes four steps, each a rename or a deletion::

    1. rename name -> .name.old-<pid>          (the previous output, aside and complete)
    2. rename .name.tmp-<pid>-*/... -> name    (the new output in place)
    3. rename .name.old-<pid> -> .name.tmp-<pid>-*/old  (the previous output is now garbage)
    4. delete .name.tmp-<pid>-*

A file output that replaces a file is a single atomic ``os.replace`` instead.

**Guarantee.** Whatever moment a run is killed at (even by SIGKILL), either ``name`` holds a
complete output (the previous one or the new one), or ``name`` is missing and
``.name.old-<pid>`` holds the previous complete output (killed between steps 1 and 2). The next
run for the same output repairs this before anything else (`check_target` calls `repair`): for
each ``.name.old-<pid>`` whose process is gone, it is renamed back to ``name`` when ``name`` is
missing, and deleted when ``name`` exists (the replacement completed); then ``.name.tmp-<pid>-*``
siblings of dead processes are deleted. A run that fails with an exception (not killed) undoes
step 1 itself. Siblings of live processes are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

from rolltool.errors import RolltoolError


def check_target(path: Path, force: bool) -> None:
    """Repair what a killed run left (see the module docstring), then fail early (before any
    work) when `path` exists and `force` is not set."""
    if path.parent.exists():
        repair(path)
    if os.path.lexists(path) and not force:
        raise RolltoolError(f"{path} already exists", hint="pass --force to replace it")
    if not path.parent.exists():
        raise RolltoolError(f"{path.parent}: output folder does not exist")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _dead_siblings(target: Path, kind: str) -> list[Path]:
    """Siblings ``.<name>.<kind>-<pid>[-*]`` of `target` whose process is gone, newest first."""
    prefix = f".{target.name}.{kind}-"
    found = []
    for p in target.parent.glob(f"{glob_escape(prefix)}*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            found.append(p)
    return sorted(found, key=lambda p: (-_ctime(p), p.name))


def _ctime(path: Path) -> float:
    try:
        return path.lstat().st_ctime
    except FileNotFoundError:
        return 0.0  # gone meanwhile (another run cleaning up)


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale(target: Path) -> list[Path]:
    """Delete temporary siblings of `target` left by runs that died (their pid is gone)."""
    stale = _dead_siblings(target, "tmp")
    for p in stale:
        _delete(p)
    return stale


def restore_replaced(target: Path) -> list[Path]:
    """Settle the ``.name.old-<pid>`` siblings of dead runs: rename the newest back to `target`
    when `target` is missing, delete the others. Returns the siblings handled."""
    old = _dead_siblings(target, "old")
    for p in old:
        if not os.path.lexists(target):
            os.rename(p, target)
        else:
            _discard(target, p)
    return old


def repair(target: Path) -> list[Path]:
    """Undo what killed runs left next to `target`: old outputs first, then temporary dirs."""
    try:
        return restore_replaced(target) + remove_stale(target)
    except OSError as e:
        raise RolltoolError(f"{target}: cannot repair a previous run's leftovers ({e})") from None


def _discard(target: Path, old: Path) -> None:
    """Make `old` garbage with one rename into a fresh ``.name.tmp-<pid>-*`` dir (so a half-deleted
    old output is never restored), then delete it."""
    garbage = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    os.rename(old, garbage / "old")
    _delete(garbage)


def _commit(work: Path, target: Path) -> None:
    """Move the complete `work` to `target`, replacing what is there (module docstring)."""
    if not os.path.lexists(target):
        os.rename(work, target)
        return
    if work.is_file() and target.is_file() and not target.is_symlink():
        os.replace(work, target)  # one atomic step
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    os.rename(target, old)
    try:
        os.rename(work, target)
    except BaseException:
        os.rename(old, target)  # put the previous output back
        raise
    _discard(target, old)


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, force: bool, directory: bool) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success move it to `path`.

    An existing output (with ``force``) is replaced so that a reader never sees a half-written
    one and a killed run loses neither (see the module docstring).
    """
    target = Path(path)
    check_target(target, force)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise RolltoolError(f"{target}: cannot write here ({e.strerror})") from None
    work = tmp if directory else tmp / target.name
    try:
        yield work
        if directory:
            os.chmod(work, 0o755)
        _commit(work, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
