"""``--hybrid-cp`` packs read back (issue 22): every GPU's view, against the input and the plain
``--cp`` layout, and the reader's refusal of a forged layout.

The input is test_split's: five groups of four rollouts of 3..61 tokens, packed over 2 groups
of 4 GPUs with 16 tokens per GPU, so one step holds whole samples (up to 16 tokens), samples
split over 2 GPUs (17..32) and over 4 (33..61): sub-groups of every size side by side. Checked
the slow, obvious way: each sample put back together from the views (`cp_gather` over its
sub-group's members in rank order), weights read per (sample, position), attention computed
per sub-group the way ring attention does (each member's queries against the K/V gathered from
its sub-group only) against each sample alone.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, input_samples, pack, rollouts, samples

import rolltool
from rolltool.errors import RolltoolError
from rolltool.format.hybrid import GROUP_FIELDS, blocks, partition_problem
from rolltool.format.shards import file_record, read_shard
from rolltool.format.split import cp_gather, cp_positions

PER_TOKEN = ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "loss_weight")
TARGETS = ("target_ids", "target_loss_weight", "target_advantages", "target_logprobs")
LENGTHS = [[9, 23, 4, 17], [40, 6, 31, 12], [3, 58, 21, 8], [14, 27, 5, 44], [61, 19, 7, 33]]
STEPS = ("--batch-size", 8, "--keep-last")
HYBRID = ("--dp", 2, "--cp", 4, "--hybrid-cp", "--micro-batch-tokens", 16)


@pytest.fixture(scope="module")
def long_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(3)
    groups = [
        G("math" if g % 2 else "agent", rng.random(4).round(2).tolist(), lens)
        for g, lens in enumerate(LENGTHS)
    ]
    path = tmp_path_factory.mktemp("hybrid") / "in.parquet"
    pq.write_table(rollouts(groups, seed=5), path)
    return path


@pytest.fixture(scope="module")
def packed(long_input: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid-out") / "p"
    pack(long_input, out, *STEPS, *HYBRID)
    return out


Views = dict[tuple[int, int, int], list[dict[str, np.ndarray]]]


def all_views(out: Path) -> Views:
    """(step, rank, micro-batch) -> every GPU's view of it, in GPU order."""
    ds = rolltool.open_packed(out)
    found: Views = defaultdict(list)
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for gpu in range(ds.split.cp):
                for j, view in enumerate(ds.micro_batches(step, rank, cp_rank=gpu)):
                    found[(step, rank, j)].append(view)
    return found


def sub_groups(views: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    """A slot's views grouped by sub-group (its members in rank order), from the views' own
    cp_group_* fields, checked against each other."""
    by_start: dict[int, list[dict[str, np.ndarray]]] = defaultdict(list)
    for g, v in enumerate(views):
        size, rank, start = (int(v[k][0]) for k in GROUP_FIELDS)
        assert start % size == 0 and start + rank == g  # aligned, and GPU g is its rank
        by_start[start].append(v)
    for start, members in by_start.items():
        assert len(members) == int(members[0]["cp_group_size"][0]), start
    return [by_start[a] for a in sorted(by_start)]


def gathered(out: Path) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, set[int]]]:
    """sample_index -> its per-token arrays (targets included) put back from the views, and
    which degrees each step used."""
    result: dict[int, dict[str, np.ndarray]] = {}
    degrees: dict[int, set[int]] = defaultdict(set)
    keys = (*PER_TOKEN, *TARGETS)
    for (step, _rank, _j), views in all_views(out).items():
        for members in sub_groups(views):
            k = len(members)
            degrees[step].add(k)
            first = members[0]
            for q, i in enumerate(first["sample_index"].tolist()):
                if i < 0:
                    continue
                assert i not in result, f"sample {i} twice"
                if k == 1:
                    cu = first["cu_seqlens"]
                    result[i] = {key: first[key][cu[q] : cu[q + 1]] for key in keys}
                    continue
                real = int(np.diff(first["cu_seqlens_unpadded"])[q])
                local = [{key: p[key][p["cu_seqlens"][q] : p["cu_seqlens"][q + 1]] for key in keys}
                         for p in members]  # fmt: skip
                result[i] = {key: cp_gather([x[key] for x in local], real) for key in keys}
                padded = sum(len(x["input_ids"]) for x in local)
                for r, x in enumerate(local):  # its CP padding weighs nothing
                    pad = cp_positions(padded, k, r) >= real
                    assert (
                        not x["loss_weight"][pad].any() and not x["target_loss_weight"][pad].any()
                    )
    return result, degrees


