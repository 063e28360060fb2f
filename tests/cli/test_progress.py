"""Progress on stderr (rolltool.cli.progress): silent for short piped runs, a line now and then
for long ones, a bar on a terminal, off with ROLLTOOL_PROGRESS_S=0."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from rolltool.cli import progress as prog
from rolltool.errors import RolltoolError


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A monotonic clock that moves only when the test says: `clock[0] = t`."""
    now = [0.0]
    monkeypatch.setattr(prog.time, "monotonic", lambda: now[0])
    return now


def _run(
    clock: list[float],
    items: list[int],
    step_s: float,
    terminal: bool = False,
    size: Callable[[int], int] | None = None,
) -> tuple[list[int], str]:
    """Consume `progress` over items, the clock moving `step_s` per item: (items, stderr)."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=200)
    seen = []
    for item in prog.progress(console, items, len(items), "packing steps", size=size):
        seen.append(item)
        clock[0] += step_s
    return seen, buf.getvalue()


def test_short_piped_run_prints_nothing(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLTOOL_PROGRESS_S", raising=False)
    seen, out = _run(clock, list(range(20)), 1.0, size=lambda i: 10)
    assert seen == list(range(20)) and out == ""  # 20 s < the default 30 s


def test_long_piped_run_prints_a_line_per_interval_and_a_last_one(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLTOOL_PROGRESS_S", "25")
    sizes = itertools.cycle([1_000_000, 3_000_000])
    seen, out = _run(clock, list(range(10)), 10.0, size=lambda i: next(sizes))
    assert seen == list(range(10))
    lines = out.splitlines()
    # 10 s per item, a line once 25 s have passed since the last: after items 3, 6 and 9
    # (30, 60, 90 s), then the last line at 100 s
    assert lines[0] == (
        "packing steps: 3/10 (30%), 5.0 M tokens, 166,667 tokens/s, 0:00:30 elapsed, ~0:01:10 left"
    )
    assert [line.split(",")[0] for line in lines] == [
        f"packing steps: {k}/10 ({k}0%)" for k in (3, 6, 9, 10)
    ]
    assert lines[-1].startswith("packing steps: 10/10 (100%), 20.0 M tokens, ")
    assert "left" not in lines[-1] and "\x1b" not in out


def test_interval_zero_turns_progress_off_even_on_a_terminal(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLTOOL_PROGRESS_S", "0")
    seen, out = _run(clock, list(range(5)), 100.0, terminal=True)
    assert seen == list(range(5)) and out == ""


def test_terminal_bar_passes_items_through_and_shows_the_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROLLTOOL_PROGRESS_S", raising=False)
    seen, out = _run([0.0], list(range(7)), 1.0, terminal=True, size=lambda i: 5)
    assert seen == list(range(7))
    assert "packing steps" in out and "tokens/s" in out


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_a_bad_interval_is_a_clear_error(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLTOOL_PROGRESS_S", raw)
    with pytest.raises(RolltoolError, match="ROLLTOOL_PROGRESS_S"):
        _run([0.0], [1], 1.0)


def test_tally_line_without_total_or_size() -> None:
    t = prog.Tally(None, "tokens", start=0.0)
    t.add(0)
    t.add(0)
    assert t.line("scanning row groups", 3725.0) == "scanning row groups: 2, 1:02:05 elapsed"


def _pack(src: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = ["pack", str(src), "-o", str(out), "--dp", "2", "--batch-size", "64", "--json"]
    return subprocess.run(
        [sys.executable, "-m", "rolltool", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_a_pack_in_a_log_says_how_far_each_phase_is(synth_path: Path, tmp_path: Path) -> None:
    """Piped stderr (a cluster log): with a tiny interval every row group and step is a line;
    the last line of each phase is its 100% line; stdout is still one JSON document."""
    proc = _pack(synth_path, tmp_path / "out", {"ROLLTOOL_PROGRESS_S": "1e-9"})
    assert proc.returncode == 0, proc.stderr
    steps = len(json.loads(proc.stdout)["steps"])
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("Warning")]
    scan = [line for line in lines if line.startswith("checking the input: ")]
    packing = [line for line in lines if line.startswith("packing steps")]
    assert scan and packing and len(scan) + len(packing) == len(lines)
    assert scan[-1].startswith("checking the input: ") and "(100%)" in scan[-1]
    assert f"{steps}/{steps} (100%)" in packing[-1] and "tokens/s" in packing[-1]
    assert lines.index(scan[-1]) < lines.index(packing[0])  # the scan ends before packing


def test_a_bad_interval_stops_the_pack_with_nothing_written(
    synth_path: Path, tmp_path: Path
) -> None:
    proc = _pack(synth_path, tmp_path / "out", {"ROLLTOOL_PROGRESS_S": "often"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("Error: ROLLTOOL_PROGRESS_S must be a number")
    assert [p.name for p in tmp_path.iterdir()] == [synth_path.name]  # no output, no temp
