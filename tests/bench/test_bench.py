"""rolltool bench on CPU with the sdpa backend at small sizes (GPU paths skip without CUDA).

Invariants: every segment of a packed row equals attention over that sequence alone (against a
naive softmax reference), and a whole layer's output and gradients for a segment equal the layer
run on that sequence alone (against a naive float64 layer); a kernel that leaks across segments
fails --check; the report's arithmetic matches hand-made tables; layer FLOPs match the ``flops``
workload; the fit recovers known coefficients in both modes; the JSON carries the documented
keys; several directories compare with the best marked.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from rolltool.bench import report as rp
from rolltool.bench.backends import Backend, make_backend
from rolltool.bench.check import check_row, sample_rows
from rolltool.bench.config import BenchConfig, BenchSetup, LayerShape, resolve_shape
from rolltool.bench.layer import LayerWeights, layer_forward, make_weights
from rolltool.bench.rows import Row
from rolltool.errors import RolltoolError
from rolltool.input.synth import SynthConfig, generate
from rolltool.plan.workload import MODEL_PRESETS, make_workload

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = ("--backend", "sdpa", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--hidden", "32", "--intermediate", "64", "--repeats", "1", "--warmup", "0")  # fmt: skip
TINY_SHAPE = LayerShape(heads=2, kv_heads=1, head_dim=16, hidden=32, intermediate=64)
STEP_KEYS = {
    "step",
    "dp_time",
    "lockstep_time",
    "ideal_time",
    "dp_efficiency",
    "lockstep_efficiency",
}


def naive_attention(q: Any, k: Any, v: Any) -> Any:
    """Causal softmax attention of one sequence in float64, written out: [L, H, D] -> [L, H, D]."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    n = q.shape[0]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_row(lengths: list[int], step: int = 0, rank: int = 0, mb: int = 0) -> Row:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return Row(step=step, rank=rank, micro_batch=mb, cu_seqlens=cu,
               sample_index=np.arange(len(lengths), dtype=np.int64), predicted=float(sum(lengths)))  # fmt: skip


_SDPA = make_backend("sdpa", torch, device="cpu", dtype="fp32")[0]


def sdpa() -> Backend:
    return _SDPA


# --- the attention itself -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_sdpa_row_equals_each_sequence_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 40, size=int(rng.integers(1, 6)))]
    heads, kv = [(4, 4), (4, 2), (6, 1)][seed % 3]
    t = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, 8, generator=gen, requires_grad=True)
    k = torch.randn(t, kv, 8, generator=gen, requires_grad=True)
    v = torch.randn(t, kv, 8, generator=gen, requires_grad=True)
    row = make_row(lengths)
    out = sdpa().attend(
        q, k, v, torch.from_numpy(row.cu_seqlens), row.max_len, row.cu_seqlens.tolist()
    )
    assert out.shape == q.shape
    go = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), go)
    compared = 0
    for s, e in zip(row.cu_seqlens[:-1], row.cu_seqlens[1:], strict=True):
        alone = [x[s:e].detach().clone().requires_grad_() for x in (q, k, v)]
        ref = naive_attention(*alone)
        torch.testing.assert_close(out[s:e].double(), ref, atol=1e-5, rtol=1e-5)
        ref_grads = torch.autograd.grad(ref, alone, go[s:e].double())
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g[s:e].double(), rg.double(), atol=1e-5, rtol=1e-5)
        compared += 1
    assert compared == len(lengths)


def naive_layer(w: LayerWeights, x: Any) -> Any:
    """The documented layer over ONE sequence, written out in float64: [L, hidden] -> same."""
    s = w.shape
    wq, wk, wv, wo, wgate, wup, wdown = (m.double() for m in w.matmuls)

    def rms(x: Any, g: Any) -> Any:
        return x / (x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps).sqrt() * g.double()

    x = x.double()
    h = rms(x, w.norms[0])
    n = x.shape[0]
    q = (h @ wq.T).view(n, s.heads, s.head_dim)
    k, v = ((h @ m.T).view(n, s.kv_heads, s.head_dim) for m in (wk, wv))
    x = x + naive_attention(q, k, v).reshape(n, -1) @ wo.T
    h = rms(x, w.norms[1])
    return x + (torch.nn.functional.silu(h @ wgate.T) * (h @ wup.T)) @ wdown.T


