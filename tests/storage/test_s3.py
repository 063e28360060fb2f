"""rolltool against a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py): what the
``norename://`` fake cannot show (issue 20's defects): forked workers reading S3 inputs, a
packed directory on S3 given to ``stats``, pyarrow's URI options kept from input to output and
from ``stats`` to polars, and a wrong endpoint failing fast, naming itself."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import Result
from s3_server import S3Store

from rolltool.input.synth import SynthConfig, generate

RunCli = Callable[..., Result]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rollouts in 24 row groups (a scan of >= 8 row groups goes to the worker processes)."""
    path = tmp_path_factory.mktemp("big") / "big.parquet"
    pq.write_table(generate(SynthConfig(groups=24, max_len=2048)), path, row_group_size=12)
    return path


def _upload(s3: S3Store, local: Path, rel: str) -> str:
    s3.put(rel, local.read_bytes())
    return s3.uri(rel)


def test_forked_workers_read_s3_inputs_with_filesystems_of_their_own(
    s3: S3Store, big: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    """Defect 1: the scan's forked workers used the driver's cached S3 client (not fork-safe):
    corrupted reads. Several runs, each the bytes of the local input's."""
    uri = _upload(s3, big, "big.parquet")
    assert pq.ParquetFile(big).num_row_groups >= 8
    want = run_cli("advantages", big, "-o", tmp_path / "local.parquet", "--workers", 2)
    assert want.exit_code == 0, want.output
    for i in range(4):
        got = run_cli("advantages", uri, "-o", tmp_path / f"s3-{i}.parquet", "--workers", 2)
        assert got.exit_code == 0, got.output
        assert (tmp_path / f"s3-{i}.parquet").read_bytes() == (
            tmp_path / "local.parquet"
        ).read_bytes()


PACK = ("--dp", 2, "--batch-size", 16)


def test_stats_of_a_packed_directory_on_s3(
    s3: S3Store, big: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    """Defect 3: ``stats s3://.../packed`` said "not rollout Parquet" (the packed-directory test
    looked at local paths); it is the local directory's report."""
    assert run_cli("pack", big, "-o", tmp_path / "packed", *PACK).exit_code == 0
    assert run_cli("pack", big, "-o", s3.uri("packed"), *PACK).exit_code == 0
    local = run_cli("stats", tmp_path / "packed", "--json")
    far = run_cli("stats", s3.uri("packed"), "--json")
    assert local.exit_code == 0 and far.exit_code == 0, far.output
    a, b = json.loads(local.stdout), json.loads(far.stdout)
    assert b["kind"] == "packed" and b.pop("path") == s3.uri("packed")
    a.pop("path")
    assert a == b


def test_uri_options_reach_every_filesystem(
    s3: S3Store, big: Path, tmp_path: Path, run_cli: RunCli
) -> None:
    """Defect 4: with an s3 input and an s3 output the input's ``?endpoint_override=...`` was cut
    (rolltool then asked a public AWS host), and ``stats`` gave the URI to polars, which knows
    no pyarrow URI options. Both now go to the server named, and equal the local results."""
    uri = _upload(s3, big, "in/big.parquet")
    done = run_cli("pack", uri, "-o", s3.uri("out"), *PACK)
    assert done.exit_code == 0, done.output
    assert run_cli("pack", big, "-o", tmp_path / "ref", *PACK).exit_code == 0
    ours = s3.files("out")
    theirs = {str(p.relative_to(tmp_path / "ref")): p.read_bytes()
              for p in (tmp_path / "ref").rglob("*") if p.is_file()}  # fmt: skip
    manifest, ref = json.loads(ours.pop("manifest.json")), json.loads(theirs.pop("manifest.json"))
    assert ours == theirs and manifest["files"] == ref["files"]
    inside = run_cli("pack", s3.uri("in"), "-o", s3.uri("in/packed"), *PACK)  # the folder
    assert inside.exit_code == 1 and "refusing to overwrite an input" in inside.stderr
    for limit in ((), ("--limit", 50)):
        local = run_cli("stats", big, "--json", *limit)
        far = run_cli("stats", uri, "--json", *limit)
        assert local.exit_code == 0 and far.exit_code == 0, far.output
        a, b = json.loads(local.stdout), json.loads(far.stdout)
        assert [i["path"] for i in b.pop("inputs")] == [uri]
        a.pop("inputs")
        assert a == b


def test_a_wrong_endpoint_fails_fast_naming_it(s3: S3Store, run_cli: RunCli) -> None:
    """A wrong endpoint in an input's URI (nothing listens there) is one line naming it, within
    seconds (pyarrow's retries: ~6 s), for pack with an s3 output and for stats: never a
    fall-through to a public host (no internet here)."""
    dead = f"127.0.0.1:{_dead_port()}"
    uri = s3.uri("big.parquet").replace(s3.server.endpoint, dead)
    for args in (
        ("pack", uri, "-o", s3.uri("out"), *PACK),  # an s3 input, an s3 output (the check)
        ("stats", uri),
    ):
        start = time.monotonic()
        result = run_cli(*args)
        took = time.monotonic() - start
        assert result.exit_code == 1 and dead in result.stderr, (args, result.output)
        assert "amazonaws" not in result.output and "Traceback" not in result.output
        assert took < 30, (args, took)


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
