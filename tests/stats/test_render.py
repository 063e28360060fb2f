"""One way to print each figure: the formatters, and pack's tables next to stats' for one run."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console, Group
from rich.table import Table

from rolltool.format import Manifest
from rolltool.jobs.pack import run_pack
from rolltool.plan.batches import StepConfig
from rolltool.plan.config import PackConfig
from rolltool.stats import compute_stats
from rolltool.stats import render as stats_render
from rolltool.util import numfmt


def test_formatters() -> None:
    assert numfmt.count(1234567.4) == "1,234,567" and numfmt.count(2.5) == "2"
    assert numfmt.num(0.12345, ".3f") == "0.123" and numfmt.num(-0.5, "+.3f") == "-0.500"
    assert numfmt.pct(0.4567) == "45.7%" and numfmt.pct(0.4567, ".0%") == "46%"
    assert numfmt.over(1.0123) == "+1.23%" and numfmt.over(1.0) == "+0.00%"
    assert numfmt.ms(0.0123) == "12.3" and numfmt.ms(12.0) == "12,000.0"
    assert numfmt.big(233_016_320) == "233.0 M" and numfmt.big(9216) == "9,216"
    every = (numfmt.count, numfmt.num, numfmt.pct, numfmt.over, numfmt.ms, numfmt.big)
    for f in every:  # a figure that could not be computed reads the same everywhere
        assert f(None) == f(math.nan) == numfmt.MISSING, f.__name__
    assert numfmt.num(0.0) == "0.0" and numfmt.count(0) == "0"  # zero is not missing


def _text(renderable: Any, width: int = 1000) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def _cells(table: Table) -> list[dict[str, str]]:
    """The rows of a table printed without squeezing, as {header: cell}."""
    lines = _text(table).splitlines()
    (header,) = [line for line in lines if line.startswith("┃")]
    names = [c.strip() for c in header.strip("┃").split("┃")]
    rows = [line for line in lines if line.startswith("│")]
    return [
        dict(zip(names, (c.strip() for c in r.strip("│").split("│")), strict=True)) for r in rows
    ]


def _table(group: Any, title: str) -> Table:
    found = [r for r in group.renderables if isinstance(r, Table) and r.title == title]
    assert len(found) == 1, title
    return found[0]


def _pack_steps(manifest: Manifest, output: str) -> Table:
    group = stats_render.render_pack(manifest, output)
    assert isinstance(group, Group)
    tables = [r for r in group.renderables if isinstance(r, Table)]
    assert len(tables) == 2
    return tables[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> tuple[Manifest, Path]:
    root = tmp_path_factory.mktemp("render")
    pq.write_table(synth_table, root / "in.parquet")
    config = PackConfig(dp=3, steps=StepConfig(batch_size=24), micro_batch_tokens=8192)
    manifest = run_pack([str(root / "in.parquet")], root / "out", config, command=["t"])
    assert manifest.num_steps >= 2
    return manifest, root / "out"


@pytest.fixture(scope="module")
def cp_run(
    tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table
) -> tuple[Manifest, Path]:
    """--cp 2 with 1,536 tokens per GPU: samples up to 3,072 (padded) split, longer ones dropped."""
    root = tmp_path_factory.mktemp("render-cp")
    pq.write_table(synth_table, root / "in.parquet")
    config = PackConfig(
        dp=2, cp=2, steps=StepConfig(batch_size=24), micro_batch_tokens=1536, overlong="drop"
    )
    manifest = run_pack([str(root / "in.parquet")], root / "out", config, command=["t"])
    assert manifest.num_steps >= 2 and sum(s.over_gpu_budget for s in manifest.steps) > 0
    return manifest, root / "out"


@pytest.mark.parametrize("which", ["run", "cp_run"])
def test_pack_and_stats_print_the_same_balance_figures(
    request: pytest.FixtureRequest, which: str
) -> None:
    """pack printed lockstep overhead as 1.0123 and stats as +1.23%: now both print the plan's
    figure the one way (numfmt.over), under the same header; with cp both are figures of the
    padded tokens the plan balanced."""
    manifest, out = request.getfixturevalue(which)
    *pack_steps, total = _cells(_pack_steps(manifest, str(out)))
    assert total["step"] == "all"
    assert total["sampled tokens"] == f"{sum(st.sampled_tokens for st in manifest.steps):,}"
    report = compute_stats([str(out)]).report
    stats_steps = _cells(_table(stats_render.render(report, per_step=True), "steps"))
    assert len(pack_steps) == len(stats_steps) == manifest.num_steps
    for st, p, s in zip(manifest.steps, pack_steps, stats_steps, strict=True):
        for header, figure in (("lockstep ovh. (cost)", st.plan.lockstep_overhead_cost),
                               ("rank imb. (cost)", st.plan.imbalance_cost)):  # fmt: skip
            assert p[header] == s[header] == numfmt.over(figure), (st.step, header)
        assert p["step"] == s["step"] == str(st.step)
        assert p["sampled tokens"] == s["sampled tokens"] == f"{st.sampled_tokens:,}"


def test_long_runs_show_the_stats_env_totals(
    run: tuple[Manifest, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short runs: one row per step and env; beyond MAX_ENV_STEPS, the stats table of env totals
    (the same cells `rolltool stats` prints)."""
    manifest, out = run
    group = stats_render.render_pack(manifest, str(out))
    per_step = _cells([r for r in group.renderables if isinstance(r, Table)][1])
    assert len(per_step) == sum(len(s.envs) for s in manifest.steps)
    monkeypatch.setattr(stats_render, "MAX_ENV_STEPS", manifest.num_steps - 1)
    group = stats_render.render_pack(manifest, str(out))
    totals = _cells([r for r in group.renderables if isinstance(r, Table)][1])
    report = compute_stats([str(out)]).report
    assert totals == _cells(_table(stats_render.render(report), "envs (all steps)"))