@pytest.mark.parametrize(("kv_heads", "gqa", "layers"), [(1, True, 1), (1, False, 2), (2, True, 2)])
def test_layer_row_equals_each_sequence_alone(kv_heads: int, gqa: bool, layers: int) -> None:
    """Projections and MLP work per token, attention per segment: a packed row's outputs and
    input gradients per segment equal the layer run on each sequence alone; the weights'
    gradients are the sums of the sequences' gradients (what a trainer accumulates)."""
    shape = LayerShape(heads=2, kv_heads=kv_heads, head_dim=16, hidden=32, intermediate=64)
    w = make_weights(torch, shape, device="cpu", dtype=torch.float32, seed=3, grad=True)
    row = make_row([7, 1, 23, 12])
    gen = torch.Generator().manual_seed(layers)
    x = torch.randn(row.tokens, shape.hidden, generator=gen, requires_grad=True)
    go = torch.randn(row.tokens, shape.hidden, generator=gen)
    attend = sdpa().attend

    def stack(x: Any, bounds: list[int]) -> Any:
        cu = torch.tensor(bounds, dtype=torch.int32)
        max_len = max(e - s for s, e in pairwise(bounds))
        for _ in range(layers):
            x = layer_forward(torch, w, x, attend, cu, max_len, bounds, gqa=gqa)
        return x

    out = stack(x, row.cu_seqlens.tolist())
    assert out.shape == x.shape
    grads = torch.autograd.grad(out, (x, *w.params), go)
    summed = [torch.zeros_like(p) for p in w.params]
    for s, e in zip(row.cu_seqlens[:-1].tolist(), row.cu_seqlens[1:].tolist(), strict=True):
        alone = x[s:e].detach().clone().requires_grad_()
        ref = stack(alone, [0, e - s])
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)
        ref_grads = torch.autograd.grad(ref, (alone, *w.params), go[s:e])
        torch.testing.assert_close(grads[0][s:e], ref_grads[0], atol=1e-5, rtol=1e-5)
        summed = [a + b for a, b in zip(summed, ref_grads[1:], strict=True)]
        if layers == 1:  # the layer is the documented one
            torch.testing.assert_close(ref.double(), naive_layer(w, alone), atol=1e-5, rtol=1e-5)
    for g, want in zip(grads[1:], summed, strict=True):
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_layer_weights_are_made_once_and_rows_are_timed(monkeypatch) -> None:
    from rolltool.bench import timing

    made: list[LayerShape] = []

    def counting(*args: Any, **kwargs: Any) -> LayerWeights:
        made.append(args[1])
        return make_weights(*args, **kwargs)

    monkeypatch.setattr(timing, "make_weights", counting)
    rows = [make_row([40, 9]), make_row([60], mb=1), make_row([5, 5, 5], rank=1)]
    for backward in (False, True):
        config = BenchSetup(backend="sdpa", shape=TINY_SHAPE, backward=backward, repeats=2)
        times = timing.time_rows(torch, sdpa(), rows, config)
        assert times.shape == (2, 3) and np.all(times > 0)
    assert made == [TINY_SHAPE, TINY_SHAPE]  # once per run (shape), not per row or pass
    st = timing.stage(torch, sdpa(), rows, BenchSetup(backend="sdpa", shape=TINY_SHAPE))
    assert st.x.shape == (60, 32) and st.q is None and st.weights is not None


def _leaky(torch: Any) -> Backend:
    """A broken kernel: causal attention over the whole row, ignoring the boundaries."""

    def attend(q: Any, k: Any, v: Any, cu: Any, max_len: int, bounds: Any) -> Any:
        return sdpa().attend(q, k, v, cu, max_len, [0, q.shape[0]])

    return Backend("leaky", attend, True, "ignores cu_seqlens")


@pytest.mark.parametrize("backward", [False, True])
def test_check_passes_sdpa_and_catches_cross_contamination(backward: bool) -> None:
    # --check compares attention per segment in either mode (attention is what mixes tokens).
    shape = LayerShape(heads=4, kv_heads=2, head_dim=8, hidden=32, intermediate=64)
    config = BenchSetup(backend="sdpa", shape=shape, backward=backward, check_rows=1)
    row = make_row([5, 17, 1, 30])
    good = check_row(torch, sdpa(), row, config)
    assert good["ok"] and good["segments"] == 4
    bad = check_row(torch, _leaky(torch), row, config)
    assert not bad["ok"] and bad["worst_segment"] >= 1  # segment 0 is right even when leaking
    assert bad["max_abs_error"] > 0.05


def test_check_samples_distinct_rows_including_the_extremes() -> None:
    rows = [make_row([10] * (i % 4 + 1), mb=i) for i in range(9)] + [make_row([200], mb=9)]
    picks = sample_rows(rows, 4)
    assert len(picks) == len(set(picks)) == 4
    assert 9 in picks  # the longest segment
    assert any(len(rows[i].cu_seqlens) == 5 for i in picks)  # the most segments
    assert sample_rows(rows, 0) == []


# --- backends ---------------------------------------------------------------------------------


def test_auto_on_cpu_picks_sdpa_and_says_why() -> None:
    backend, reason = make_backend("auto", torch, device="cpu", dtype="fp32")
    assert backend.name == "sdpa"
    assert "torch-varlen" in reason and "CUDA" in reason


@pytest.mark.parametrize("name", ["torch-varlen", "flash-attn"])
def test_cuda_backends_refuse_cpu(name: str) -> None:
    with pytest.raises(RolltoolError, match="CUDA"):
        make_backend(name, torch, device="cpu", dtype="bf16")


@pytest.mark.parametrize(
    ("signature", "expected"),
    [("window", {"window_size": (-1, 0)}), ("causal", {"is_causal": True})],
)
def test_torch_varlen_handles_both_signatures(monkeypatch, signature: str, expected: dict) -> None:
    """2.10 takes is_causal=True, 2.11+ window_size=(-1, 0): detected from the signature."""
    import torch.nn.attention.varlen as varlen

    calls: list[dict[str, Any]] = []

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        calls.append({"window_size": window_size})
        return query

    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        calls.append({"is_causal": is_causal})
        return query

    monkeypatch.setattr(varlen, "varlen_attn", v211 if signature == "window" else v210)
    from rolltool.bench.backends import BACKENDS

    backend = BACKENDS["torch-varlen"](torch)
    assert not backend.gqa  # neither fake takes enable_gqa: k, v are repeated beforehand
    x = torch.zeros(3, 2, 4)
    backend.attend(x, x, x, torch.tensor([0, 3], dtype=torch.int32), 3, [0, 3])
    assert calls == [expected]


