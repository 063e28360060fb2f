"""Long samples over sequence- and context-parallel GPUs (`rolltool.format.split`, ``pack --sp/--cp``).

The layouts are checked end to end: the zigzag mapping both ways against a slow reference, a
round trip through pack and the reader's per-GPU views for C in {1, 2, 3, 4} and S in {1, 2, 4},
loss weights that do not depend on the layout, attention computed the way ring attention and
Ulysses compute it equal to each sample run alone, and the budget a long sample may use.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, input_samples, pack, rollouts, samples

import rolltool
from rolltool.errors import RolltoolError
from rolltool.format.split import (
    GroupSplit,
    cp_gather,
    cp_positions,
    cp_token_map,
    cp_view,
    sp_view,
)

PER_TOKEN = ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "loss_weight")


# -- the mapping ------------------------------------------------------------------------------


def zigzag_reference(length: int, cp: int) -> list[list[int]]:
    """Per CP rank, the sample positions it holds (padding included), the obvious way: pad to a
    multiple of 2cp, cut into 2cp chunks, rank r takes chunk r then chunk 2cp-1-r."""
    padded = length + (-length) % (2 * cp)
    c = padded // (2 * cp)
    chunks = [list(range(q * c, (q + 1) * c)) for q in range(2 * cp)]
    return [chunks[r] + chunks[2 * cp - 1 - r] for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_mapping_both_ways(cp: int) -> None:
    for length in [1, 2, 5, 7, 8, 10, 16, 23, 64, 101]:
        ref = zigzag_reference(length, cp)
        padded = sum(len(p) for p in ref)
        assert padded == int(GroupSplit(cp=cp).padded(np.array([length]))[0])
        for r in range(cp):
            assert cp_positions(padded, cp, r).tolist() == ref[r]
        rank, offset = cp_token_map(length, cp)
        for t in range(length):
            assert ref[rank[t]][offset[t]] == t  # token -> (rank, offset) -> the same token
        values = np.arange(padded) * 10
        parts = [values[cp_positions(padded, cp, r)] for r in range(cp)]
        assert cp_gather(parts, length).tolist() == (np.arange(length) * 10).tolist()


def test_cp_1_maps_every_token_to_itself() -> None:
    rank, offset = cp_token_map(7, 1)
    assert rank.tolist() == [0] * 7 and offset.tolist() == list(range(7))
    assert GroupSplit().padded(np.array([7])).tolist() == [7]


def test_cp_balances_causal_work() -> None:
    """The zigzag gives every CP rank the same causal attention work (sum of key counts of its
    queries) on a padded sample, where a contiguous split would not."""
    for cp in (2, 3, 4):
        padded = 2 * cp * 7
        work = [int((cp_positions(padded, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1


# -- a pack, its views and the input ----------------------------------------------------------

LENGTHS = [[9, 23, 4, 17], [40, 6, 31, 12], [3, 58, 21, 8], [14, 27, 5, 44], [61, 19, 7, 33]]


@pytest.fixture(scope="module")
def long_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five groups of four rollouts, lengths 3..61 tokens (several over a 16-token budget)."""
    rng = np.random.default_rng(3)
    groups = [
        G("math" if g % 2 else "agent", rng.random(4).round(2).tolist(), lens)
        for g, lens in enumerate(LENGTHS)
    ]
    path = tmp_path_factory.mktemp("split") / "in.parquet"
    pq.write_table(rollouts(groups, seed=5), path)
    return path


def views(out: Path) -> list[tuple[int, int, int, int, dict[str, np.ndarray]]]:
    """(step, rank, micro-batch, gpu, view) for every GPU's view of every row."""
    ds = rolltool.open_packed(out)
    kind, size = ds.split.kind, ds.split.size
    found = []
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for gpu in range(size):
                arg = {f"{kind}_rank": gpu} if kind else {}
                for j, row in enumerate(ds.micro_batches(step, rank, **arg)):
                    found.append((step, rank, j, gpu, row))
    return found


