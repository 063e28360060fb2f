"""rolltool bench on packs made with --cp / --sp (CPU, sdpa, tiny shapes).

Invariants: a CP rank's attention blocks, over the group, compute every causal (query, key)
pair of every sample exactly once, and its gathered keys it holds itself are the tokens at those
positions in its view; SP ranks' heads cover the heads once; the group's Σ L² is shared out
without loss; a micro-batch's time is its slowest GPU's and the DP figures follow from it;
--check passes on correct layouts and fails with a wrong chunk order, a wrong SP slice order or
a block kernel aligned top-left; sdpa's block attention equals a naive bottom-right reference.
"""

from __future__ import annotations

import doctest
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pack_helpers import G, rollouts

from rolltool.bench.shares import GpuShare, cp_share, sp_heads
from rolltool.format.split import cp_positions

torch = pytest.importorskip("torch")

TINY = ("--backend", "sdpa", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
        "--hidden", "32", "--intermediate", "32", "--repeats", "1", "--warmup", "0")  # fmt: skip
LENGTHS = [[13, 37, 50, 8], [90, 21, 66, 5], [44, 17, 71, 30], [9, 58, 33, 77]]


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same hand-made rollouts (lengths 5..90, not multiples of 4) packed plain, --cp 2,
    --cp 3 and --sp 2 (dp 2, two steps)."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from rolltool.cli import main

    root = tmp_path_factory.mktemp("bench-split")
    groups = [G("math", [0.0, 1.0, 0.5, 1.0], lengths) for lengths in LENGTHS]
    data = root / "in.parquet"
    pq.write_table(rollouts(groups), data)
    out = {}
    for name, extra in (("plain", []), ("cp2", ["--cp", "2"]), ("cp3", ["--cp", "3"]),
                        ("sp2", ["--sp", "2"])):  # fmt: skip
        out[name] = root / name
        args = [str(data), "--dp", "2", "--batch-size", "8", "--micro-batch-tokens", "96",
                *extra, "-o", str(out[name])]  # fmt: skip
        result = CliRunner().invoke(main, ["pack", *args])
        assert result.exit_code == 0, result.output
    return out


# --- the shares (pure NumPy) ------------------------------------------------------------------


