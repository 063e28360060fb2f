"""The old flat import paths keep working for one release, each with a DeprecationWarning naming
the new path, and give the very module (or, for a split module, the very objects) of the new
layout; every old name is covered, in a fresh interpreter each, so no earlier import hides one."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from rolltool._deprecated import MOVED, targets

OLD_NAMES = {  # a name each old module was imported for, before the layers
    "rolltool.layout": "step_rows",
    "rolltool.split": "GroupSplit",
    "rolltool.shards": "write_shard",
    "rolltool.jsonable": "jsonable",
    "rolltool.numfmt": "pct",
    "rolltool.problems": "Problems",
    "rolltool.fs": "Location",
    "rolltool.remote": "RemoteRun",
    "rolltool.outputs": "atomic_path",
    "rolltool.source": "resolve_inputs",
    "rolltool.synth": "SynthConfig",
    "rolltool.writer": "PackedWriter",
    "rolltool.reader": "open_packed",
    "rolltool.torch_data": "RankRows",
    "rolltool.advantages": "ESTIMATORS",
    "rolltool.minibatches": "cut_points",
    "rolltool.loss": "LOSS_AGGS",
    "rolltool.workload": "Workload",
    "rolltool.steps": "StepConfig",
    "rolltool.schedule": "schedule",
    "rolltool.config": "PackConfig",
    "rolltool.partition": "plan_step",
    "rolltool.tokens": "TokenReader",
    "rolltool.exchange": "Buckets",
    "rolltool.readplan": "read_plan",
    "rolltool.workers": "map_in_order",
    "rolltool.ray_engine": "RayEngine",
    "rolltool.ray_exchange": "exchange_steps",
    "rolltool.rewrite": "append_columns",
    "rolltool.pool": "pack_steps",
    "rolltool.pack": "run_pack",
}


def test_every_moved_module_is_listed_here() -> None:
    assert set(OLD_NAMES) == set(MOVED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_warns_and_is_the_new_module(old: str) -> None:
    name = OLD_NAMES[old]
    if old == "rolltool.torch_data":
        pytest.importorskip("torch")
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error')\n"
        "import rolltool\n"
        "try:\n"
        f"    importlib.import_module({old!r})\n"
        "except DeprecationWarning as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no warning')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    new = targets(old)
    assert new is not None and all(n in proc.stdout for n in new), proc.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = getattr(importlib.import_module(old), name)
    holders = [importlib.import_module(n) for n in new]
    assert any(getattr(m, name, None) is got for m in holders)
    if len(new) == 1:
        assert importlib.import_module(old) is holders[0]
        assert holders[0].__spec__.name == new[0]  # the import system's rename undone


def test_a_moved_packages_submodule_is_not_loaded_twice() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("rolltool.partition.kk")
    assert old is importlib.import_module("rolltool.plan.partition.kk")


def test_the_warning_points_at_the_importing_line(tmp_path) -> None:
    script = tmp_path / "user.py"
    script.write_text("import rolltool.reader\n")
    proc = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", str(script)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{script}:1: DeprecationWarning: rolltool.reader has moved" in proc.stderr


def test_new_paths_do_not_warn() -> None:
    code = (
        "import warnings\nwarnings.simplefilter('error')\n"
        "import rolltool, rolltool.cli, rolltool.jobs.pack, rolltool.packed.reader\n"
        "rolltool.open_packed, rolltool.run_pack, rolltool.PackConfig\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_split_module_proxies_renames_star_imports_and_patches() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pool = importlib.import_module("rolltool.pool")
        ray_engine = importlib.import_module("rolltool.ray_engine")
        namespace: dict = {}
        exec("from rolltool.pack import *", namespace)
    local = importlib.import_module("rolltool.engine.local")
    base = importlib.import_module("rolltool.engine.base")
    assert pool.worth_it is local.pack_worth_it  # pool's own worth_it, under its new name
    assert ray_engine.CHUNKS_PER_CPU == base.CHUNKS_PER_WORKER
    assert pool.CHUNKS_PER_WORKER == base.CHUNKS_PER_WORKER
    assert {"run_pack", "write_step", "manifest_record"} <= set(namespace)
    assert "pack_steps" in dir(pool)
    old = local.MIN_WORKERS
    try:
        pool.MIN_WORKERS = old + 1  # a patch through the old path reaches the code
        assert local.MIN_WORKERS == old + 1
    finally:
        local.MIN_WORKERS = old