@cuda
@pytest.mark.parametrize("name", ["torch-varlen", "auto"])
def test_cuda_backend_matches_sequences_alone(name: str) -> None:
    backend, _ = make_backend(name, torch, device="cuda", dtype="bf16")
    config = BenchSetup(backend=backend.name, shape=LayerShape(heads=8, kv_heads=2, head_dim=64),
                         what="attention", dtype="bf16", device="cuda", backward=True, check_rows=1)  # fmt: skip
    assert check_row(torch, backend, make_row([100, 1, 700, 33]), config)["ok"]


@cuda
def test_cuda_layer_mode_times_rows_and_keeps_segments_apart() -> None:
    from rolltool.bench import timing

    backend, _ = make_backend("auto", torch, device="cuda", dtype="bf16")
    shape = LayerShape(heads=8, kv_heads=2, head_dim=64, hidden=512, intermediate=1024)
    rows = [make_row([100, 1, 700, 33]), make_row([834], rank=1)]
    config = BenchSetup(backend=backend.name, shape=shape, dtype="bf16", device="cuda",
                         backward=True, repeats=2)  # fmt: skip
    times = timing.time_rows(torch, backend, rows, config)
    assert times.shape == (2, 2) and np.all(np.isfinite(times)) and np.all(times > 0)
    w = make_weights(torch, shape, device="cuda", dtype=torch.bfloat16, seed=0)
    row = rows[0]
    x = torch.randn(row.tokens, shape.hidden, device="cuda").bfloat16()
    bounds = row.cu_seqlens.tolist()
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        out = layer_forward(torch, w, x, backend.attend, cu, row.max_len, bounds, gqa=backend.gqa)
        for s, e in pairwise(bounds):
            one = torch.tensor([0, e - s], dtype=torch.int32, device="cuda")
            ref = layer_forward(torch, w, x[s:e], backend.attend, one, e - s, [0, e - s],
                                gqa=backend.gqa)  # fmt: skip
            # bf16: a few ulps of the largest element (a sanity check; --check is the leak test).
            diff = float((out[s:e].float() - ref.float()).abs().max())
            assert diff <= 2e-2 * float(ref.float().abs().max())


# --- report arithmetic ------------------------------------------------------------------------


def test_step_times_on_a_hand_made_table() -> None:
    # step 0: rank 0 takes (3, 1) s, rank 1 takes (1, 3) s; step 1: rank 0 (2,), rank 1 (4,).
    step = np.array([0, 0, 0, 0, 1, 1])
    rank = np.array([0, 0, 1, 1, 0, 1])
    mb = np.array([0, 1, 0, 1, 0, 0])
    t = np.array([3.0, 1.0, 1.0, 3.0, 2.0, 4.0])
    s0, s1 = rp.step_times(step, rank, mb, t, dp=2)
    assert (s0["dp_time"], s0["lockstep_time"], s0["ideal_time"]) == (4.0, 6.0, 4.0)
    assert s0["dp_efficiency"] == 1.0 and s0["lockstep_efficiency"] == pytest.approx(4 / 6)
    assert (s1["dp_time"], s1["lockstep_time"], s1["ideal_time"]) == (4.0, 4.0, 3.0)
    total = rp.total_times([s0, s1])
    assert (total["dp_time"], total["lockstep_time"], total["ideal_time"]) == (8.0, 10.0, 7.0)
    assert total["lockstep_efficiency"] == pytest.approx(0.7)
    assert STEP_KEYS - {"step"} <= set(total)


def test_step_times_invariants_on_random_tables() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        dp, m = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        t = rng.random((dp, m))
        rank, mb = np.meshgrid(np.arange(dp), np.arange(m), indexing="ij")
        (s,) = rp.step_times(np.zeros(dp * m, int), rank.ravel(), mb.ravel(), t.ravel(), dp)
        assert s["lockstep_time"] >= s["dp_time"] - 1e-12 >= s["ideal_time"] - 2e-12
        assert s["dp_time"] == pytest.approx(t.sum(1).max())
        assert s["lockstep_time"] == pytest.approx(t.max(0).sum())


def test_attention_flops_and_peak_share() -> None:
    # 2 · 1024² · 128 · 32 = 8.59 GFLOP forward; backward adds 2x (the flops workload's count).
    assert rp.attention_flops(np.array([1024]), heads=32, head_dim=128) == 2 * 1024**2 * 128 * 32
    assert rp.attention_flops(np.array([3, 4]), heads=1, head_dim=1, layers=2, backward=True) == (
        2 * 25 * 2 * 3
    )
    t = rp.throughput(989e12, 2.0, "NVIDIA H200", "bf16")
    assert t["tflops"] == pytest.approx(494.5) and t["peak_share"] == pytest.approx(0.5)
    assert rp.throughput(1e12, 1.0, "CPU (x86_64)", "fp32")["peak_share"] is None
    assert rp.peak_tflops("NVIDIA H100 80GB HBM3", "fp32") is None