def _cp_view(padded: list[int], cp: int, pad_end: int = 0) -> dict[str, np.ndarray]:
    """A CP view's boundaries for samples of these padded lengths (and row-end padding)."""
    spans = [*padded, pad_end] if pad_end else padded
    sample = [*range(len(padded)), *([-1] if pad_end else [])]
    local = np.concatenate([[0], np.cumsum([p // cp for p in spans])])
    return {"cu_seqlens": local.astype(np.int32),
            "cu_seqlens_padded": np.concatenate([[0], np.cumsum(spans)]).astype(np.int32),
            "sample_index": np.array(sample, dtype=np.int64)}  # fmt: skip


def _pairs(share: GpuShare, padded: list[int], cp: int) -> set[tuple[int, int, int]]:
    """(sample, query position, key position) of every pair the share's blocks compute, the
    query positions by the zigzag layout (chunk r, then chunk 2C-1-r), slowly."""
    found: set[tuple[int, int, int]] = set()
    b = 0
    for s, p in enumerate(padded):
        c = p // (2 * cp)
        for chunk in (share.gpu, 2 * cp - 1 - share.gpu):
            m = int(share.q_cu[b + 1] - share.q_cu[b])
            n = int(share.k_cu[b + 1] - share.k_cu[b])
            for i in range(m):
                for j in range(n - m + i + 1):  # bottom-right causal
                    found.add((s, chunk * c + i, j))
            b += 1
    return found


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_blocks_compute_every_causal_pair_once(cp: int) -> None:
    rng = np.random.default_rng(cp)
    padded = [int(x) * 2 * cp for x in rng.integers(1, 6, size=3)]
    shares = [cp_share(_cp_view(padded, cp, pad_end=2 * cp), cp, r) for r in range(cp)]
    seen: list[tuple[int, int, int]] = []
    for sh in shares:
        got = _pairs(sh, padded, cp)
        pad = sh.pairs - len(got)  # the row-end padding's own block: n(n+1)/2 pairs
        assert pad == 2 * (2 + 1) // 2
        seen += sorted(got)
    want = {(s, q, k) for s, p in enumerate(padded) for q in range(p) for k in range(q + 1)}
    assert len(seen) == len(set(seen)) == len(want) and set(seen) == want
    total = sum(sh.sum_sq for sh in shares)
    assert total == pytest.approx(sum(p * p for p in padded) + 4 * cp)  # Σ L², padding's too
    if cp > 1:  # the zigzag evens the work: every rank computes the same pairs
        assert len({sh.pairs for sh in shares}) == 1


def test_cp_own_keys_are_the_rank_s_tokens(packs: dict[str, Path]) -> None:
    """A gathered key the rank holds itself points at its local token of that position (the
    reader's view's position_ids); the rest come from the other ranks."""
    import rolltool

    ds = rolltool.open_packed(packs["cp2"])
    checked = 0
    for r in range(2):
        for view in ds.micro_batches(0, 0, cp_rank=r):
            share = cp_share(view, 2, r)
            b = 0
            for seg, s in enumerate(view["sample_index"].tolist()):
                blocks = 1 if s < 0 else 2
                start = int(view["cu_seqlens"][seg])
                for _ in range(blocks):
                    a, e = int(share.k_cu[b]), int(share.k_cu[b + 1])
                    own = share.own_key[a:e]
                    held = own >= 0
                    if s >= 0:
                        p = int(np.diff(view["cu_seqlens_padded"])[seg])
                        mine = np.isin(np.arange(e - a), cp_positions(p, 2, r))
                        assert np.array_equal(held, mine)
                        assert np.array_equal(view["position_ids"][own[held]], np.flatnonzero(held))
                    else:
                        assert held.all() and own[0] == start
                    checked += int(held.sum())
                    b += 1
    assert checked > 0


@pytest.mark.parametrize(
    ("heads", "kv", "sp"), [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (6, 3, 3)]
)
def test_sp_heads_cover_every_head_once(heads: int, kv: int, sp: int) -> None:
    group = heads // kv
    seen = []
    for i in range(sp):
        q, k = sp_heads(heads, kv, sp, i)
        seen += list(range(heads))[q]
        assert {h // group for h in range(heads)[q]} == set(range(kv)[k])  # the kv heads it reads
        assert k.stop - k.start == max(kv // sp, 1)
    assert seen == list(range(heads))


def test_sp_heads_refuse_what_does_not_split() -> None:
    from rolltool.errors import RolltoolError

    for heads, kv, sp in ((6, 2, 4), (8, 6, 4)):
        with pytest.raises(RolltoolError, match="--sp"):
            sp_heads(heads, kv, sp, 0)


def test_docstring_examples() -> None:
    from rolltool.bench import report, shares

    for module in (shares, report):
        assert doctest.testmod(module).failed == 0


# --- block attention --------------------------------------------------------------------------


def naive_blocks(q: Any, k: Any, v: Any, q_b: list[int], k_b: list[int]) -> Any:
    """Block i's queries against block i's keys, bottom-right causal, float64, written out."""
    outs = []
    for (qs, qe), (ks, ke) in zip(pairwise(q_b), pairwise(k_b), strict=True):
        qq, kk, vv = (x.double() for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
        group = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        m, n = len(qq), len(kk)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) / qq.shape[-1] ** 0.5
        allowed = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("seed", range(3))
def test_sdpa_block_attention_is_bottom_right_causal(seed: int) -> None:
    from rolltool.bench.backends import make_backend

    be, _ = make_backend("sdpa", torch, device="cpu", dtype="fp32")
    assert be.attend_blocks is not None
    rng = np.random.default_rng(seed)
    m = [int(x) for x in rng.integers(1, 12, size=4)]
    n = [a + int(b) for a, b in zip(m, rng.integers(0, 20, size=4), strict=True)]
    q_b, k_b = [0, *np.cumsum(m).tolist()], [0, *np.cumsum(n).tolist()]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_b[-1], 4, 8, generator=gen)
    k, v = (torch.randn(k_b[-1], 2, 8, generator=gen) for _ in range(2))
    cu_q, cu_k = torch.tensor(q_b, dtype=torch.int32), torch.tensor(k_b, dtype=torch.int32)
    out = be.attend_blocks(q, k, v, cu_q, cu_k, max(m), max(n), q_b, k_b)
    torch.testing.assert_close(out.double(), naive_blocks(q, k, v, q_b, k_b), atol=1e-5, rtol=1e-5)


# --- the command ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "k"), [("cp2", 2), ("cp3", 3), ("sp2", 2)])
def test_bench_reports_the_group_balance(run_cli, packs, name: str, k: int) -> None:
    """One timed row per GPU; a micro-batch takes its slowest GPU's time and the DP figures are
    computed on those; the group balance is max / mean over its GPUs; the group's Σ L² is
    shared out without loss (CP: the padded samples'; SP: divided by S)."""
    import rolltool

    result = run_cli("bench", packs[name], *TINY, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    ds = rolltool.open_packed(packs[name])
    split = doc["split"]
    assert (split["kind"], split["size"]) == (name[:2], k)
    assert split["real_tokens"] == sum(sum(g) for g in LENGTHS)
    # The zigzag (CP) and the head split (SP) even the counted work exactly.
    assert split["flops_imbalance_max"] == pytest.approx(1.0, abs=1e-12)
    groups: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        groups.setdefault((r["step"], r["rank"], r["micro_batch"]), []).append(r)
    n_rows = sum(len(ds.micro_batches(s, r)) for s in range(ds.num_steps) for r in range(ds.dp))
    assert len(groups) == n_rows and all(
        sorted(g["gpu"] for g in v) == list(range(k)) for v in groups.values()
    )
    for (step, rank, mb), gpus in groups.items():
        row = ds.micro_batches(step, rank)[mb]
        lengths = np.diff(row["cu_seqlens"].astype(np.int64))
        assert sum(g["tokens"] for g in gpus) == lengths.sum()
        if name.startswith("cp"):  # a sample and its padding are one span of the zigzag
            lengths = np.diff(ds.micro_batches(step, rank, cp_rank=0)[mb]["cu_seqlens_padded"])
        want = float(np.sum(lengths.astype(float) ** 2))
        assert sum(g["sum_sq"] for g in gpus) == pytest.approx(want)
    slowest = {key: max(g["seconds"] for g in v) for key, v in groups.items()}
    ratios = []
    for s in doc["steps"]:
        per_rank = [sum(t for (st, r, _), t in slowest.items() if (st, r) == (s["step"], rank))
                    for rank in range(ds.dp)]  # fmt: skip
        assert s["dp_time"] == pytest.approx(max(per_rank))
        mine = [max(g["seconds"] for g in v) / np.mean([g["seconds"] for g in v])
                for key, v in groups.items() if key[0] == s["step"]]  # fmt: skip
        assert s["group_imbalance_max"] == pytest.approx(max(mine))
        assert s["group_imbalance_median"] == pytest.approx(float(np.median(mine)))
        ratios += mine
    assert doc["total"]["group_imbalance_max"] == pytest.approx(max(ratios)) and max(ratios) >= 1
    table = run_cli("bench", packs[name], *TINY, "--rows")
    assert table.exit_code == 0, table.output
    lines = [line.strip() for line in table.stdout.splitlines()]
    assert f"{name[:2]} {k} balance" in lines and "max/mean" in table.stdout
    assert "gpu" in table.stdout


@pytest.mark.parametrize("name", ["cp2", "cp3", "sp2"])
@pytest.mark.parametrize("what", ["layer", "attention"])
def test_check_passes_on_split_packs(run_cli, packs, name: str, what: str) -> None:
    result = run_cli("bench", packs[name], *TINY, "--check", "--check-rows", "2", "--what", what,
                     "--backward", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    check = json.loads(result.stdout)["check"]
    assert check["ok"] and check["what"].startswith(name[:2])
    assert check["rows_checked"] == 2 and check["segments_checked"] >= 2
    assert all(r["tokens"] > 0 for r in check["rows"])  # tokens really compared


def _swapped_chunks(monkeypatch) -> None:
    """cp_positions gives a rank's late chunk first: views and cp_gather stay consistent with
    each other, but the layout is not the zigzag a ring-attention kernel assumes."""
    import rolltool.format.split as split

    right = split.cp_positions

    def swapped(padded_len: int, cp: int, rank: int) -> np.ndarray:
        x = right(padded_len, cp, rank)
        return np.concatenate([x[len(x) // 2 :], x[: len(x) // 2]])

    monkeypatch.setattr(split, "cp_positions", swapped)


def _reversed_slices(monkeypatch) -> None:
    """SP rank i gets the slice of rank S-1-i."""
    import rolltool.packed.core as reader

    right = reader.sp_view
    monkeypatch.setattr(reader, "sp_view", lambda row, sp, rank: right(row, sp, sp - 1 - rank))


def _top_left_blocks(monkeypatch) -> None:
    """A block kernel that aligns the causal mask top-left (sdpa's is_causal with Lq < Lk)."""
    from rolltool.bench import backends

    def wrong(torch: Any) -> Any:
        be = backends._sdpa(torch)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def blocks(q, k, v, q_cu, k_cu, max_q, max_k, q_b, k_b):  # type: ignore[no-untyped-def]
            outs = [sdpa(q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None],
                         v[c:d].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                    for a, b, c, d in zip(q_b, q_b[1:], k_b, k_b[1:], strict=False)]  # fmt: skip
            return torch.cat(outs)

        return backends.Backend(be.name, be.attend, be.gqa, "top-left", blocks)

    monkeypatch.setitem(backends.BACKENDS, "sdpa", wrong)


@pytest.mark.parametrize(
    ("name", "breaks"),
    [("cp2", _swapped_chunks), ("cp3", _swapped_chunks), ("sp2", _reversed_slices),
     ("cp2", _top_left_blocks)],
)  # fmt: skip
def test_check_fails_on_a_wrong_split(
    run_cli, packs, monkeypatch, tmp_path, name: str, breaks
) -> None:
    breaks(monkeypatch)
    cal = tmp_path / "cal.json"
    result = run_cli(
        "bench", packs[name], *TINY, "--check", "--check-rows", "1", "--calibrate", cal
    )
    assert result.exit_code == 1, result.output
    assert "--check failed" in result.stderr and "FAILED" in result.stdout
    assert "--cp/--sp group" in result.stderr and not cal.exists()


@pytest.mark.parametrize("name", ["cp2", "sp2"])
def test_backward_check_catches_lost_key_gradients(run_cli, packs, monkeypatch, name: str) -> None:
    """A kernel whose forward is right but whose keys and values get no gradient (detached):
    the outputs pass, the gradient comparison (--backward) fails; without it, --check passes."""
    from rolltool.bench import backends

    def detached(torch: Any) -> Any:
        be = backends._sdpa(torch)
        assert be.attend_blocks is not None
        blocks = be.attend_blocks

        def attend(q, k, v, *args):  # type: ignore[no-untyped-def]
            return be.attend(q, k.detach(), v.detach(), *args)

        def attend_blocks(q, k, v, *args):  # type: ignore[no-untyped-def]
            return blocks(q, k.detach(), v.detach(), *args)

        return backends.Backend(be.name, attend, be.gqa, "detached keys", attend_blocks)

    monkeypatch.setitem(backends.BACKENDS, "sdpa", detached)
    from rolltool.bench import run

    # Timing differentiates k and v too (it would refuse the kernel): only --check runs here.
    monkeypatch.setattr(
        run, "time_rows", lambda torch, be, rows, config, **_: np.ones((1, len(rows)))
    )
    args = ("bench", packs[name], *TINY, "--what", "attention", "--check", "--check-rows", "1")
    assert run_cli(*args).exit_code == 0
    result = run_cli(*args, "--backward", "--json")
    assert result.exit_code == 1, result.output
    (row,) = json.loads(result.stdout)["check"]["rows"]
    assert row["worst_output_ratio"] <= 1 < row["worst_grad_ratio"]


def test_split_and_plain_packs_compare_as_the_same_input(run_cli, packs) -> None:
    dirs = [packs[k] for k in ("plain", "cp2", "sp2")]
    doc = json.loads(run_cli("bench", *dirs, *TINY, "--json").stdout)
    cmp = doc["comparison"]
    assert cmp["same_input"]
    assert [line["balance"] for line in cmp["lines"]] == ["flops", "flops (cp 2)", "flops (sp 2)"]
    assert "split" not in doc["runs"][0] and "group_imbalance_max" not in doc["runs"][0]["total"]


def test_sp_needs_heads_that_split(run_cli, packs) -> None:
    result = run_cli("bench", packs["sp2"], "--backend", "sdpa", "--heads", "6", "--kv-heads",
                     "3", "--head-dim", "8", "--what", "attention", "--repeats", "1")  # fmt: skip
    assert result.exit_code == 1 and "--sp 2" in result.stderr, result.output


# --- GPU (skipped without CUDA) ---------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("name", ["torch-varlen", "flash-attn"])
def test_cuda_block_attention_is_bottom_right_causal(name: str) -> None:
    """The kernels' causal mask for queries fewer than keys is aligned bottom-right (what
    backends.py relies on for CP); bf16 against the float64 reference."""
    from rolltool.bench.backends import make_backend
    from rolltool.errors import RolltoolError

    try:
        be, _ = make_backend(name, torch, device="cuda", dtype="bf16")
    except RolltoolError as e:
        pytest.skip(e.message)
    assert be.attend_blocks is not None
    m, n = [64, 1, 100, 37], [64, 300, 100, 512]
    q_b, k_b = [0, *np.cumsum(m).tolist()], [0, *np.cumsum(n).tolist()]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(q_b[-1], 8, 64, generator=gen)
    k, v = (torch.randn(k_b[-1], 2, 64, generator=gen) for _ in range(2))
    want = naive_blocks(*(x.bfloat16().double() for x in (q, k, v)), q_b, k_b)
    dev = [x.cuda().bfloat16() for x in (q, k, v)]
    if not be.gqa:
        dev[1:] = [x.repeat_interleave(4, dim=1) for x in dev[1:]]
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device="cuda") for b in (q_b, k_b))
    out = be.attend_blocks(*dev, cu_q, cu_k, max(m), max(n), q_b, k_b)
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("name", ["cp2", "sp2"])
def test_cuda_bench_and_check_on_split_packs(run_cli, packs, name: str) -> None:
    result = run_cli("bench", packs[name], "--device", "cuda", "--heads", "4", "--kv-heads", "2",
                     "--head-dim", "64", "--hidden", "256", "--intermediate", "512", "--repeats",
                     "2", "--backward", "--check", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["check"]["ok"] and doc["split"]["kind"] == name[:2]
    assert all(r["seconds"] > 0 for r in doc["rows"])
