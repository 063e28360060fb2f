"""The physical layout of packed output: the reader contract, no cross-contamination, and loss
weights that do not depend on the layout (--dp, token budget, row length, balance, shard size).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pack_helpers import G, input_samples, pack, placements, rollouts, samples, token_loss

import rolltool
import rolltool.format as _format
from rolltool.format.targets import IGNORE_INDEX, TARGET_FIELDS
from rolltool.plan.loss import LOSS_AGGS
from rolltool.verify import verify

DTYPES = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.uint8,
    "advantages": np.float32,
    "logprobs": np.float32,
    "loss_weight": np.float32,
    **TARGET_FIELDS,
    "cu_seqlens": np.int32,
    "sample_index": np.int64,
}
PER_TOKEN = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "advantages",
    "logprobs",
    "loss_weight",
    *TARGET_FIELDS,
)
SHARD_NAME = re.compile(r"rank-\d{4}/step-\d{6}-\d{2}\.safetensors")
CAP, ROW_LEN = 4096, 4608


def _check_row(row: dict[str, Any], cap: int | None, row_len: int | None) -> int:
    """Every per-row invariant of the reader contract; returns the row's real tokens."""
    assert set(row) == set(DTYPES)
    for key, dtype in DTYPES.items():
        assert row[key].dtype == dtype and row[key].ndim == 1, key
    n = len(row["input_ids"])
    assert all(len(row[k]) == n for k in PER_TOKEN)
    cu = row["cu_seqlens"].astype(np.int64)
    assert cu[0] == 0 and cu[-1] == n and np.all(np.diff(cu) > 0)
    assert len(row["sample_index"]) == len(cu) - 1
    starts = np.repeat(cu[:-1], np.diff(cu))
    assert np.array_equal(row["position_ids"], np.arange(n) - starts)  # restart per segment
    pad = np.repeat(row["sample_index"] < 0, np.diff(cu))
    assert np.all(row["loss_weight"][pad] == 0) and np.all(row["loss_mask"][pad] == 0)
    assert np.all(row["loss_weight"][row["loss_mask"] == 0] == 0)
    assert np.all(row["loss_weight"] >= 0)
    assert int((row["sample_index"] < 0).sum()) <= 1  # at most one padding segment, at the end
    assert np.all(row["sample_index"][:-1] >= 0)
    last = np.zeros(n, dtype=bool)
    last[cu[1:] - 1] = True  # each sample's last token: no next-token target, as padding
    assert np.array_equal(row["target_ids"] == IGNORE_INDEX, last | pad)
    assert np.array_equal(
        row["target_ids"][~(last | pad)], row["input_ids"][1:][~(last | pad)[:-1]]
    )
    assert np.all(row["target_loss_weight"][last | pad] == 0)
    if row_len is not None:
        assert n == row_len
    real = int((~pad).sum())
    if cap is not None:
        assert real <= cap
    return real


# --- the reader contract -------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("layout")
    pq.write_table(synth_table, tmp / "in.parquet")
    args = ("--dp", 4, "--batch-size", 32, "--keep-last", "--micro-batch-tokens", CAP,
            "--row-len", ROW_LEN, "--shard-mb", 0.2)  # fmt: skip
    manifest = pack(tmp / "in.parquet", tmp / "out", *args)
    return {"dir": tmp, "out": tmp / "out", "manifest": manifest, "args": args}


def test_reader_rows_meet_the_contract(packed: dict[str, Any]) -> None:
    ds = rolltool.open_packed(packed["out"])
    m = packed["manifest"]
    assert ds.num_steps == m["num_steps"] >= 2 and ds.dp == 4
    rows = real = 0
    for step in range(ds.num_steps):
        assert _format.Manifest.from_json(m).steps[step] == ds.step_meta(step)
        per_rank = [ds.micro_batches(step, r) for r in range(ds.dp)]
        assert len({len(x) for x in per_rank}) == 1  # same micro-batch count on every rank
        for mbs in per_rank:
            for row in mbs:
                real += _check_row(row, CAP, ROW_LEN)
                rows += 1
    assert rows == sum(r["micro_batches"] for s in m["steps"] for r in s["ranks"]) > 8
    assert real == sum(s["sampled_tokens"] for s in m["steps"])


def test_reader_arrays_are_read_only_views(packed: dict[str, Any]) -> None:
    row = rolltool.open_packed(packed["out"]).micro_batches(0, 0)[0]
    assert not row["input_ids"].flags.writeable  # memory-mapped file, not a private copy


