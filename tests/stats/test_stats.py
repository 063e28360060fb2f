"""`rolltool stats`: counts against an independent recount, exact merging, the JSON contract,
the figure, and errors for people.

Recounts use plain polars/pyarrow/numpy on the input Parquet (or on samples.parquet and the shards
of a packed run), never rolltool's own code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolltool.format import MANIFEST, Manifest
from rolltool.jobs.pack import PackConfig, run_pack
from rolltool.plan.batches import StepConfig
from rolltool.stats import ValueCounts, compute_stats
from rolltool.stats.accumulate import Moments
from rolltool.stats.packed import placement_problem, read_samples
from rolltool.storage.fs import locate

# --- the JSON contract --------------------------------------------------------------------------

ROLLOUT_TOP = {"kind", "inputs", "limit", "rows", "overall", "envs"}
ROLLOUT_SECTION = {
    "groups", "group_size", "rollouts", "samples", "branches_per_rollout", "sampled_tokens",
    "trainable_tokens", "reward", "uniform_groups", "completion",
}  # fmt: skip
LENGTH_KEYS = {"total", "mean", "min", "p50", "p90", "p99", "max"}
UNIFORM_KEYS = {"all_0", "all_1", "other", "total", "share"}
COMPLETION_KEYS = {
    "out_of_order_groups", "out_of_order_share", "displacement", "rank_correlation", "span_s",
    "group_wait_s",
}  # fmt: skip
PACKED_TOP = {
    "kind", "path", "dp", "world", "num_steps", "steps_read", "config", "workload", "samples",
    "totals", "across_steps", "selected_step", "steps",
}  # fmt: skip
STEP_KEYS = {
    "step", "batch", "epoch", "mini_batch", "status", "nominal", "actual", "groups", "rollouts", "samples", "sampled_tokens",
    "trainable_tokens", "uniform_groups_kept", "uniform_groups_dropped", "overlong_dropped",
    "over_gpu_budget", "reward_mean", "advantage_mean", "advantage_std", "envs",
    "micro_batches_per_rank", "ffd_micro_batches", "empty_micro_batches", "rows", "row_tokens",
    "real_tokens", "padding_tokens", "padding_fraction", "cp_padding_tokens",
    "cp_padding_fraction", "row_capacity", "packing_efficiency", "fill_histogram",
    "rank_imbalance", "lockstep_overhead", "step_cost", "alternatives", "ranks",
}  # fmt: skip
STEP_ENV_KEYS = {
    "groups", "rollouts", "samples", "sampled_tokens", "trainable_tokens", "uniform_groups_kept",
    "uniform_groups_dropped", "overlong_dropped", "over_gpu_budget", "reward_mean", "token_share",
    "loss_weight_sum", "loss_weight_share",
}  # fmt: skip
ALT_KEYS = {
    "micro_batches_per_rank", "rank_imbalance", "lockstep_overhead", "step_cost",
    "step_cost_vs_chosen",
}  # fmt: skip
WORLD_KEYS = {
    "dp", "sp", "cp", "group_size", "gpus", "gpu_budget", "group_budget", "row_len",
    "group_row_len",
}  # fmt: skip
RANK_KEYS = {
    "rank", "micro_batches", "samples", "row_tokens", "real_tokens", "cost", "micro_batch_tokens",
    "micro_batch_cost",
}  # fmt: skip


def _json(run_cli: Any, *args: Any) -> dict[str, Any]:
    result = run_cli("stats", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# --- an independent recount of rollout Parquet ---------------------------------------------------


def _recount(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Per env (and "all"): what stats should say, from plain polars on the input table."""
    df = pl.from_arrow(table).with_columns(
        pl.col("input_ids").list.len().alias("_len"),
        pl.col("loss_mask").cast(pl.List(pl.Int64)).list.sum().alias("_train"),
    )
    assert isinstance(df, pl.DataFrame)
    out = {}
    for name, part in [*df.group_by("env"), (("all",), df)]:
        ro = part.group_by("group_id", "rollout_id").agg(pl.col("reward").first(), pl.len())
        gr = ro.group_by("group_id").agg(
            pl.len().alias("size"), pl.col("reward").min().alias("lo"), pl.col("reward").max()
        )
        uniform = gr.filter((pl.col("size") > 1) & (pl.col("lo") == pl.col("reward")))
        lengths, train = part["_len"].to_numpy(), part["_train"].to_numpy()
        out[str(name[0])] = {
            "groups": gr.height,
            "rollouts": ro.height,
            "samples": part.height,
            "sizes": {str(k): v for k, v in gr["size"].value_counts().iter_rows()},
            "branches": {str(k): v for k, v in ro["len"].value_counts().iter_rows()},
            "sampled": {
                "total": int(lengths.sum()),
                "max": int(lengths.max()),
                **{
                    f"p{q}": int(np.percentile(lengths, q, method="inverted_cdf"))
                    for q in (50, 90, 99)
                },
            },
            "trainable_total": int(train.sum()),
            "trainable_p90": int(np.percentile(train, 90, method="inverted_cdf")),
            "reward_mean": float(ro["reward"].mean()),  # type: ignore[arg-type]
            "reward_std": float(ro["reward"].std()),  # type: ignore[arg-type]
            "uniform": {
                "all_0": int((uniform["lo"] == 0).sum()),
                "all_1": int((uniform["lo"] == 1).sum()),
                "total": uniform.height,
            },
        }
    return out


def _check_against(report: dict[str, Any], expected: dict[str, dict[str, Any]]) -> None:
    sections = {**report["envs"], "all": report["overall"]}
    assert set(sections) == set(expected)
    for name, want in expected.items():
        got = sections[name]
        assert got["groups"] == want["groups"], name
        assert got["rollouts"] == want["rollouts"], name
        assert got["samples"] == want["samples"], name
        assert got["group_size"]["counts"] == want["sizes"], name
        assert got["branches_per_rollout"]["counts"] == want["branches"], name
        for k, v in want["sampled"].items():
            assert got["sampled_tokens"][k] == v, (name, k)
        assert got["trainable_tokens"]["total"] == want["trainable_total"], name
        assert got["trainable_tokens"]["p90"] == want["trainable_p90"], name
        assert got["reward"]["mean"] == pytest.approx(want["reward_mean"]), name
        assert got["reward"]["std"] == pytest.approx(want["reward_std"]), name
        for k, v in want["uniform"].items():
            assert got["uniform_groups"][k] == v, (name, k)


