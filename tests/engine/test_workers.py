"""``pack --workers N``: batches planned (`rolltool.engine.local`) and steps packed (`rolltool.pool`)
in worker processes give the same bytes as one process.

Both pools are used only for big runs; the tests lower their thresholds so that the small
example input is planned and packed by two processes, then compare every output file byte for
byte (manifest included: created_at fixed by SOURCE_DATE_EPOCH, the same command recorded).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rolltool.engine import local as pool
from rolltool.engine import local as workers
from rolltool.engine.config import ExecutionConfig
from rolltool.errors import RolltoolError
from rolltool.jobs.pack import run_pack
from rolltool.plan.config import PackConfig

EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
COMMAND = ["rolltool", "pack", "(test)"]


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


pytestmark = pytest.mark.usefixtures("small_pools")


@pytest.mark.parametrize(
    "options",
    [
        {"dp": 4, "batch_size": 32},
        {"dp": 2, "batch_size": 64, "mini_batches": 2, "epochs": 2, "cp": 2},
        {"dp": 3, "batch_size": 96, "batch_unit": "samples", "estimator": "reinforce_pp_baseline",
         "order": "shuffle", "keep_last": True},
    ],
)  # fmt: skip
def test_same_bytes_with_two_workers(tmp_path: Path, options: dict) -> None:
    config = PackConfig.from_options(**options)
    for n in (1, 2):
        run_pack(
            [str(EXAMPLE)], tmp_path / f"w{n}", config, ExecutionConfig(workers=n), command=COMMAND
        )
    one, two = files(tmp_path / "w1"), files(tmp_path / "w2")
    assert one.keys() == two.keys() and len(one) > 3
    assert [k for k in one if one[k] != two[k]] == []


def test_pool_really_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """map_in_order in two processes returns what the serial map does, in order, and computes
    in other processes (their pids)."""
    got = workers.map_in_order(lambda x: (x * x, os.getpid()), list(range(20)), 2)
    assert [v for v, _ in got] == [x * x for x in range(20)]
    assert os.getpid() not in {pid for _, pid in got}


def test_iter_in_order_yields_each_result_when_it_is_asked_for() -> None:
    """Serially a result is computed only when the caller asks for it (so `schedule` folds one
    batch's steps before planning the next); in two processes the results and their order are
    the serial ones."""
    calls: list[int] = []

    def square(x: int) -> int:
        calls.append(x)
        return x * x

    it = workers.iter_in_order(square, list(range(5)), 1)
    assert calls == [] and next(it) == 0 and calls == [0]
    assert list(it) == [1, 4, 9, 16] and calls == list(range(5))
    assert list(workers.iter_in_order(lambda x: x * x, list(range(20)), 2)) == [
        x * x for x in range(20)
    ]


def test_the_pool_runs_at_most_a_window_ahead_of_the_caller() -> None:
    """While the caller holds its first result, the workers compute only the first chunk and
    those of the window after it (`WINDOW_PER_WORKER` per worker, of at most `MAX_CHUNK` items
    each: the next is submitted as the first is collected), not every item:
    finished results wait in the driver only until their turn. A shared counter (inherited by
    the forked workers) counts the items computed."""
    import multiprocessing
    import time

    done = multiprocessing.get_context("fork").Value("i", 0)

    def count(x: int) -> int:
        with done.get_lock():
            done.value += 1
        return x

    n, ahead = 40 * workers.MAX_CHUNK, (1 + 2 * workers.WINDOW_PER_WORKER) * workers.MAX_CHUNK
    it = workers.iter_in_order(count, list(range(n)), 2)
    assert next(it) == 0
    time.sleep(0.5)  # time for a pool that ran ahead unbounded to compute far more
    assert workers.MAX_CHUNK <= done.value <= ahead
    assert list(it) == list(range(1, n)) and done.value == n


def test_an_error_in_a_worker_is_the_serial_error(tmp_path: Path) -> None:
    config = PackConfig.from_options(dp=7, batch_size=32, equal_count=True)
    messages = []
    for n in (1, 2):
        with pytest.raises(RolltoolError) as e:
            run_pack(
                [str(EXAMPLE)],
                tmp_path / f"e{n}",
                config,
                ExecutionConfig(workers=n),
                command=COMMAND,
            )
        messages.append(str(e.value))
        assert not (tmp_path / f"e{n}").exists()
    assert messages[0] == messages[1] and "--equal-count" in messages[0]


def test_the_pool_packs_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the thresholds met, every step goes through the pack pool (`rolltool.pool`)."""
    seen: list[int] = []
    real = pool.pack_steps

    def spy(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        for done in real(*args, **kwargs):  # type: ignore[arg-type]
            seen.append(done.record.step)
            yield done

    monkeypatch.setattr("rolltool.engine.local.pack_steps", spy)
    config = PackConfig.from_options(dp=2, batch_size=32)
    m = run_pack(
        [str(EXAMPLE)], tmp_path / "p", config, ExecutionConfig(workers=2), command=COMMAND
    )
    assert seen == list(range(m.num_steps)) and m.num_steps >= 2


def test_a_worker_refuses_an_input_changed_since_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "in.parquet"
    shutil.copy(EXAMPLE, src)
    real = pool.pack_steps

    def touch_then_pack(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        st = src.stat()
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        yield from real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("rolltool.engine.local.pack_steps", touch_then_pack)
    config = PackConfig.from_options(dp=2, batch_size=32, cache_mb=0)
    with pytest.raises(RolltoolError, match="changed while rolltool was reading it"):
        run_pack([str(src)], tmp_path / "p", config, ExecutionConfig(workers=2), command=COMMAND)
    assert not (tmp_path / "p").exists()
    assert not list(tmp_path.glob(".p.*"))
