"""Atomic outputs: write into a temporary sibling, rename into place when complete.

An existing output is refused unless ``force``; a run that dies midway leaves only a hidden
``.<name>.tmp-<pid>-*`` sibling, never something that looks complete. The next run for the same
output removes such leftovers of processes that are no longer alive.
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
    """Fail early (before any work) when `path` exists and `force` is not set."""
    if path.exists() and not force:
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


def remove_stale(target: Path) -> list[Path]:
    """Delete temporary siblings of `target` left by runs that died (their pid is gone)."""
    removed = []
    for p in target.parent.glob(f".{glob_escape(target.name)}.tmp-*"):
        pid = p.name[len(f".{target.name}.tmp-") :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, force: bool, directory: bool) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success move it to `path`.

    For a directory, the old one (with ``force``) is first renamed aside, then removed after the
    new one is in place, so a reader never sees a half-replaced directory.
    """
    target = Path(path)
    check_target(target, force)
    try:
        remove_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise RolltoolError(f"{target}: cannot write here ({e.strerror})") from None
    work = tmp if directory else tmp / target.name
    try:
        yield work
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
            os.replace(work, target)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(work, target)
        if directory:
            os.chmod(target, 0o755)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
