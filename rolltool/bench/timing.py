"""Time every row through a backend: staged inputs, warm-up, shuffled repeats, median.

The protocol, in order:

1. **Stage** everything on the device before any timing: one random input buffer as long as
   the longest row (layer mode: x ``[T, hidden]``; attention mode: q, k, v), and the output
   gradient for ``--backward``, seeded, in the chosen dtype; layer mode's weights, made once for
   the shape (``rolltool.bench.layer.make_weights``); each row's ``cu_seqlens`` as a device
   tensor. Row i uses the first T_i tokens of the buffers, so nothing is allocated or copied for
   inputs inside a timed region.
2. **Warm up**: ``warmup`` untimed passes over all rows (kernel loading, allocator, autotuning;
   nothing here compiles, so no timed pass follows a compilation).
3. **Repeat** ``repeats`` timed passes, each over all rows in a fresh random order (so a row's
   time does not depend on its neighbour's cache state or on clock ramps at fixed positions).
   CUDA: events around each row, one synchronize per pass; an optional L2 flush (writing a
   buffer larger than the cache) precedes each row outside its events. CPU: ``perf_counter``.
4. Each row's time is the **median** over its repeats.

A row of a ``--cp``/``--sp`` pack is one GPU's share of a group row; ``runner`` hands it to
`rolltool.bench.split_work` (the same protocol, that GPU's work).

One row's timed work is ``layers`` decoder layers chained (``--what layer``: forward, or forward +
backward of the input and all weights) or ``layers`` attention calls (``--what attention``:
forward, or forward + backward of q, k, v).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolltool.bench.backends import Backend
from rolltool.bench.config import BenchSetup, torch_dtype
from rolltool.bench.layer import LayerWeights, layer_forward, make_weights
from rolltool.bench.rows import Row
from rolltool.bench.split_work import run_share, stage_shares
from rolltool.errors import RolltoolError

L2_FLUSH_BYTES = 256 * 2**20
"""Larger than any current GPU's L2 (H100/H200: 50 MiB)."""

Progress = Callable[[Iterable[Any], int | None, str], Iterator[Any]]


@dataclass
class Staged:
    """Device-side inputs shared by all rows, and each row's boundaries."""

    q: Any
    """Attention mode: [T_max, heads, head_dim] in the bench dtype (None in layer mode)."""
    k: Any
    """Attention mode: [T_max, kv_heads, head_dim] (heads if the backend has no GQA: repeated
    beforehand)."""
    v: Any
    grad_out: Any
    """The upstream gradient for --backward (None otherwise): [T_max, heads, head_dim] in
    attention mode, [T_max, hidden] in layer mode."""
    cu: list[Any]
    """Per row: int32 ``cu_seqlens`` on the device."""
    bounds: list[list[int]]
    max_len: list[int]
    tokens: list[int]
    x: Any = None
    """Layer mode: the layer input [T_max, hidden] (None in attention mode)."""
    weights: LayerWeights | None = None
    """Layer mode: the layer's weights (None in attention mode)."""
    attends: list[Any] | None = None
    """Per row: its attention call (a backend's ``attend``, or for a ``--share-prefix`` row
    `shared_attend`'s); None: every row's is the backend's."""


def stage(torch: Any, backend: Backend, rows: Sequence[Row], setup: BenchSetup) -> Staged:
    """Put every input on the device (see step 1 of the module docstring)."""
    shape = setup.shape
    device, dtype = torch.device(setup.device), torch_dtype(torch, setup.dtype)
    t_max = max(r.tokens for r in rows)
    gen = torch.Generator(device="cpu").manual_seed(setup.seed)

    def rand(*dims: int) -> Any:
        x = torch.randn(t_max, *dims, generator=gen, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)

    boundaries: dict[str, Any] = {
        "cu": [torch.from_numpy(r.cu_seqlens).to(device=device, dtype=torch.int32) for r in rows],
        "bounds": [[int(x) for x in r.cu_seqlens] for r in rows],
        "max_len": [r.max_len for r in rows],
        "tokens": [r.tokens for r in rows],
    }
    if any(r.prefix is not None for r in rows):
        boundaries["attends"] = [
            backend.attend if r.prefix is None else shared_attend(torch, backend, r, device)
            for r in rows
        ]
    if setup.what == "layer":
        weights = make_weights(torch, shape, device=setup.device, dtype=dtype,
                               seed=setup.seed + 2, grad=setup.backward)  # fmt: skip
        grad_out = rand(shape.hidden) if setup.backward else None
        return Staged(q=None, k=None, v=None, grad_out=grad_out, x=rand(shape.hidden),
                      weights=weights, **boundaries)  # fmt: skip
    q = rand(shape.heads, shape.head_dim)
    k, v = rand(shape.kv_heads, shape.head_dim), rand(shape.kv_heads, shape.head_dim)
    if not backend.gqa and shape.kv_heads != shape.heads:
        group = shape.heads // shape.kv_heads
        k = k.repeat_interleave(group, dim=1).contiguous()
        v = v.repeat_interleave(group, dim=1).contiguous()
    grad_out = rand(shape.heads, shape.head_dim) if setup.backward else None
    return Staged(q=q, k=k, v=v, grad_out=grad_out, **boundaries)


