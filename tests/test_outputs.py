"""Atomic outputs: leftovers of dead runs are cleaned, live runs' temp dirs are left alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rolltool.errors import RolltoolError
from rolltool.outputs import atomic_path, remove_stale


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
