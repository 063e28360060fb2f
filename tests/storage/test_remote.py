"""Outputs and reads on a filesystem without rename (object storage): the ``norename://``
filesystem of tests/fs_helpers.py (a local folder whose ``move`` is refused, no network) and,
for the tests of the protocol (the ``far`` fixture), a real S3 server (SeaweedFS on 127.0.0.1,
tests/s3_server.py).

A pack there holds exactly the bytes of a local pack (one process and worker processes),
verifies and reads back; the manifest is the commit marker (no manifest: the reader and verify
refuse the prefix); --force replaces only a finished rolltool output; a run killed mid-way
leaves no manifest, and the next run deletes its files and claim by run id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fs_helpers
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import Result
from fault_hooks import HERE, Injector
from s3_server import S3Store

from rolltool.errors import RolltoolError
from rolltool.input.synth import SynthConfig, generate
from rolltool.packed.reader import open_packed
from rolltool.storage import remote
from rolltool.storage.fs import locate
from rolltool.verify import run_verify

PACK = ("--dp", 2, "--batch-size", 16, "--keep-last")

RunCli = Callable[..., Result]
Far = fs_helpers.Folder | S3Store


@pytest.fixture(autouse=True)
def _norename(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fs_helpers.rfs.SCHEMES, fs_helpers.SCHEME, fs_helpers._open)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    fs_helpers.refused.clear()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 samples of synthetic rollouts, in row groups of 16."""
    path = tmp_path_factory.mktemp("data") / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=8, max_len=2048)), path, row_group_size=16)
    return path


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (folders left empty by deletes do not count)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _pack(run_cli: RunCli, data: Path, out: str | Path, *extra: Any) -> Result:
    return run_cli("pack", data, "-o", out, *PACK, *extra)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_pack_without_rename_holds_the_local_bytes_verifies_and_reads_back(
    workers: int, data: Path, tmp_path: Path, run_cli: RunCli, small_pools: None, far: Far
) -> None:
    local = tmp_path / "local"
    assert _pack(run_cli, data, local, "--workers", workers).exit_code == 0
    done = _pack(run_cli, data, far.uri(), "--workers", workers)
    assert done.exit_code == 0, done.output
    ours, theirs = _files(local), far.files()
    assert len(ours) >= 4 and ours.keys() == theirs.keys()  # shards, samples, manifest
    assert all(ours[k] == theirs[k] for k in ours), [k for k in ours if ours[k] != theirs[k]]
    report = run_verify(far.uri())
    assert report.ok and report.checked["files"] == len(ours) - 1, report.problems.listed()
    a, b = open_packed(local), open_packed(far.uri(), verify="hash")
    rows = 0
    for rank in range(a.dp):
        for (s1, m1, r1), (s2, m2, r2) in zip(a.rank_iter(rank), b.rank_iter(rank), strict=True):
            assert (s1, m1) == (s2, m2) and r1.keys() == r2.keys()
            assert all(np.array_equal(r1[k], r2[k]) for k in r1)
            rows += 1
    assert rows == sum(r.micro_batches for st in a.manifest.steps for r in st.ranks) > 0


def test_no_manifest_is_no_output_for_the_reader_and_verify(
    data: Path, tmp_path: Path, run_cli: RunCli, far: Far
) -> None:
    assert _pack(run_cli, data, far.uri()).exit_code == 0
    far.delete("manifest.json")
    for open_it in (open_packed, run_verify):
        with pytest.raises(RolltoolError, match=r"no manifest\.json: not a finished rolltool"):
            open_it(far.uri())
    result = run_cli("verify", far.uri())
    assert result.exit_code == 1 and "no manifest.json" in result.stderr
    assert "Traceback" not in result.output
    assert _pack(run_cli, data, tmp_path / "near").exit_code == 0
    (tmp_path / "near" / "manifest.json").unlink()
    with pytest.raises(RolltoolError, match=r"no manifest\.json"):  # a local folder: the same
        open_packed(tmp_path / "near")


