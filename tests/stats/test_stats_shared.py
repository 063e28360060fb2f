"""``rolltool stats`` on a ``--share-prefix`` pack (issue 24): tokens stored against unshared
per env and in total are the manifest's, a step's micro-batch tokens and costs are recomputed
from what the shards store and compute (so its balance equals the plan record's), and the
text report has the sharing table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pack_helpers import pack
from shared_helpers import shared_rollouts

import rolltool


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats-shared")
    pq.write_table(shared_rollouts(groups=6, rollouts=4, branches=2, seed=5), root / "in.parquet")
    pack(root / "in.parquet", root / "p", "--dp", 2, "--share-prefix", "--batch-size", 8,
         "--micro-batch-tokens", 1500)  # fmt: skip
    return root / "p"


def test_stats_report_what_sharing_saved(run_cli: Any, shared: Path) -> None:
    r = run_cli("stats", shared, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    m = rolltool.open_packed(shared).manifest
    total = doc["totals"]["shared"]
    assert total["tokens"] == sum(st.sampled_tokens for st in m.steps)
    assert total["stored"] == sum(st.plan.shared.stored for st in m.steps if st.plan.shared)
    assert (
        0 < total["stored"] < total["tokens"]
        and total["saved"] == total["tokens"] - total["stored"]
    )
    assert total["envs"]["agent"]["tokens"] == total["tokens"]
    for s, rec in zip(doc["steps"], m.steps, strict=True):
        assert rec.plan.shared is not None
        assert s["shared"]["stored"] == rec.plan.shared.stored == s["real_tokens"]
        assert "alternatives" not in s  # the partition's plans would not share
        assert s["lockstep_overhead"]["cost"] == pytest.approx(rec.plan.lockstep_overhead_cost)
        assert s["rank_imbalance"]["cost"] == pytest.approx(rec.plan.imbalance_cost)
    text = run_cli("stats", shared)
    assert text.exit_code == 0 and "shared prefixes" in text.stdout
    steps = run_cli("stats", shared, "--per-step")
    assert steps.exit_code == 0 and "shared prefixes per step and env" in steps.stdout


torch = pytest.importorskip("torch")

TINY = ("--backend", "sdpa", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--hidden", "32", "--intermediate", "32", "--repeats", "1", "--warmup", "0")  # fmt: skip


@pytest.mark.parametrize("what", ["layer", "attention"])
def test_bench_replays_shared_rows_beside_the_same_data_unshared(
    run_cli: Any, shared: Path, what: str
) -> None:
    r = run_cli("bench", shared, *TINY, "--what", what, "--check", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    shared_run, plain_run = doc["runs"]
    assert plain_run["path"] == f"{shared} (unshared)"
    m = rolltool.open_packed(shared).manifest
    stored = sum(st.plan.shared.stored for st in m.steps if st.plan.shared)
    sampled = sum(st.sampled_tokens for st in m.steps)
    padding = sum(rk.tokens - rk.real_tokens for st in m.steps for rk in st.ranks)
    assert shared_run["tokens"] == stored + padding
    assert plain_run["tokens"] == sampled + padding
    assert shared_run["samples"] == plain_run["samples"] == sum(st.samples for st in m.steps)
    assert len(shared_run["rows"]) == len(plain_run["rows"])
    for run in (shared_run, plain_run):  # every segment equals its chain (or itself) alone
        assert run["check"]["ok"] and run["check"]["segments_checked"] > 0
    line = {x["path"]: x for x in doc["comparison"]["lines"]}
    assert set(line) == {str(shared), f"{shared} (unshared)"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch-varlen on a GPU)")
@pytest.mark.parametrize("backend", ["torch-varlen", "sdpa"])
def test_bench_checks_shared_rows_on_the_gpu(run_cli: Any, shared: Path, backend: str) -> None:
    """On a GPU the shared rows go through the varlen kernel's block attention (bottom-right
    causal over the gathered K/V); --check compares each segment with its chain alone."""
    r = run_cli("bench", shared, "--backend", backend, "--device", "cuda", "--dtype", "bf16",
                "--what", "attention", "--repeats", "1", "--warmup", "0", "--check", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert all(run["check"]["ok"] for run in doc["runs"])