def shared_attend(torch: Any, backend: Backend, row: Row, device: Any) -> Any:
    """A ``--share-prefix`` row's attention with a backend's call signature: each segment's
    queries over its gathered keys and values (``k[kv_index]``, bottom-right causal), through
    the backend's block attention (sdpa per segment on CPU; varlen or flash-attn on a GPU)."""
    p = row.prefix
    assert p is not None
    if backend.attend_blocks is None:
        raise RolltoolError(
            f"backend {backend.name} cannot replay --share-prefix rows (no block attention)",
            hint="use --backend sdpa or torch-varlen",
        )
    blocks = backend.attend_blocks
    kv = torch.from_numpy(p.kv_index).to(device=device)
    cu_k = torch.from_numpy(p.cu_seqlens_k).to(device=device, dtype=torch.int32)
    k_bounds = [int(x) for x in p.cu_seqlens_k]
    max_q, max_k = p.max_seqlen_q, p.max_seqlen_k

    def attend(q: Any, k: Any, v: Any, cu: Any, max_len: int, bounds: Sequence[int]) -> Any:
        return blocks(q, k.index_select(0, kv), v.index_select(0, kv), cu, cu_k, max_q, max_k,
                      bounds, k_bounds)  # fmt: skip

    return attend


def run_row(torch: Any, backend: Backend, st: Staged, i: int, setup: BenchSetup) -> None:
    """Row i's work: ``layers`` layers or attention calls, with backward when configured."""
    t = st.tokens[i]
    args = (st.cu[i], st.max_len[i], st.bounds[i])
    layers = setup.shape.layers
    attend = backend.attend if st.attends is None else st.attends[i]
    if st.weights is not None:
        w = st.weights
        x0 = st.x[:t].detach().requires_grad_(setup.backward)
        x = x0
        for _ in range(layers):
            x = layer_forward(torch, w, x, attend, *args, gqa=backend.gqa)
        if setup.backward:
            torch.autograd.grad(x, (x0, *w.params), st.grad_out[:t])
        return
    if not setup.backward:
        for _ in range(layers):
            attend(st.q[:t], st.k[:t], st.v[:t], *args)
        return
    # Leaf views of the staged buffers (no copy): autograd returns fresh gradients per call.
    q, k, v = (x[:t].detach().requires_grad_() for x in (st.q, st.k, st.v))
    for _ in range(layers):
        out = attend(q, k, v, *args)
        torch.autograd.grad(out, (q, k, v), st.grad_out[:t])


def runner(
    torch: Any, backend: Backend, rows: Sequence[Row], setup: BenchSetup
) -> Callable[[int], None]:
    """Stage every row and return ``run(i)``, row i's work: `run_row` for a whole row,
    `rolltool.bench.split_work.run_share` for one GPU's share of a split row (``--cp``/``--sp``
    packs; several directories may mix both). The layer's weights are made once."""
    plain = [i for i, r in enumerate(rows) if r.share is None]
    shared = [i for i, r in enumerate(rows) if r.share is not None]
    where = {i: j for j, i in enumerate(plain)} | {i: j for j, i in enumerate(shared)}
    st = stage(torch, backend, [rows[i] for i in plain], setup) if plain else None
    if not shared:
        assert st is not None
        return lambda i: run_row(torch, backend, st, where[i], setup)
    weights = st.weights if st is not None else None
    sh = stage_shares(torch, backend, [rows[i] for i in shared], setup, weights)

    def run(i: int) -> None:
        if rows[i].share is None:
            assert st is not None
            run_row(torch, backend, st, where[i], setup)
        else:
            run_share(torch, backend, sh, where[i], setup)

    return run


def time_rows(
    torch: Any,
    backend: Backend,
    rows: Sequence[Row],
    setup: BenchSetup,
    *,
    progress: Progress | None = None,
    label: str = "bench",
) -> np.ndarray:
    """Seconds per row: ``[repeats, n_rows]`` float64, in the rows' order (not the run order)."""
    run_one = runner(torch, backend, rows, setup)
    n = len(rows)
    cuda = setup.device.startswith("cuda")
    flush = (
        torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=setup.device)
        if setup.flush_l2
        else None
    )
    rng = np.random.default_rng(setup.seed)
    passes = [("warmup", np.arange(n))] * setup.warmup + [
        ("timed", rng.permutation(n)) for _ in range(setup.repeats)
    ]
    times = np.zeros((setup.repeats, n))
    grad_ctx = torch.enable_grad if setup.backward else torch.inference_mode

    def work() -> Iterator[tuple[int, int, bool]]:
        for p, (_, order) in enumerate(passes):
            for pos, i in enumerate(order):
                yield p, int(i), pos == n - 1

    items: Iterable[tuple[int, int, bool]] = work()
    if progress is not None:
        items = progress(items, len(passes) * n, f"{label}: {n} rows x {len(passes)} passes")
    pending: list[tuple[int, int, Any, Any]] = []
    with grad_ctx():
        for p, i, last in items:
            timed = passes[p][0] == "timed"
            r = p - setup.warmup
            if flush is not None:
                flush.zero_()
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                run_one(i)
                end.record()
                if timed:
                    pending.append((r, i, start, end))
                if last:  # end of a pass: collect its events
                    torch.cuda.synchronize()
                    for rr, ii, s, e in pending:
                        times[rr, ii] = s.elapsed_time(e) / 1e3
                    pending.clear()
            else:
                t0 = time.perf_counter()
                run_one(i)
                if timed:
                    times[r, i] = time.perf_counter() - t0
    return times
