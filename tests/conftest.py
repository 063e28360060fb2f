"""Shared fixtures: a small synthetic dataset, a Parquet writer and a CLI runner.

Fixtures are small on purpose (the whole suite runs on a 2-core machine in under a minute).

- ``synth_table``: a small `rolltool.input.synth.generate` table (all three envs, 12 groups, samples of
  at most 4,096 tokens); session-scoped, a pyarrow Table is immutable.
- ``synth_path``: that table written to ``tmp_path / "synth.parquet"``.
- ``write_parquet(data, name="data.parquet")``: write a pyarrow Table or a dict of columns under
  ``tmp_path`` and return the path (sub-folders in ``name`` are created).
- ``small_pools``: the worker pools of ``pack --workers`` (`rolltool.engine.local`, `rolltool.pool`)
  used even for the small example input (their size thresholds lowered), and a fixed
  ``created_at`` (SOURCE_DATE_EPOCH), so that runs compare byte for byte.
- ``run_cli(*args)``: run the ``rolltool`` click CLI in-process; returns click's Result with
  ``stdout`` and ``stderr`` apart. An exception other than SystemExit escaping the CLI (what a
  user would see as a traceback) fails the test at once.

Hypothesis runs derandomized by default (profile ``ci``), so a test run is reproducible and CI
cannot fail on a new random draw; ``HYPOTHESIS_PROFILE=explore pytest`` draws fresh examples, and
anything it finds belongs in an ``@example``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from hypothesis import settings

from rolltool.cli import main
from rolltool.input.synth import SynthConfig, generate

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
