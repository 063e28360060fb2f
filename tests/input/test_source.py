"""Input resolution: each file once whatever its spelling, resolved paths recorded, and a
bounded number of open files whatever the number of inputs."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rolltool.input.parquet as parquet
import rolltool.input.resolve as resolve
from rolltool.input.parquet import InputFile, read_row_group, read_row_groups
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import scan


def _rows(k: int, n: int = 4) -> dict[str, Any]:
    return {
        "group_id": [f"g{k}"] * n,
        "rollout_id": list(range(n)),
        "sample_id": [f"s{k}-{i}" for i in range(n)],
        "reward": [float(i % 2) for i in range(n)],
        "input_ids": pa.array([[1, 2, 3]] * n, pa.list_(pa.int32())),
        "loss_mask": pa.array([[0, 1, 1]] * n, pa.list_(pa.int8())),
    }


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path/data/{a,b}.parquet and data/sub/c.parquet, with tmp_path as the cwd."""
    monkeypatch.chdir(tmp_path)
    for k, name in enumerate(["a.parquet", "b.parquet", "sub/c.parquet"]):
        path = tmp_path / "data" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(_rows(k)), path)
    return tmp_path / "data"


@pytest.mark.parametrize(
    ("spellings", "kept"),
    [
        (["data/a.parquet", "{root}/data/a.parquet"], "data/a.parquet"),  # relative, absolute
        (["{root}/data/a.parquet", "data/a.parquet"], "{root}/data/a.parquet"),
        (["data/../data/a.parquet", "data/./a.parquet"], "data/../data/a.parquet"),
        (["data/*.parquet", "data/a.parquet"], "data/a.parquet"),  # a glob and a path
        (["data", "data/a.parquet", "data/sub/c.parquet"], "data/a.parquet"),  # a directory
        (["link.parquet", "data/a.parquet"], "link.parquet"),  # a symlink
    ],
)
def test_a_file_named_twice_is_read_once(data: Path, spellings: list[str], kept: str) -> None:
    root = data.parent
    (root / "link.parquet").symlink_to(data / "a.parquet")
    inputs = [s.format(root=root) for s in spellings]
    files = resolve_inputs(inputs)
    resolved = [f.resolved for f in files]
    assert len(resolved) == len(set(resolved))
    assert str((data / "a.parquet").resolve()) in resolved
    # the first spelling is kept, and the list is in sorted order of the kept spellings
    first = next(f for f in files if f.resolved == str((data / "a.parquet").resolve()))
    assert first.path == kept.format(root=root)
    assert [f.path for f in files] == sorted(f.path for f in files)
    ro = scan(files)  # would report every sample_id as repeated if a file were read twice
    assert ro.num_samples == 4 * len(files)


def test_a_directory_named_twice_keeps_its_partitions(data: Path) -> None:
    for k, env in enumerate(["math", "code"]):
        path = data / "hive" / f"env={env}" / "x.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(pa.table(_rows(k)), path)
    files = resolve_inputs(["data/hive", str(data.resolve() / "hive" / "env=math")])
    assert [f.path for f in files] == [
        "data/hive/env=code/x.parquet",
        "data/hive/env=math/x.parquet",
    ]
    assert [f.partitions for f in files] == [{"env": "code"}, {"env": "math"}]
    assert scan(files).env_names == ["code", "math"]


@pytest.mark.parametrize("fault", ["unlistable", "unenterable"])
def test_a_folder_that_cannot_be_read_is_an_error_not_skipped(
    data: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # tests run as root, who reads any folder: simulate a folder without r (listing fails)
    # or without x (looking inside fails) for data/sub, the folder that holds c.parquet
    assert [f.path for f in resolve_inputs(["data"])][-1] == "data/sub/c.parquet"
    hits: list[str] = []

    def refuse(real: Any) -> Any:
        def call(path: Any, *args: Any) -> Any:
            if Path(path).name == "sub" or Path(path).parent.name == "sub":
                hits.append(str(path))
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args)

        return call

    if fault == "unlistable":
        monkeypatch.setattr(os, "scandir", refuse(os.scandir))
    else:
        monkeypatch.setattr(resolve, "is_packed_dir", refuse(resolve.is_packed_dir))
    with pytest.raises(resolve.RolltoolError, match=r"data/sub: cannot read this folder") as e:
        resolve_inputs(["data"])
    assert hits and "Permission denied" in e.value.message