def test_force_replaces_only_a_finished_rolltool_output(
    data: Path, tmp_path: Path, run_cli: RunCli, far: Far
) -> None:
    ref = tmp_path / "ref"
    assert _pack(run_cli, data, far.uri(), "--dp", 4).exit_code == 0
    refused = _pack(run_cli, data, far.uri())
    assert refused.exit_code == 1 and "already exists" in refused.stderr
    before = far.files()
    assert any(k.startswith("rank-0003/") for k in before)
    # --force: the dp=4 output's files all go (rank-0002/3 would not be overwritten), the new
    # output is a local pack's bytes
    assert _pack(run_cli, data, far.uri(), "--force").exit_code == 0
    assert _pack(run_cli, data, ref).exit_code == 0
    assert far.files() == _files(ref)
    # a file rolltool did not write: --force refuses and deletes nothing
    far.put("notes.txt", b"mine")
    kept = far.files()
    foreign = _pack(run_cli, data, far.uri(), "--force")
    assert foreign.exit_code == 1 and "notes.txt" in foreign.stderr
    assert far.files() == kept
    assert fs_helpers.refused == []


def test_a_failed_run_deletes_what_it_wrote(
    data: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch, far: Far
) -> None:
    from rolltool.packed.writer import PackedWriter

    def boom(self: PackedWriter, manifest: Any) -> Any:
        assert far.files()  # shards and samples were uploaded, a claim is there
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PackedWriter, "finish", boom)
    result = _pack(run_cli, data, far.uri())
    assert result.exit_code == 1 and "No space left" in result.stderr
    assert far.files() == {}


CHILD = f"""
import sys
sys.path.insert(0, {HERE!r})
import fault_hooks, fs_helpers
fs_helpers.register()
fault_hooks.Injector.from_env().install_global()
from rolltool.cli import main
main(sys.argv[1:])
"""


