"""One-file outputs on a real S3 server (SeaweedFS, tests/s3_server.py), issue 20's defects 2
and 10: ``synth``/``advantages -o s3://.../x.parquet`` write a temporary object under a claim
(`rolltool.storage.remote.file_stage`) and copy it into place, with a local file's bytes and
``--force`` rules; a failure or a kill leaves no object under the final name; ``stats`` of a
prefix a killed pack left says it is an unfinished run and when it is cleaned up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import Result
from s3_server import S3Store

from rolltool.storage import remote

RunCli = Callable[..., Result]
SYNTH = ("--groups", 6, "--max-len", 1024)
STAGE = f".out.parquet{remote.STAGE_SUFFIX}/"


def _synth(run_cli: RunCli, out: str | Path, *extra: Any) -> Result:
    return run_cli("synth", *SYNTH, "-o", out, *extra)


def _repairable(left: dict[str, bytes]) -> bool:
    """Only a dead run's claim and temporary object, in the output's stage."""
    return all(
        k.startswith(STAGE) and k[len(STAGE) :].startswith(remote.CLAIM_PREFIX)
        and remote.rolltool_named(k[len(STAGE) :])
        for k in left
    )  # fmt: skip


def test_synth_and_advantages_to_s3_are_a_local_files_bytes(
    s3: S3Store, tmp_path: Path, run_cli: RunCli
) -> None:
    """Defect 2: ``-o s3://...`` was "cannot write here (No such file or directory)"."""
    local = tmp_path / "syn.parquet"
    assert _synth(run_cli, local).exit_code == 0
    done = _synth(run_cli, s3.uri("syn.parquet"))
    assert done.exit_code == 0, done.output
    assert s3.files() == {"syn.parquet": local.read_bytes()}  # nothing else left
    want = run_cli("advantages", local, "-o", tmp_path / "adv.parquet")
    assert want.exit_code == 0, want.output
    for inp in (local, s3.uri("syn.parquet")):  # a local and an s3 input
        got = run_cli("advantages", inp, "-o", s3.uri("adv.parquet"), "--force")
        assert got.exit_code == 0, got.output
        assert s3.files() == {
            "adv.parquet": (tmp_path / "adv.parquet").read_bytes(),
            "syn.parquet": local.read_bytes(),
        }
    report = json.loads(_synth(run_cli, s3.uri("j.parquet"), "--json").stdout)
    assert report["bytes"] == local.stat().st_size


def test_an_existing_object_is_refused_without_force_and_replaced_with_it(
    s3: S3Store, tmp_path: Path, run_cli: RunCli
) -> None:
    uri = s3.uri("out.parquet")
    assert _synth(run_cli, uri).exit_code == 0
    before = s3.files()
    again = _synth(run_cli, uri, "--seed", 2)
    assert again.exit_code == 1 and f"{uri} already exists" in again.stderr
    assert "--force" in again.stderr and s3.files() == before
    assert _synth(run_cli, tmp_path / "seed2.parquet", "--seed", 2).exit_code == 0
    forced = _synth(run_cli, uri, "--seed", 2, "--force")
    assert forced.exit_code == 0, forced.output
    assert s3.files() == {"out.parquet": (tmp_path / "seed2.parquet").read_bytes()}
    # --force replaces only what rolltool wrote; a folder is no file to replace
    s3.put("theirs.parquet", b"not ours")
    s3.put("dir/x", b"x")
    for name in ("theirs.parquet", "dir"):
        refused = _synth(run_cli, s3.uri(name), "--force")
        assert refused.exit_code == 1 and s3.uri(name) in refused.stderr, refused.output
    assert (
        "not an output rolltool wrote"
        in _synth(run_cli, s3.uri("theirs.parquet"), "--force").stderr
    )
    assert s3.files()["theirs.parquet"] == b"not ours"
    # an output inside an input
    inside = run_cli("advantages", s3.uri(), "-o", s3.uri("sub/adv.parquet"))
    assert inside.exit_code == 1 and "refusing to overwrite an input" in inside.stderr
    assert s3.uri("sub/adv.parquet") in inside.stderr


