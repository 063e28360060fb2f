"""``rolltool pack --share-prefix`` (issue 24): packed, read back and checked against the input.

Every sample reassembles exactly from the reader's rows (its chain's stored tokens, positions
0 .. L-1), every stored loss weight is the sum over the samples through its segment of what the
same input packed unshared gives them (for dp 1, 2, 8 and every loss aggregation), the step's
denominators and samples.parquet's weights are the unshared pack's, no row passes its budget (a
tree too big for one is cut, each part with its own copy of the prefix), and a shard whose
parents or prefix samples were forged is refused by the reader.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, input_samples, pack, samples
from shared_helpers import shared_rollouts

import rolltool
from rolltool.errors import RolltoolError
from rolltool.format.shards import read_shard, save_safetensors
from rolltool.input.synth import SynthConfig, generate
from rolltool.plan.loss import LOSS_AGGS

BUDGET = ("--micro-batch-tokens", 2048)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """grpo: 6 groups of 8 rollouts behind a 100-300-token prompt; agent: 4 groups of 3
    rollouts x 3 branches sharing a trained trajectory, plus 2 copies of a group's first sample
    (identical samples); none: synth data (no common prefix)."""
    root = tmp_path_factory.mktemp("shared-in")
    tables = {
        "grpo": shared_rollouts(groups=6, rollouts=8),
        "agent": shared_rollouts(groups=4, rollouts=3, branches=3, identical=2, seed=1),
        "none": generate(SynthConfig(groups=4, seed=3, max_len=1500)),
    }
    out = {}
    for name, table in tables.items():
        out[name] = root / f"{name}.parquet"
        pq.write_table(table, out[name])
    return out


def _rows(out: Path) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    ds = rolltool.open_packed(out)
    return [
        (step, rank, row)
        for step in range(ds.num_steps)
        for rank in range(ds.dp)
        for row in ds.micro_batches(step, rank)
    ]


def _leaves(row: dict[str, np.ndarray]) -> dict[int, list[int]]:
    """sample_index -> its chain of segments (root first) for every leaf of a shared row."""
    parent = row["parent"]
    has_kids = np.zeros(len(parent), dtype=bool)
    has_kids[parent[parent >= 0]] = True
    out = {}
    for j in np.flatnonzero(~has_kids & (row["sample_index"] >= 0)).tolist():
        chain, seg = [], j
        while seg >= 0:
            chain.append(seg)
            seg = int(parent[seg])
        out[int(row["sample_index"][j])] = chain[::-1]
    return out


def _through(row: dict[str, np.ndarray]) -> dict[int, list[int]]:
    """segment -> the samples whose chain holds it."""
    out: dict[int, list[int]] = defaultdict(list)
    for i, chain in _leaves(row).items():
        for seg in chain:
            out[seg].append(i)
    return out


def test_every_sample_reassembles_exactly(inputs: dict[str, Path], tmp_path: Path) -> None:
    for name in ("grpo", "agent"):
        out = tmp_path / name
        m = pack(inputs[name], out, "--dp", 2, "--share-prefix", "--batch-size", 12, *BUDGET)
        assert m["format_version"] == 4 and m["config"]["share_prefix"] is True
        assert m["config"]["share_min"] == 64
        inp = input_samples(inputs[name])
        seen: list[int] = []
        for _, _, row in _rows(out):
            cu = row["cu_seqlens"]
            for i, chain in _leaves(row).items():
                rows = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in chain])
                assert row["input_ids"][rows].tolist() == inp["input_ids"][i]
                assert row["loss_mask"][rows].tolist() == [int(x) for x in inp["loss_mask"][i]]
                np.testing.assert_array_equal(row["logprobs"][rows][row["loss_mask"][rows] == 1],
                                              np.float32(inp["logprobs"][i])[row["loss_mask"][rows] == 1])  # fmt: skip
                assert row["position_ids"][rows].tolist() == list(range(len(rows)))
                seen.append(i)
        trained = samples(out)
        want = sorted(trained["sample_index"][trained["status"] == "trained"].tolist())
        assert sorted(seen) == want  # every trained sample once
        for st in m["steps"]:
            sh = st["plan"]["shared"]
            assert sh["prefixes"] > 0 and sh["stored"] < sh["tokens"]
            assert sh["tokens"] == st["sampled_tokens"]
            assert sum(e["stored"] for e in sh["envs"].values()) == sh["stored"]


@pytest.mark.parametrize("agg", sorted(LOSS_AGGS))
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_loss_weights_are_the_unshared_ones_summed(
    inputs: dict[str, Path], tmp_path: Path, dp: int, agg: str
) -> None:
    """Layout invariance: a stored token weighs the sum over its samples of their unshared
    weights; the step's target weights, denominators and samples.parquet are unchanged."""
    extra: tuple[Any, ...] = (
        ("--loss-scale-factor", 512) if agg == "seq-mean-token-sum-norm" else ()
    )
    common = ("--dp", dp, "--batch-size", 12, "--loss-agg", agg, *extra, *BUDGET)
    plain = pack(inputs["agent"], tmp_path / "plain", *common)
    shared = pack(inputs["agent"], tmp_path / "shared", *common, "--share-prefix")
    alone: dict[int, np.ndarray] = {}
    plain_target = defaultdict(float)
    for step, _, row in _rows(tmp_path / "plain"):
        cu = row["cu_seqlens"]
        plain_target[step] += float(row["target_loss_weight"].astype(np.float64).sum())
        for k, i in enumerate(row["sample_index"].tolist()):
            if i >= 0:
                alone[i] = row["loss_weight"][cu[k] : cu[k + 1]].astype(np.float64)
    checked = 0
    shared_target = defaultdict(float)
    for step, _, row in _rows(tmp_path / "shared"):
        cu = row["cu_seqlens"]
        start = row["position_ids"][cu[:-1]]
        shared_target[step] += float(row["target_loss_weight"].astype(np.float64).sum())
        for seg, members in _through(row).items():
            n = int(cu[seg + 1] - cu[seg])
            a = int(start[seg])
            want = sum(alone[i][a : a + n] for i in members)
            np.testing.assert_allclose(row["loss_weight"][cu[seg] : cu[seg + 1]], want,
                                       rtol=1e-6, atol=0)  # fmt: skip
            checked += len(members) > 1
    assert checked > 0  # prefixes were really compared
    for step in plain_target:
        assert shared_target[step] == pytest.approx(plain_target[step], rel=1e-6)
    for a, b in zip(plain["steps"], shared["steps"], strict=True):
        assert a["denominators"] == b["denominators"]
        assert a["loss_weight_sum"] == b["loss_weight_sum"]
    sp, ss = samples(tmp_path / "plain"), samples(tmp_path / "shared")
    np.testing.assert_array_equal(sp["token_loss_weight"], ss["token_loss_weight"])
    np.testing.assert_array_equal(sp["step"], ss["step"])


