"""ring-flash-attn's zigzag ring attention on ``--cp 2`` views gives every sample's tokens
exactly the attention of the sample alone.

ring-flash-attn 0.1.8's own ``zigzag_ring_flash_attn_varlen_forward`` runs over a real gloo
group of 2 processes (`oracle_worker.py ring`), each on its CP rank's view (``cu_seqlens``, the
view's tokens); q, k and v are fixed random tables looked up by token id. Only flash-attn's
CUDA kernel is replaced, by a float32 torch stand-in computing exact attention per sequence
(`oracle_ports.flash_attn_stand_in`). The reference is each sample's causal attention alone,
in float64, from the group row's tokens; every real token of every sample must be compared
once over the two ranks. Rows with and without ``--row-len``, empty micro-batches included.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import oracle_ports
import pytest

import rolltool

torch = pytest.importorskip("torch")
oracle_ports.require("ring_flash_attn", "ring-flash-attn, in the oracles extra")

pytestmark = pytest.mark.slow
CP = 2
TOL = 1e-5  # float32 kernel and merge against a float64 reference (seen: 5e-7)
CASES = {"cp2": (), "cp2-row-len": ("--row-len", 64)}


@pytest.fixture(scope="module")
def ring_runs(packs: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every case's pack, and what the ring returned on each CP rank (one gloo run for all)."""
    dirs = {
        name: packs("--cp", CP, "--micro-batch-tokens", 40, *args) for name, args in CASES.items()
    }
    assert all(isinstance(d, Path) for d in dirs.values())
    out = tmp_path_factory.mktemp("ring")
    return dirs, oracle_ports.run_gloo("ring", CP, out, *map(str, dirs.values()))


def _alone(ids: np.ndarray) -> np.ndarray:
    """[L, heads, dim] causal attention of one sample alone, float64."""
    q, k, v = (torch.from_numpy(t[ids]) for t in oracle_ports.qkv_tables())
    scores = torch.einsum("qhd,khd->hqk", q, k) * oracle_ports.DIM**-0.5
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).numpy()


@pytest.mark.parametrize("case", CASES)
def test_zigzag_ring_attention_equals_each_sample_alone(case: str, ring_runs: Any) -> None:
    dirs, results = ring_runs
    path = dirs[case]
    ds = rolltool.open_packed(path)
    compared, empty, worst = 0, 0, 0.0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            views = [ds.micro_batches(step, rank, cp_rank=r) for r in range(CP)]
            for j, row in enumerate(ds.micro_batches(step, rank)):
                empty += bool(np.all(row["sample_index"] < 0))
                cu = row["cu_seqlens"]
                for s, a, b in zip(row["sample_index"], cu[:-1], cu[1:], strict=True):
                    if s < 0:
                        continue
                    ref = _alone(row["input_ids"][a:b].astype(np.int64))
                    covered = np.zeros(b - a, dtype=int)
                    for r in range(CP):
                        view, got = views[r][j], results[r][(str(path), step, rank, j)].numpy()
                        (seg,) = np.flatnonzero(view["sample_index"] == s)
                        lo, hi = view["cu_seqlens"][seg], view["cu_seqlens"][seg + 1]
                        pos = view["position_ids"][lo:hi]
                        real = pos < b - a
                        err = np.abs(got[lo:hi][real] - ref[pos[real]]).max(initial=0.0)
                        worst = max(worst, float(err))
                        covered[pos[real]] += 1
                    assert np.all(covered == 1), (step, rank, j, s)
                    compared += b - a
    assert worst <= TOL, worst
    assert compared > 300 and empty >= 1