@pytest.mark.parametrize("width", [80, 120])
def test_pack_tables_fit_the_terminal(run: tuple[Manifest, Path], width: int) -> None:
    manifest, out = run
    text = _text(stats_render.render_pack(manifest, str(out), width=width), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    full = _text(stats_render.render_pack(manifest, str(out)))
    assert "hidden" not in full and "hidden at this width" in text  # narrower: fewer columns


def test_pack_tables_of_a_cp_pack(
    cp_run: tuple[Manifest, Path], run: tuple[Manifest, Path]
) -> None:
    """With cp: the world line first, samples over the per-GPU budget per step and env (the
    manifest's counts) beside the over-long ones, and in the last line; without: none of it."""
    manifest, out = cp_run
    group = stats_render.render_pack(manifest, str(out))
    assert isinstance(group, Group)
    first = _text(group.renderables[0]).strip()
    assert first == (
        "world: dp 2 x cp 2 = 4 GPUs; 1,536 tokens per GPU, 3,072 per group micro-batch "
        "(CP padding counted)"
    )
    *steps, total = _cells(_pack_steps(manifest, str(out)))
    for st, row in zip(manifest.steps, steps, strict=True):
        assert row["over GPU budget"] == f"{st.over_gpu_budget:,}"
        assert row["over-long"] == f"{st.overlong_dropped:,}"
    assert total["over GPU budget"] == f"{sum(st.over_gpu_budget for st in manifest.steps):,}"
    envs = _cells([r for r in group.renderables if isinstance(r, Table)][1])
    want = [f"{e.over_gpu_budget:,}" for st in manifest.steps for e in st.envs.values()]
    assert [r["over GPU budget"] for r in envs] == want
    summary = stats_render.pack_summary(manifest, str(out))
    over = sum(st.over_gpu_budget for st in manifest.steps)
    assert f"x 2 ranks (x cp 2 = 4 GPUs) to {out}" in summary
    assert f"trained ({over:,} over the per-GPU budget, split over cp)" in summary
    plain, plain_out = run
    text = _text(stats_render.render_pack(plain, str(plain_out)))
    assert "world:" not in text and "GPU" not in text
    assert "GPU" not in stats_render.pack_summary(plain, str(plain_out))