def test_no_common_prefix_packs_as_unshared(inputs: dict[str, Path], tmp_path: Path) -> None:
    m = pack(inputs["none"], tmp_path / "s", "--dp", 2, "--share-prefix", "--batch-size", 16,
             "--micro-batch-tokens", 4096)  # fmt: skip
    for st in m["steps"]:
        sh = st["plan"]["shared"]
        assert sh["prefixes"] == 0 and sh["stored"] == sh["tokens"]
    for _, _, row in _rows(tmp_path / "s"):
        assert (row["parent"] == -1).all()
        np.testing.assert_array_equal(row["kv_index"], np.arange(len(row["input_ids"])))


def test_identical_samples_and_nested_branches(inputs: dict[str, Path], tmp_path: Path) -> None:
    pack(inputs["agent"], tmp_path / "s", "--dp", 1, "--share-prefix", "--batch-size", 12,
         "--micro-batch-tokens", 8192)  # fmt: skip
    inp = input_samples(inputs["agent"])
    depth, one_token = 0, 0
    for _, _, row in _rows(tmp_path / "s"):
        cu = row["cu_seqlens"]
        for i, chain in _leaves(row).items():
            depth = max(depth, len(chain))
            leaf = chain[-1]
            if cu[leaf + 1] - cu[leaf] == 1 and len(chain) > 1:  # all but its last token shared
                one_token += 1
                assert row["target_ids"][cu[leaf]] == -100
                twin = [k for k, ids in enumerate(inp["input_ids"]) if ids == inp["input_ids"][i]]
                assert len(twin) > 1
    assert depth >= 2  # branches nest under the group's prompt
    assert one_token >= 3  # a group's first sample and its two copies