def test_layer_flops_formula() -> None:
    # TINY_SHAPE: q, o 32x32 each, k, v 32x16 each, gate, up, down 32x64 each.
    assert TINY_SHAPE.matmul_params == 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 == 9216
    kw = {"matmul_params": 9216, "heads": 2, "head_dim": 16}
    assert rp.layer_flops(np.array([3, 4]), **kw) == 2 * 7 * 9216 + 2 * 25 * 16 * 2
    assert rp.layer_flops(np.array([3, 4]), **kw, layers=2, backward=True) == 2 * (
        3 * 2 * 7 * 9216 + 3 * 2 * 25 * 16 * 2
    )
    # dense-7b: 233.0 M matmul parameters per layer; 2.03 TFLOP forward for 4,096 tokens.
    shape, _ = resolve_shape(model="dense-7b")
    assert shape.matmul_params == 233_046_016
    f = rp.layer_flops(np.array([4096]), matmul_params=shape.matmul_params, heads=28, head_dim=128)
    assert f == pytest.approx(2.029e12, rel=1e-3)
    # All layers with backward = the flops workload, but for the output projection (h·vocab,
    # once per model): one formula (workload.flops_coefficients), attention backward 2x forward.
    for name in ("dense-7b", "dense-8b"):
        shape, _ = resolve_shape(model=name)
        w, model = make_workload("flops", model=name), MODEL_PRESETS[name]
        lengths = np.array([1, 700, 9000])
        got = sum(
            rp.layer_flops(np.array([n]), matmul_params=shape.matmul_params, heads=shape.heads,
                           head_dim=shape.head_dim, layers=model.num_layers, backward=True)
            + 6.0 * model.hidden_size * model.vocab_size * n
            for n in lengths
        )  # fmt: skip
        assert got == pytest.approx(float(w.cost(lengths).sum()), rel=1e-12)


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(1)
    a, b = 3e-7, 2e-11
    rows = [rng.integers(50, 8000, size=int(rng.integers(1, 12))) for _ in range(40)]
    tokens = np.array([r.sum() for r in rows], dtype=float)
    sum_sq = np.array([(r.astype(float) ** 2).sum() for r in rows])
    seconds = (a * tokens + b * sum_sq) * rng.normal(1.0, 1e-3, size=len(rows))
    fit = rp.fit_quadratic(tokens, sum_sq, seconds)
    assert fit["a"] == pytest.approx(a, rel=0.02) and fit["b"] == pytest.approx(b, rel=0.02)
    assert fit["r2"] > 0.999 and fit["rows"] == 40
    # A quadratic-only truth with noise pulling a below 0: the fit stays a valid cost model.
    fit0 = rp.fit_quadratic(tokens, sum_sq, b * sum_sq - 1e-9 * tokens)
    assert fit0["a"] == 0.0 and fit0["b"] > 0


def test_calibration_file_is_what_pack_reads(tmp_path: Path) -> None:
    from rolltool.bench.run import write_json

    fit = {"a": 1.5e-7, "b": 2.5e-12, "r2": 0.99, "rows": 10}
    path = tmp_path / "cal.json"
    write_json(
        path, rp.calibration(fit, {"device": "NVIDIA H200", "backend": "torch-varlen"}), force=False
    )
    w = make_workload("calibrated", calibration=path)
    assert (w.a, w.b, w.c) == (1.5e-7, 2.5e-12, 0.0)
    assert w.notes["device"] == "NVIDIA H200" and w.notes["r2"] == 0.99
    with pytest.raises(RolltoolError, match="exists"):
        write_json(path, {}, force=False)


def test_shape_resolution() -> None:
    shape, source = resolve_shape(model="dense-8b")
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.layers) == (32, 8, 128, 1)
    assert (shape.hidden, shape.intermediate) == (4096, 14_336) and "overrides" not in source
    shape, source = resolve_shape(model="dense-8b", heads=16)
    assert (shape.heads, shape.kv_heads, shape.hidden) == (16, 4, 4096) and "overrides" in source
    shape, source = resolve_shape(hidden=32, intermediate=64)
    assert (shape.heads, shape.hidden, shape.intermediate) == (28, 32, 64) and "dense-7b" in source
    with pytest.raises(RolltoolError, match="multiple"):
        resolve_shape(heads=6, kv_heads=4)
    # Layer mode needs both widths; attention mode does not.
    bare = LayerShape(heads=2, kv_heads=1, head_dim=16)
    with pytest.raises(RolltoolError, match="--hidden"):
        BenchSetup(backend="sdpa", shape=bare)
    assert BenchSetup(backend="sdpa", shape=bare, what="attention").what == "attention"
    with pytest.raises(RolltoolError, match="--what"):
        BenchSetup(backend="sdpa", shape=bare, what="mlp")


def test_bench_config_refuses_what_it_cannot_run() -> None:
    """The settings are checked where they are made (before torch), with the option's name."""
    assert BenchConfig() == BenchConfig(backend="auto", device="auto", dtype="auto", what="layer")
    for kw, words in (({"device": "tpu"}, "--device"), ({"backend": "nope"}, "--backend"),
                      ({"what": "mlp"}, "--what"), ({"dtype": "fp8"}, "--dtype"),
                      ({"model": "nope"}, "nope"), ({"repeats": 0}, "--repeats"),
                      ({"warmup": -1}, "--warmup"), ({"check_rows": -1}, "check"),
                      ({"steps": (1, -1)}, "steps")):  # fmt: skip
        with pytest.raises(RolltoolError, match=words):
            BenchConfig(**kw)