def test_rollout_counts_match_an_independent_recount(
    run_cli: Any, synth_path: Path, synth_table: pa.Table
) -> None:
    report = _json(run_cli, synth_path)
    assert report["rows"] == synth_table.num_rows
    _check_against(report, _recount(synth_table))
    # the data has several envs with several sizes, branches and uniform groups: not vacuous
    assert len(report["envs"]) == 3
    assert len(report["overall"]["branches_per_rollout"]["counts"]) > 1
    assert report["overall"]["uniform_groups"]["total"] > 0


def test_rollout_json_schema_is_pinned(run_cli: Any, synth_path: Path) -> None:
    report = _json(run_cli, synth_path)
    assert set(report) == ROLLOUT_TOP
    assert report["kind"] == "rollouts"
    for section in [report["overall"], *report["envs"].values()]:
        assert set(section) == ROLLOUT_SECTION
        assert set(section["sampled_tokens"]) == set(section["trainable_tokens"]) == LENGTH_KEYS
        assert set(section["uniform_groups"]) == UNIFORM_KEYS
        assert set(section["group_size"]) == {"usual", "odd_size_groups", "counts"}
        assert set(section["completion"]) == COMPLETION_KEYS


def test_completion_order_matches_a_slow_recount(run_cli: Any, synth_path: Path) -> None:
    report = _json(run_cli, synth_path)
    df = pl.read_parquet(synth_path, columns=["group_id", "env", "finished_at"])
    df = df.with_row_index("row").with_columns(pl.col("finished_at").dt.epoch("us") / 1e6)
    for name, part in [*df.group_by("env"), (("all",), df)]:
        groups = part.group_by("group_id").agg(pl.col("row").min(), pl.col("finished_at").max())
        done = groups.sort("row")["finished_at"].to_list()
        late = sum(any(done[j] > done[i] for j in range(i)) for i in range(len(done)))
        section = report["overall"] if name[0] == "all" else report["envs"][name[0]]
        assert section["completion"]["out_of_order_groups"] == late
        assert section["completion"]["span_s"] == pytest.approx(max(done) - min(done))
        # percentiles are inverted-CDF (one of the values), as for lengths: never interpolated
        by_done = sorted(range(len(done)), key=lambda i: done[i])
        shift = [abs(by_done.index(i) - i) for i in range(len(done))]
        p90 = section["completion"]["displacement"]["p90"]
        assert p90 == int(np.percentile(shift, 90, method="inverted_cdf")) and p90 in shift


