"""Atomic outputs: a run's liveness is its lock (never a pid), leftovers of dead runs are
settled, a --force replacement killed at any point leaves a complete output that the next run
repairs, and --force replaces only what rolltool wrote."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolltool.errors import RolltoolError
from rolltool.storage import outputs
from rolltool.storage.outputs import LOCK, atomic_path, check_target, parquet_marker, repair


def _temp(folder: Path, name: str, *, lock: str | None = "host 1\n", age: float = 0.0) -> Path:
    """A run's temporary directory as `_make_temp` leaves it (`lock`: the lock file's content,
    None: no lock file), made to look `age` seconds old."""
    tmp = folder / name
    (tmp / "out" / "rank-0000").mkdir(parents=True)
    paths = [tmp]
    if lock is not None:
        (tmp / LOCK).write_text(lock)
        paths.append(tmp / LOCK)
    then = time.time() - age
    for p in paths:
        os.utime(p, (then, then))
    return tmp


@pytest.fixture
def held() -> Iterator[list[int]]:
    """Lock files to hold (as a live run does) for the test's duration."""
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


def _hold(path: Path, fds: list[int]) -> None:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fds.append(fd)


def test_liveness_is_the_lock_not_the_pid(tmp_path: Path, held: list[int]) -> None:
    target = tmp_path / "out"
    # The lock file names this (live) process, but nobody holds the lock: a dead run.
    dead = _temp(tmp_path, ".out.tmp-dead", lock=f"host {os.getpid()}\n")
    # Held by a run in another container: its pid (1) says nothing here.
    live = _temp(tmp_path, ".out.tmp-live", lock="elsewhere 1\n")
    _hold(live / LOCK, held)
    # Between mkdtemp and locking: young and empty or without a lock file -> left alone.
    starting = _temp(tmp_path, ".out.tmp-starting", lock="")
    creating = _temp(tmp_path, ".out.tmp-creating", lock=None)
    # The same, but old: their run died right there.
    died_empty = _temp(tmp_path, ".out.tmp-died1", lock="", age=3600)
    died_bare = _temp(tmp_path, ".out.tmp-died2", lock=None, age=3600)
    # Empty, without a lock file: removed at once (a run about to lock it makes another).
    bare = tmp_path / ".out.tmp-bare"
    bare.mkdir()
    other = _temp(tmp_path, ".other.tmp-dead")
    assert sorted(repair(target)) == sorted([dead, died_empty, died_bare, bare])
    assert all(p.exists() for p in (live, starting, creating, other))
    assert not any(p.exists() for p in (dead, died_empty, died_bare, bare))


def test_a_rerun_refused_for_already_exists_still_cleans_a_dead_runs_temp(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    _temp(tmp_path, ".out.tmp-dead")
    with pytest.raises(RolltoolError, match="already exists"):
        check_target(tmp_path / "out", force=False)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_dir_commits_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_path(target, force=False, directory=True) as work:
        work.mkdir()
        (work / "manifest.json").write_text("{}")
        raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == []
    with atomic_path(target, force=False, directory=True) as work:
        work.mkdir()
        (work / "manifest.json").write_text("{}")
        (lock,) = tmp_path.glob(".out.tmp-*/lock")
        with pytest.raises(BlockingIOError), open(lock) as f:  # held while the run lives
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert (target / "manifest.json").read_text() == "{}"
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with (
        pytest.raises(RolltoolError, match="already exists"),
        atomic_path(target, force=False, directory=True),
    ):
        pass


def test_a_run_whose_temp_was_deleted_does_not_commit(tmp_path: Path) -> None:
    import shutil

    target = tmp_path / "out"
    with (
        pytest.raises(RolltoolError, match="removed by another process"),
        atomic_path(target, force=False, directory=True) as work,
    ):
        work.mkdir()
        (work / "a").write_text("x")
        shutil.rmtree(work.parent)  # what a pid-based cleaner in another container did
    assert not target.exists()


# --- what --force may replace -------------------------------------------------------------------


def _packed(path: Path) -> Path:
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": "rolltool-packed"}))
    (path / "rank-0000").mkdir()
    (path / "rank-0000" / "step-000000-00.safetensors").write_bytes(b"x")
    return path


def _marked(path: Path, kind: str) -> Path:
    table = pa.table({"x": [1]})
    pq.write_table(table.replace_schema_metadata(parquet_marker(kind)), path)
    return path


def test_force_replaces_rolltool_outputs_only(tmp_path: Path) -> None:
    mine = {
        "packed": _packed(tmp_path / "packed"),
        "adv": _marked(tmp_path / "adv.parquet", "advantages"),
        "synth": _marked(tmp_path / "s.parquet", "synth"),
        "calib": tmp_path / "c.json",
    }
    mine["calib"].write_text(json.dumps({"a": 1e-9, "b": 1e-13, "r2": 0.99, "rows": 100}))
    for path in mine.values():
        check_target(path, force=True)  # no error
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), plain)
    other_kind = _marked(tmp_path / "other.parquet", "something-else")
    text = tmp_path / "file.txt"
    text.write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (notes, plain, other_kind, text, empty):
        with pytest.raises(RolltoolError, match="not an output rolltool wrote") as e:
            check_target(path, force=True)
        assert str(path) in e.value.message and e.value.hint
    assert (notes / "todo.txt").read_text() == "mine" and text.read_text() == "mine"