def test_parse_steps_and_device() -> None:
    from rolltool.bench.config import parse_device, parse_steps

    assert parse_steps("0,2-4") == (0, 2, 3, 4) and parse_steps(" 3 , 1,1") == (1, 3)
    for bad in ("2-1", "-1", "a", "1,,2", "1-b", ""):
        with pytest.raises(ValueError, match="0,2-4"):
            parse_steps(bad)
    assert [parse_device(d) for d in ("auto", "cpu", "cuda", "cuda:3")]
    with pytest.raises(ValueError, match="cuda:N"):
        parse_device("cuda:")


def test_cli_hands_run_bench_the_config_the_api_would_build(monkeypatch) -> None:
    """Options map to BenchConfig fields one to one; --check without --check-rows takes the
    config module's default, no --check means no rows."""
    from click.testing import CliRunner

    from rolltool.bench import run
    from rolltool.bench.config import DEFAULT_CHECK_ROWS
    from rolltool.cli import main

    seen: list[tuple[Any, dict[str, Any]]] = []

    def capture(paths: Any, config: BenchConfig, **kw: Any) -> Any:
        seen.append((config, kw))
        raise LookupError("stop here: the config is all this test wants")

    monkeypatch.setattr(run, "run_bench", capture)
    for args, want in (
        ([], BenchConfig()),
        (["--check"], BenchConfig(check_rows=DEFAULT_CHECK_ROWS)),
        (["--check-rows", "9"], BenchConfig()),
        ([*TINY, "--steps", "3,1-2", "--what", "attention", "--backward", "--device", "cpu",
          "--dtype", "fp32", "--seed", "5", "--layers", "2", "--model", "dense-8b", "--check",
          "--check-rows", "2"],
         BenchConfig(backend="sdpa", heads=2, kv_heads=1, head_dim=16, hidden=32,
                     intermediate=64, repeats=1, warmup=0, steps=(1, 2, 3), what="attention",
                     backward=True, device="cpu", dtype="fp32", seed=5, layers=2,
                     model="dense-8b", check_rows=2)),
    ):  # fmt: skip
        result = CliRunner().invoke(main, ["bench", "some/dir", *args, "--calibrate", "c.json"])
        assert isinstance(result.exception, LookupError), result.output
        config, kw = seen.pop()
        assert config == want, args
        assert kw["calibrate"] == "c.json" and kw["force"] is False


# --- the command ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same small synthetic input packed three ways (dp 2, 4,096-token micro-batches)."""
    from click.testing import CliRunner

    from rolltool.cli import main

    root = tmp_path_factory.mktemp("bench")
    data = root / "synth.parquet"
    pq.write_table(generate(SynthConfig(groups=8, max_len=2048, seed=0)), data)
    dirs = {}
    for balance in ("flops", "tokens", "count"):
        dirs[balance] = root / balance
        args = [str(data), "--dp", "2", "--batch-size", "16", "--micro-batch-tokens", "4096",
                "--balance", balance, "-o", str(dirs[balance])]  # fmt: skip
        result = CliRunner().invoke(main, ["pack", *args])
        assert result.exit_code == 0, result.output
    return dirs


