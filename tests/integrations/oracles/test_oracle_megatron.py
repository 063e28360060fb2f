"""A ``--cp C`` view is exactly what Megatron-Core selects for CP rank r from the group's row.

Megatron-Core 0.16.1's own ``get_thd_batch_on_this_cp_rank`` runs on the stored group row
with the view's ``cu_seqlens_unpadded`` / ``cu_seqlens_padded`` as its ``cu_seqlens`` /
``cu_seqlens_padded``. The one piece ported is TransformerEngine's CUDA-only
``thd_get_partitioned_indices`` (`oracle_ports`, line by line with its checks), put where
Megatron looks for it (``megatron.core.utils.tex``; its TE version check answered yes).
Every row of every pack (cp 2 and 4, with and without ``--row-len``, empty micro-batches
included) must be valid THD for TE (each padded boundary a multiple of 2C), and TE's selection
of every per-token array must equal the view. Labels are shifted over each whole sample before
the split, as Megatron's data path does (``labels[t] = tokens[t+1]``, -100 at a sample's last
token and on padding; the loss mask shifted with them): the selection of those must equal the
view's ``target_ids`` and ``target_loss_weight``. An odd ``--row-len`` must be refused at plan
time or give valid rows as well.
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
mu = pytest.importorskip(
    "megatron.core.utils", reason="megatron-core (the oracles extra) is not installed"
)

TOKENS = ("loss_mask", "advantages", "logprobs", "loss_weight")
CASES = {  # (cp, per-GPU budget, --row-len): budgets of 80 tokens per group
    "cp2": (2, 40, None),
    "cp2-row-len": (2, 40, 64),
    "cp2-odd-row-len": (2, 40, 41),
    "cp4": (4, 20, None),
    "cp4-row-len": (4, 20, 30),
    "cp4-odd-row-len": (4, 20, 21),
}


@pytest.fixture
def megatron_thd(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Megatron's get_thd_batch_on_this_cp_rank with the ported TE partitioner."""
    from types import SimpleNamespace

    tex = SimpleNamespace(thd_get_partitioned_indices=oracle_ports.thd_get_partitioned_indices)
    monkeypatch.setattr(mu, "tex", tex)
    monkeypatch.setattr(mu, "is_te_min_version", lambda *a, **k: True)
    return mu.get_thd_batch_on_this_cp_rank


def _t(a: np.ndarray) -> Any:
    return torch.tensor(np.asarray(a))[None]


def _shifted(row: dict[str, np.ndarray], unpadded: np.ndarray, padded: np.ndarray) -> Any:
    """Megatron-style labels and loss mask of a group row: each sample's next token (and its
    weight), -100 (0) at its last token and on padding."""
    labels = np.full(len(row["input_ids"]), -100, dtype=np.int64)
    weight = np.zeros(len(row["input_ids"]), dtype=np.float32)
    for a, n in zip(padded[:-1], np.diff(unpadded), strict=True):
        if n == 0:  # row-end padding
            continue
        labels[a : a + n - 1] = row["input_ids"][a + 1 : a + n]
        weight[a : a + n - 1] = row["loss_weight"][a + 1 : a + n]
    return labels, weight


@pytest.mark.parametrize("case", CASES)
def test_views_equal_megatron_thd_selection(
    case: str, packs: Callable[..., Any], megatron_thd: Callable[..., Any]
) -> None:
    cp, budget, row_len = CASES[case]
    args = ("--cp", cp, "--micro-batch-tokens", budget)
    out = packs(*args, *(("--row-len", row_len) if row_len else ()))
    if not isinstance(out, Path):  # refused: only an odd --row-len may be, with the reason
        assert row_len is not None and row_len % 2, out.stderr
        assert out.exit_code == 1 and "--row-len" in out.stderr and f"{2 * cp}" in out.stderr
        return
    ds = rolltool.open_packed(out)
    seen = {"rows": 0, "empty": 0, "tokens": 0}
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            groups = ds.micro_batches(step, rank)
            views = [ds.micro_batches(step, rank, cp_rank=r) for r in range(cp)]
            for j, row in enumerate(groups):
                padded = views[0][j]["cu_seqlens_padded"]
                unpadded = views[0][j]["cu_seqlens_unpadded"]
                starts = np.repeat(padded[:-1], np.diff(padded))
                for r in range(cp):
                    view = views[r][j]
                    assert np.array_equal(view["cu_seqlens_padded"], padded)
                    assert np.array_equal(view["cu_seqlens_unpadded"], unpadded)
                    batch = {"tokens": _t(row["input_ids"]).long(),
                             "position_ids": _t(np.arange(len(starts)) - starts)}  # fmt: skip
                    batch |= {k: _t(row[k]) for k in TOKENS}
                    labels, label_weight = _shifted(row, unpadded, padded)
                    batch |= {"labels": _t(labels), "label_weight": _t(label_weight)}
                    got, params = megatron_thd(
                        batch, torch.tensor(unpadded), torch.tensor(padded),
                        torch.tensor([int(np.diff(padded).max())]), cp_size=cp, cp_rank=r,
                    )  # fmt: skip
                    assert np.array_equal(got["tokens"][0].numpy(), view["input_ids"])
                    for k in TOKENS:
                        assert np.array_equal(got[k][0].numpy(), view[k]), k
                    assert np.array_equal(got["labels"][0].numpy(), view["target_ids"])
                    assert np.array_equal(
                        got["label_weight"][0].numpy(), view["target_loss_weight"]
                    )
                    # positions: the sample's own (its padding continues them); row-end
                    # padding is its own segment in either, split differently (padding only)
                    owned = np.repeat(view["sample_index"] >= 0, np.diff(view["cu_seqlens"]))
                    pos = got["position_ids"][0].numpy()
                    assert np.array_equal(pos[owned], view["position_ids"][owned])
                    assert params.qkv_format == "thd"
                    assert params.cu_seqlens_q.tolist() == unpadded.tolist()
                    assert params.cu_seqlens_q_padded.tolist() == padded.tolist()
                    seen["tokens"] += int(owned.sum())
                seen["rows"] += 1
                seen["empty"] += bool(np.all(row["sample_index"] < 0))
    assert seen["rows"] >= 8 and seen["empty"] >= 1 and seen["tokens"] > 300, seen


def test_the_port_refuses_what_te_refuses() -> None:
    """The port's checks are TE's: a boundary off a multiple of 2C, or a total, is refused."""
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert oracle_ports.thd_get_partitioned_indices(cu, 8, 2, 0).tolist() == [0, 3, 4, 7]
    assert oracle_ports.thd_get_partitioned_indices(cu, 8, 2, 1).tolist() == [1, 2, 5, 6]
    with pytest.raises(RuntimeError, match="seqlen % "):
        oracle_ports.thd_get_partitioned_indices(torch.tensor([0, 2], dtype=torch.int32), 4, 2, 0)
    with pytest.raises(RuntimeError, match="total_tokens"):
        oracle_ports.thd_get_partitioned_indices(torch.tensor([0, 2], dtype=torch.int32), 2, 2, 0)