def test_files_merge_exactly(
    run_cli: Any, synth_table: pa.Table, write_parquet: Any, tmp_path: Path
) -> None:
    """Cuts in the middle of groups and rollouts: per-file results still add up to the whole."""
    whole = _json(run_cli, write_parquet(synth_table, "whole.parquet"))
    n = synth_table.num_rows
    rid = synth_table["rollout_id"].to_pylist()
    gid = synth_table["group_id"].to_pylist()
    in_rollout = [i for i in range(1, n) if rid[i] == rid[i - 1]]  # cuts a rollout's branches
    in_group = [i for i in range(1, n) if gid[i] == gid[i - 1] and rid[i] != rid[i - 1]]
    assert in_rollout and in_group
    cuts = sorted({0, in_rollout[0], in_rollout[-1], in_group[len(in_group) // 2], n})
    for k in range(len(cuts) - 1):
        write_parquet(synth_table.slice(cuts[k], cuts[k + 1] - cuts[k]), f"parts/p{k}.parquet")
    parts = _json(run_cli, tmp_path / "parts")
    assert len(parts["inputs"]) == len(cuts) - 1 >= 3
    assert parts["rows"] == whole["rows"] == n
    # exactly, floats too: rollouts are reduced in input order wherever the files were cut
    assert parts["overall"] == whole["overall"] and list(parts["envs"]) == list(whole["envs"])
    assert parts["envs"] == whole["envs"]


@pytest.mark.parametrize("limit", [None, 50])
def test_row_group_pieces_give_the_report_of_whole_files(
    synth_table: pa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """Two files of 7-row row groups (cutting groups and rollouts) read one row group per piece,
    also under --limit: the report is the one of one piece per file, exactly."""
    from rolltool.stats import rollouts

    half = synth_table.num_rows // 2
    for k, part in enumerate([synth_table.slice(0, half), synth_table.slice(half)]):
        pq.write_table(part, tmp_path / f"p{k}.parquet", row_group_size=7)
    read: list[int] = []
    real = rollouts.piece_stats

    def spy(piece: rollouts.Piece, **kw: Any) -> rollouts.RolloutStats:
        got = real(piece, **kw)
        read.append(got.rows)
        return got

    monkeypatch.setattr(rollouts, "piece_stats", spy)
    whole = compute_stats([str(tmp_path)], limit=limit).report
    assert len(read) == 2 - (limit is not None)
    read.clear()
    monkeypatch.setattr(rollouts, "PIECE_TOKENS", 1)
    cut = compute_stats([str(tmp_path)], limit=limit).report
    assert len(read) > 5 and max(read) == 7 and sum(read) == whole["rows"]
    assert whole["rows"] == synth_table.num_rows if limit is None else whole["rows"] < half
    assert cut == whole


def _group_end(ids: list[Any], limit: int) -> int:
    """Rows up to the end of the group of the limit-th row (contiguous rows of one group)."""
    n = min(limit, len(ids))
    while n < len(ids) and ids[n] == ids[n - 1]:
        n += 1
    return n


@pytest.mark.parametrize("limit", [1, 50, 10_000])
def test_limit_reads_whole_groups(
    run_cli: Any, synth_path: Path, synth_table: pa.Table, limit: int
) -> None:
    """--limit N reads at least N rows, on to the end of the last group: no group cut in half."""
    ids = synth_table["group_id"].to_pylist()
    want = _group_end(ids, limit)
    report = _json(run_cli, synth_path, "--limit", limit)
    assert report["limit"] == limit
    assert report["rows"] == report["overall"]["samples"] == want >= min(limit, len(ids))
    assert limit >= len(ids) or ids[limit - 1] == ids[want - 1] != ids[want]  # not vacuous
    _check_against(report, _recount(synth_table.slice(0, want)))
    whole = pl.Series("g", ids).value_counts(name="n")
    read = pl.Series("g", ids[:want]).value_counts(name="n")
    assert read.join(whole, on="g", how="left").filter(pl.col("n") != pl.col("n_right")).is_empty()


def test_limit_follows_a_group_into_the_next_file(run_cli: Any, write_parquet: Any) -> None:
    rows = {
        "group_id": ["a", "a", "b", "b", "b", "b", "c", "c"],
        "reward": [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0],
        "input_ids": [[1, 2]] * 8,
        "loss_mask": [[0, 1]] * 8,
    }
    table = pa.table(rows)
    write_parquet(table.slice(0, 3), "d/0.parquet")  # group b starts here...
    write_parquet(table.slice(3, 2), "d/1.parquet")  # ...goes on here...
    path = write_parquet(table.slice(5), "d/2.parquet").parent  # ...and ends here
    report = _json(run_cli, path, "--limit", 3)
    assert report["rows"] == 6
    assert report["overall"]["groups"] == 2
    assert report["overall"]["group_size"]["counts"] == {"2": 1, "4": 1}
    assert _json(run_cli, path, "--limit", 2)["rows"] == 2  # already at a boundary


def test_prompt_response_format_and_column_mapping(run_cli: Any, write_parquet: Any) -> None:
    path = write_parquet(
        {
            "gid": ["a", "a", "b", "b", "b"],
            "score": [1.0, 1.0, 0.0, 1.0, 0.5],
            "prompt_ids": [[1, 2], [1, 2], [3], [3], [3]],
            "response_ids": [[5], [6, 7, 8], [9, 9], [], [1]],
        }
    )
    report = _json(run_cli, path, "--column", "group_id=gid", "--column", "reward=score")
    o = report["overall"]
    assert list(report["envs"]) == ["default"]
    assert (o["groups"], o["rollouts"], o["samples"]) == (2, 5, 5)
    assert o["sampled_tokens"]["total"] == 3 + 5 + 3 + 1 + 2
    assert o["trainable_tokens"]["total"] == 1 + 3 + 2 + 0 + 1
    assert o["uniform_groups"] == {"all_0": 0, "all_1": 1, "other": 0, "total": 1, "share": 0.5}
    assert o["completion"] is None


def test_hive_partition_names_the_env(run_cli: Any, write_parquet: Any, tmp_path: Path) -> None:
    rows = {"group_id": [1, 1], "reward": [0.0, 1.0], "loss_mask": [[0, 1, 1], [1]]}
    write_parquet(rows, "data/env=math/part-0.parquet")
    write_parquet({**rows, "group_id": [2, 2]}, "data/env=code/part-0.parquet")
    report = _json(run_cli, tmp_path / "data")
    assert sorted(report["envs"]) == ["code", "math"]
    # [1]'s only 1 is its first token, never a target (issue 21, defect 3): 2 + 0
    assert report["envs"]["math"]["trainable_tokens"]["total"] == 2
    assert report["overall"]["rollouts"] == 4  # no rollout_id: each row is its own rollout


@pytest.mark.parametrize("seed", range(20))
def test_accumulators_add_like_the_concatenation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 50, size=rng.integers(0, 200))
    cut = int(rng.integers(0, len(x) + 1))
    merged = ValueCounts.of(x[:cut]) + ValueCounts.of(x[cut:])
    direct = ValueCounts.of(x)
    assert np.array_equal(merged.values, direct.values)
    assert np.array_equal(merged.counts, direct.counts)
    for q in (0.01, 0.5, 0.9, 0.99, 1.0):
        want = int(np.percentile(x, 100 * q, method="inverted_cdf")) if len(x) else None
        assert merged.quantile(q) == want
    f = rng.normal(size=len(x))
    m = Moments.of(f[:cut]) + Moments.of(f[cut:])
    assert m.n == len(f)
    if len(f) > 1:
        assert m.mean == pytest.approx(f.mean())
        assert m.std == pytest.approx(f.std(ddof=1))


# --- packed runs ---------------------------------------------------------------------------------


def _pack(root: Path, table: pa.Table, **kw: Any) -> Path:
    src = root / "in.parquet"
    pq.write_table(table, src)
    out = root / "packed"
    kw.setdefault("steps", StepConfig(batch_size=32))
    config = PackConfig(dp=4, micro_batch_tokens=8192, **kw)
    run_pack([str(src)], out, config, command=["test"])
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> Path:
    """Fixed-length rows (padding) and uniform groups dropped: every figure is non-trivial."""
    steps = StepConfig(batch_size=32, uniform="drop")
    return _pack(tmp_path_factory.mktemp("packed"), synth_table, row_len=8192, steps=steps)


def test_packed_counts_match_samples_parquet(run_cli: Any, packed: Path) -> None:
    report = _json(run_cli, packed)
    samples = pl.read_parquet(packed / "samples.parquet")
    trained = samples.filter(pl.col("status") == "trained")
    manifest = json.loads((packed / "manifest.json").read_text())
    assert report["num_steps"] == manifest["num_steps"] == len(report["steps"]) > 1
    assert report["totals"]["samples"] == trained.height
    assert report["totals"]["uniform_groups_dropped"] > 0  # the fixture is not vacuous
    for s in report["steps"]:
        mine = trained.filter(pl.col("step") == s["step"])
        dropped = samples.filter(
            (pl.col("step") == s["step"]) & (pl.col("status") == "uniform_dropped")
        )
        assert s["samples"] == mine.height
        assert s["sampled_tokens"] == s["real_tokens"] == mine["length"].sum()
        assert s["trainable_tokens"] == mine["trainable_tokens"].sum()
        assert s["groups"] == mine["group_id"].n_unique()
        assert s["rollouts"] == mine.select("group_id", "rollout_id").n_unique()
        assert s["uniform_groups_dropped"] == dropped["group_id"].n_unique()
        for env, e in s["envs"].items():
            part = mine.filter(pl.col("env") == env)
            assert e["samples"] == part.height
            assert e["sampled_tokens"] == part["length"].sum()
            assert e["token_share"] == pytest.approx(part["length"].sum() / mine["length"].sum())
            weight = (part["token_loss_weight"].cast(pl.Float64) * part["trainable_tokens"]).sum()
            assert e["loss_weight_share"] == pytest.approx(weight, rel=1e-5)  # token-mean: sum 1
        # rows are padded to 8192: capacity is every row, padding is the rest
        m = mine.select("rank", "micro_batch").n_unique()
        assert s["micro_batches_per_rank"] * 4 == s["rows"] >= m
        assert s["row_tokens"] == s["rows"] * 8192 == s["row_capacity"]
        assert s["padding_tokens"] == s["row_capacity"] - mine["length"].sum()
        assert s["packing_efficiency"] == pytest.approx(mine["length"].sum() / (s["rows"] * 8192))
        assert sum(s["fill_histogram"]) == s["rows"]
        per_rank = mine.group_by("rank").agg(pl.col("length").sum())["length"].to_numpy()
        imbalance = per_rank.max() / (mine["length"].sum() / 4)
        assert s["rank_imbalance"]["tokens"] == pytest.approx(imbalance)
        plan = manifest["steps"][s["step"]]["plan"]
        assert s["rank_imbalance"]["cost"] == pytest.approx(plan["imbalance_cost"])
        assert s["lockstep_overhead"]["cost"] == pytest.approx(plan["lockstep_overhead_cost"])
        assert s["lockstep_overhead"]["tokens"] == pytest.approx(plan["lockstep_overhead_tokens"])


def test_packed_padding_matches_the_shards(packed: Path) -> None:
    """The one figure worth checking against the rows themselves: padding tokens."""
    import rolltool

    stats = compute_stats([str(packed)]).report
    ds = rolltool.open_packed(packed)
    checked = 0
    for s in stats["steps"]:
        pad = 0
        for rank in range(ds.dp):
            for mb in ds.micro_batches(s["step"], rank):
                seg = np.diff(np.asarray(mb["cu_seqlens"]))
                pad += int(seg[np.asarray(mb["sample_index"]) < 0].sum())
                checked += 1
        assert s["padding_tokens"] == pad
    assert checked == sum(s["rows"] for s in stats["steps"])


def test_packed_json_schema_is_pinned(run_cli: Any, packed: Path) -> None:
    report = _json(run_cli, packed)
    assert set(report) == PACKED_TOP
    assert report["kind"] == "packed"
    assert set(report["world"]) == WORLD_KEYS
    for s in report["steps"]:
        assert set(s) == STEP_KEYS
        assert set(s["rank_imbalance"]) == set(s["lockstep_overhead"]) == {"tokens", "cost"}
        assert set(s["alternatives"]) == {"tokens", "count"}
        for alt in s["alternatives"].values():
            assert set(alt) == ALT_KEYS
        for e in s["envs"].values():
            assert set(e) == STEP_ENV_KEYS
        assert len(s["ranks"]) == report["dp"]
        for r in s["ranks"]:
            assert set(r) == RANK_KEYS
            assert len(r["micro_batch_tokens"]) == s["micro_batches_per_rank"]
    assert set(report["totals"]["balance"]) == {"chosen", "tokens", "count"}


def test_alternative_equal_to_the_chosen_split_costs_the_same(
    tmp_path: Path, synth_table: pa.Table
) -> None:
    """Balancing tokens, the 'tokens' re-plan is the plan itself: ratio exactly 1."""
    out = _pack(tmp_path, synth_table, balance="tokens")
    report = compute_stats([str(out)]).report
    for s in report["steps"]:
        assert s["alternatives"]["tokens"]["step_cost_vs_chosen"] == pytest.approx(1.0, abs=1e-12)
        assert s["alternatives"]["tokens"]["rank_imbalance"] == pytest.approx(s["rank_imbalance"])


def test_packed_step_and_limit(run_cli: Any, packed: Path) -> None:
    one = run_cli("stats", packed, "--step", 1, "--per-step")
    assert one.exit_code == 0, one.stderr
    assert "step 1: ranks" in one.stdout and "step 1: balance" in one.stdout
    report = _json(run_cli, packed, "--limit", 1)
    assert report["steps_read"] == len(report["steps"]) == 1
    assert report["totals"]["samples"] == report["steps"][0]["samples"]


def test_packed_percentiles_across_steps_are_inverted_cdf(run_cli: Any, packed: Path) -> None:
    report = _json(run_cli, packed)
    for key in ("sampled_tokens", "packing_efficiency"):
        values = [s[key] for s in report["steps"]]
        for q in (50, 90):
            got = report["across_steps"][key][f"p{q}"]
            assert got == np.percentile(values, q, method="inverted_cdf") and got in values


def test_an_env_named_all(run_cli: Any, write_parquet: Any, tmp_path: Path) -> None:
    """ "all" is an env like any other: JSON keeps `overall` apart from `envs`, the table names
    the column of all envs "(all)"."""
    n = 12
    path = write_parquet(
        {
            "group_id": [f"g{i // 4}" for i in range(n)],
            "env": ["all"] * 8 + ["x"] * 4,
            "reward": [float(i % 2) for i in range(n)],
            "input_ids": [[1] * (i + 1) for i in range(n)],
            "loss_mask": [[1] * (i + 1) for i in range(n)],
        }
    )
    report = _json(run_cli, path)
    assert list(report["envs"]) == ["all", "x"]
    assert report["envs"]["all"]["samples"] == 8 and report["envs"]["all"]["groups"] == 2
    assert report["overall"]["samples"] == n and report["overall"]["groups"] == 3
    assert json.loads(json.dumps(report))["envs"]["all"] == report["envs"]["all"]
    table = run_cli("stats", path).stdout
    header = next(line for line in table.splitlines() if "(all)" in line)
    assert [c.strip() for c in header.split("┃")[2:-1]] == ["all", "x", "(all)"]
    packed = tmp_path / "packed"
    run_pack([str(path)], packed, PackConfig(dp=2, steps=StepConfig(batch_size=3)), command=["t"])
    report = _json(run_cli, packed)
    assert set(report["totals"]["envs"]) == {"all", "x"}
    assert report["totals"]["envs"]["all"]["samples"] == 8


def _text(renderable: Any, width: int) -> str:
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 120])
def test_tables_fit_the_terminal(
    run_cli: Any, packed: Path, write_parquet: Any, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Narrower than the tables: short headers, fewer columns (named in a caption), env columns
    over several tables, never a cut number; piped output (160 columns) keeps every column."""
    from rolltool.stats.render import render

    envs = [f"environment-{i}" for i in range(7)]
    many = write_parquet(
        {
            "group_id": [f"g{i // 2}" for i in range(28)],
            "env": [envs[i // 4] for i in range(28)],
            "reward": [float(i % 3 == 0) for i in range(28)],
            "input_ids": [[1] * (1000 * i + 1) for i in range(28)],
            "loss_mask": [[1] * (1000 * i + 1) for i in range(28)],
        }
    )
    for report, kw in (
        (compute_stats([str(packed)], step=1).report, {"per_step": True, "step": 1}),
        (compute_stats([str(many)]).report, {}),
    ):
        text = _text(render(report, width=width, **kw), width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text
        full = _text(render(report, width=None, **kw), 1000)

        def numbers(t: str) -> set[str]:
            return {w for w in t.replace("│", " ").split() if w[0].isdigit() and "," in w}

        assert numbers(text) and numbers(text) <= numbers(full)  # no number cut or wrapped
    monkeypatch.delenv("COLUMNS", raising=False)  # COLUMNS, when set, is honoured piped too
    piped = run_cli("stats", packed, "--per-step", "--step", 1).stdout
    assert "hidden" not in piped  # every column of every table
    for header in ("(tokens)", "step time", "status", "uniform", "micro-batches"):
        assert header in piped
    assert max(len(line) for line in piped.splitlines()) <= 160


def test_terminal_tables(run_cli: Any, synth_path: Path, packed: Path) -> None:
    result = run_cli("stats", synth_path)
    assert result.exit_code == 0
    assert "uniform groups" in result.stdout and "agent" in result.stdout
    assert f"{_recount(pq.read_table(synth_path))['all']['sampled']['total']:,}" in result.stdout
    result = run_cli("stats", packed)
    assert result.exit_code == 0
    for text in ("packing efficiency", "lockstep overhead", "tokens", "count", "token fill"):
        assert text in result.stdout


# --- the figure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["rollouts", "packed"])
def test_plot_is_written_with_labelled_axes(
    run_cli: Any, synth_path: Path, packed: Path, tmp_path: Path, kind: str
) -> None:
    from rolltool.stats.plot import figure

    src = synth_path if kind == "rollouts" else packed
    png = tmp_path / "stats.png"
    result = run_cli("stats", src, "--plot", png, "--json")
    assert result.exit_code == 0, result.stderr
    json.loads(result.stdout)  # the figure does not spoil the JSON document
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    fig = figure(compute_stats([str(src)]))
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(loc="left"), ax
        assert ax.has_data()


def _drawn(fig: Any) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def _ticks(axis: Any) -> list[tuple[float, str]]:
    """Major ticks inside the view, with their labels."""
    lo, hi = sorted(axis.get_view_interval())
    return [
        (t.get_loc(), t.label1.get_text())
        for t in axis.get_major_ticks()
        if lo <= t.get_loc() <= hi and t.label1.get_visible()
    ]


@pytest.mark.parametrize("kind", ["rollouts", "tiny", "packed"])
def test_plot_is_readable(synth_path: Path, packed: Path, write_parquet: Any, kind: str) -> None:
    """Plain 1-2-5 length ticks without minor labels, whole-number counts, legends that cover
    neither bars nor other axes and stay on the page."""
    import re

    from matplotlib.patches import Rectangle

    from rolltool.stats.plot import figure

    src = {"rollouts": synth_path, "packed": packed}.get(kind)
    if src is None:  # two groups: count axes where 0.25 steps would come naturally
        src = write_parquet(pq.read_table(synth_path).slice(0, 20), "tiny.parquet")
    fig = figure(compute_stats([str(src)]))
    renderer = _drawn(fig)
    axes = {ax.get_title(loc="left").split(":")[0].split(" ")[0]: ax for ax in fig.get_axes()}
    lengths = next(ax for ax in fig.get_axes() if ax.get_xscale() == "log").xaxis
    ticks = _ticks(lengths)
    assert 2 <= len(ticks) <= 8
    for loc, label in ticks:
        assert re.fullmatch(r"\d{1,3}(,\d{3})*", label), label
        assert float(label.replace(",", "")) == pytest.approx(loc)
        assert label[0] in "125" or kind == "tiny"
    assert all(not t.label1.get_text() for t in lengths.get_minor_ticks())
    counts = [lengths.axes.yaxis]
    if kind != "packed":
        counts += [axes["Groups"].xaxis, axes["Group"].yaxis]
    for axis in counts:
        assert all(float(loc).is_integer() for loc, _ in _ticks(axis)), _ticks(axis)
    page = fig.bbox
    bars = [
        p.get_window_extent(renderer)
        for ax in fig.get_axes()
        for p in ax.patches
        if isinstance(p, Rectangle) and p.get_height() > 0
    ]
    for ax in fig.get_axes():
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
        for other in fig.get_axes():
            if other is not ax:
                assert not box.overlaps(other.get_window_extent(renderer)), ax.get_title(loc="left")  # fmt: skip
        for bar in bars:
            assert not box.overlaps(bar), ax.get_title(loc="left")


def test_plot_without_matplotlib_is_an_error(
    run_cli: Any, synth_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = run_cli("stats", synth_path, "--plot", tmp_path / "x.png")
    assert result.exit_code == 1
    assert "matplotlib" in result.stderr and "rolltool[plot]" in result.stderr


# --- errors --------------------------------------------------------------------------------------


def test_errors_are_for_people(run_cli: Any, tmp_path: Path, write_parquet: Any, packed: Path) -> None:  # fmt: skip
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "something-else"}')
    not_rollouts = write_parquet({"a": [1, 2]}, "plain/x.parquet").parent
    cases = [
        ((tmp_path / "missing",), "no such file"),
        ((tmp_path / "empty",), "not a rolltool directory"),
        ((other,), "not a rolltool packed manifest"),
        ((not_rollouts,), "not rollout Parquet"),
        ((packed, "--step", 99), "out of range"),
        ((not_rollouts / "x.parquet", "--step", 0), "packed directory"),
        ((packed, packed), "give it alone"),
    ]
    for args, message in cases:
        result = run_cli("stats", *args)  # a traceback fails the test (conftest)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith("Error: ") and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rank": 99}, "rank 99, micro_batch"),
        ({"rank": -1}, "rank -1"),
        ({"micro_batch": 10**6}, "micro_batch 1000000;"),
        ({"step": 10**6}, "at step 1000000"),
        ({"status": None}, "samples.parquet is missing or unreadable (string with"),
        ({"whole env": 7}, "samples.parquet is missing or unreadable (int64, not strings)"),
        ({"length": 1.5}, "samples.parquet is missing or unreadable (double"),
        ({"drop": "micro_batch"}, "samples.parquet is missing or unreadable"),
    ],
)
def test_a_samples_file_that_does_not_fit_its_manifest_is_an_error(
    run_cli: Any, packed: Path, tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    """A trained sample placed outside the manifest's steps, ranks or micro-batches (or a column
    of another type) names the directory and the sample: never an IndexError."""
    out = tmp_path / "packed"
    shutil.copytree(packed, out)
    table = pq.read_table(out / "samples.parquet")
    first = int(np.flatnonzero(np.asarray(table["status"].to_pylist()) == "trained")[0])
    for column, value in edit.items():
        if column == "drop":
            table = table.drop_columns([value])
            continue
        if column.startswith("whole "):
            column = column.split()[1]
            whole = pa.array([value] * len(table))
            table = table.set_column(table.schema.get_field_index(column), column, whole)
            continue
        values = table[column].to_pylist()
        values[first] = value
        typed = pa.array(values) if value is not None else pa.array(values, table[column].type)
        table = table.set_column(table.schema.get_field_index(column), column, typed)
    pq.write_table(table, out / "samples.parquet")
    result = run_cli("stats", out)  # a traceback fails the test (conftest)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {out}: samples.parquet ") and message in result.stderr
    if edit.keys() & {"rank", "micro_batch", "step"}:
        index = table["sample_index"][first].as_py()
        assert f"sample {index} is at step" in result.stderr, result.stderr


def test_a_pack_whose_samples_none_trained_is_reported_not_a_traceback(
    run_cli: Any, packed: Path, tmp_path: Path
) -> None:
    """samples.parquet with no trained sample (every status another): each step's figures are
    of no samples, as before the pyarrow reader, not a ValueError of the split by step; and a
    manifest of no steps places no trained sample (`placement_problem` names it)."""
    out = tmp_path / "packed"
    shutil.copytree(packed, out)
    table = pq.read_table(out / "samples.parquet")
    status = table.schema.get_field_index("status")
    table = table.set_column(status, "status", pa.array(["leftover"] * len(table)))
    pq.write_table(table, out / "samples.parquet")
    result = run_cli("stats", out, "--json")  # a traceback fails the test (conftest)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["steps"]) == json.loads(result.stdout)["steps_read"] > 0
    samples, _ = read_samples(locate(str(packed)))
    manifest = Manifest.from_json(json.loads((packed / MANIFEST).read_text()), "manifest")
    assert len(samples["step"]) and placement_problem(samples, manifest) is None
    none = dataclasses.replace(manifest, steps=())
    wrong = placement_problem(samples, none)
    assert wrong is not None and f"the manifest has 0 steps of {manifest.dp} ranks" in wrong


def test_stats_does_not_import_torch(synth_path: Path, packed: Path) -> None:
    """Nor Ray, without --engine ray."""
    code = (
        "import sys; from rolltool.cli import main; from rolltool.stats import compute_stats; "
        "from rolltool.stats import render; "
        f"compute_stats([{str(synth_path)!r}]); compute_stats([{str(packed)!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ray_address_needs_engine_ray(run_cli: Any, synth_path: Path) -> None:
    result = run_cli("stats", synth_path, "--ray-address", "auto")
    assert result.exit_code == 2 and "--ray-address is for --engine ray" in result.stderr
    assert result.stdout == ""


def test_column_mapping_from_a_column_no_file_has(run_cli: Any, synth_path: Path) -> None:
    result = run_cli("stats", synth_path, "--column", "reward=nope")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(
        "Error: --column reward=nope: no input file has a column 'nope'"
    )
    assert "query plan" not in result.stderr.lower() and len(result.stderr.splitlines()) == 2
    twice = run_cli("stats", synth_path, "--column", "a=reward", "--column", "b=reward")
    assert twice.exit_code == 2 and "'reward'" in twice.stderr


@pytest.mark.parametrize("column", ["group_id", "rollout_id"])
def test_an_id_column_typed_differently_across_files_is_refused(
    run_cli: Any, write_parquet: Any, tmp_path: Path, column: str
) -> None:
    """1 and "1" are not merged into one group (or rollout): refused, as pack refuses it."""
    rows = {"group_id": [1, 1], "rollout_id": [0, 1], "reward": [0.0, 1.0], "loss_mask": [[1], [1]]}
    a = write_parquet(rows, "data/a.parquet")
    b = write_parquet({**rows, column: [str(v) for v in rows[column]]}, "data/b.parquet")
    result = run_cli("stats", tmp_path / "data")
    assert result.exit_code == 1, result.output
    assert f"column '{column}' is integer in {a} but string in {b}" in result.stderr


@pytest.mark.parametrize("n", [5, 35, 500])
def test_row_capacity_panel_is_readable(n: int) -> None:
    """Issue 13: 35 overlapping percentage labels and an axis from 0 squashed the part that
    matters. Labels only where they fit (none overlapping), the axis starting just below the
    lowest step, every step's bar reaching 100% of its capacity inside the view."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from rolltool.stats.plot import MAX_CAPACITY_LABELS, _capacity

    rng = np.random.default_rng(n)
    eff = rng.uniform(0.55, 0.99, n)
    pad = rng.uniform(0.0, 0.3, n) * (1 - eff)
    steps = [
        {"row_capacity": 10_000, "real_tokens": int(e * 10_000), "padding_tokens": int(p * 10_000)}
        for e, p in zip(eff, pad, strict=True)
    ]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    _capacity(ax, steps, np.arange(n), {"packing_efficiency": 0.8, "padding_fraction": 0.05})
    renderer = _drawn(fig)
    lo, hi = ax.get_ylim()
    assert 0 < lo <= eff.min() - 0.05 and hi >= 1.0
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == (n if n <= MAX_CAPACITY_LABELS else 0)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for i, a in enumerate(boxes):
        assert not any(a.overlaps(b) for b in boxes[i + 1 :]), labels[i].get_text()
    tops = [p.get_y() + p.get_height() for p in ax.patches]
    assert len(tops) == 3 * n and max(tops) == pytest.approx(1.0)
    assert all(label.endswith("%") for _, label in _ticks(ax.yaxis))


# --- --sp / --cp: the world, the budgets and the samples only the split made trainable ---------

SPLIT_PACKS = {
    # cp 2, 1,536 tokens per GPU: a group's row holds 3,072 padded tokens, longer samples drop
    "cp2": {"cp": 2, "micro_batch_tokens": 1536, "overlong": "drop"},
    # sp 2 with rows of 2,560 per GPU: a row (and its capacity) is 5,120 tokens of the group
    "sp2": {"sp": 2, "micro_batch_tokens": 2048, "row_len": 2560},
}


@pytest.fixture(scope="module")
def split_packs(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split")
    src = root / "in.parquet"
    pq.write_table(synth_table, src)
    out = {}
    for name, kw in SPLIT_PACKS.items():
        config = PackConfig(dp=2, steps=StepConfig(batch_size=32), **kw)
        run_pack([str(src)], root / name, config, command=["test"])
        out[name] = root / name
    return out


def _padded(length: pl.Expr, cp: int) -> pl.Expr:
    """A sample's tokens in its group's row: its length, with cp rounded up to a multiple of 2cp."""
    m = 2 * cp if cp > 1 else 1
    return ((length + m - 1) // m) * m


@pytest.mark.parametrize("name", sorted(SPLIT_PACKS))
def test_split_world_and_over_gpu_budget_match_samples_parquet(
    run_cli: Any, split_packs: dict[str, Path], name: str
) -> None:
    """dp/sp/cp, both budgets and, per step and env, the trained samples longer than the per-GPU
    budget, recounted from samples.parquet; with cp the CP padding is each trained sample's
    rounding up to a multiple of 2cp, and the balance figures are the plan's (padded tokens)."""
    kw, packed = SPLIT_PACKS[name], split_packs[name]
    sp, cp, budget = kw.get("sp", 1), kw.get("cp", 1), kw["micro_batch_tokens"]
    k = sp * cp
    report = _json(run_cli, packed)
    assert report["world"] == {
        "dp": 2, "sp": sp, "cp": cp, "group_size": k, "gpus": 2 * k, "gpu_budget": budget,
        "group_budget": budget * k, "row_len": kw.get("row_len"),
        "group_row_len": kw["row_len"] * k if "row_len" in kw else None,
    }  # fmt: skip
    samples = pl.read_parquet(packed / "samples.parquet")
    trained = samples.filter(pl.col("status") == "trained").with_columns(
        over=pl.col("length") > budget, padded=_padded(pl.col("length"), cp)
    )
    manifest = json.loads((packed / "manifest.json").read_text())
    assert report["totals"]["over_gpu_budget"] == trained["over"].sum() > 0  # not vacuous
    if cp > 1:  # over the group's budget (padded): dropped, not split
        dropped = samples.filter(pl.col("status") == "overlong_dropped")
        assert report["totals"]["overlong_dropped"] == dropped.height > 0
        assert (_padded(dropped["length"], cp) > budget * k).all()
    assert (trained["padded"] <= budget * k).all()
    for s in report["steps"]:
        mine = trained.filter(pl.col("step") == s["step"])
        assert s["over_gpu_budget"] == mine["over"].sum()
        for env, e in s["envs"].items():
            assert e["over_gpu_budget"] == mine.filter(pl.col("env") == env)["over"].sum()
        cp_padding = int((mine["padded"] - mine["length"]).sum())
        assert s["cp_padding_tokens"] == cp_padding and (cp_padding > 0) == (cp > 1)
        assert s["cp_padding_fraction"] == pytest.approx(cp_padding / s["row_tokens"])
        per_row = kw["row_len"] * k if "row_len" in kw else budget * k
        assert s["row_capacity"] == s["rows"] * per_row
        assert s["real_tokens"] == mine["length"].sum()
        per_rank = mine.group_by("rank").agg(pl.col("padded").sum())["padded"].to_numpy()
        assert s["rank_imbalance"]["tokens"] == pytest.approx(per_rank.max() / per_rank.mean())
        plan = manifest["steps"][s["step"]]["plan"]
        assert plan["max_tokens"] == budget * k
        for key in ("imbalance_cost", "imbalance_tokens"):
            assert s["rank_imbalance"][key.split("_")[1]] == pytest.approx(plan[key])
        for key in ("lockstep_overhead_cost", "lockstep_overhead_tokens"):
            assert s["lockstep_overhead"][key.rsplit("_", 1)[1]] == pytest.approx(plan[key])
    for env, e in report["totals"]["envs"].items():
        assert e["over_gpu_budget"] == trained.filter(pl.col("env") == env)["over"].sum()


@pytest.mark.parametrize("name", sorted(SPLIT_PACKS))
def test_split_padding_matches_the_shards(split_packs: dict[str, Path], name: str) -> None:
    """Padding tokens (CP padding segments after samples and row-end padding) and CP padding
    alone, counted in the group's rows themselves."""
    import rolltool

    packed = split_packs[name]
    stats = compute_stats([str(packed)]).report
    ds = rolltool.open_packed(packed)
    for s in stats["steps"]:
        pad = after_sample = 0
        for rank in range(ds.dp):
            for mb in ds.micro_batches(s["step"], rank):
                seg = np.diff(np.asarray(mb["cu_seqlens"]))
                idx = np.asarray(mb["sample_index"])
                pad += int(seg[idx < 0].sum())
                follows = np.r_[False, idx[:-1] >= 0] & (idx < 0)
                after_sample += int(seg[follows].sum())
        assert s["padding_tokens"] == pad
        if SPLIT_PACKS[name].get("cp", 1) > 1:  # row-end padding never follows a sample here:
            assert s["cp_padding_tokens"] == after_sample  # a multiple of 2cp needs none


def test_split_tables_show_the_world(run_cli: Any, split_packs: dict[str, Path]) -> None:
    cp = run_cli("stats", split_packs["cp2"], "--per-step", "--step", 0)
    assert cp.exit_code == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[1] == (
        "dp 2 x cp 2 = 4 GPUs; 1,536 tokens per GPU, 3,072 per group micro-batch "
        "(CP padding counted)"
    )
    report = compute_stats([str(split_packs["cp2"])]).report
    over = next(line for line in lines if "over the per-GPU budget (split)" in line)
    assert over.split("│")[2].strip() == f"{report['totals']['over_gpu_budget']:,}"
    cp_pad = next(line for line in lines if "CP padding tokens" in line)
    assert cp_pad.split("│")[2].strip() == f"{report['totals']['cp_padding_tokens']:,}"
    assert "of which CP padding" in cp.stdout and cp.stdout.count("over GPU") == 3
    sp = run_cli("stats", split_packs["sp2"]).stdout
    world = "dp 2 x sp 2 = 4 GPUs; 2,048 tokens per GPU, 4,096 per group micro-batch"
    assert f"{world}; rows of 2,560 per GPU (5,120 per group)" in sp
    from rolltool.stats.render import render

    for width in (80, 120):  # the split's rows and columns fit a terminal like the others
        text = _text(render(report, per_step=True, step=0, width=width), width)
        assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
    assert "over the per-GPU budget" in sp and "CP padding" not in sp


def test_packs_without_a_split_print_as_before(run_cli: Any, packed: Path) -> None:
    """No sp/cp: the header's first line as it always was, none of the split's rows or columns;
    in JSON a world of one GPU per rank and nothing over a budget or padded for cp."""
    result = run_cli("stats", packed, "--per-step", "--step", 1)
    lines = result.stdout.splitlines()
    assert lines[0].endswith("steps of 32 rollouts, dp 4, 8,192 tokens per micro-batch, rows padded to 8,192")  # fmt: skip
    assert lines[1].startswith("balance ")
    for text in ("GPU", "CP padding", "x sp", "x cp"):
        assert text not in result.stdout
    report = _json(run_cli, packed)
    assert report["world"] == {
        "dp": 4, "sp": 1, "cp": 1, "group_size": 1, "gpus": 4, "gpu_budget": 8192,
        "group_budget": 8192, "row_len": 8192, "group_row_len": 8192,
    }  # fmt: skip
    assert report["totals"]["over_gpu_budget"] == report["totals"]["cp_padding_tokens"] == 0
    assert all(s["over_gpu_budget"] == s["cp_padding_tokens"] == 0 for s in report["steps"])


def test_mini_batches_and_epochs_show_the_batch_structure(run_cli: Any, tmp_path: Path) -> None:
    """A pack with --mini-batches/--epochs: the header says how batches became optimizer
    steps, every step its (batch, epoch, mini-batch) in the JSON and the per-step table."""
    src = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
    out = tmp_path / "ppo"
    r = run_cli("pack", str(src), "-o", str(out), "--dp", "2", "--batch-size", "64",
                "--mini-batches", "2", "--epochs", "2")  # fmt: skip
    assert r.exit_code == 0
    assert "(each batch: 2 epochs x 2 mini-batches)" in r.stderr
    assert "(sample, epoch) pairs (2 epochs) trained" in r.stderr
    report = _json(run_cli, out)
    got = [(s["batch"], s["epoch"], s["mini_batch"]) for s in report["steps"]]
    assert got == [(k // 4, k % 4 // 2, k % 2) for k in range(len(got))]
    text = "".join(run_cli("stats", str(out), "--per-step").stdout.split())  # wrapped anywhere
    assert "optimizerstepsfrombatchesof64rollouts(eachbatch:2epochsx2mini-batches)" in text
    assert "5(b1e0m1)" in text