def test_a_tree_over_the_budget_is_cut(inputs: dict[str, Path], tmp_path: Path) -> None:
    cap = 1024
    m = pack(inputs["grpo"], tmp_path / "s", "--dp", 2, "--share-prefix", "--batch-size", 16,
             "--micro-batch-tokens", cap)  # fmt: skip
    for _, _, row in _rows(tmp_path / "s"):
        assert len(row["input_ids"]) <= cap
    prefixes = sum(st["plan"]["shared"]["prefixes"] for st in m["steps"])
    assert prefixes > sum(st["groups"] for st in m["steps"])  # some prefix has two copies
    for st in m["steps"]:
        assert st["plan"]["tokens"] == st["plan"]["shared"]["stored"]


def test_forged_parents_and_prefix_samples_are_refused(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "s"
    pack(inputs["grpo"], out, "--dp", 1, "--share-prefix", "--batch-size", 8, *BUDGET)
    shard = next(out.glob("rank-0000/step-000000-*.safetensors"))
    good = {k: np.array(v) for k, v in read_shard(shard).items()}  # a copy, not the map
    meta = {"step": "0", "rank": "0", "first_row": "0"}
    kids = np.flatnonzero(good["seg_parent"] >= 0)
    forgeries = {
        "parent": ("seg_parent", int(kids[0]), int(kids[0])),  # names itself
        "prefix sample": ("sample_index", int(good["seg_parent"][kids[0]]),
                          int(good["sample_index"][kids[0] + 1])),  # not its first child's
        "prefix weight": ("seg_weight", int(good["seg_parent"][kids[0]]), 0.5),
    }  # fmt: skip
    for what, (name, at, value) in forgeries.items():
        arrays = {k: np.array(v) for k, v in good.items()}
        arrays[name][at] = value
        save_safetensors(shard, arrays, meta)
        with pytest.raises(RolltoolError, match="corrupt shared-prefix rows") as e:
            rolltool.open_packed(out).micro_batches(0, 0)
        assert "\n" not in e.value.message, what
    save_safetensors(shard, {k: np.array(v) for k, v in good.items()}, meta)
    rolltool.open_packed(out).micro_batches(0, 0)  # the original reads again


@pytest.mark.parametrize(
    "args",
    [("--cp", 2), ("--sp", 2), ("--cp", 2, "--hybrid-cp"), ("--micro-batch-size", 4),
     ("--align", "total"), ("--equal-count",)],
)  # fmt: skip
def test_refused_combinations(inputs: dict[str, Path], tmp_path: Path, args: tuple) -> None:
    r = cli("pack", inputs["grpo"], "-o", tmp_path / "x", "--dp", 2, "--share-prefix", *args)
    assert r.exit_code == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    error = [k for k, line in enumerate(lines) if line.startswith("Error:")]
    assert len(error) == 1 and "--share-prefix is not available with" in lines[error[0]]
    assert lines[error[0] + 1].startswith("Hint:") and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


def test_share_min_needs_share_prefix(inputs: dict[str, Path], tmp_path: Path) -> None:
    r = cli("pack", inputs["grpo"], "-o", tmp_path / "x", "--dp", 2, "--share-min", 32)
    assert r.exit_code == 2 and "--share-min applies to --share-prefix only" in r.stderr


def test_share_min_is_recorded_and_used(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A larger --share-min shares less: the agent's branch trajectories (80-160 tokens) stop
    paying at 200."""
    low = pack(inputs["agent"], tmp_path / "a", "--dp", 1, "--share-prefix", "--batch-size", 12,
               "--micro-batch-tokens", 8192, "--share-min", 64)  # fmt: skip
    high = pack(inputs["agent"], tmp_path / "b", "--dp", 1, "--share-prefix", "--batch-size", 12,
                "--micro-batch-tokens", 8192, "--share-min", 200)  # fmt: skip
    assert high["config"]["share_min"] == 200

    def prefixes(m: dict[str, Any]) -> int:
        return sum(st["plan"]["shared"]["prefixes"] for st in m["steps"])

    assert prefixes(high) < prefixes(low)


def test_a_shared_manifest_says_its_version(inputs: dict[str, Path], tmp_path: Path) -> None:
    import json

    out = tmp_path / "s"
    pack(inputs["grpo"], out, "--dp", 1, "--share-prefix", "--batch-size", 8, *BUDGET)
    doc = json.loads((out / "manifest.json").read_text())
    doc["format_version"] = 1  # what a reader of version 1 would take it for
    (out / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(RolltoolError, match="a --share-prefix pack is version 4"):
        rolltool.open_packed(out)
    plain = pack(inputs["grpo"], tmp_path / "p", "--dp", 1, "--batch-size", 8, *BUDGET)
    assert "share_prefix" not in plain["config"] and "shared" not in plain["steps"][0]["plan"]


def test_workers_epochs_and_row_len(
    inputs: dict[str, Path], tmp_path: Path, small_pools: None
) -> None:
    """The same bytes from two worker processes as from one; --epochs x --mini-batches and
    --row-len packs verify (every sample reassembled and compared with the input)."""
    from rolltool.verify import verify

    args = ("--dp", 2, "--share-prefix", "--batch-size", 12, *BUDGET)
    pack(inputs["agent"], tmp_path / "one", *args, "--workers", 1)
    pack(inputs["agent"], tmp_path / "two", *args, "--workers", 2)
    for f in sorted((tmp_path / "one").rglob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "two" / f.relative_to(tmp_path / "one")).read_bytes()
    for name, extra in (("ep", ("--epochs", 2, "--mini-batches", 2)), ("rl", ("--row-len", 2048))):
        pack(inputs["agent"], tmp_path / name, *args, *extra)
        report = verify(tmp_path / name, inputs=[inputs["agent"]])
        assert report["ok"], report["problems"]
        assert report["checked"]["input_samples"] > 0
    for _, _, row in _rows(tmp_path / "rl"):
        assert len(row["input_ids"]) == 2048


def test_differing_advantages_over_a_shared_trunk(tmp_path: Path) -> None:
    """Two rollouts of a group with the same tokens and log-probs but different rewards (so
    different advantages) share their untrained prompt, not their trained response; copies of
    one reward share all but their last token. The pack verifies."""
    from rolltool.verify import verify

    table = shared_rollouts(groups=3, rollouts=4, identical=3, seed=9)
    ids = table.column("sample_id").to_pylist()
    reward = table.column("reward").to_pylist()
    first = {s.split("/r")[0]: reward[k] for k, s in enumerate(ids) if s.endswith("/r0/b0")}
    # copies r4, r5, r6 of each group's r0: r4 flips its reward, r5 and r6 keep it
    flip = [
        1 - first[s.split("/r")[0]] if "/r4/" in s else r for s, r in zip(ids, reward, strict=True)
    ]
    path = tmp_path / "in.parquet"
    table = table.set_column(table.column_names.index("reward"), "reward", pa.array(flip))
    pq.write_table(table, path)
    pack(path, tmp_path / "s", "--dp", 1, "--share-prefix", "--batch-size", 7,
         "--micro-batch-tokens", 8192, "--share-min", 8)  # fmt: skip
    report = verify(tmp_path / "s", inputs=[path])
    assert report["ok"], report["problems"]
    inp = input_samples(path)
    own = {}
    for _, _, row in _rows(tmp_path / "s"):
        cu = row["cu_seqlens"]
        for i, chain in _leaves(row).items():
            own[inp["sample_id"][i]] = int(cu[chain[-1] + 1] - cu[chain[-1]])
    for g in range(3):
        base = f"math/{g:04d}"
        assert own[f"{base}/r5/b0"] == own[f"{base}/r6/b0"] == 1  # equal copies: one own token
        assert own[f"{base}/r4/b0"] > 1  # the flipped copy keeps its response
