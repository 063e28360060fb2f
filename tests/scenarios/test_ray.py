"""``pack --engine ray`` (`rolltool.engine.ray`): Ray tasks give the same bytes as one process
and as two worker processes, survive a task killed mid-step, and stop cleanly on a failure that
persists.

One real multi-process local cluster for the module (2 CPUs, a small object store, no dashboard,
no usage stats, no auth), shut down at the end; the tests that need Ray are skipped where it is
not installed (``pip install -e '.[test,ray]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from rolltool.cli import main
from rolltool.engine import ray as ray_engine
from rolltool.engine.base import check_engine
from rolltool.engine.config import ExecutionConfig
from rolltool.engine.ray import RayEngine
from rolltool.errors import OptionConflict, RolltoolError
from rolltool.jobs.pack import run_pack
from rolltool.packing.step import Job, Packed
from rolltool.plan.config import PackConfig
from rolltool.plan.step_plan import PlannedStep

EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
COMMAND = ["rolltool", "pack", "(test)"]


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _count_maps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on `RayEngine.map_in_order`: the list gets the number of items of every call."""
    mapped: list[int] = []
    real_map = RayEngine.map_in_order

    def spy_map(self: RayEngine, fn, items, **kw):  # type: ignore[no-untyped-def]
        mapped.append(len(items))
        return real_map(self, fn, items, **kw)

    monkeypatch.setattr(RayEngine, "map_in_order", spy_map)
    return mapped


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(
            address="local",  # a cluster of its own, even where `ray start` left one running
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=96 * 2**20,
            log_to_driver=False,
            configure_logging=False,
        )
        try:
            yield
        finally:
            ray.shutdown()


pytestmark = pytest.mark.usefixtures("small_pools")


def pack_with(tmp_path: Path, name: str, config: PackConfig, **kw: object) -> Path:
    """`run_pack` of the example into ``tmp_path / name``, `kw` its `ExecutionConfig`."""
    execution = ExecutionConfig(**kw)  # type: ignore[arg-type]
    run_pack([str(EXAMPLE)], tmp_path / name, config, execution, command=COMMAND)
    return tmp_path / name