def gathered(out: Path) -> dict[int, dict[str, np.ndarray]]:
    """sample_index -> its per-token arrays put back together from the GPUs' views (the slow
    way: SP slices concatenated per row, CP parts by `cp_positions`, each found by scanning)."""
    ds = rolltool.open_packed(out)
    split = ds.split
    by_row: dict[tuple[int, int, int], list[dict[str, np.ndarray]]] = defaultdict(list)
    for step, rank, j, _gpu, row in views(out):
        by_row[(step, rank, j)].append(row)
    result: dict[int, dict[str, np.ndarray]] = {}
    for parts in by_row.values():
        if split.cp == 1:  # sp (or none): the row is the concatenation of the slices
            row = {k: np.concatenate([p[k] for p in parts]) for k in PER_TOKEN}
            cu, index = parts[0]["cu_seqlens"], parts[0]["sample_index"]
            for q, i in enumerate(index.tolist()):
                if i >= 0:
                    assert i not in result, f"sample {i} twice"
                    result[i] = {k: row[k][cu[q] : cu[q + 1]] for k in PER_TOKEN}
            continue
        index = parts[0]["sample_index"]
        for q, i in enumerate(index.tolist()):
            if i < 0:
                continue
            assert i not in result, f"sample {i} twice"
            real = int(np.diff(parts[0]["cu_seqlens_unpadded"])[q])
            local = [{k: p[k][p["cu_seqlens"][q] : p["cu_seqlens"][q + 1]] for k in PER_TOKEN}
                     for p in parts]  # fmt: skip
            result[i] = {k: cp_gather([x[k] for x in local], real) for k in PER_TOKEN}
            padded = sum(len(x["input_ids"]) for x in local)
            for r, x in enumerate(local):  # padding inside the sample's span weighs nothing
                pad = cp_positions(padded, split.cp, r) >= real
                assert not x["loss_weight"][pad].any() and not x["loss_mask"][pad].any()
    return result


STEPS = ("--batch-size", 8, "--keep-last")  # two groups a step, the fifth group a partial step


def pk(inp: Path, out: Path, *args: Any) -> dict[str, Any]:
    return pack(inp, out, *STEPS, *args)


LAYOUTS = [(1, 1), (1, 2), (1, 4), (2, 1), (3, 1), (4, 1)]  # (cp, sp)


@pytest.mark.parametrize(("cp", "sp"), LAYOUTS)
def test_round_trip_over_all_gpus(long_input: Path, tmp_path: Path, cp: int, sp: int) -> None:
    """Undoing the split over every GPU of every group gives back exactly each sample's tokens,
    positions and per-token fields, once; every view has 1/k of its row; padding weighs 0."""
    out = tmp_path / "p"
    budget = 72 // (cp * sp)  # a group holds 72 tokens: the 61-token sample fits every layout
    m = pk(long_input, out, "--dp", 2, "--cp", cp, "--sp", sp, "--micro-batch-tokens", budget,
             "--batch-size", 8)  # fmt: skip
    assert (m["config"]["cp"], m["config"]["sp"]) == (cp, sp)
    verified = cli("verify", out)
    assert verified.exit_code == 0, verified.stdout
    inp, s = input_samples(long_input), samples(out)
    back = gathered(out)
    trained = np.flatnonzero(s["status"] == "trained")
    assert sorted(back) == trained.tolist()
    for i in trained.tolist():
        got = back[i]
        assert got["input_ids"].tolist() == inp["input_ids"][i]
        assert got["loss_mask"].astype(bool).tolist() == inp["loss_mask"][i]
        assert np.array_equal(got["logprobs"], np.asarray(inp["logprobs"][i], np.float32))
        assert got["position_ids"].tolist() == list(range(len(inp["input_ids"][i])))
        assert np.all(got["advantages"] == np.float32(s["advantage"][i]))
        weight = np.float32(s["token_loss_weight"][i]) * got["loss_mask"]
        assert np.array_equal(got["loss_weight"], weight)
    for _step, _rank, _j, _gpu, row in views(out):
        pad = row["loss_mask"] == 0
        assert not row["loss_weight"][pad].any()