def _fail_after_first_row_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Parquet writer writes its first row group (a slice of the first table), then fails
    as a full disk or a dropped connection would."""
    write = pq.ParquetWriter.write_table

    def boom(self: pq.ParquetWriter, table: Any, row_group_size: Any = None) -> None:
        write(self, table.slice(0, 8), row_group_size)
        raise OSError("injected failure after the first row group")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", boom)


@pytest.mark.parametrize("command", ["synth", "advantages"])
def test_a_failure_mid_write_leaves_no_object_and_keeps_the_old_one(
    command: str, s3: S3Store, tmp_path: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "syn.parquet"
    assert _synth(run_cli, src).exit_code == 0
    uri = s3.uri("out.parquet")
    args = ("synth", *SYNTH) if command == "synth" else ("advantages", src)
    with monkeypatch.context() as m:
        _fail_after_first_row_group(m)
        failed = run_cli(*args, "-o", uri)
    assert failed.exit_code == 1 and uri in failed.stderr and "injected" in failed.stderr
    assert s3.files() == {}  # no output, no temporary object, no claim
    assert run_cli(*args, "-o", uri).exit_code == 0
    old = s3.files()
    with monkeypatch.context() as m:
        _fail_after_first_row_group(m)
        failed = run_cli(*args, "-o", uri, "--force")
    assert failed.exit_code == 1 and "injected" in failed.stderr
    assert s3.files() == old  # the previous object, whole


KILLED = """
import os, signal, sys
import pyarrow.parquet as pq
write = pq.ParquetWriter.write_table
def kill(self, table, row_group_size=None):
    write(self, table.slice(0, 8), row_group_size)
    os.kill(os.getpid(), signal.SIGKILL)
pq.ParquetWriter.write_table = kill
from rolltool.cli import main
main(sys.argv[1:])
"""


def test_a_killed_run_leaves_only_what_the_next_run_repairs(
    s3: S3Store, tmp_path: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL mid-write: no object under the final name; the claim (and a temporary object, if
    its upload had begun) is the next run's to delete, once the claim is stale; until then the
    output is busy, as for pack."""
    uri = s3.uri("out.parquet")
    argv = [sys.executable, "-c", KILLED, "synth", *map(str, SYNTH), "-o", uri]
    killed = subprocess.run(argv, capture_output=True, timeout=120, env=os.environ.copy())
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = s3.files()
    assert "out.parquet" not in left and left and _repairable(left), left
    busy = _synth(run_cli, uri)
    assert busy.exit_code == 1 and f"{uri}: another rolltool run" in busy.stderr
    assert s3.files() == left
    monkeypatch.setattr(remote, "STALE_S", 0.0)
    assert _synth(run_cli, tmp_path / "ref.parquet").exit_code == 0
    done = _synth(run_cli, uri)
    assert done.exit_code == 0, done.output
    assert s3.files() == {"out.parquet": (tmp_path / "ref.parquet").read_bytes()}


def test_stats_of_a_killed_packs_prefix_says_it_is_unfinished_and_when_it_is_cleaned(
    s3: S3Store, run_cli: RunCli
) -> None:
    """Defect 10: ``stats`` said "holds no *.parquet files"; it now says what ``verify`` says
    (no manifest: an unfinished or killed run) and when the next pack may clean it up."""
    now = time.time()
    claim = remote.Claim("ab12cd34ef56ab78", socket.gethostname(), 4242, now - 5, now - 5)
    s3.put(f"p/{claim.name}", claim.dumps())
    s3.put("p/rank-0000/step-000000-00.safetensors", b"\0" * 64)
    got = run_cli("stats", s3.uri("p"))
    assert got.exit_code == 1 and "no *.parquet" not in got.output
    line = f"{s3.uri('p')}: no manifest.json: not a finished rolltool output (files of an unfinished or killed run"
    assert line in got.stderr, got.stderr
    assert claim.run_id in got.stderr and "600 s after its last heartbeat" in got.stderr
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(claim.beat + remote.STALE_S))
    assert at in got.stderr
    assert line in run_cli("verify", s3.uri("p")).stderr  # verify's words
    dead = remote.Claim(claim.run_id, claim.host, claim.pid, now - 900, now - 700)
    s3.put(f"p/{claim.name}", dead.dumps())
    got = run_cli("stats", s3.uri("p"))
    assert got.exit_code == 1 and line in got.stderr
    assert "the next `rolltool pack` to this prefix deletes its files" in got.stderr