def test_round_trip_over_all_gpu_views(long_input: Path, packed: Path) -> None:
    """Every trained sample comes back exactly once from the GPUs' views: tokens, mask,
    logprobs, positions, advantage, loss weight and next-token targets; one step mixes whole
    samples with 2- and 4-way splits; verify finds nothing wrong."""
    m = rolltool.open_packed(packed).manifest
    assert m.format_version == 3 and m.config.hybrid_cp and m.config.cp == 4
    inp, s = input_samples(long_input), samples(packed)
    back, degrees = gathered(packed)
    trained = np.flatnonzero(s["status"] == "trained")
    assert sorted(back) == trained.tolist() and len(trained) == sum(map(len, LENGTHS))
    assert any(d == {1, 2, 4} for d in degrees.values()), degrees
    for i in trained.tolist():
        got, ids = back[i], inp["input_ids"][i]
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].astype(bool).tolist() == inp["loss_mask"][i]
        assert np.array_equal(got["logprobs"], np.asarray(inp["logprobs"][i], np.float32))
        assert got["position_ids"].tolist() == list(range(len(ids)))
        assert np.all(got["advantages"] == np.float32(s["advantage"][i]))
        weight = np.float32(s["token_loss_weight"][i]) * got["loss_mask"]
        assert np.array_equal(got["loss_weight"], weight)
        assert got["target_ids"].tolist() == [*ids[1:], -100]  # shifted on the whole sample
        assert np.array_equal(got["target_loss_weight"], np.append(weight[1:], 0))
    r = cli("verify", packed)
    assert r.exit_code == 0, r.stdout


def test_each_gpu_view_is_its_sub_group_and_under_the_budget(packed: Path) -> None:
    """The group row's partition and each segment's sub-group agree with the views: a plain
    row (k = 1) of whole samples, or a --cp k view; every GPU holds at most 16 tokens of
    samples and their CP padding; a split sample is in a sub-group of its own degree."""
    ds = rolltool.open_packed(packed)
    seen, splits = 0, 0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            rows = ds.micro_batches(step, rank)
            per_gpu = [ds.micro_batches(step, rank, cp_rank=g) for g in range(4)]
            assert all(len(p) == len(rows) for p in per_gpu)  # equal counts on every GPU
            for j, row in enumerate(rows):
                assert partition_problem(row["cp_groups"], 4) is None
                for a, k in blocks(row["cp_groups"]):
                    for g in range(a, a + k):
                        v = per_gpu[g][j]
                        assert [int(v[x][0]) for x in GROUP_FIELDS] == [k, g - a, a]
                        assert ("cu_seqlens_padded" in v) == (k > 1)
                        real = v["sample_index"] >= 0
                        held = np.diff(v["cu_seqlens"])[real].sum()
                        assert held <= 16
                        mine = row["sample_index"][
                            (row["cp_start"] == a) & (row["sample_index"] >= 0)
                        ]
                        assert v["sample_index"][real].tolist() == mine.tolist()
                        seen += 1
                        splits += k > 1
    mbs = sum(r.micro_batches for st in ds.manifest.steps for r in st.ranks)
    assert seen == 4 * mbs and splits  # every GPU of every row, some in a split sub-group


def weights_by_token(out: Path) -> dict[tuple[int, int], float]:
    """(sample, position) -> loss weight, from every GPU's view of every row (plain --cp
    views, hybrid views of any degree)."""
    ds = rolltool.open_packed(out)
    w: dict[tuple[int, int], float] = {}
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for gpu in range(ds.split.cp):
                for v in ds.micro_batches(step, rank, cp_rank=gpu):
                    cu = v["cu_seqlens"]
                    for q, i in enumerate(v["sample_index"].tolist()):
                        if i < 0:
                            continue
                        real = (int(np.diff(v["cu_seqlens_unpadded"])[q])
                                if "cu_seqlens_unpadded" in v else int(cu[q + 1] - cu[q]))  # fmt: skip
                        pos = v["position_ids"][cu[q] : cu[q + 1]].tolist()
                        for p, x in zip(
                            pos, v["loss_weight"][cu[q] : cu[q + 1]].tolist(), strict=True
                        ):
                            if p < real:
                                assert (i, p) not in w
                                w[(i, p)] = x
    return w


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_loss_weights_equal_the_plain_cp_layout(long_input: Path, tmp_path: Path, agg: str) -> None:
    extra = ["--loss-scale-factor", 64] if agg == "seq-mean-token-sum-norm" else []
    pack(long_input, tmp_path / "h", *STEPS, *HYBRID, "--loss-agg", agg, *extra)
    pack(long_input, tmp_path / "c", *STEPS, "--dp", 2, "--cp", 4, "--micro-batch-tokens", 16,
         "--loss-agg", agg, *extra)  # fmt: skip
    hybrid, plain = weights_by_token(tmp_path / "h"), weights_by_token(tmp_path / "c")
    assert len(hybrid) == sum(map(sum, LENGTHS))
    assert hybrid == plain
    for a, b in zip(samples(tmp_path / "h")["token_loss_weight"],
                    samples(tmp_path / "c")["token_loss_weight"], strict=True):  # fmt: skip
        assert a == b