def test_views_split_rows_evenly(long_input: Path, tmp_path: Path) -> None:
    """Each GPU of a group holds the same number of tokens of each row (1/k)."""
    for cp, sp in [(2, 1), (3, 1), (1, 4)]:
        out = tmp_path / f"p{cp}{sp}"
        pk(
            long_input,
            out,
            "--dp",
            2,
            "--cp",
            cp,
            "--sp",
            sp,
            "--micro-batch-tokens",
            72 // (cp * sp),
        )
        ds = rolltool.open_packed(out)
        for step in range(ds.num_steps):
            for rank in range(ds.dp):
                whole = ds.micro_batches(step, rank)
                k = ds.split.size
                for gpu in range(k):
                    arg = {"cp_rank": gpu} if cp > 1 else {"sp_rank": gpu}
                    for row, part in zip(whole, ds.micro_batches(step, rank, **arg), strict=True):
                        assert len(row["input_ids"]) % k == 0
                        assert len(part["input_ids"]) == len(row["input_ids"]) // k


def test_fixed_row_length_is_per_gpu(long_input: Path, tmp_path: Path) -> None:
    """--row-len is what each GPU holds: the group's stored row is row_len x cp, every view
    row_len long, and the row-end padding splits evenly."""
    out = tmp_path / "rl"
    pk(long_input, out, "--dp", 2, "--cp", 3, "--micro-batch-tokens", 24, "--row-len", 30)
    ds = rolltool.open_packed(out)
    for step in range(ds.num_steps):
        for row in ds.micro_batches(step, 1):
            assert len(row["input_ids"]) == 90
        for r in range(3):
            for row in ds.micro_batches(step, 1, cp_rank=r):
                assert len(row["input_ids"]) == 30
                assert row["cu_seqlens"][-1] == 30 and row["cu_seqlens_padded"][-1] == 90
    assert cli("verify", out).exit_code == 0


# -- layout invariance of the loss weights ----------------------------------------------------

INVARIANCE = [  # (dp, cp, sp, per-GPU budget)
    (1, 1, 1, 64),
    (2, 1, 1, 80),
    (8, 1, 1, 64),
    (2, 2, 1, 32),
    (1, 4, 1, 16),
    (8, 4, 1, 20),
    (2, 1, 2, 32),
    (8, 1, 2, 40),
]


def weights_by_token(out: Path) -> dict[tuple[int, int], float]:
    """(sample, position) -> loss weight, read from every GPU's view of every row."""
    w: dict[tuple[int, int], float] = {}
    for _step, _rank, _j, _gpu, row in views(out):
        cu = row["cu_seqlens"]
        if "cu_seqlens_padded" in row:  # CP: local segments
            for q, i in enumerate(row["sample_index"].tolist()):
                pos = row["position_ids"][cu[q] : cu[q + 1]]
                lw = row["loss_weight"][cu[q] : cu[q + 1]]
                real = int(np.diff(row["cu_seqlens_unpadded"])[q])
                for p, x in zip(pos.tolist(), lw.tolist(), strict=True):
                    if i >= 0 and p < real:
                        assert (i, p) not in w
                        w[(i, p)] = x
            continue
        starts = cu[:-1]
        seg = np.repeat(np.arange(len(starts)), np.diff(cu))
        offset = int(row.get("sp_offset", np.zeros(1))[0])
        n = len(row["input_ids"])
        seg = seg[offset : offset + n]
        for t in range(n):
            i = int(row["sample_index"][seg[t]])
            if i >= 0:
                key = (i, int(row["position_ids"][t]))
                assert key not in w
                w[key] = float(row["loss_weight"][t])
    return w


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_loss_weights_do_not_depend_on_the_layout(
    long_input: Path, tmp_path: Path, agg: str
) -> None:
    extra = ["--loss-scale-factor", 64] if agg == "seq-mean-token-sum-norm" else []
    seen = []
    for dp, cp, sp, budget in INVARIANCE:
        out = tmp_path / f"p{dp}-{cp}-{sp}-{budget}"
        pk(long_input, out, "--dp", dp, "--cp", cp, "--sp", sp, "--micro-batch-tokens", budget,
             "--loss-agg", agg, *extra)  # fmt: skip
        seen.append(weights_by_token(out))
    total = sum(sum(x) for x in LENGTHS)  # every token of every sample
    assert len(seen[0]) == total
    for other in seen[1:]:
        assert other == seen[0]


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