def test_a_killed_run_leaves_no_manifest_and_the_next_cleans_up_by_run_id(
    data: Path, tmp_path: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch, far: Far
) -> None:
    ref = tmp_path / "ref"
    assert _pack(run_cli, data, ref).exit_code == 0
    argv = [sys.executable, "-c", CHILD, "pack", data, "-o", far.uri(), *PACK]
    env = Injector(at=3, only="write_shard").env()
    killed = subprocess.run(list(map(str, argv)), env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = far.files()
    claims = [k for k in left if k.startswith(remote.CLAIM_PREFIX)]
    assert len(claims) == 1 and "manifest.json" not in left
    assert any(k.endswith(".safetensors") for k in left)  # shards of the killed run
    with pytest.raises(RolltoolError, match=r"no manifest\.json"):
        open_packed(far.uri())
    # while the claim is fresh the run counts as alive: the prefix is busy
    busy = _pack(run_cli, data, far.uri(), "--force")
    assert busy.exit_code == 1 and "another rolltool run" in busy.stderr
    assert far.files() == left
    run_id = json.loads(left[claims[0]])["run_id"]
    assert claims[0] == f"{remote.CLAIM_PREFIX}{run_id}.json"
    # once its heartbeat is older than STALE_S it is dead: the next run deletes its files
    monkeypatch.setattr(remote, "STALE_S", 0.0)
    assert remote.repair(locate(far.uri())) == [*sorted(set(left) - {claims[0]}), *claims]
    assert far.files() == {}
    tmp = tmp_path / "tmp"  # the child's local staging folder goes here (TMPDIR)
    tmp.mkdir()
    killed = subprocess.run(list(map(str, argv)), env={**env, "TMPDIR": str(tmp)},
                            capture_output=True, timeout=120)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    (stage,) = tmp.glob(f"{remote.STAGE_PREFIX}*")  # a SIGKILL leaves it behind
    pid = stage.name.removeprefix(remote.STAGE_PREFIX).partition("-")[0]
    assert stage.is_dir() and pid.isdigit() and int(pid) != os.getpid()  # the child's pid
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    again = _pack(run_cli, data, far.uri())  # no --force: leftovers are no output
    assert again.exit_code == 0, again.output
    assert far.files() == _files(ref)
    assert not stage.exists()  # the next run deleted the dead run's staging folder
    assert list(tmp.iterdir()) == []


def test_only_staging_folders_nobody_holds_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, lock = remote.STAGE_PREFIX, remote.STAGE_LOCK
    names = ["dead-1", "live-2", "nolock-3", "link-4"]
    folders = {n: tmp_path / f"{prefix}{n}" for n in names}
    for n in names[:-1]:
        (folders[n] / "packed").mkdir(parents=True)
        if n != "nolock-3":
            (folders[n] / lock).touch()
    folders["link-4"].symlink_to(folders["dead-1"])
    (tmp_path / f"{prefix}file-5").write_text("not a folder")
    # a live run in another process (another pid namespace would do the same): it holds the lock
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code, str(folders["live-2"] / lock)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with monkeypatch.context() as mp:  # as another user: none of these folders is theirs
            mp.setattr(os, "getuid", lambda: os.geteuid() + 1)
            assert remote.sweep_dead_stages(tmp_path) == []
        assert remote.sweep_dead_stages(tmp_path) == [folders["dead-1"]]
    finally:
        holder.kill()
        holder.wait()
    left = [f"{prefix}{n}" for n in ("live-2", "nolock-3", "link-4", "file-5")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)
    assert remote.sweep_dead_stages(tmp_path) == [folders["live-2"]]  # its holder is gone now


def _beat(loc: Any, name: str) -> float | None:
    try:
        return float(json.loads(loc.read_bytes(name))["beat"])
    except ValueError:
        return None  # caught mid-rewrite (a local file is not replaced atomically)


def test_a_heartbeat_keeps_a_long_run_alive(monkeypatch: pytest.MonkeyPatch, far: Far) -> None:
    monkeypatch.setattr(remote, "HEARTBEAT_S", 0.01)
    loc = locate(far.uri())
    run = remote.RemoteRun(loc, force=False)
    run.start()
    first = run.claim.beat
    deadline = time.time() + 30
    while _beat(loc, run.claim.name) in (first, None):
        assert time.time() < deadline, "the claim was never rewritten"
        time.sleep(0.01)
    run.abort()
    assert loc.files() == []


def test_filesystem_errors_are_one_line_with_a_hint(run_cli: RunCli, data: Path) -> None:
    with pytest.raises(RolltoolError, match="foo://x/packed: cannot reach") as e:
        locate("foo://x/packed")
    assert e.value.hint is not None and "s3://" in e.value.hint
    result = run_cli("pack", data, "-o", "foo://x/packed", "--dp", 2)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 2, result.stderr
    result = run_cli("verify", "foo://x/packed")
    assert result.exit_code == 1 and "cannot reach" in result.stderr
    assert not os.path.exists("foo:")


def test_a_file_uri_is_a_local_path(data: Path, tmp_path: Path, run_cli: RunCli) -> None:
    """``file://`` outputs take the local (rename) path: the same files as a plain path."""
    assert _pack(run_cli, data, tmp_path / "plain").exit_code == 0
    done = _pack(run_cli, data, f"file://{tmp_path}/uri")
    assert done.exit_code == 0, done.output
    assert _files(tmp_path / "uri") == _files(tmp_path / "plain")
    assert (
        open_packed(f"file://{tmp_path}/uri").num_steps == open_packed(tmp_path / "uri").num_steps
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "uri"]  # no "file:" folder


def test_force_takes_over_rolltool_files_whose_claim_is_gone(
    data: Path, tmp_path: Path, run_cli: RunCli, far: Far
) -> None:
    """A killed run's files whose claim someone deleted: no output without --force; --force
    replaces them (they are all names rolltool writes), unlike a folder with other files."""
    ref = tmp_path / "ref"
    assert _pack(run_cli, data, far.uri(), "--dp", 4).exit_code == 0
    far.delete("manifest.json")
    refused = _pack(run_cli, data, far.uri())
    assert refused.exit_code == 1 and "already exists" in refused.stderr
    assert _pack(run_cli, data, far.uri(), "--force").exit_code == 0
    assert _pack(run_cli, data, ref).exit_code == 0
    assert far.files() == _files(ref)


@pytest.fixture(scope="module")
def hive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rollouts in hive folders (env=...), with files and folders the walk must skip."""
    root = tmp_path_factory.mktemp("hive")
    table = generate(SynthConfig(groups=12, max_len=1024)).drop_columns(["env"])
    for i, env in enumerate(("code", "math")):
        (root / f"env={env}").mkdir()
        part = table.slice(i * 40, 40)
        pq.write_table(part.slice(0, 24), root / f"env={env}" / "part-1.parquet")
        pq.write_table(part.slice(24), root / f"env={env}" / "part-0.parquet")
    (root / "_SUCCESS").write_text("")
    (root / ".tmp").mkdir()
    pq.write_table(table.slice(0, 4), root / ".tmp" / "x.parquet")
    return root


def test_inputs_by_uri_are_listed_like_local_ones(hive: Path) -> None:
    from rolltool.input.resolve import resolve_inputs

    local = resolve_inputs([hive])
    far = resolve_inputs([fs_helpers.uri(hive)])
    assert len(local) == 4
    assert [f.path for f in far] == [fs_helpers.uri(f.path) for f in local]
    assert [(f.rows, dict(f.partitions)) for f in far] == [
        (f.rows, dict(f.partitions)) for f in local
    ]
    assert [f.resolved for f in far] == [f.path for f in far]  # a URI is its own identity
    for pattern in ("**/*.parquet", "env=*/part-0.parquet", "env=m?th/*"):
        got = [f.path for f in resolve_inputs([fs_helpers.uri(f"{hive}/{pattern}")])]
        want = [fs_helpers.uri(f.path) for f in resolve_inputs([f"{hive}/{pattern}"])]
        assert got == want and got, pattern
    # named twice (a folder and a glob): read once
    twice = resolve_inputs([fs_helpers.uri(hive), fs_helpers.uri(f"{hive}/**/*.parquet")])
    assert [f.path for f in twice] == [f.path for f in far]
    for missing, why in (("nope", "no such file or directory"), ("*.nope", "no file matches")):
        with pytest.raises(RolltoolError, match=why):
            resolve_inputs([fs_helpers.uri(f"{hive}/{missing}")])


def test_a_pack_of_inputs_by_uri_equals_a_pack_of_the_local_files(
    hive: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    local, far = tmp_path / "local", tmp_path / "far"
    args = ("--dp", 2, "--batch-size", 16)
    assert run_cli("pack", hive, "-o", local, *args).exit_code == 0
    done = run_cli("pack", fs_helpers.uri(hive), "-o", fs_helpers.uri(far), *args)
    assert done.exit_code == 0, done.output
    ours, theirs = _files(local), _files(far)
    manifest = json.loads(theirs.pop("manifest.json"))
    assert json.loads(ours.pop("manifest.json"))["files"] == manifest["files"]
    assert ours == theirs  # shards and samples.parquet byte for byte
    assert all(r["path"].startswith("norename://") for r in manifest["inputs"])
    report = run_verify(fs_helpers.uri(far))  # the recorded inputs are found by URI
    assert report.ok and report.input == "compared", report.problems.listed()
    assert report.checked["input_samples"] > 0


def test_an_output_inside_an_input_by_uri_is_refused_before_any_work(
    hive: Path, run_cli: RunCli
) -> None:
    inside = fs_helpers.uri(hive / "env=math" / "packed")
    result = run_cli("pack", fs_helpers.uri(hive), "-o", inside, "--dp", 2)
    assert result.exit_code == 1 and "refusing to overwrite an input" in result.stderr
    assert not (hive / "env=math" / "packed").exists()
    result = run_cli("verify", fs_helpers.uri(hive / "env=math" / "part-0.parquet"))
    assert result.exit_code == 1 and "is a file, not a packed directory" in result.stderr


@pytest.mark.parametrize(
    ("only", "after", "far"),
    [
        ("write_shard", False, "norename"),
        ("write_samples", False, "norename"),
        ("finish", True, "norename"),
        ("finish", True, "s3"),  # the server once: the suite's time
    ],
    indirect=["far"],
)
def test_a_force_run_killed_anywhere_leaves_no_finished_output_and_is_repaired(
    only: str,
    after: bool,
    data: Path,
    tmp_path: Path,
    run_cli: RunCli,
    monkeypatch: pytest.MonkeyPatch,
    far: Far,
) -> None:
    """Killed over an existing output (--force) before the first shard, before samples.parquet,
    or just before the manifest goes up: the old output was invalidated first, no manifest is
    left, and a run without --force cleans the killed run's files and finishes."""
    ref = tmp_path / "ref"
    assert _pack(run_cli, data, ref).exit_code == 0
    assert _pack(run_cli, data, far.uri(), "--dp", 4).exit_code == 0
    argv = [sys.executable, "-c", CHILD, "pack", data, "-o", far.uri(), *PACK, "--force"]
    env = Injector(at=1, only=only, after=after).env()
    killed = subprocess.run(list(map(str, argv)), env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = far.files()
    assert "manifest.json" not in left
    assert sum(k.startswith(remote.CLAIM_PREFIX) for k in left) == 1
    monkeypatch.setattr(remote, "STALE_S", 0.0)
    again = _pack(run_cli, data, far.uri())
    assert again.exit_code == 0, again.output
    assert far.files() == _files(ref)