def test_a_fixed_row_length_pads_every_gpu_view(long_input: Path, tmp_path: Path) -> None:
    """--row-len 20: every GPU's view is 20 tokens whatever its sub-group; the stored row is
    4 x 20; verify is clean."""
    out = tmp_path / "rl"
    pack(long_input, out, *STEPS, *HYBRID, "--row-len", 20)
    ds = rolltool.open_packed(out)
    for step in range(ds.num_steps):
        for row in ds.micro_batches(step, 1):
            assert len(row["input_ids"]) == 80
        for g in range(4):
            for v in ds.micro_batches(step, 1, cp_rank=g):
                assert len(v["input_ids"]) == 20 and v["cu_seqlens"][-1] == 20
    back, _ = gathered(out)
    assert len(back) == sum(map(len, LENGTHS))
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout


# -- attention computed the way the GPUs compute it ------------------------------------------

torch = pytest.importorskip("torch")


class TinyAttention:
    """One causal attention head over token and position embeddings, float64."""

    def __init__(self, seed: int = 0, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.randn(1000, dim, generator=g, dtype=torch.float64)
        self.pos = torch.randn(256, dim, generator=g, dtype=torch.float64)
        self.wq, self.wk, self.wv = (
            torch.randn(dim, dim, generator=g, dtype=torch.float64) for _ in range(3)
        )

    def qkv(self, ids: Any, pos: Any) -> tuple[Any, Any, Any]:
        x = self.tok[torch.as_tensor(ids).long()] + self.pos[torch.as_tensor(pos).long()]
        return x @ self.wq, x @ self.wk, x @ self.wv

    def attend(self, q: Any, k: Any, v: Any, allowed: Any) -> Any:
        scores = (q @ k.T) / q.shape[1] ** 0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, dim=1) @ v

    def alone(self, ids: list[int]) -> Any:
        pos = torch.arange(len(ids))
        q, k, v = self.qkv(ids, pos)
        return self.attend(q, k, v, pos[None, :] <= pos[:, None])


def _token_samples(v: dict[str, np.ndarray]) -> Any:
    return torch.as_tensor(np.repeat(v["sample_index"], np.diff(v["cu_seqlens"])))


def test_ring_attention_over_each_sub_group_equals_each_sample_alone(
    long_input: Path, packed: Path
) -> None:
    """Per slot and sub-group: each member's queries against the K/V all-gathered from its
    sub-group's members only (a plain GPU: its own), causal by the tokens' positions within a
    sample, equal the sample run alone, for every real token of every sample."""
    model, inp = TinyAttention(), input_samples(long_input)
    checked, sizes = 0, set()
    for views in all_views(packed).values():
        for members in sub_groups(views):
            sizes.add(len(members))
            kv = [model.qkv(x["input_ids"], x["position_ids"]) for x in members]
            keys = torch.cat([k for _, k, _ in kv])
            values = torch.cat([v for _, _, v in kv])
            k_sample = torch.cat([_token_samples(x) for x in members])
            k_pos = torch.cat([torch.as_tensor(x["position_ids"]).long() for x in members])
            for r, x in enumerate(members):
                q_sample, q_pos = _token_samples(x), torch.as_tensor(x["position_ids"]).long()
                allowed = (q_sample[:, None] == k_sample[None, :]) & (
                    k_pos[None, :] <= q_pos[:, None]
                )
                allowed &= q_sample[:, None] >= 0  # padding attends to nothing we check
                got = model.attend(kv[r][0], keys, values, allowed | ~allowed.any(1, True))
                cu = x["cu_seqlens"]
                for q, i in enumerate(x["sample_index"].tolist()):
                    if i < 0:
                        continue
                    pos = q_pos[cu[q] : cu[q + 1]]
                    real = pos < len(inp["input_ids"][i])
                    want = model.alone(inp["input_ids"][i])[pos[real]]
                    torch.testing.assert_close(
                        got[cu[q] : cu[q + 1]][real], want, rtol=1e-10, atol=1e-12
                    )
                    checked += int(real.sum())
    assert sizes == {1, 2, 4}
    assert checked == sum(map(sum, LENGTHS))