def test_torch_switch_and_dataset(packed: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    ds = rolltool.open_packed(packed["out"])
    as_np = ds.micro_batches(1, 2)
    as_t = ds.micro_batches(1, 2, torch=True)
    assert len(as_t) == len(as_np) > 0
    for a, b in zip(as_np, as_t, strict=True):
        assert set(a) == set(b)
        for k in a:
            assert isinstance(b[k], torch.Tensor)
            assert np.array_equal(b[k].numpy(), a[k]) and b[k].numpy().dtype == a[k].dtype
    for rank in (0, 3):
        items = list(ds.torch_dataset(rank))
        expected = [
            (s, j) for s in range(ds.num_steps) for j in range(len(ds.micro_batches(s, rank)))
        ]
        assert [(x["step"], x["micro_batch"]) for x in items] == expected
        assert all(isinstance(x["input_ids"], torch.Tensor) for x in items)


def test_files_modes_names_and_manifest(packed: dict[str, Any]) -> None:
    out, m = packed["out"], packed["manifest"]
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert on_disk == set(m["files"]) | {"manifest.json"}
    shards = [f for f in m["files"] if f.endswith(".safetensors")]
    assert len(shards) > m["num_steps"] * m["dp"]  # --shard-mb 0.2 split some (step, rank)s
    for name in on_disk:
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))
    for name in shards:
        assert SHARD_NAME.fullmatch(name), name
        data = (out / name).read_bytes()
        assert len(data) == m["files"][name]["bytes"]
        assert hashlib.sha256(data).hexdigest() == m["files"][name]["sha256"]
        assert b"pickle" not in data[:8]
    # Shard size is bounded: a file holding more than one row stays within --shard-mb.
    for step in m["steps"]:
        for rank, r in enumerate(step["ranks"]):
            assert all(f["path"].startswith(f"rank-{rank:04d}/") for f in r["files"])
            for f in r["files"]:
                if f["rows"] > 1:
                    assert m["files"][f["path"]]["bytes"] <= 0.2e6 * 1.05 + 4096
    # What the manifest says about how the output was made.
    on_file = json.loads((out / "manifest.json").read_text())
    assert on_file["format_version"] >= 1 and on_file["rolltool_version"] == rolltool.__version__
    assert on_file["config"]["dp"] == 4 and on_file["config"]["row_len"] == ROW_LEN
    assert on_file["config"]["steps"]["batch_size"] == 32
    assert on_file["command"][0] == "rolltool"  # in-process here; test_pack_e2e runs a process
    assert [(Path(x["path"]).name, x["rows"]) for x in on_file["inputs"]] == [("in.parquet", 146)]
    assert len(on_file["steps"]) == on_file["num_steps"]
    assert "usage" in on_file["loss"] and "dp" in on_file["loss"]["usage"]
    for step in on_file["steps"]:
        assert {"groups", "rollouts", "samples", "sampled_tokens", "trainable_tokens",
                "uniform_groups_kept", "uniform_groups_dropped", "envs", "denominators",
                "nominal", "actual", "status"} <= set(step)  # fmt: skip
        for env in step["envs"].values():
            assert {"reward_mean", "advantage_mean", "advantage_std", "samples"} <= set(env)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_outputs_are_readable_by_others_under_a_strict_umask(
    packed: dict[str, Any], tmp_path: Path
) -> None:
    old = os.umask(0o077)
    try:
        pack(packed["dir"] / "in.parquet", tmp_path / "out", *packed["args"])
    finally:
        os.umask(old)
    out = tmp_path / "out"
    folders = [out, *(p for p in out.rglob("*") if p.is_dir())]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(folders) == 5 and len(files) > 8
    assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {0o755}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}


def test_shard_size_does_not_change_rows(packed: dict[str, Any], tmp_path: Path) -> None:
    args = [a for a in packed["args"]]
    args[args.index("--shard-mb") + 1] = 256
    other = tmp_path / "out"
    pack(packed["dir"] / "in.parquet", other, *args)
    a, b = rolltool.open_packed(packed["out"]), rolltool.open_packed(other)
    compared = 0
    for step in range(a.num_steps):
        for rank in range(a.dp):
            for x, y in zip(a.micro_batches(step, rank), b.micro_batches(step, rank), strict=True):
                assert all(np.array_equal(x[k], y[k]) for k in DTYPES)
                compared += 1
    assert compared > 8


