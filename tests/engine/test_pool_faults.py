"""The local engine's pools under process faults (issue 20's fault sweep): a planning worker
SIGKILLed (as the OOM killer does) fails the run in seconds with one line; a driver SIGKILLed
mid-run takes every process it started with it (forked planning workers, the forkserver, its
pack workers, the resource tracker), and nothing is written into its temporary folder after.

Each run is ``rolltool pack`` in a child process (``python -c CHILD``) with the pools' size
thresholds lowered (as the ``small_pools`` fixture does) and a fault hook: `_run` (a planning
worker's chunk) or the pack workers' ``pack_chunk`` slowed down or killing its own process. Every
process a test sees is killed by pid at its end, whatever the test found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"

CHILD = """
import os, signal, sys, time
sys.path.insert(0, {hooks!r})
from rolltool.engine import local
local.MIN_BATCHES, local.MIN_SAMPLES = 2, 0
local.MIN_TOKENS, local.MIN_WORKERS, local.MIN_STEPS_PER_WORKER = 0, 2, 1
FAULT = os.environ["FAULT"]
real_run = local._run

def run(span):
    if FAULT == "kill-planner" and span[0] <= 5 < span[1]:
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "slow-planner":
        time.sleep(0.5)
    return real_run(span)

local._run = run
if FAULT == "slow-packer":
    import multiprocessing
    multiprocessing.set_forkserver_preload(["slow_packer"])
from rolltool.cli import main
main(sys.argv[1:])
"""

SLOW_PACKER = """
import time
from rolltool.engine import local
real = local.pack_chunk

def slow(job, steps, reader):
    time.sleep(0.4 * len(steps))
    return real(job, steps, reader)

local.pack_chunk = slow
"""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; parent-death signals are Linux's"
)


def _start(tmp_path: Path, fault: str, *args: object) -> subprocess.Popen[bytes]:
    """The child, its stderr in ``tmp_path/stderr`` (a file: a pipe would stay open as long as
    any orphan holds it)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "slow_packer.py").write_text(SLOW_PACKER)
    code = textwrap.dedent(CHILD.format(hooks=str(hooks)))
    argv = [sys.executable, "-c", code, "pack", str(EXAMPLE), *map(str, args)]
    env = {**os.environ, "FAULT": fault, "SOURCE_DATE_EPOCH": "1700000000"}
    with open(tmp_path / "stderr", "wb") as err:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)  # fmt: skip


def _children() -> dict[int, list[int]]:
    """Every live process's children, by parent pid (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] != "Z":
            tree.setdefault(stat[1], []).append(int(entry))
    return tree


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid`, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if (s := _stat(p)) is not None and s[0] != "Z"}


@pytest.fixture
def reaped() -> Iterator[set[int]]:
    """Pids the test saw; any still alive at the end is killed."""
    pids: set[int] = set()
    yield pids
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_planning_worker_killed_fails_the_run_in_seconds(
    tmp_path: Path, reaped: set[int]
) -> None:
    """One forked planning worker SIGKILLed: exit 1 within seconds with one line naming the
    batches, no hang (the survivors are killed), no output, no worker left."""
    out = tmp_path / "out"
    child = _start(tmp_path, "kill-planner", "-o", out, "--dp", 2, "--batch-size", 16,
                   "--workers", 2)  # fmt: skip
    reaped.add(child.pid)
    try:
        child.wait(timeout=20)
    except subprocess.TimeoutExpired:
        reaped |= _descendants(child.pid)
        child.kill()
        child.wait()
        pytest.fail("pack hung after a planning worker was killed")
    stderr = (tmp_path / "stderr").read_text()
    assert child.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("Error: a worker process died while planning batches ")
    assert errors[0].endswith("(killed, or out of memory?); nothing was written")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("fault", ["slow-planner", "slow-packer"])
def test_a_killed_driver_takes_its_workers_with_it(
    tmp_path: Path, reaped: set[int], fault: str
) -> None:
    """The driver SIGKILLed mid-run (planning in forked workers, or packing in the forkserver
    pool): within 5 s no process it started is left, and no file appears in its temporary
    folder after that."""
    out = tmp_path / "out"
    child = _start(tmp_path, fault, "-o", out, "--dp", 2, "--batch-size", 16, "--workers", 2)
    reaped.add(child.pid)
    want = 2 if fault == "slow-planner" else 3  # 2 forked workers; forkserver + 2 workers
    deadline = time.monotonic() + 60
    seen: set[int] = set()
    while time.monotonic() < deadline and child.poll() is None:
        seen = _descendants(child.pid)
        reaped |= seen
        grandchildren = {p for p in seen if (s := _stat(p)) is not None and s[1] != child.pid}
        busy = len(seen) >= want if fault == "slow-planner" else len(grandchildren) >= 2
        if busy:
            time.sleep(0.6)  # the workers well into their chunks
            break
        time.sleep(0.05)
    else:
        child.wait()
        pytest.fail(f"the pool never started: {(tmp_path / 'stderr').read_text()}")
    seen = _descendants(child.pid)
    reaped |= seen
    assert len(seen) >= want, seen
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    gone_by = time.monotonic() + 5
    while _alive(seen) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert _alive(seen) == set(), [Path(f"/proc/{p}/cmdline").read_bytes() for p in _alive(seen)]
    tmp = list(tmp_path.glob(".out.tmp-*"))
    before = sorted(str(p) for d in tmp for p in d.rglob("*"))
    time.sleep(1.5)
    after = sorted(str(p) for d in tmp for p in d.rglob("*"))
    assert after == before


def _die_on_75(x: int) -> int:
    if x == 75:  # the first of the fourth chunk: its worker dies a moment after starting it
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def test_a_worker_dying_between_collects_is_named_not_a_broken_pool() -> None:
    """A worker dies while the driver is busy with an earlier chunk's results (a slow
    consumer), so the pool is broken when the driver next submits a chunk of its window: the
    run fails with the one `RolltoolError` naming a pending chunk, not `BrokenProcessPool`
    raised by ``submit``."""
    from rolltool.engine import base, local
    from rolltool.errors import RolltoolError

    items = list(range(200))
    assert base.chunks(len(items), 2, local.MAX_CHUNK)[3] == (75, 100)
    results = local.iter_in_order(_die_on_75, items, 2, "planning batches")
    with pytest.raises(RolltoolError, match="a worker process died while planning batches"):
        for i, _ in enumerate(results):
            if i == 0:
                time.sleep(1.5)  # chunk 1 done, chunk 3's worker dead meanwhile