def test_json_schema_and_arithmetic(run_cli, packed_dirs, tmp_path: Path) -> None:
    cal = tmp_path / "cal.json"
    result = run_cli("bench", packed_dirs["flops"], *TINY, "--backward", "--check", "--calibrate",
                     cal, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["backend"] == "sdpa" and doc["check_ok"] is True and doc["check"]["ok"]
    c = doc["config"]
    assert (c["what"], c["hidden"], c["intermediate"], c["matmul_params"]) == (
        "layer",
        32,
        64,
        9216,
    )
    import rolltool

    ds = rolltool.open_packed(packed_dirs["flops"])
    assert [s["step"] for s in doc["steps"]] == list(range(ds.num_steps))
    n_rows = sum(len(ds.micro_batches(s, r)) for s in range(ds.num_steps) for r in range(ds.dp))
    assert len(doc["rows"]) == n_rows
    for s in [*doc["steps"], doc["total"]]:
        assert STEP_KEYS - {"step"} <= set(s)
        assert s["dp_efficiency"] == pytest.approx(s["ideal_time"] / s["dp_time"])
        assert s["lockstep_efficiency"] == pytest.approx(s["ideal_time"] / s["lockstep_time"])
        assert 0 < s["lockstep_efficiency"] <= s["dp_efficiency"] <= 1 + 1e-12
    for key in ("dp_time", "lockstep_time", "ideal_time"):
        assert doc["total"][key] == pytest.approx(sum(s[key] for s in doc["steps"]))
    assert doc["total"]["ideal_time"] == pytest.approx(
        sum(r["seconds"] for r in doc["rows"]) / ds.dp
    )
    assert doc["throughput"]["tflops"] > 0 and doc["throughput"]["peak_share"] is None
    assert {"a", "b", "r2"} <= set(doc["fit"])
    w = make_workload("calibrated", calibration=cal)
    assert w.a == doc["fit"]["a"] and w.b == doc["fit"]["b"] and w.notes["backend"] == "sdpa"
    assert w.notes["what"] == "layer" and w.notes["shape"]["hidden"] == 32
    assert "forward + backward" in w.notes["measures"]
    for key in ("workload_fit", "flops_fit", "tokens_fit", "sum_sq_fit"):
        assert {"r2", "rel_rmse", "seconds_per_unit"} <= set(doc[key])


def test_attention_mode_still_works(run_cli, packed_dirs, tmp_path: Path) -> None:
    cal = tmp_path / "cal.json"
    result = run_cli("bench", packed_dirs["count"], *TINY, "--what", "attention", "--backward",
                     "--calibrate", cal, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["config"]["what"] == "attention" and doc["config"]["matmul_params"] is None
    notes = json.loads(cal.read_text())
    assert notes["what"] == "attention" and "hidden" not in notes["shape"]
    table = run_cli("bench", packed_dirs["count"], *TINY, "--what", "attention")
    assert table.exit_code == 0 and "attention only" in table.stderr
    assert "attention:" in table.stdout and "R²" in table.stdout


def _synthetic_device(monkeypatch, seconds_per_flop: float) -> None:
    """Replace timing by a device whose row time is exactly its FLOPs (as bench counts them)
    times ``seconds_per_flop``."""
    from rolltool.bench import run

    def fake_time_rows(torch: Any, backend: Any, rows: Any, config: Any, **_: Any) -> np.ndarray:
        return np.array([[seconds_per_flop * run.row_flops(r.lengths, config) for r in rows]])

    monkeypatch.setattr(run, "time_rows", fake_time_rows)


@pytest.mark.parametrize("backward", [False, True])
def test_layer_calibration_recovers_known_coefficients(
    monkeypatch, packed_dirs, tmp_path: Path, backward: bool
) -> None:
    """On a device whose time is proportional to FLOPs, layer mode's fit is the layer's FLOPs
    per token and per token² (linear term included), and pack can balance on it."""
    from rolltool.bench.run import run_bench

    k = 1e-12
    _synthetic_device(monkeypatch, k)
    cal = tmp_path / "cal.json"
    dirs = [packed_dirs[b] for b in ("flops", "tokens", "count")]
    config = BenchConfig(backend="sdpa", device="cpu", model="dense-7b", backward=backward,
                         repeats=1, warmup=0)  # fmt: skip
    doc = run_bench(dirs, config, calibrate=cal)
    shape, _ = resolve_shape(model="dense-7b")
    a = k * 2 * shape.matmul_params * (3 if backward else 1)
    b = k * 2 * shape.heads * shape.head_dim * (3 if backward else 1)
    written = json.loads(cal.read_text())
    assert written["a"] == pytest.approx(a, rel=1e-6) and written["b"] == pytest.approx(b, rel=1e-6)
    assert written["r2"] == pytest.approx(1.0) and written["what"] == "layer"
    assert written["shape"] == {**shape.to_dict()} and written["shape"]["intermediate"] == 18_944
    assert make_workload("calibrated", calibration=cal).a == written["a"]
    assert "warning" not in written and doc["fit_warning"] is None
    for run in doc["runs"]:
        assert run["flops_fit"]["r2"] == pytest.approx(1.0)
        assert run["flops_fit"]["rel_rmse"] == pytest.approx(0.0, abs=1e-9)
    flops_run = doc["runs"][0]
    assert flops_run["workload"]["kind"] == "flops"
    # The packed cost model (dense-7b flops) predicts layer-mode times: bench now measures what
    # pack balanced (R² short of 1 by the output projection and the backward's attention
    # convention only). Attention-only times on the same device it does not predict.
    assert flops_run["workload_fit"]["r2"] > 0.999 and flops_run["workload_fit"]["rel_rmse"] < 0.01
    attn = run_bench(dirs[:1], dataclasses.replace(config, what="attention"))
    assert attn["workload_fit"]["rel_rmse"] > 0.05


def test_steps_subset_and_table(run_cli, packed_dirs) -> None:
    result = run_cli("bench", packed_dirs["tokens"], *TINY, "--steps", "0,2-3", "--rows")
    assert result.exit_code == 0, result.output
    assert (
        "lockstep eff" in result.stdout and "TFLOP/s" in result.stdout and "total" in result.stdout
    )
    doc = json.loads(
        run_cli("bench", packed_dirs["tokens"], *TINY, "--steps", "1", "--json").stdout
    )
    assert [s["step"] for s in doc["steps"]] == [1] and {r["step"] for r in doc["rows"]} == {1}
    bad = run_cli("bench", packed_dirs["tokens"], *TINY, "--steps", "99")
    assert bad.exit_code == 1 and "out of range" in bad.stderr
    assert run_cli("bench", packed_dirs["tokens"], "--steps", "2-1").exit_code == 2


def test_several_directories_side_by_side(run_cli, packed_dirs) -> None:
    dirs = [packed_dirs[k] for k in ("flops", "tokens", "count")]
    doc = json.loads(run_cli("bench", *dirs, *TINY, "--json").stdout)
    cmp = doc["comparison"]
    assert [line["path"] for line in cmp["lines"]] == [str(d) for d in dirs]
    assert [line["balance"] for line in cmp["lines"]] == ["flops", "tokens", "count"]
    assert cmp["same_input"]
    for key in ("dp_time", "lockstep_time"):
        best = [i for i, line in enumerate(cmp["lines"]) if key in line["best"]]
        assert best == [cmp["best"][key]]
        assert cmp["lines"][best[0]][key] == min(line[key] for line in cmp["lines"])
    assert len(doc["runs"]) == 3 and all("steps" in r and "total" in r for r in doc["runs"])
    table = run_cli("bench", *dirs, *TINY)
    assert table.exit_code == 0 and "comparison" in table.stdout and " *" in table.stdout


def test_several_directories_keep_the_top_level_schema(run_cli, packed_dirs, tmp_path) -> None:
    """backend, steps and total at the top level for any number of directories (the first
    directory's); --json-out writes that document from the same run that prints the tables."""
    dirs = [packed_dirs[k] for k in ("tokens", "count")]
    out = tmp_path / "bench.json"
    result = run_cli("bench", *dirs, *TINY, "--json-out", out)
    assert result.exit_code == 0, result.output
    assert "comparison" in result.stdout and "lockstep eff" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["backend"] == "sdpa"
    assert doc["steps"] == doc["runs"][0]["steps"] and doc["total"] == doc["runs"][0]["total"]
    assert doc["runs"][1]["path"] == str(dirs[1]) and doc["runs"][1]["steps"] != doc["steps"]
    for s in [*doc["steps"], doc["total"]]:
        assert STEP_KEYS - {"step"} <= set(s)
    # the same timings as the table: the comparison's first line is the top-level total
    assert doc["comparison"]["lines"][0]["dp_time"] == pytest.approx(doc["total"]["dp_time"])
    single = json.loads(run_cli("bench", dirs[0], *TINY, "--json").stdout)
    assert {"backend", "steps", "total"} <= set(single) and "runs" not in single


def test_unreliable_fit_warns_and_still_writes(
    run_cli, packed_dirs, monkeypatch, tmp_path: Path
) -> None:
    """Times that a·L + b·L² does not explain (noise) or too few rows: a warning on stderr and
    in the calibration file, which is still written."""
    from rolltool.bench import run

    rng = np.random.default_rng(0)

    def noise(torch: Any, backend: Any, rows: Any, config: Any, **_: Any) -> np.ndarray:
        return rng.uniform(1e-3, 2e-3, size=(1, len(rows)))

    monkeypatch.setattr(run, "time_rows", noise)
    cal = tmp_path / "cal.json"
    result = run_cli("bench", packed_dirs["flops"], *TINY, "--calibrate", cal)
    assert result.exit_code == 0, result.output
    assert "Warning" in result.stderr and "unreliable" in result.stderr and "R²" in result.stderr
    written = json.loads(cal.read_text())
    assert "R²" in written["warning"] and written["r2"] < 0.9
    assert make_workload("calibrated", calibration=cal).notes["warning"] == written["warning"]

    # Too few rows warn too, however well they fit (step 0 alone has fewer than 8 rows).
    _synthetic_device(monkeypatch, 1e-12)
    few = tmp_path / "few.json"
    result = run_cli("bench", packed_dirs["flops"], *TINY, "--steps", "0", "--calibrate", few,
                     "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["fit"]["rows"] < 8
    assert "only" in json.loads(few.read_text())["warning"] and "Warning" in result.stderr


def test_fit_warning_thresholds() -> None:
    from rolltool.bench.run import fit_warning

    assert fit_warning({"r2": 0.95, "rows": 8}) is None
    assert "R² 0.899" in (fit_warning({"r2": 0.899, "rows": 100}) or "")
    assert "undefined" in (fit_warning({"r2": float("nan"), "rows": 100}) or "")
    assert "only 7 rows" in (fit_warning({"r2": 1.0, "rows": 7}) or "")


def test_failed_check_exits_1_and_writes_no_calibration(
    run_cli, packed_dirs, monkeypatch, tmp_path: Path
) -> None:
    from rolltool.bench import backends

    monkeypatch.setitem(backends.BACKENDS, "sdpa", _leaky)
    cal = tmp_path / "cal.json"
    result = run_cli("bench", packed_dirs["flops"], *TINY, "--check", "--calibrate", cal)
    assert result.exit_code == 1, result.output
    assert "--check failed" in result.stderr and "FAILED" in result.stdout
    assert not cal.exists()


def test_cpu_refuses_cuda_backend_and_device(run_cli, packed_dirs) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for args in (["--backend", "torch-varlen"], ["--device", "cuda"]):
        result = run_cli("bench", packed_dirs["count"], *args)
        assert result.exit_code == 1 and "CUDA" in result.stderr, result.output


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:", "CPU", "mps"])
def test_unknown_device_is_a_usage_error(run_cli, packed_dirs, device: str) -> None:
    result = run_cli("bench", packed_dirs["count"], *TINY, "--device", device)
    assert result.exit_code == 2 and "--device" in result.stderr, result.output
    assert "auto, cpu, cuda or cuda:N" in result.stderr and "Traceback" not in result.output
    from rolltool.bench.run import run_bench

    with pytest.raises(RolltoolError, match="--device"):
        run_bench([packed_dirs["count"]], BenchConfig(backend="sdpa", device=device))


def test_missing_cuda_index_is_a_clear_error(run_cli, packed_dirs) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = torch.cuda.device_count()
    result = run_cli("bench", packed_dirs["count"], *TINY, "--device", f"cuda:{n}")
    assert result.exit_code == 1 and "CUDA device(s)" in result.stderr, result.output


def test_missing_torch_is_a_clear_error(run_cli, packed_dirs, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    result = run_cli("bench", packed_dirs["count"], "--backend", "sdpa")
    assert result.exit_code == 1
    assert "needs PyTorch" in result.stderr and "Traceback" not in result.output


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, rolltool.cli, rolltool.cli.bench, rolltool.bench; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _repeats_device(monkeypatch, noise: float, repeats: int = 5) -> None:
    """Row time proportional to tokens, each repeat scaled per row by up to ±``noise``."""
    from rolltool.bench import run

    rng = np.random.default_rng(1)

    def fake(torch: Any, backend: Any, rows: Any, config: Any, **_: Any) -> np.ndarray:
        base = np.array([1e-6 * r.tokens for r in rows])
        return base * (1 + rng.uniform(-noise, noise, size=(repeats, len(rows))))

    monkeypatch.setattr(run, "time_rows", fake)


def test_noisy_repeats_warn_that_efficiencies_are_unsupported(
    run_cli, packed_dirs, monkeypatch
) -> None:
    """Issue 13: CPU runs gave 60%, 78% and 98% efficiency on the same data without a word.
    Repeats whose efficiencies range wider than what the figure says is lost: a warning naming
    the range; steady repeats: none."""
    _repeats_device(monkeypatch, noise=0.6)
    noisy = run_cli("bench", packed_dirs["tokens"], *TINY, "--json")
    assert noisy.exit_code == 0, noisy.output
    doc = json.loads(noisy.stdout)
    r = doc["noise"]["lockstep_efficiency"]
    assert doc["noise"]["repeats"] == 5 and r["max"] - r["min"] > 0.02
    assert "timing noise is as large as the imbalance" in noisy.stderr
    assert "on CPU" in noisy.stderr
    _repeats_device(monkeypatch, noise=0.0)
    steady = run_cli("bench", packed_dirs["tokens"], *TINY, "--json")
    assert steady.exit_code == 0, steady.output
    assert "timing noise" not in steady.stderr
    assert json.loads(steady.stdout)["noise"]["row_spread"] == pytest.approx(0.0)


def test_repeat_spread_against_each_pass_alone() -> None:
    """The range is over the efficiencies of each timed pass computed on its own (slow: the
    efficiencies by hand from the formulas of the module docstring)."""
    from rolltool.bench.report import repeat_spread

    rng = np.random.default_rng(0)
    dp, steps, m = 3, 4, 2
    step, rank, mb = (a.ravel() for a in np.meshgrid(range(steps), range(dp), range(m), indexing="ij"))  # fmt: skip
    times = rng.uniform(0.5, 1.5, size=(6, len(step)))
    spread = repeat_spread(step, rank, mb, times, dp)
    lock = []
    for t in times:
        grid = t.reshape(steps, dp, m)
        ideal = grid.sum() / dp
        lock.append(ideal / sum(grid[s].max(axis=0).sum() for s in range(steps)))
    assert spread["lockstep_efficiency"]["min"] == pytest.approx(min(lock))
    assert spread["lockstep_efficiency"]["max"] == pytest.approx(max(lock))
    assert spread["repeats"] == 6


def test_fit_warning_without_calibrate_and_reliable_flag(
    run_cli, packed_dirs, monkeypatch, tmp_path: Path
) -> None:
    """R² near 0 warns even without --calibrate; the calibration file says ``reliable``, and
    pack --balance calibrated warns on a file marked unreliable (and not on a good one)."""
    from rolltool.bench import run

    rng = np.random.default_rng(0)
    monkeypatch.setattr(run, "time_rows", lambda torch, be, rows, config, **_: rng.uniform(1e-3, 2e-3, size=(1, len(rows))))  # fmt: skip
    plain = run_cli("bench", packed_dirs["flops"], *TINY)
    assert plain.exit_code == 0 and "unreliable" in plain.stderr
    bad = tmp_path / "bad.json"
    assert run_cli("bench", packed_dirs["flops"], *TINY, "--calibrate", bad).exit_code == 0
    assert json.loads(bad.read_text())["reliable"] is False
    _synthetic_device(monkeypatch, 1e-12)
    good = tmp_path / "good.json"
    assert run_cli("bench", packed_dirs["flops"], *TINY, "--calibrate", good).exit_code == 0
    assert json.loads(good.read_text())["reliable"] is True
    data = packed_dirs["flops"].parent / "synth.parquet"
    for cal, warned in ((bad, True), (good, False)):
        result = run_cli("pack", data, "--dp", "2", "--batch-size", "16", "--balance",
                         "calibrated", "--calibration", cal, "-o", tmp_path / f"p-{cal.stem}")  # fmt: skip
        assert result.exit_code == 0, result.output
        assert (f"calibration file {cal}" in result.stderr) is warned, result.stderr


def test_comparison_within_noise_warns(run_cli, packed_dirs, monkeypatch) -> None:
    """Directories timed in the same passes: when the fastest one changes from pass to pass,
    the comparison's best is within noise (a warning); when every pass agrees, no warning."""
    dirs = [packed_dirs[k] for k in ("tokens", "count")]
    _repeats_device(monkeypatch, noise=0.6)
    noisy = run_cli("bench", *dirs, *TINY)
    assert noisy.exit_code == 0, noisy.output
    assert "fastest directory changes from pass to pass" in noisy.stderr
    _repeats_device(monkeypatch, noise=0.0)
    steady = run_cli("bench", *dirs, *TINY)
    assert steady.exit_code == 0, steady.output
    assert "fastest directory changes" not in steady.stderr


def test_tables_fit_80_columns(run_cli, packed_dirs, monkeypatch) -> None:
    """Issue 13: at 80 columns the row and comparison tables cut every number (``450,2…``);
    they now shorten headers and hide columns (named in a caption) instead."""
    import re

    monkeypatch.setenv("COLUMNS", "80")
    dirs = [packed_dirs[k] for k in ("tokens", "count")]
    result = run_cli("bench", *dirs, *TINY, "--rows")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any("comparison" in line for line in lines) and any("rows" in line for line in lines)
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if re.search(r"\w…|…\w", line)]