# -- the reader against a forged layout -------------------------------------------------------


def _poke(path: Path, name: str, index: int, value: Any) -> None:
    """Set element `index` of tensor `name` in the shard itself (its size unchanged)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
    dtype = {"I32": "<i4", "I64": "<i8", "U8": "u1", "F32": "<f4"}[info["dtype"]]
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    a, b = info["data_offsets"]
    mm[8 + n + a : 8 + n + b].view(dtype)[index] = value
    mm.flush()
    del mm


def _rehash(out: Path, path: Path) -> None:
    """The manifest's size and sha256 of shard `path` made current: only the layout can tell."""
    doc = json.loads((out / "manifest.json").read_text())
    doc["files"][str(path.relative_to(out))] = vars(file_record(path))
    (out / "manifest.json").write_text(json.dumps(doc))


def _shard_with(out: Path, want: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """The first shard whose arrays satisfy `want`, and its arrays (a copy)."""
    for path in sorted(out.glob("rank-*/*.safetensors")):
        arrays = {k: np.array(v) for k, v in read_shard(path).items()}
        if want(arrays):
            return path, arrays
    raise AssertionError("no such shard")


def _split_and_whole(a: dict[str, np.ndarray]) -> int | None:
    """A row holding a 2-GPU sub-group then two plain GPUs ([2, 2, 1, 1]), or None."""
    rows = a["row_cp_groups"].reshape(-1, 4).tolist()
    return next((r for r, g in enumerate(rows) if g == [2, 2, 1, 1]), None)


FORGERIES = {
    # the row's sizes no longer an aligned partition: [2, 2, 1, 1] -> [1, 2, 2, 1]
    "unaligned sub-groups": (
        lambda a, r: [("row_cp_groups", 4 * r, 1), ("row_cp_groups", 4 * r + 2, 2)],
        "do not form one aligned sub-group",
    ),
    # the row's first segment (in the 2-GPU sub-group) claimed by plain GPU 3
    "segment outside its block": (
        lambda a, r: [("seg_cp_start", int(a["row_segments"][r]), 3)],
        "in this order",
    ),
    # a size that is no power of two
    "a size of 3": (lambda a, r: [("row_cp_groups", 4 * r + 3, 3)], "power of two"),
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step whose row is a 2-GPU sub-group then two plain GPUs ([2, 2, 1, 1]): a 30-token
    sample that needs 2 GPUs of 16 beside two 16-token ones that fill a GPU each (split wider,
    all three would pay more of the ring than they save)."""
    tmp = tmp_path_factory.mktemp("hybrid-mixed")
    pq.write_table(
        rollouts([G("agent", [0.1, 0.9, 0.5], [30, 16, 16])], seed=5), tmp / "in.parquet"
    )
    pack(tmp / "in.parquet", tmp / "p", *STEPS, "--dp", 1, *HYBRID[2:])
    return tmp / "p"


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_the_reader_refuses_a_forged_layout(mixed: Path, tmp_path: Path, case: str) -> None:
    out = tmp_path / "p"
    shutil.copytree(mixed, out)
    path, arrays = _shard_with(out, lambda a: _split_and_whole(a) is not None)
    edits, match = FORGERIES[case]
    for name, index, value in edits(arrays, _split_and_whole(arrays)):
        _poke(path, name, index, value)
    _rehash(out, path)
    ds = rolltool.open_packed(out)
    rank, step = int(path.parent.name[5:]), int(path.name[5:11])
    with pytest.raises(RolltoolError, match="not laid out") as e:
        ds.micro_batches(step, rank, cp_rank=0)
    assert str(path.relative_to(out)) in e.value.message
    assert re.search(match, e.value.message), e.value.message
    r = cli("verify", out, "--json")
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and "row.hybrid" in kinds, kinds


def test_a_split_sample_without_its_padding_is_refused(packed: Path, tmp_path: Path) -> None:
    """One token of a split sample's CP padding moved into the sample (its length +1, the
    padding -1: still a multiple of 2k): the reader refuses the shard, verify names the
    sample."""
    out = tmp_path / "p"
    shutil.copytree(packed, out)

    def padded_split(a: dict[str, np.ndarray]) -> bool:
        return bool(len(_pad_after_split(a)))

    path, arrays = _shard_with(out, padded_split)
    k = int(_pad_after_split(arrays)[0])
    _poke(path, "seq_lens", k, arrays["seq_lens"][k] - 1)
    _poke(path, "seq_lens", k - 1, arrays["seq_lens"][k - 1] + 1)
    _rehash(out, path)
    ds = rolltool.open_packed(out)
    rank, step = int(path.parent.name[5:]), int(path.name[5:11])
    with pytest.raises(RolltoolError, match=r"real tokens|not as samples") as e:
        ds.micro_batches(step, rank, cp_rank=0)
    assert str(path.relative_to(out)) in e.value.message
    r = cli("verify", out, "--json")
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and "sample.length" in kinds, kinds


def test_a_block_without_its_thd_padding_is_refused(packed: Path, tmp_path: Path) -> None:
    """A split sample's CP padding made one token shorter and the segment after it one longer
    (same row): the sub-group's row is no longer valid THD for its ring; the reader refuses
    it naming the shard and verify reports row.hybrid."""
    out = tmp_path / "p"
    shutil.copytree(packed, out)

    def inside(a: dict[str, np.ndarray]) -> np.ndarray:
        k = _pad_after_split(a)
        row_end = a["row_segments"][np.searchsorted(a["row_segments"], k, side="right")]
        return k[k + 1 < row_end]

    path, arrays = _shard_with(out, lambda a: bool(len(inside(a))))
    k = int(inside(arrays)[0])
    _poke(path, "seq_lens", k, arrays["seq_lens"][k] - 1)
    _poke(path, "seq_lens", k + 1, arrays["seq_lens"][k + 1] + 1)
    _rehash(out, path)
    rank, step = int(path.parent.name[5:]), int(path.name[5:11])
    with pytest.raises(RolltoolError, match="not laid out") as e:
        rolltool.open_packed(out).micro_batches(step, rank, cp_rank=0)
    assert "padding tokens that bring it to a multiple" in e.value.message
    r = cli("verify", out, "--json")
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and "row.hybrid" in kinds, kinds


def test_verify_reports_a_gpu_over_its_budget(long_input: Path, tmp_path: Path) -> None:
    """A manifest whose per-GPU budget was lowered under what the rows hold: verify reports
    row.budget per sub-group, and the reader refuses the shard."""
    out = tmp_path / "p"
    pack(long_input, out, *STEPS, *HYBRID)
    doc = json.loads((out / "manifest.json").read_text())
    doc["config"]["micro_batch_tokens"] = 8
    (out / "manifest.json").write_text(json.dumps(doc))
    r = cli("verify", out, "--json", "--no-hash")
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and "row.budget" in kinds, kinds
    with pytest.raises(RolltoolError, match="over the 8-token budget"):
        rolltool.open_packed(out).micro_batches(0, 0, cp_rank=0)


def _pad_after_split(a: dict[str, np.ndarray]) -> np.ndarray:
    """Padding segments that follow a sample in a block of k > 1 (its CP padding)."""
    idx, start = a["sample_index"], a["seg_cp_start"]
    k = np.flatnonzero((idx[1:] == -1) & (idx[:-1] >= 0) & (start[1:] == start[:-1]))
    groups = a["row_cp_groups"]
    row_of = np.searchsorted(a["row_segments"], k + 1, side="right") - 1
    size = groups[row_of * 4 + start[k + 1]]
    return (k + 1)[(size > 1) & (a["seq_lens"][k + 1] > 1)]


def test_a_plain_cp_rank_is_refused_out_of_range(packed: Path) -> None:
    ds = rolltool.open_packed(packed)
    with pytest.raises(RolltoolError, match="out of range"):
        ds.micro_batches(0, 0, cp_rank=4)
    with pytest.raises(RolltoolError, match="packed with --cp 4"):
        ds.micro_batches(0, 0, sp_rank=0)


def test_torch_dataset_serves_a_hybrid_gpu_view(packed: Path) -> None:
    """ds.torch_dataset(rank, cp_rank=i) yields GPU i's views as tensors, the sub-group fields
    included, and resumes mid-stream."""
    ds = rolltool.open_packed(packed)
    want = [row for _s, _j, row in ds.rank_iter(1, cp_rank=2)]
    got = list(ds.torch_dataset(1, cp_rank=2))
    assert len(got) == len(want) > 1
    for item, row in zip(got, want, strict=True):
        assert set(row) <= set(item)
        for key, value in row.items():
            assert item[key].tolist() == value.tolist(), key
    step, j = int(got[1]["step"]), int(got[1]["micro_batch"])
    resumed = ds.torch_dataset(1, cp_rank=2, start_step=step, start_micro_batch=j)
    assert [x["input_ids"].tolist() for x in resumed] == [r["input_ids"].tolist() for r in want[1:]]