def token_samples(row: dict[str, np.ndarray], key: str = "cu_seqlens") -> Any:
    cu = row[key]
    return torch.as_tensor(np.repeat(row["sample_index"], np.diff(cu)))


def test_ring_attention_over_cp_views_equals_each_sample_alone(
    long_input: Path, tmp_path: Path
) -> None:
    """Every CP rank's queries against keys/values gathered from all CP ranks of its group
    (what ring attention computes: causal by the tokens' original positions, within a sample)
    equal, per token, the sample run alone."""
    model, inp = TinyAttention(), input_samples(long_input)
    for cp in (2, 3, 4):
        out = tmp_path / f"cp{cp}"
        pk(long_input, out, "--dp", 2, "--cp", cp, "--micro-batch-tokens", 72 // cp)
        ds = rolltool.open_packed(out)
        checked = 0
        for step in range(ds.num_steps):
            for rank in range(ds.dp):
                per_gpu = [ds.micro_batches(step, rank, cp_rank=r) for r in range(cp)]
                for j in range(len(per_gpu[0])):
                    local = [per_gpu[r][j] for r in range(cp)]
                    kv = [model.qkv(x["input_ids"], x["position_ids"]) for x in local]
                    keys = torch.cat([k for _, k, _ in kv])  # the all-gather of K and V
                    values = torch.cat([v for _, _, v in kv])
                    k_sample = torch.cat([token_samples(x) for x in local])
                    k_pos = torch.cat([torch.as_tensor(x["position_ids"]).long() for x in local])
                    for r, x in enumerate(local):
                        q_sample, q_pos = (
                            token_samples(x),
                            torch.as_tensor(x["position_ids"]).long(),
                        )
                        allowed = (q_sample[:, None] == k_sample[None, :]) & (
                            k_pos[None, :] <= q_pos[:, None]
                        )
                        got = model.attend(kv[r][0], keys, values, allowed)
                        cu = x["cu_seqlens"]
                        for q, i in enumerate(x["sample_index"].tolist()):
                            if i < 0:
                                continue
                            n = len(inp["input_ids"][i])
                            pos = q_pos[cu[q] : cu[q + 1]]
                            real = pos < n
                            want = model.alone(inp["input_ids"][i])[pos[real]]
                            torch.testing.assert_close(
                                got[cu[q] : cu[q + 1]][real], want, rtol=1e-10, atol=1e-12
                            )
                            checked += int(real.sum())
        assert checked == sum(len(x) for x in inp["input_ids"])


def test_ulysses_attention_over_sp_views_equals_each_sample_alone(
    long_input: Path, tmp_path: Path
) -> None:
    """Gathering the SP ranks' slices into the row, running varlen causal attention over it
    (segments apart) and keeping each rank's slice gives, per token, the sample run alone."""
    model, inp = TinyAttention(seed=1), input_samples(long_input)
    out = tmp_path / "sp4"
    pk(long_input, out, "--dp", 2, "--sp", 4, "--micro-batch-tokens", 16)
    ds = rolltool.open_packed(out)
    checked = 0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            per_gpu = [ds.micro_batches(step, rank, sp_rank=r) for r in range(4)]
            for j in range(len(per_gpu[0])):
                local = [per_gpu[r][j] for r in range(4)]
                ids = np.concatenate([x["input_ids"] for x in local])  # all-to-all gather
                pos = torch.as_tensor(np.concatenate([x["position_ids"] for x in local])).long()
                seg = token_samples(local[0])
                seg_id = torch.as_tensor(np.repeat(np.arange(len(local[0]["sample_index"])),
                                                   np.diff(local[0]["cu_seqlens"])))  # fmt: skip
                q, k, v = model.qkv(ids, pos)
                allowed = (seg_id[:, None] == seg_id[None, :]) & (pos[None, :] <= pos[:, None])
                full = model.attend(q, k, v, allowed)
                for r, x in enumerate(local):
                    off, n = int(x["sp_offset"][0]), len(x["input_ids"])
                    mine = full[off : off + n]
                    for t in range(n):
                        i = int(seg[off + t])
                        if i < 0:
                            continue
                        want = model.alone(inp["input_ids"][i])[int(pos[off + t])]
                        torch.testing.assert_close(mine[t], want, rtol=1e-10, atol=1e-12)
                        checked += 1
                    del r
    assert checked == sum(len(x) for x in inp["input_ids"])


# -- budgets ----------------------------------------------------------------------------------


def test_a_sample_over_the_gpu_budget_trains_within_the_group_budget(
    long_input: Path, tmp_path: Path
) -> None:
    """cp 4 x 16 tokens: the 61-token sample (padded to 64) trains and is counted over the
    per-GPU budget, overall and per env; without cp it is refused, naming it."""
    m = pk(long_input, tmp_path / "cp4", "--dp", 2, "--cp", 4, "--micro-batch-tokens", 16)
    s = samples(tmp_path / "cp4")
    assert (s["status"] == "trained").all()
    over = int((s["length"] > 16).sum())
    assert sum(st["over_gpu_budget"] for st in m["steps"]) == over
    by_env = defaultdict(int)
    for st in m["steps"]:
        for env, c in st["envs"].items():
            by_env[env] += c["over_gpu_budget"]
    env = np.asarray(s["env"], dtype=object)
    for name, count in by_env.items():
        assert count == int(((s["length"] > 16) & (env == name)).sum())
    r = cli(
        "pack", long_input, *STEPS, "-o", tmp_path / "no", "--dp", 2, "--micro-batch-tokens", 16
    )
    assert r.exit_code == 1 and "agent/g000/r1/b0" in r.stderr and "23 tokens" in r.stderr


def test_a_sample_over_the_group_budget_is_refused_or_dropped(
    long_input: Path, tmp_path: Path
) -> None:
    """cp 2 x 16 = 32 padded tokens: the 58- and 61-token samples do not fit, nor do 31 and 33
    (padded to 32 and 36: 33 does not). Refused naming the first, or dropped and counted."""
    r = cli("pack", long_input, *STEPS, "-o", tmp_path / "e", "--dp", 2, "--cp", 2,
            "--micro-batch-tokens", 16)  # fmt: skip
    assert r.exit_code == 1
    assert "agent/g000/r1/b0" not in r.stderr  # 23 tokens fit two GPUs
    assert "math/g001/r0/b0" in r.stderr and "40 tokens" in r.stderr and "--cp 2" in r.stderr
    assert not (tmp_path / "e").exists()
    m = pk(long_input, tmp_path / "d", "--dp", 2, "--cp", 2, "--micro-batch-tokens", 16,
             "--overlong", "drop")  # fmt: skip
    s = samples(tmp_path / "d")
    padded = s["length"] + (-s["length"]) % 4
    assert ((s["status"] == "overlong_dropped") == (padded > 32)).all()
    assert sum(st["overlong_dropped"] for st in m["steps"]) == int((padded > 32).sum())


def test_options_refused(long_input: Path, tmp_path: Path) -> None:
    r = cli("pack", long_input, *STEPS, "-o", tmp_path / "x", "--dp", 2, "--cp", 2, "--sp", 2)
    assert r.exit_code == 2 and "--sp or --cp" in r.stderr
    r = cli("pack", long_input, *STEPS, "-o", tmp_path / "x", "--dp", 2, "--cp", 0)
    assert r.exit_code == 2


# -- reader and verify against a wrong layout -------------------------------------------------


def test_views_of_the_wrong_kind_are_refused(long_input: Path, tmp_path: Path) -> None:
    pk(long_input, tmp_path / "cp", "--dp", 2, "--cp", 2, "--micro-batch-tokens", 32)
    ds = rolltool.open_packed(tmp_path / "cp")
    with pytest.raises(RolltoolError, match="packed with --cp 2"):
        ds.micro_batches(0, 0, sp_rank=0)
    with pytest.raises(RolltoolError, match="out of range"):
        ds.micro_batches(0, 0, cp_rank=2)
    row = ds.micro_batches(0, 0)[0]
    with pytest.raises(RolltoolError, match="multiple of 2 x cp = 6"):
        cp_view(row, 3, 0)  # the row was padded for cp 2, not 3
    with pytest.raises(RolltoolError, match="does not split"):
        sp_view({**row, "input_ids": row["input_ids"][:-1]}, 2, 0)


def test_verify_catches_a_manifest_that_claims_another_cp(long_input: Path, tmp_path: Path) -> None:
    """Rows padded for cp 2 under a manifest saying cp 4: verify reports row.split, and the
    reader refuses the CP views naming the shard."""
    out = tmp_path / "cp"
    pk(long_input, out, "--dp", 2, "--cp", 2, "--micro-batch-tokens", 32)
    assert cli("verify", out).exit_code == 0
    doc = json.loads((out / "manifest.json").read_text())
    doc["config"]["cp"] = 4
    (out / "manifest.json").write_text(json.dumps(doc))
    r = cli("verify", out, "--json")
    kinds = {p["kind"] for p in json.loads(r.stdout)["problems"]}
    assert r.exit_code == 1 and "row.split" in kinds
    with pytest.raises(RolltoolError, match="safetensors"):
        rolltool.open_packed(out).micro_batches(0, 0, cp_rank=3)


def test_torch_dataset_serves_one_gpu_view_and_resumes_it(long_input: Path, tmp_path: Path) -> None:
    out = tmp_path / "cp"
    pk(long_input, out, "--dp", 2, "--cp", 2, "--micro-batch-tokens", 36)
    ds = rolltool.open_packed(out)
    want = [row for _s, _j, row in ds.rank_iter(1, cp_rank=1)]
    data = ds.torch_dataset(1, cp_rank=1)
    got = list(data)
    assert len(got) == len(want)
    for item, row in zip(got, want, strict=True):
        for key in (*PER_TOKEN, "cu_seqlens", "cu_seqlens_padded", "sample_index"):
            assert item[key].tolist() == row[key].tolist()
    it = iter(ds.torch_dataset(1, cp_rank=1))
    next(it)
    state = ds.torch_dataset(1, cp_rank=1)
    state.load_state_dict({**data.state_dict(), "step": 0, "micro_batch": 1})
    assert [x["input_ids"].tolist() for x in state] == [r["input_ids"].tolist() for r in want[1:]]
    other = ds.torch_dataset(1, cp_rank=0)
    with pytest.raises(RolltoolError, match="cp_rank 1"):
        other.load_state_dict(data.state_dict())
    with pytest.raises(RolltoolError, match="packed with --cp 2"):
        ds.torch_dataset(1, sp_rank=0)