def test_symlinks_dot_and_inputs_are_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = _packed(tmp_path / "packed")
    (tmp_path / "link").symlink_to(packed)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        with pytest.raises(RolltoolError, match="symbolic link"):
            check_target(tmp_path / name, force=True)
    assert (tmp_path / "link").is_symlink() and (packed / "manifest.json").exists()
    monkeypatch.chdir(packed)
    for spelling in (".", str(packed), "../packed"):
        with pytest.raises(RolltoolError, match="current directory"):
            check_target(spelling, force=True)
    data = tmp_path / "data"
    (data / "env=a").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), data / "env=a" / "in.parquet")
    cases = {
        data: "is one of the inputs",  # equals
        tmp_path: "contains",  # contains
        data / "packed": "lies inside",  # inside an input folder
    }
    for out, words in cases.items():
        with pytest.raises(RolltoolError, match=words):
            check_target(out, force=True, inputs=[data])
    with pytest.raises(RolltoolError, match="is one of the inputs"):
        check_target(data / "env=a" / "in.parquet", force=True, inputs=[f"{data}/**/*.parquet"])
    check_target(tmp_path / "elsewhere", force=True, inputs=[data])  # no error


def test_an_output_this_user_cannot_remove_is_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = _packed(tmp_path / "packed")
    locked = packed / "rank-0000"
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    with pytest.raises(RolltoolError, match="permission denied") as e:
        check_target(packed, force=True)
    assert str(locked) in e.value.message
    with pytest.raises(RolltoolError, match="permission denied"):
        with atomic_path(packed, force=True, directory=True) as work:
            work.mkdir()
    assert (locked / "step-000000-00.safetensors").exists()


# --- --force replacement survives a kill at any point -------------------------------------------

FILES = ("a.txt", "b.txt", "c.txt")

# Runs atomic_path(force=True) over an existing output and SIGKILLs itself just before the
# `kill_at`-th file-system operation that moves or deletes (0: while writing the new output).
# Prints how many such operations a run that is not killed makes.
CHILD = """
import json, os, shutil, signal, sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
from rolltool.storage.outputs import atomic_path, parquet_marker

target, kind, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
count = 0

def wrap(module, name):
    real = getattr(module, name)
    def op(*args, **kwargs):
        global count
        count += 1
        if count == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(module, name, op)

for name in ("rename", "replace", "unlink", "rmdir", "chmod"):
    wrap(os, name)
wrap(shutil, "rmtree")
with atomic_path(target, force=True, directory=kind == "dir") as work:
    if kind == "dir":
        work.mkdir()
        for i, f in enumerate(("a.txt", "b.txt", "c.txt")):
            (work / f).write_text("new")
            if kill_at == 0 and i == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        (work / "manifest.json").write_text(json.dumps({"format": "rolltool-packed"}))
    else:
        pq.write_table(pa.table({"v": ["new"]}).replace_schema_metadata(parquet_marker("synth")), work)
        if kill_at == 0:
            os.kill(os.getpid(), signal.SIGKILL)
print(count)
"""