@pytest.mark.parametrize("row_len", [None, 256])
def test_empty_micro_batches_are_zero_weight_padding_rows(
    tmp_path: Path, row_len: int | None
) -> None:
    # Steps of two samples over four ranks: two ranks get nothing to train on.
    pq.write_table(
        rollouts([G("math", [0.0, 1.0], [30, 40]) for _ in range(3)]), tmp_path / "in.parquet"
    )
    extra = () if row_len is None else ("--row-len", row_len)
    pack(tmp_path / "in.parquet", tmp_path / "out", "--dp", 4, "--batch-size", 2,
         "--micro-batch-tokens", 128, *extra)  # fmt: skip
    ds = rolltool.open_packed(tmp_path / "out")
    empty = 0
    for step in range(ds.num_steps):
        per_rank = [ds.micro_batches(step, r) for r in range(4)]
        assert {len(x) for x in per_rank} == {1}
        for mbs in per_rank:
            row = mbs[0]
            _check_row(row, 128, row_len)
            if np.all(row["sample_index"] == -1):
                assert len(row["sample_index"]) == 1
                assert len(row["input_ids"]) == (row_len or 1)
                assert not row["loss_weight"].any() and not row["loss_mask"].any()
                empty += 1
    assert empty == 2 * ds.num_steps == 6
    assert verify(tmp_path / "out")["ok"]


# --- no cross-contamination ----------------------------------------------------------------


def _tiny_model(torch: Any) -> Callable[..., Any]:
    """Two layers of causal self-attention with learned positions; the mask only lets a token
    see earlier tokens of its own segment (cu_seqlens -> block-diagonal causal)."""
    g = torch.Generator().manual_seed(0)
    dim, vocab = 16, 1000
    emb = torch.randn(vocab, dim, generator=g)
    pos = torch.randn(512, dim, generator=g)
    layers = [torch.randn(3, dim, dim, generator=g) / dim**0.5 for _ in range(2)]
    f = torch.nn.functional

    def forward(ids: Any, positions: Any, cu: Any, *, isolate: bool = True) -> Any:
        n = len(ids)
        seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu.long()))
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        if isolate:
            mask &= seg[:, None] == seg[None, :]
        x = emb[ids.long()] + pos[positions.long()]
        for w in layers:
            q, k, v = x @ w[0], x @ w[1], x @ w[2]
            x = x + f.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return x

    return forward


def test_no_cross_contamination(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    groups = [G("math", [0.1 * i for i in range(4)], [5 + (7 * i + 3 * g) % 40 for i in range(4)]) for g in range(6)]  # fmt: skip
    pq.write_table(rollouts(groups), tmp_path / "in.parquet")
    pack(tmp_path / "in.parquet", tmp_path / "out", "--dp", 2, "--batch-size", 12,
         "--micro-batch-tokens", 120, "--row-len", 128)  # fmt: skip
    inp = input_samples(tmp_path / "in.parquet")
    ds = rolltool.open_packed(tmp_path / "out")
    model = _tiny_model(torch)
    checked = shared = leaked = 0
    with torch.no_grad():
        for step in range(ds.num_steps):
            for rank in range(ds.dp):
                for row in ds.micro_batches(step, rank, torch=True):
                    out = model(row["input_ids"], row["position_ids"], row["cu_seqlens"])
                    naive = model(
                        row["input_ids"], row["position_ids"], row["cu_seqlens"], isolate=False
                    )
                    cu = row["cu_seqlens"].tolist()
                    real = [k for k, i in enumerate(row["sample_index"].tolist()) if i >= 0]
                    shared += len(real) >= 2
                    for k in real:
                        i = int(row["sample_index"][k])
                        ids = torch.tensor(inp["input_ids"][i])
                        alone = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]))
                        a, b = cu[k], cu[k + 1]
                        torch.testing.assert_close(out[a:b], alone, rtol=1e-5, atol=1e-5)
                        leaked += k > 0 and not torch.allclose(naive[a:b], alone, atol=1e-5)
                        checked += 1
    assert checked == 24 and shared >= 4
    assert leaked > 0  # a model that ignored the boundaries would have been caught


# --- layout-invariant loss weights ---------------------------------------------------------

LAYOUTS = [
    ("--dp", 1, "--micro-batch-tokens", 4096),
    ("--dp", 3, "--micro-batch-tokens", 6000, "--row-len", 6144, "--balance", "tokens"),
    ("--dp", 4, "--micro-batch-tokens", 4096, "--balance", "verl", "--align", "total"),
    ("--dp", 2, "--micro-batch-size", 3, "--balance", "count"),
    ("--dp", 8, "--micro-batch-tokens", 5000, "--model", "dense-0.5b"),
]
FACTOR = 512.0


def _agg_args(agg: str) -> tuple[Any, ...]:
    return ("--loss-agg", agg) + (("--loss-scale-factor", FACTOR) if agg.endswith("norm") else ())


def _expected_step_loss(agg: str, inp: dict[str, list[Any]], members: np.ndarray) -> float:
    """The step's loss under `agg` for l_t = token_loss, computed from the input directly."""
    sums, counts = [], []
    for i in members:
        mask = np.asarray(inp["loss_mask"][i], dtype=bool)
        sums.append(float(token_loss(int(i), len(mask))[mask].sum()))
        counts.append(int(mask.sum()))
    s, c = np.array(sums), np.array(counts)
    keep = c > 0
    S = keep.sum()
    return {
        "token-mean": s.sum() / c.sum(),
        "seq-mean-token-mean": (s[keep] / c[keep]).sum() / S,
        "seq-mean-token-sum": s.sum() / S,
        "seq-mean-token-sum-norm": s.sum() / (S * FACTOR),
    }[agg]