def test_resolved_paths_are_absolute_and_work_from_elsewhere(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = resolve_inputs(["data/a.parquet"])
    assert files[0].path == "data/a.parquet"
    assert Path(files[0].resolved).is_absolute()
    assert files[0].resolved == str((data / "a.parquet").resolve())
    monkeypatch.chdir("/")
    assert pq.read_metadata(files[0].resolved).num_rows == 4


def _limit_files(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX rlimits")
def test_many_input_files_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """200 input files with `ulimit -n 128`: pack and stats hold a bounded number of files open
    (it used to fail with "not a readable Parquet file (Too many open files)")."""
    data = tmp_path / "many"
    data.mkdir()
    for k in range(200):
        pq.write_table(pa.table(_rows(k)), data / f"part-{k:03d}.parquet")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for args in (
        ["pack", str(data), "-o", str(tmp_path / "out"), "--dp", "2", "--batch-size", "16"],
        [
            "pack",
            str(data),
            "-o",
            str(tmp_path / "o0"),
            "--dp",
            "1",
            "--batch-size",
            "16",
            "--cache-mb",
            "0",
        ],
        ["verify", str(tmp_path / "out")],
        ["stats", str(data), "--json"],
        ["stats", str(data), "--json", "--limit", "5"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "rolltool", *args],
            preexec_fn=lambda: _limit_files(128),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "manifest.json").is_file()


# -- one footer parse per file -------------------------------------------------------------------


def _open_fds(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_row_groups_read_one_at_a_time_parse_the_footer_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading every row group of a file one at a time (the token reader with --cache-mb 0,
    verify) parsed its footer each time: quadratic in row groups. Now once per file while it
    is unchanged, and no file stays open."""
    path = tmp_path / "rg.parquet"
    pq.write_table(pa.table(_rows(0, n=300)), path, row_group_size=1)
    parses = []
    real = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda p, **kw: parses.append(p) or real(p, **kw))
    file = InputFile(str(path), 300)
    got = [read_row_group(file, {}, ["sample_id"], rg).column(0)[0].as_py() for rg in range(300)]
    assert got == [f"s0-{i}" for i in range(300)]
    assert len(parses) == 1
    assert _open_fds(path) == 0
    # a file changed since: its new footer is read, never the old one's offsets
    pq.write_table(pa.table(_rows(1, n=3)), path, row_group_size=2)
    os.utime(path, ns=(1, 1))
    assert read_row_group(file, {}, ["sample_id"], 1).column(0).to_pylist() == ["s1-2"]
    assert len(parses) == 2
    assert len(parquet._footers) <= parquet.FOOTERS_KEPT


def test_row_groups_read_together_open_the_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rg.parquet"
    pq.write_table(pa.table(_rows(0, n=50)), path, row_group_size=5)
    opened = []
    real = parquet._open
    monkeypatch.setattr(parquet, "_open", lambda p: opened.append(p) or real(p))
    file = InputFile(str(path), 50, partitions={"env": "math"})
    wanted = [7, 2, 9]
    tables = read_row_groups(file, {"sample_id": "id"}, ["id", "env"], wanted)
    assert len(opened) == 1 and _open_fds(path) == 0
    for rg, t in zip(wanted, tables, strict=True):
        assert t.column_names == ["id", "env"]
        assert t.equals(read_row_group(file, {"sample_id": "id"}, ["id", "env"], rg))
        assert t.column("id").to_pylist() == [f"s0-{i}" for i in range(5 * rg, 5 * rg + 5)]