def _write(path: Path, version: str, kind: str) -> None:
    if kind == "dir":
        path.mkdir()
        for f in FILES:
            (path / f).write_text(version)
        (path / "manifest.json").write_text(json.dumps({"format": "rolltool-packed"}))
    else:
        pq.write_table(
            pa.table({"v": [version]}).replace_schema_metadata(parquet_marker("synth")), path
        )


def _version(path: Path) -> str | None:
    """'old' or 'new' for a complete output at `path`, None when missing, else 'broken'."""
    if not path.exists():
        return None
    if path.is_file():
        return str(pq.read_table(path).column("v")[0])
    texts = {f.name: f.read_text() for f in path.iterdir() if f.name != "manifest.json"}
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


def test_repair_restores_or_discards_old_outputs_of_dead_runs_only(
    tmp_path: Path, held: list[int]
) -> None:
    # Killed between the two renames: no output, the old one aside -> restored.
    _write(tmp_path / ".out.old-abcd", "old", "dir")
    tmp = _temp(tmp_path, ".out.tmp-abcd")
    assert repair(tmp_path / "out") == [tmp_path / ".out.old-abcd", tmp]
    assert _version(tmp_path / "out") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # Killed after the new output was in place -> the old one is deleted.
    _write(tmp_path / ".out.old-efgh", "old", "dir")
    _temp(tmp_path, ".out.tmp-efgh")
    repair(tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # An orphan (its .tmp gone, e.g. an older rolltool's) is settled the same way.
    _write(tmp_path / ".out.old-4194297", "old", "dir")
    assert repair(tmp_path / "out") == [tmp_path / ".out.old-4194297"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    # A live run's old output, mid-swap, is its business.
    live = _temp(tmp_path, ".out.tmp-live")
    _hold(live / LOCK, held)
    _write(tmp_path / ".out.old-live", "old", "dir")
    (tmp_path / "out").rename(tmp_path / "gone")
    assert repair(tmp_path / "out") == []
    assert (tmp_path / ".out.old-live").exists() and not (tmp_path / "out").exists()


def test_a_restored_output_is_not_replaced_without_force(tmp_path: Path) -> None:
    _write(tmp_path / ".out.old-x", "old", "file")
    _temp(tmp_path, ".out.tmp-x")
    with pytest.raises(RolltoolError, match="already exists"):
        check_target(tmp_path / "out", force=False)
    assert _version(tmp_path / "out") == "old"
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
            work.mkdir()
            (work / "a.txt").write_text("new")
        else:
            work.write_text("new")
    assert calls[0][0] == "out" and calls[0][1].startswith(".out.old-")  # failed where intended
    assert _version(target) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_write_error_without_a_file_name_names_the_output(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space") as e:
        with atomic_path(tmp_path / "out.parquet", force=False, directory=False):
            raise OSError(28, "No space left on device")
    assert e.value.filename == str(tmp_path / "out.parquet") and e.value.errno == 28
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raising KeyboardInterrupt, as in a foreground run, for the test: pytest started
    as a background job (``nohup ... &``, some CI runners) inherits SIGINT ignored, and the swap
    rightly keeps an ignored signal ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises")
def test_sigint_during_the_swap_is_delivered_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    _write(target, "old", "dir")
    real_rename, calls = os.rename, [0]

    def rename(src: Any, dst: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:  # the old output moved aside: the worst moment to stop
            os.kill(os.getpid(), signal.SIGINT)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    outputs.committed.clear()
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target, force=True, directory=True) as work:
            work.mkdir()
            for f in FILES:
                (work / f).write_text("new")
    assert calls[0] >= 3  # the swap really ran to its end
    assert _version(target) == "new" and outputs.committed == [target]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    outputs.committed.clear()


def test_pack_warns_when_dp_exceeds_a_steps_samples(tmp_path: Path) -> None:
    from rolltool.jobs.pack import PackConfig, run_pack
    from rolltool.plan.batches import StepConfig

    out = tmp_path / "packed"
    manifest = run_pack(
        [str(Path(__file__).parents[2] / "examples" / "rollouts.parquet")],
        out,
        PackConfig(dp=200, steps=StepConfig(batch_size=128)),
    )
    assert any("fewer samples than --dp 200" in w for w in manifest.warnings)
    assert all(len({r.micro_batches for r in s.ranks}) == 1 for s in manifest.steps)
