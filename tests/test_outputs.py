"""Atomic outputs: leftovers of dead runs are cleaned, live runs' temp dirs are left alone, and
a --force replacement killed at any point leaves a complete output that the next run repairs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rolltool.errors import RolltoolError
from rolltool.outputs import atomic_path, check_target, remove_stale, repair


def _dead_pid() -> int:
    pid = 2**22 - 7  # above the usual pid_max; checked below
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_stale_temp_dirs_of_dead_runs_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "packed"
    dead = tmp_path / f".packed.tmp-{_dead_pid()}-abc"
    live = tmp_path / f".packed.tmp-{os.getpid()}-xyz"
    other = tmp_path / f".other.tmp-{_dead_pid()}-abc"
    for d in (dead, live, other):
        (d / "rank-0000").mkdir(parents=True)
    removed = remove_stale(target)
    assert removed == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_atomic_dir_commits_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_path(target, force=False, directory=True) as work:
        work.mkdir(exist_ok=True)
        (work / "manifest.json").write_text("{}")
        raise RuntimeError("killed")
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == []
    with atomic_path(target, force=False, directory=True) as work:
        work.mkdir(exist_ok=True)
        (work / "manifest.json").write_text("{}")
    assert (target / "manifest.json").read_text() == "{}"
    with (
        pytest.raises(RolltoolError, match="already exists"),
        atomic_path(target, force=False, directory=True),
    ):
        pass


def test_pack_warns_when_dp_exceeds_a_steps_samples(tmp_path: Path) -> None:
    from rolltool.pack import PackConfig, run_pack
    from rolltool.steps import StepConfig

    out = tmp_path / "packed"
    manifest = run_pack(
        [str(Path(__file__).parent.parent / "examples" / "rollouts.parquet")],
        out,
        PackConfig(dp=200, steps=StepConfig(batch_size=128)),
    )
    assert any("fewer samples than --dp 200" in w for w in manifest.warnings)
    assert all(len({r.micro_batches for r in s.ranks}) == 1 for s in manifest.steps)


# --- --force replacement survives a kill at any point (defect 11) ----------------------------

FILES = ("a.txt", "b.txt", "c.txt")

# Runs atomic_path(force=True) over an existing output and SIGKILLs itself just before the
# `kill_at`-th file-system operation that moves or deletes (0: while writing the new output).
# Prints how many such operations a run that is not killed makes.
CHILD = """
import os, signal, sys
from pathlib import Path
from rolltool.outputs import atomic_path

target, kind, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
count = 0

def wrap(name):
    real = getattr(os, name)
    def op(*args, **kwargs):
        global count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(os, name, op)

for name in ("rename", "replace", "unlink", "rmdir", "chmod"):
    wrap(name)
with atomic_path(target, force=True, directory=kind == "dir") as work:
    if kind == "dir":
        work.mkdir(exist_ok=True)
        for i, f in enumerate(("a.txt", "b.txt", "c.txt")):
            (work / f).write_text("new")
            if kill_at == 0 and i == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    else:
        work.write_text("new")
        if kill_at == 0:
            os.kill(os.getpid(), signal.SIGKILL)