def _weights_and_losses(out: Path) -> tuple[dict[int, tuple[int, np.ndarray]], list[float]]:
    """Per sample (step, per-token loss weights) and per step sum of loss_weight * l_t."""
    placed = placements(out)
    steps = max(v[0].step for v in placed.values()) + 1
    losses = [0.0] * steps
    weights = {}
    for i, (seg,) in placed.items():
        w = seg.arrays["loss_weight"]
        weights[i] = (seg.step, w)
        losses[seg.step] += float((w.astype(np.float64) * token_loss(i, len(w))).sum())
    return weights, losses


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_loss_weights_do_not_depend_on_the_layout(
    agg: str, tmp_path: Path, synth_table: pa.Table
) -> None:
    pq.write_table(synth_table, tmp_path / "in.parquet")
    inp = input_samples(tmp_path / "in.parquet")
    base: tuple[dict[int, tuple[int, np.ndarray]], list[float]] | None = None
    for k, layout in enumerate(LAYOUTS):
        out = tmp_path / f"out{k}"
        m = pack(
            tmp_path / "in.parquet",
            out,
            "--batch-size",
            32,
            "--keep-last",
            *layout,
            *_agg_args(agg),
        )
        weights, losses = _weights_and_losses(out)
        s = samples(out)
        assert len(weights) == int((s["status"] == "trained").sum()) == 146
        for step, loss in enumerate(losses):
            members = np.flatnonzero(s["step"] == step)
            assert loss == pytest.approx(_expected_step_loss(agg, inp, members), rel=1e-5)
            assert sum(
                float(w.sum()) for st_, w in weights.values() if st_ == step
            ) == pytest.approx(m["steps"][step]["denominators"]["weight_sum"], rel=1e-5)
        if base is None:
            base = (weights, losses)
            continue
        assert weights.keys() == base[0].keys()
        for i, (step, w) in weights.items():
            assert step == base[0][i][0] and np.array_equal(w, base[0][i][1]), (layout, i)
        assert losses == pytest.approx(base[1], rel=1e-9)
    assert verify(tmp_path / "out1")["ok"]


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dp=st.integers(1, 5),
    budget=st.integers(80, 300),
    pad=st.one_of(st.none(), st.integers(0, 50)),
    balance=st.sampled_from(["flops", "tokens", "count", "verl"]),
    align=st.sampled_from(["lockstep", "total"]),
    agg=st.sampled_from(LOSS_AGGS),
)
def test_loss_weights_match_the_formula_for_any_layout(
    tmp_path_factory: pytest.TempPathFactory, dp: int, budget: int, pad: int | None,
    balance: str, align: str, agg: str,
) -> None:  # fmt: skip
    tmp = tmp_path_factory.mktemp("hyp")
    groups = [G("math", [(g * i) % 3 for i in range(4)], [5 + (11 * i + 7 * g) % 75 for i in range(4)]) for g in range(5)]  # fmt: skip
    pq.write_table(rollouts(groups), tmp / "in.parquet")
    layout: tuple[Any, ...] = (
        "--dp",
        dp,
        "--micro-batch-tokens",
        budget,
        "--balance",
        balance,
        "--align",
        align,
    )
    if pad is not None:
        layout += ("--row-len", budget + pad)
    m = pack(
        tmp / "in.parquet", tmp / "out", "--batch-size", 8, "--keep-last", *layout, *_agg_args(agg)
    )
    inp = input_samples(tmp / "in.parquet")
    weights, _ = _weights_and_losses(tmp / "out")
    assert len(weights) == 20 and m["num_steps"] == 3
    for step in range(m["num_steps"]):
        mine = [i for i, (s_, _) in weights.items() if s_ == step]
        t = {i: int(np.sum(inp["loss_mask"][i])) for i in mine}
        T, S = sum(t.values()), sum(1 for v in t.values() if v)
        for i in mine:
            want = {
                "token-mean": 1 / T,
                "seq-mean-token-mean": 1 / (S * t[i]),
                "seq-mean-token-sum": 1 / S,
                "seq-mean-token-sum-norm": 1 / (S * FACTOR),
            }[agg]
            w = weights[i][1]
            mask = np.asarray(inp["loss_mask"][i], dtype=bool)
            assert np.all(w[~mask] == 0)
            np.testing.assert_allclose(w[mask], want, rtol=1e-6)
