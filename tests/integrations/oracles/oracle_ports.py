"""What the oracle tests share (not a test module): the CUDA-only pieces ported to CPU, the
skip for a missing oracle, and the gloo launcher.

Ported, line by line, because the real code runs only on a GPU:

- ``thd_get_partitioned_indices``: TransformerEngine's ``tex.thd_get_partitioned_indices``
  (transformer_engine/pytorch/csrc/extensions/attention.cpp, its ``NVTE_CHECK``s, and the CUDA
  kernel ``thd_partition_indices_kernel`` with its ``binary_search``,
  transformer_engine/common/fused_attn/thd_utils.cu), which Megatron-Core's
  ``get_thd_batch_on_this_cp_rank`` calls for its THD token selection;
- ``flash_attn_stand_in``: flash-attn's ``_flash_attn_varlen_forward`` as ring-flash-attn calls
  it (q, k, v of shape [tokens, heads, dim], ``cu_seqlens_q/k``, causal masks aligned to the
  bottom right as flash-attn >= 2.1; returns ``out, softmax_lse [heads, tokens], None, None``),
  computed exactly in float32 with torch. flash-attn itself cannot be installed without CUDA.

Everything else the tests call is the libraries' own code.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WORKER = Path(__file__).with_name("oracle_worker.py")
HEADS, DIM, VOCAB = 2, 8, 1024
"""Attention shapes of the ring test: q, k, v are fixed random tables looked up by token id."""


def require(module: str, why: str) -> None:
    """Skip the calling test module when ``module`` is not installed (found without importing
    it: importing verl alone takes ~10 s, and the gloo workers import it themselves)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(
            f"{module} is not installed ({why}); install the oracles: "
            "pip install -e '.[test,oracles]' && pip install --no-deps -r .ci/requirements-oracles.txt",
            allow_module_level=True,
        )


# -- TransformerEngine's THD partitioner, ported (tests/te_thd.py) -----------------------------


def thd_get_partitioned_indices(
    cu_seqlens: Any, total_tokens: int, world_size: int, rank: int
) -> Any:
    """``tex.thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, world_size, rank)``:
    [total_tokens / world_size] int32, the row positions CP rank ``rank`` holds (each sequence's
    chunks ``rank`` and ``2 * world_size - 1 - rank``); TE's host checks on the tensor here, the
    rest in `te_thd.partitioned_indices`. A failed check is a RuntimeError, as TE raises."""
    import torch
    from te_thd import partitioned_indices  # tests/: not on the gloo workers' path, nor needed

    if cu_seqlens.dtype != torch.int32:
        raise RuntimeError("TransformerEngine check failed: cu_seqlens.scalar_type() == Int")
    if cu_seqlens.dim() != 1:
        raise RuntimeError("TransformerEngine check failed: cu_seqlens.dim() == 1")
    out = partitioned_indices(cu_seqlens.tolist(), total_tokens, world_size, rank)
    return torch.tensor(out, dtype=torch.int32)


# -- flash-attn's varlen forward, a float32 torch stand-in ------------------------------------


def _flash_attn_varlen_forward(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    return_softmax: bool = False,
    block_table: Any = None,
) -> tuple[Any, Any, None, None]:
    """flash-attn 2.6+'s ``_flash_attn_varlen_forward`` for the arguments ring-flash-attn passes
    (no dropout, window, softcap or ALiBi): exact attention per sequence in float32."""
    import torch

    assert dropout_p == 0 and softcap == 0 and alibi_slopes is None and block_table is None
    assert (window_size_left, window_size_right) == (-1, -1)
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), -torch.inf, dtype=torch.float32)
    for i in range(len(cu_seqlens_q) - 1):
        a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        c, d = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qs, ks, vs = q[a:b].float(), k[c:d].float(), v[c:d].float()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        if causal:  # bottom-right aligned: query t sees keys up to t + (len_k - len_q)
            shift = (d - c) - (b - a)
            rows = torch.arange(b - a)[:, None]
            scores = scores.masked_fill(torch.arange(d - c)[None, :] > rows + shift, -torch.inf)
        seq_lse = torch.logsumexp(scores, dim=-1)  # [heads, len_q]
        probs = torch.exp(scores - seq_lse[..., None]).nan_to_num(0.0)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, vs)
        lse[:, a:b] = seq_lse
    return out.to(q.dtype), lse, None, None


def _cuda_only(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("the flash-attn stand-in has the varlen forward only")


def flash_attn_stand_in() -> None:
    """Register ``flash_attn`` and ``flash_attn.flash_attn_interface`` in ``sys.modules`` with
    the stand-in forward (the names ring-flash-attn imports; the others raise)."""
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = _flash_attn_varlen_forward  # type: ignore[attr-defined]
    for name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_backward"):
        setattr(interface, name, _cuda_only)
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface


def qkv_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[VOCAB, HEADS, DIM] float64 q, k and v per token id, the same in every process."""
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((VOCAB, HEADS, DIM)) for _ in range(3))
    return q, k, v


# -- gloo groups -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(task: str, world: int, out: Path, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``oracle_worker.py TASK`` as ``world`` processes of one gloo group on 127.0.0.1;
    returns each rank's results (what it saved with torch.save), rank order."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    head = [sys.executable, str(WORKER), task]
    tail = [str(world), str(port), str(out), *map(str, args)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = [subprocess.Popen([*head, str(rank), *tail], **pipes) for rank in range(world)]
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"{proc.args}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