print(count)
"""


def _write(path: Path, version: str, kind: str) -> None:
    if kind == "dir":
        path.mkdir()
        for f in FILES:
            (path / f).write_text(version)
    else:
        path.write_text(version)


def _version(path: Path) -> str | None:
    """'old' or 'new' for a complete output at `path`, None when missing, else 'broken'."""
    if not path.exists():
        return None
    if path.is_file():
        return path.read_text()
    texts = {f.name: f.read_text() for f in path.iterdir()}
    versions = set(texts.values())
    return versions.pop() if sorted(texts) == list(FILES) and len(versions) == 1 else "broken"


def _run_child(target: Path, kind: str, kill_at: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(target), kind, str(kill_at)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_force_replacement_killed_at_any_point_loses_nothing(tmp_path: Path, kind: str) -> None:
    clean = tmp_path / "clean"
    clean.mkdir()
    _write(clean / "out", "old", kind)
    done = _run_child(clean / "out", kind, -1)
    assert done.returncode == 0, done.stderr
    assert _version(clean / "out") == "new" and [p.name for p in clean.iterdir()] == ["out"]
    ops = int(done.stdout)
    assert ops >= (4 if kind == "dir" else 2)  # the moves and deletions really were counted

    states = set()
    for kill_at in range(ops + 1):
        folder = tmp_path / f"kill-{kill_at}"
        folder.mkdir()
        target = folder / "out"
        _write(target, "old", kind)
        killed = _run_child(target, kind, kill_at)
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
        # Right after the kill: a complete output at the target, or the old one aside.
        now = _version(target)
        aside = sorted(folder.glob(".out.old-*"))
        states.add((now, len(aside)))
        if now is None:
            assert [_version(p) for p in aside] == ["old"], kill_at
        else:
            assert now in ("old", "new"), kill_at
        # The next run repairs: the output is complete and no hidden sibling is left.
        check_target(target, force=True)
        assert _version(target) == (now or "old"), kill_at
        assert [p.name for p in folder.iterdir()] == ["out"], kill_at
    if kind == "dir":  # the kills reached the states this test is about
        assert {(None, 1), ("new", 1), ("old", 0), ("new", 0)} <= states
    else:
        assert {("old", 0), ("new", 0)} <= states


def test_repair_restores_or_discards_old_outputs_of_dead_runs_only(tmp_path: Path) -> None:
    dead = _dead_pid()
    # Killed between the two renames: no output, the old one aside -> restored.
    _write(tmp_path / f".out.old-{dead}", "old", "dir")
    (tmp_path / f".out.tmp-{dead}-abcd").mkdir()
    assert repair(tmp_path / "out") == [
        tmp_path / f".out.old-{dead}",
        tmp_path / f".out.tmp-{dead}-abcd",
    ]
    assert _version(tmp_path / "out") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # Killed after the new output was in place -> the old one is deleted.
    _write(tmp_path / f".out.old-{dead}", "old", "dir")
    repair(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # A live run's old output is its business.
    live = tmp_path / f".out.old-{os.getpid()}"
    _write(live, "old", "dir")
    assert repair(tmp_path / "out") == []
    assert live.exists()


def test_a_restored_output_is_not_replaced_without_force(tmp_path: Path) -> None:
    _write(tmp_path / f".out.old-{_dead_pid()}", "old", "file")
    with pytest.raises(RolltoolError, match="already exists"):
        check_target(tmp_path / "out", force=False)
    assert _version(tmp_path / "out") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_newest_of_several_old_outputs_is_restored(tmp_path: Path) -> None:
    dead = _dead_pid()
    older, newer = tmp_path / f".out.old-{dead}", tmp_path / f".out.old-{dead - 1}"
    older.write_text("older")
    time.sleep(0.02)
    newer.write_text("newer")  # ctime orders them (renames set it too)
    repair(tmp_path / "out")
    assert (tmp_path / "out").read_text() == "newer"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_failed_rename_into_place_puts_the_old_output_back(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    _write(target, "old", "dir")  # a dir, so a file output also goes through the aside rename
    real_rename, calls = os.rename, []

    def rename(src: Any, dst: Any) -> None:
        calls.append((Path(src).name, Path(dst).name))
        if Path(dst) == target and len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with (
        pytest.raises(OSError, match="No space"),
        atomic_path(target, force=True, directory=kind == "dir") as work,
    ):
        if kind == "dir":
            work.mkdir(exist_ok=True)
            (work / "a.txt").write_text("new")
        else:
            work.write_text("new")
    assert calls[0] == ("out", f".out.old-{os.getpid()}")  # the failure was where intended
    assert _version(target) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
