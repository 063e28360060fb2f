"""``rolltool stats`` and ``rolltool bench`` on a ``--hybrid-cp`` pack (issue 22).

stats: the samples and tokens at each CP degree equal what the shards hold (every GPU's view,
read the slow way), and the per-GPU balance equals the step record's (which verify recomputes);
bench (CPU, sdpa, tiny shapes): one timed row per GPU of every group row, each GPU's tokens
those of its view, and a micro-batch's balance the slowest of its group's GPUs over their mean.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, pack, rollouts

import rolltool

LENGTHS = [[9, 23, 4, 17], [40, 6, 31, 12], [3, 58, 21, 8], [14, 27, 5, 44], [61, 19, 7, 33]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats-hybrid")
    groups = [G("math", [0.0, 1.0, 0.5, 0.25], lens) for lens in LENGTHS]
    pq.write_table(rollouts(groups, seed=2), root / "in.parquet")
    pack(root / "in.parquet", root / "p", "--dp", 2, "--cp", 4, "--hybrid-cp",
         "--micro-batch-tokens", 16, "--batch-size", 8, "--keep-last")  # fmt: skip
    return root / "p"


def _degrees_from_views(out: Path) -> dict[int, int]:
    """sample_index -> the size of the sub-group whose views hold it."""
    ds = rolltool.open_packed(out)
    found: dict[int, int] = {}
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for g in range(4):
                for v in ds.micro_batches(step, rank, cp_rank=g):
                    for i in v["sample_index"][v["sample_index"] >= 0].tolist():
                        k = int(v["cp_group_size"][0])
                        assert found.setdefault(i, k) == k
    return found


def test_stats_counts_samples_and_tokens_per_degree(run_cli: Any, hybrid: Path) -> None:
    r = run_cli("stats", hybrid, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["world"]["hybrid_cp"] is True
    degree = _degrees_from_views(hybrid)
    lengths = {i: n for i, n in enumerate(x for g in LENGTHS for x in g)}
    want_samples: dict[str, int] = defaultdict(int)
    want_tokens: dict[str, int] = defaultdict(int)
    for i, k in degree.items():
        want_samples[str(k)] += 1
        want_tokens[str(k)] += lengths[i]
    h = doc["totals"]["hybrid"]
    assert h["split_samples"] == dict(want_samples) and h["split_tokens"] == dict(want_tokens)
    assert len(want_samples) >= 2  # whole and split samples both
    m = rolltool.open_packed(hybrid).manifest
    for s, rec in zip(doc["steps"], m.steps, strict=True):
        assert rec.plan.hybrid is not None
        assert s["hybrid"]["gpu_lockstep_overhead"] == pytest.approx(
            rec.plan.hybrid.lockstep_overhead, rel=1e-9
        )
        assert s["lockstep_overhead"]["cost"] == pytest.approx(rec.plan.lockstep_overhead_cost)
        assert s["hybrid"]["split_samples"] == dict(rec.plan.hybrid.split_samples)
    text = run_cli("stats", hybrid)
    assert text.exit_code == 0 and "hybrid CP" in text.stdout and "hybrid cp 4" in text.stdout


torch = pytest.importorskip("torch")

TINY = ("--backend", "sdpa", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--hidden", "32", "--intermediate", "32", "--repeats", "1", "--warmup", "0")  # fmt: skip


def test_bench_replays_every_gpu_view(run_cli: Any, hybrid: Path) -> None:
    r = run_cli("bench", hybrid, *TINY, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["split"]["hybrid"] is True and doc["split"]["size"] == 4
    ds = rolltool.open_packed(hybrid)
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in doc["rows"]:
        groups[(row["step"], row["rank"], row["micro_batch"])].append(row)
    for (step, rank, j), gpus in groups.items():
        assert sorted(g["gpu"] for g in gpus) == [0, 1, 2, 3]
        for g in gpus:
            view = ds.micro_batches(step, rank, cp_rank=g["gpu"])[j]
            assert g["tokens"] == len(view["input_ids"])
    ratios = [max(g["seconds"] for g in v) / np.mean([g["seconds"] for g in v])
              for v in groups.values()]  # fmt: skip
    assert doc["total"]["group_imbalance_max"] == pytest.approx(max(ratios))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step whose row is a 2-GPU sub-group then two plain GPUs ([2, 2, 1, 1])."""
    root = tmp_path_factory.mktemp("stats-hybrid-mixed")
    pq.write_table(
        rollouts([G("agent", [0.1, 0.9, 0.5], [30, 16, 16])], seed=5), root / "in.parquet"
    )
    pack(root / "in.parquet", root / "p", "--dp", 1, "--cp", 4, "--hybrid-cp",
         "--micro-batch-tokens", 16, "--batch-size", 8, "--keep-last")  # fmt: skip
    return root / "p"


def _row_groups(out: Path) -> set[tuple[int, ...]]:
    ds = rolltool.open_packed(out)
    return {tuple(int(ds.micro_batches(st.step, rank, cp_rank=g)[j]["cp_group_size"][0])
                  for g in range(4))
            for st in ds.manifest.steps for rank, r in enumerate(st.ranks)
            for j in range(r.micro_batches)}  # fmt: skip


@pytest.mark.parametrize("which", ["hybrid", "mixed"])
def test_bench_check_compares_every_gpu_with_the_samples_alone(
    run_cli: Any, request: pytest.FixtureRequest, which: str
) -> None:
    out = request.getfixturevalue(which)
    if which == "mixed":
        assert (2, 2, 1, 1) in _row_groups(out)  # a sub-group and plain GPUs in one row
    r = run_cli("bench", out, *TINY, "--check", "--check-rows", "64", "--json")
    assert r.exit_code == 0, r.output
    check = json.loads(r.stdout)["check"]
    assert check["ok"] and "hybrid cp 4" in check["what"]
    ds = rolltool.open_packed(out)
    assert check["segments_checked"] == ds.manifest.samples.trained  # every row, every sample


def test_bench_check_fails_a_gpu_view_out_of_place(
    run_cli: Any, mixed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 3's positions shifted by one (a plain GPU's whole sample attending as if a token
    later): the check must fail it, not pass it on the reader's word."""
    from rolltool.packed.reader import PackedDataset

    real = PackedDataset.micro_batches

    def shifted(self: Any, step: int, rank: int, **kw: Any) -> Any:
        rows = real(self, step, rank, **kw)
        if kw.get("cp_rank") == 3:
            for row in rows:
                row["position_ids"] = row["position_ids"] + 1
        return rows

    monkeypatch.setattr(PackedDataset, "micro_batches", shifted)
    r = run_cli("bench", mixed, *TINY, "--check", "--json")
    assert r.exit_code == 1
    assert not json.loads(r.stdout)["check"]["ok"]