def crash_after_first_step(mode: str) -> Callable[[Job, list[PlannedStep]], list[Packed]]:
    """A stand-in for the pack task (`ray_engine._pack_task`) that dies (``os._exit``) right
    after packing its first step, that step's first shard cut in half, as a killed worker would
    leave it: ``once:PATH`` only the attempt that first creates PATH, ``always`` every attempt.
    A closure, so that Ray pickles it by value: its workers cannot import the tests."""
    real = ray_engine._pack_task

    def pack_task(job: Job, steps: list[PlannedStep]) -> list[Packed]:
        first = real(job, steps[:1])
        kind, _, marker = mode.partition(":")
        if kind == "once":
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return first + real(job, steps[1:])
        shard = job.root / min(first[0].files)
        os.truncate(shard, shard.stat().st_size // 2)
        os._exit(1)

    return pack_task


@pytest.mark.parametrize(
    "options",
    [
        {"dp": 4, "batch_size": 32, "order": "input"},
        {"dp": 2, "batch_size": 64, "mini_batches": 2, "epochs": 2, "cp": 2, "order": "completion"},
        {"dp": 3, "batch_size": 96, "batch_unit": "samples", "estimator": "reinforce_pp_baseline",
         "order": "shuffle", "keep_last": True},
    ],
)  # fmt: skip
def test_same_bytes_on_ray(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    """Every file of a Ray run equals the one-process and the two-worker run's, and every step
    and every batch went through Ray tasks."""
    seen: dict[str, list[int]] = {"steps": [], "batches": []}
    real_pack, real_map = RayEngine.pack_steps, RayEngine.map_in_order

    def spy_pack(self: RayEngine, *args: object):  # type: ignore[no-untyped-def]
        for done in real_pack(self, *args):  # type: ignore[arg-type]
            seen["steps"].append(done.record.step)
            yield done

    def spy_map(self: RayEngine, fn, items):  # type: ignore[no-untyped-def]
        seen["batches"].extend(b.index for b in items)
        return real_map(self, fn, items)

    monkeypatch.setattr(RayEngine, "pack_steps", spy_pack)
    monkeypatch.setattr(RayEngine, "map_in_order", spy_map)
    config = PackConfig.from_options(**options)
    one = files(pack_with(tmp_path, "one", config, workers=1))
    two = files(pack_with(tmp_path, "two", config, workers=2))
    on_ray = files(pack_with(tmp_path, "ray", config, engine="ray"))
    assert one.keys() == two.keys() == on_ray.keys() and len(one) > 3
    assert [k for k in one if not one[k] == two[k] == on_ray[k]] == []
    steps = len(json.loads(one["manifest.json"])["steps"])
    assert seen["steps"] == list(range(steps)) and steps >= 2
    assert seen["batches"] == list(range(len(seen["batches"]))) and seen["batches"]


@pytest.mark.parametrize("per_cpu", [1, 3])
def test_tasks_in_flight_stay_within_the_window(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_cpu: int
) -> None:
    """One step (or batch) per task: at no time are more than ``window`` tasks submitted and
    not yet collected (counted at every submission, not timed), the window is filled, and the
    bytes are the one-process run's."""
    window = max(2, 2 * per_cpu)  # the cluster has 2 CPUs
    count = {"submitted": 0, "collected": 0, "peak": 0}
    real_in_order, real_get = ray_engine.in_order, ray_engine._get

    def spy_in_order(submit, args, window, named):  # type: ignore[no-untyped-def]
        def counted(a):  # type: ignore[no-untyped-def]
            count["submitted"] += 1
            count["peak"] = max(count["peak"], count["submitted"] - count["collected"])
            return submit(a)

        return real_in_order(counted, args, window, named)

    def spy_get(ref, what):  # type: ignore[no-untyped-def]
        got = real_get(ref, what)
        count["collected"] += 1
        return got

    monkeypatch.setattr(ray_engine, "in_order", spy_in_order)
    monkeypatch.setattr(ray_engine, "_get", spy_get)
    monkeypatch.setattr(ray_engine, "MAX_CHUNK", 1)
    monkeypatch.setattr(ray_engine, "WINDOW_PER_CPU", per_cpu)
    config = PackConfig.from_options(dp=2, batch_size=16, order="completion")
    local = files(pack_with(tmp_path, "local", config, workers=1))
    on_ray = files(pack_with(tmp_path, "ray", config, engine="ray"))
    steps = len(json.loads(local["manifest.json"])["steps"])
    assert count["submitted"] == count["collected"] >= 2 * steps > 2 * window
    assert count["peak"] == window
    assert local == on_ray


def test_the_exchange_path_on_ray(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced onto the exchange path, Ray tasks pack every step from its bucket: the shards and
    samples.parquet equal the direct one-process run's, and no bucket is left behind."""
    from rolltool.jobs import pack as pack_module

    config = PackConfig.from_options(dp=2, batch_size=32, order="shuffle", cache_mb=0)
    direct = files(pack_with(tmp_path, "direct", config, workers=1))
    monkeypatch.setattr(pack_module, "EXCHANGE_AT", 0.0)
    via = files(pack_with(tmp_path, "ray", config, engine="ray"))
    assert json.loads(via["manifest.json"])["reads"]["path"] == "exchange"
    shards = [k for k in direct if k != "manifest.json"]
    assert shards and via.keys() == direct.keys()
    assert [k for k in shards if via[k] != direct[k]] == []


@pytest.mark.parametrize("view", ["rollouts", "packed"])
def test_stats_on_ray_prints_the_local_output(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, view: str
) -> None:
    """``stats --engine ray``: every piece of the input (a row group here) or every step is
    computed by a Ray task, and the tables and --json are the local ones, byte for byte."""
    import pyarrow.parquet as pq

    from rolltool.stats import rollouts

    if view == "rollouts":
        pq.write_table(pq.read_table(EXAMPLE), tmp_path / "in.parquet", row_group_size=50)
        monkeypatch.setattr(rollouts, "PIECE_TOKENS", 1)
        path, pieces = tmp_path / "in.parquet", -(-pq.read_metadata(EXAMPLE).num_rows // 50)
    else:
        path = pack_with(tmp_path, "packed", PackConfig.from_options(dp=2, batch_size=32))
        pieces = len(json.loads((path / "manifest.json").read_text())["steps"])
    mapped = _count_maps(monkeypatch)
    for args in (["--json"], ["--per-step", "--step", "1"] if view == "packed" else []):
        local = CliRunner().invoke(main, ["stats", str(path), *args])
        on_ray = CliRunner().invoke(main, ["stats", str(path), *args, "--engine", "ray"])
        assert local.exit_code == on_ray.exit_code == 0, on_ray.output
        assert on_ray.stdout == local.stdout and len(local.stdout) > 1000
    assert mapped == [pieces, pieces] and pieces > 3


def test_the_advantages_scan_on_ray_writes_the_local_file(cluster: None, tmp_path: Path) -> None:
    """`run_advantages` with `RayEngine.map_in_order` as its mapper (what ``advantages --engine
    ray`` passes): every row group is scanned by a Ray task, the file written and the report are
    the local run's, and a row that breaks a rule stops both runs with the same message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rolltool.jobs.advantages import run_advantages
    from rolltool.plan.advantages import AdvantageConfig

    table = pq.read_table(EXAMPLE)
    mask = table["loss_mask"].to_pylist()
    mask[200] = mask[200][:-1]  # shorter than its input_ids
    broken = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                              pa.array(mask, table.schema.field("loss_mask").type))  # fmt: skip
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=40)
    pq.write_table(broken, tmp_path / "broken.parquet", row_group_size=40)
    groups = pq.read_metadata(tmp_path / "in.parquet").num_row_groups
    mapped: list[int] = []

    def mapper(fn, items):  # type: ignore[no-untyped-def]
        mapped.append(len(items))
        return RayEngine(cpus=2).map_in_order(fn, items, "scanning row groups")

    config = AdvantageConfig()
    local = run_advantages([str(tmp_path / "in.parquet")], tmp_path / "l.parquet", config)
    ray = run_advantages([str(tmp_path / "in.parquet")], tmp_path / "r.parquet", config,
                         mapper=mapper)  # fmt: skip
    assert mapped == [groups] and groups >= 8
    assert (tmp_path / "l.parquet").read_bytes() == (tmp_path / "r.parquet").read_bytes()
    assert {**ray, "output": local["output"]} == local
    messages = []
    for name, kw in {"local": {}, "ray": {"mapper": mapper}}.items():
        with pytest.raises(RolltoolError) as e:
            run_advantages([str(tmp_path / "broken.parquet")], tmp_path / f"{name}.bad", config,
                           **kw)  # type: ignore[arg-type]  # fmt: skip
        messages.append(str(e.value))
        assert not (tmp_path / f"{name}.bad").exists()
    assert messages[0] == messages[1] and "sample" in messages[0] and len(mapped) > 1


def test_packs_scan_and_checks_on_ray_give_the_local_messages(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pack --engine ray``: the deferred scan's row groups are Ray tasks (a spy counts them),
    the token columns are checked in the pack tasks, and a row that breaks a rule stops the
    run with the local run's message (the full scan's listing), whichever of them finds it: a
    reward (the scan), a token id and a logprob (the tasks' fetch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(EXAMPLE)

    def broken(name: str, row: int, value: object) -> Path:
        values = table[name].to_pylist()
        if isinstance(values[row], list):
            values[row][-1] = value
        else:
            values[row] = value
        path = tmp_path / f"{name}.parquet"
        col = pa.array(values, table.schema.field(name).type)
        pq.write_table(table.set_column(table.schema.get_field_index(name), name, col), path,
                       row_group_size=40)  # fmt: skip
        return path

    mapped = _count_maps(monkeypatch)
    config = PackConfig.from_options(dp=4, batch_size=32)
    groups = pq.read_metadata(broken("reward", 0, 0.5)).num_row_groups
    for name, value in {"reward": float("nan"), "input_ids": -1, "logprobs": float("inf")}.items():
        path = broken(name, 150, value)
        messages = []
        for where, kw in {"local": {"workers": 1}, "ray": {"engine": "ray"}}.items():
            mapped.clear()
            with pytest.raises(RolltoolError) as e:
                execution = ExecutionConfig(**kw)  # type: ignore[arg-type]
                run_pack([str(path)], tmp_path / where, config, execution, command=COMMAND)
            messages.append(str(e.value))
            assert not (tmp_path / where).exists()
        assert messages[0] == messages[1] and f"'{name}'" in messages[0], messages
        assert groups >= 8 and mapped[0] == groups  # the deferred scan, as Ray tasks


def test_the_advantages_cli_on_ray_writes_the_local_file(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rolltool advantages --engine ray``: the row groups are scanned by Ray tasks (counted),
    and the file and --json report are the local run's; --workers with it is refused."""
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(EXAMPLE), tmp_path / "in.parquet", row_group_size=40)
    groups = pq.read_metadata(tmp_path / "in.parquet").num_row_groups
    mapped = _count_maps(monkeypatch)
    runs = {}
    for name, extra in (("local", ["--workers", "1"]), ("ray", ["--engine", "ray"])):
        out = tmp_path / f"{name}.parquet"
        args = ["advantages", str(tmp_path / "in.parquet"), "-o", str(out), "--json", *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        runs[name] = (out.read_bytes(), json.loads(result.stdout))
    assert runs["ray"][0] == runs["local"][0]
    assert {**runs["ray"][1], "output": ""} == {**runs["local"][1], "output": ""}
    assert mapped == [groups] and groups >= 8
    refused = CliRunner().invoke(
        main, ["advantages", str(EXAMPLE), "-o", str(tmp_path / "x.parquet"), "--engine", "ray",
               "--workers", "2"],
    )  # fmt: skip
    assert refused.exit_code != 0 and "--workers" in refused.output
    assert not (tmp_path / "x.parquet").exists()


def test_ray_tasks_run_elsewhere_in_order(cluster: None) -> None:
    got = RayEngine(cpus=2).map_in_order(lambda x: (x * x, os.getpid()), list(range(20)))
    assert [v for v, _ in got] == [x * x for x in range(20)]
    assert os.getpid() not in {pid for _, pid in got}


def test_a_task_killed_mid_step_is_retried(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pack task dies after writing half of a shard (`crash_after_first_step`); Ray
    runs it again, it rewrites the same names, and the output is byte for byte the local one."""
    config = PackConfig.from_options(dp=2, batch_size=32)
    local = files(pack_with(tmp_path, "local", config, workers=1))
    marker = tmp_path / "crashed"
    monkeypatch.setattr(ray_engine, "_pack_task", crash_after_first_step(f"once:{marker}"))
    retried = files(pack_with(tmp_path, "ray", config, engine="ray"))
    assert marker.exists()  # a task really died
    assert local == retried


def test_a_failure_that_persists_stops_the_run(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_engine, "_pack_task", crash_after_first_step("always"))
    monkeypatch.setattr(ray_engine, "RETRIES", 1)
    config = PackConfig.from_options(dp=2, batch_size=32)
    with pytest.raises(RolltoolError) as e:
        pack_with(tmp_path, "p", config, engine="ray")
    assert "\n" not in e.value.message
    assert "packing step" in e.value.message and "2 times" in e.value.message
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob(".p*"))


def test_an_error_in_a_task_is_the_local_error(cluster: None, tmp_path: Path) -> None:
    config = PackConfig.from_options(dp=7, batch_size=32, equal_count=True)
    messages = []
    for name, kw in {"local": {"workers": 1}, "ray": {"engine": "ray"}}.items():
        with pytest.raises(RolltoolError) as e:
            pack_with(tmp_path, name, config, **kw)
        messages.append(str(e.value))
        assert not (tmp_path / name).exists()
    assert messages[0] == messages[1] and "--equal-count" in messages[0]


def test_the_cli_packs_on_ray(cluster: None, tmp_path: Path) -> None:
    args = ["pack", str(EXAMPLE), "--dp", "4", "--json"]
    local = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "l")])
    on_ray = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "r"), "--engine", "ray"])
    assert local.exit_code == on_ray.exit_code == 0, on_ray.output
    same = files(tmp_path / "l")
    same.pop("manifest.json")  # the command differs
    assert {k: v for k, v in files(tmp_path / "r").items() if k in same} == same


def test_a_node_without_the_output_directory_says_so(tmp_path: Path) -> None:
    """A task that does not see the driver's directory (no shared filesystem) stops the run."""
    job = Job(reader=None, cache_bytes=0, root=tmp_path / "elsewhere", shard_bytes=1,  # type: ignore[arg-type]
                   config=PackConfig(dp=1))  # fmt: skip
    with pytest.raises(RolltoolError, match="does not see the output directory") as e:
        ray_engine._pack_task(job, [])
    assert "shared" in (e.value.hint or "") or "filesystem" in (e.value.hint or "")


def test_an_address_that_refuses_connections_is_an_error(cluster: None) -> None:
    for address in ("127.0.0.1:1", "ray://127.0.0.1:1", "no-port"):
        with pytest.raises(RolltoolError, match="cannot reach the Ray cluster"):
            with ray_engine.attach(address):
                pass


def test_ray_address_needs_engine_ray(tmp_path: Path) -> None:
    config = PackConfig.from_options(dp=2)
    with pytest.raises(OptionConflict, match="--ray-address"):
        pack_with(tmp_path, "p", config, ray_address="auto")
    with pytest.raises(OptionConflict, match="--workers"):
        pack_with(tmp_path, "p", config, engine="ray", workers=2)
    result = CliRunner().invoke(
        main,
        ["pack", str(EXAMPLE), "--dp", "2", "-o", str(tmp_path / "c"), "--ray-address", "auto"],
    )
    assert result.exit_code == 2 and "--ray-address" in result.output
    assert not (tmp_path / "p").exists() and not (tmp_path / "c").exists()
    # the other commands refuse the same (rolltool.engine.base.check_engine), in the same words
    cases = [(("local", "auto", None), {"ray_address": "auto"}),
             (("ray", None, 2), {"engine": "ray", "workers": 2})]  # fmt: skip
    for args, kw in cases:
        with pytest.raises(OptionConflict) as by_pack:
            pack_with(tmp_path, "p", config, **kw)
        with pytest.raises(OptionConflict) as shared:
            check_engine(*args)
        assert str(by_pack.value) == str(shared.value)


def test_ray_is_imported_only_for_engine_ray(tmp_path: Path) -> None:
    code = (
        "import sys, rolltool, rolltool.cli, rolltool.jobs.pack\n"
        "from rolltool.engine.config import ExecutionConfig\n"
        "from rolltool.plan.config import PackConfig\n"
        f"rolltool.jobs.pack.run_pack([{str(EXAMPLE)!r}], {str(tmp_path / 'o')!r}, "
        "PackConfig.from_options(dp=2), ExecutionConfig(workers=1))\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sigterm_of_the_driver_mid_pack_is_the_local_engines(cluster: None, tmp_path: Path) -> None:
    """``pack --engine ray`` SIGTERMed mid-pack (a pack task is running): exit 143 and the
    local engine's "Interrupted by SIGTERM" line, not Ray's exit 15 with its "*** SIGTERM
    received" dump; nothing is left. The child attaches to this module's cluster, its pack task
    made slow (a closure, pickled by value) after it creates a marker."""
    import signal
    import time

    import ray

    marker, out = tmp_path / "packing", tmp_path / "out"
    code = (
        "import os, sys, time\n"
        "from rolltool.engine import ray as ray_engine\n"
        "from rolltool.cli import main\n"
        "def slow(job, steps):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(60)\n"
        "ray_engine._pack_task = slow\n"
        "sys.argv = ['rolltool'] + sys.argv[1:]\n"
        "main()\n"
    )
    address = ray.get_runtime_context().gcs_address
    args = ["pack", str(EXAMPLE), "--dp", "2", "-o", str(out), "--engine", "ray",
            "--ray-address", address]  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "no pack task ran"
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, stderr
    assert "Interrupted by SIGTERM: no output was written" in stderr
    assert "SIGTERM received" not in stderr and "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_cluster_that_wants_a_token_says_so() -> None:
    """Defect 9 of issue 20: a connection refused for a missing token said "start one with ray
    start --head" while the cluster was running; it says the token is missing, and a head that
    accepts connections is never told to be started."""
    ray = pytest.importorskip("ray")
    refused = ray_engine._not_connected("10.0.0.1:6379", ConnectionError("InvalidAuthToken: ..."))
    assert "token" in refused.message and "RAY_AUTH_MODE=token" in (refused.hint or "")
    auth = ray_engine._not_connected("h:1", ray.exceptions.AuthenticationError("no token"))
    assert "RAY_AUTH_MODE=token" in (auth.hint or "")
    silent = ray_engine._not_connected("10.0.0.1:6379", ConnectionError("timed out"))
    assert "ray start --head`," not in (silent.hint or "") and "token" in (silent.hint or "")
    assert "\n" not in refused.message + auth.message + silent.message


# Ray Data last: its driver threads (a prefetcher, ...) live until the cluster shuts down, and a
# fork of a process with a thread holding a lock can hang (the local runs above fork workers).


def test_the_exchange_path_through_ray_data(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced onto the exchange path on a cluster taken for two nodes, Ray Data's shuffle
    (`RayEngine.exchange_steps`) replaces the local buckets: the shards and samples.parquet equal
    the direct one-process run's; with --epochs 2 every sample is shuffled to two steps."""
    from rolltool.jobs import pack as pack_module

    config = PackConfig.from_options(dp=2, batch_size=32, mini_batches=2, epochs=2,
                                     order="shuffle", cache_mb=0)  # fmt: skip
    direct = files(pack_with(tmp_path, "direct", config, workers=1))
    shuffled: list[int] = []
    real = RayEngine.exchange_steps

    def via_ray_data(self: RayEngine, steps, job):  # type: ignore[no-untyped-def]
        for done in real(self, steps, job):
            shuffled.append(done.record.step)
            yield done

    monkeypatch.setattr(pack_module, "EXCHANGE_AT", 0.0)
    monkeypatch.setattr(ray_engine, "DATA_EXCHANGE_NODES", 1)  # as on a cluster of 2+ nodes
    monkeypatch.setattr(pack_module, "_exchange", None)  # no local buckets
    monkeypatch.setattr(RayEngine, "exchange_steps", via_ray_data)
    via = files(pack_with(tmp_path, "ray", config, engine="ray"))
    assert json.loads(via["manifest.json"])["reads"]["path"] == "exchange"
    steps = len(json.loads(direct["manifest.json"])["steps"])
    assert shuffled == list(range(steps)) and steps > 4
    shards = [k for k in direct if k != "manifest.json"]
    assert shards and via.keys() == direct.keys()
    assert [k for k in shards if via[k] != direct[k]] == []


def test_an_input_changed_before_the_ray_data_exchange_is_refused(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ray Data task that finds the input changed since the scan raises rolltool's own error
    (not Ray's wrapper), and nothing is left behind."""
    import shutil

    from rolltool.jobs import pack as pack_module

    copy = tmp_path / "in.parquet"
    shutil.copy(EXAMPLE, copy)
    real = RayEngine.exchange_steps

    def changed_first(self: RayEngine, steps, job):  # type: ignore[no-untyped-def]
        os.utime(copy, (0, 0))
        return real(self, steps, job)

    monkeypatch.setattr(pack_module, "EXCHANGE_AT", 0.0)
    monkeypatch.setattr(ray_engine, "DATA_EXCHANGE_NODES", 1)
    monkeypatch.setattr(RayEngine, "exchange_steps", changed_first)
    config = PackConfig.from_options(dp=2, batch_size=32, order="shuffle", cache_mb=0)
    with pytest.raises(RolltoolError, match="changed while rolltool was reading it") as e:
        run_pack(
            [str(copy)], tmp_path / "out", config, ExecutionConfig(engine="ray"), command=COMMAND
        )
    assert "\n" not in e.value.message and str(copy) in e.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_an_input_changed_during_the_ray_data_exchange_is_one_error(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 7 of issue 20: the input changed after some row groups were read (the last read
    task rewrites the file's time first): the steps short of samples came back as errors, which
    the driver passed on as records (``AttributeError: 'RolltoolError' object has no attribute
    'files'``). It is the changed file's one `RolltoolError`, and nothing is written."""
    import pyarrow.parquet as pq

    from rolltool.engine import ray_exchange
    from rolltool.jobs import pack as pack_module

    copy = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(EXAMPLE), copy, row_group_size=50)
    last = pq.read_metadata(copy).num_row_groups - 1
    real = ray_exchange._read_blocks

    def touching_last(batch, job, pairs, starts):  # type: ignore[no-untyped-def]
        if last in batch["id"].to_pylist():
            os.utime(str(copy), (0, 0))
        return real(batch, job, pairs, starts)

    monkeypatch.setattr(pack_module, "EXCHANGE_AT", 0.0)
    monkeypatch.setattr(ray_engine, "DATA_EXCHANGE_NODES", 1)
    monkeypatch.setattr(ray_exchange, "_read_blocks", touching_last)
    config = PackConfig.from_options(dp=2, batch_size=32, order="shuffle", cache_mb=0)
    with pytest.raises(RolltoolError, match="changed while rolltool was reading it") as e:
        run_pack(
            [str(copy)], tmp_path / "out", config, ExecutionConfig(engine="ray"), command=COMMAND
        )
    assert "\n" not in e.value.message and str(copy) in e.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]
