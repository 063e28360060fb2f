"""Through the packed files (issue 24): a ``--share-prefix`` pack's rows, as the reader and
its torch dataset serve them, give a tiny float64 Llama every sample's per-token log-probs
exactly as the sample run alone (1e-10), and the step loss (Σ target weight x -log p) of the
unshared pack of the same input (float32 weights summed: 1e-6 relative).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import input_samples, pack
from prefix_models import tiny_llamas
from shared_helpers import shared_rollouts

import rolltool
from rolltool.format.prefix import shared_view

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rolltool.bench.prefix_attention import row_prefix_tensors  # noqa: E402

VOCAB = 40
SMALL = ("--micro-batch-tokens", 400, "--batch-size", 6)


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same agent rollouts (a prompt, 2 rollouts x 2 branches sharing a trained trunk, one
    repeated sample per group) packed shared and unshared over 2 ranks."""
    root = tmp_path_factory.mktemp("packed-eq")
    table = shared_rollouts(groups=3, rollouts=2, branches=2, identical=1, prompt=(10, 20),
                            response=(3, 12), trajectory=(6, 10), vocab=VOCAB, seed=4)  # fmt: skip
    pq.write_table(table, root / "in.parquet")
    out = {"input": root / "in.parquet"}
    for name, extra in (("shared", ("--share-prefix", "--share-min", 4)), ("plain", ())):
        out[name] = root / name
        pack(out["input"], out[name], "--dp", 2, *SMALL, *extra)
    return out


def _leaves(row: dict) -> dict[int, np.ndarray]:
    """sample_index -> the stored rows of its chain, for every leaf of a shared row."""
    parent = np.asarray(row["parent"])
    cu = np.asarray(row["cu_seqlens"])
    has_kids = np.zeros(len(parent), dtype=bool)
    has_kids[parent[parent >= 0]] = True
    out = {}
    for j in np.flatnonzero(~has_kids & (np.asarray(row["sample_index"]) >= 0)).tolist():
        chain, seg = [], j
        while seg >= 0:
            chain.append(seg)
            seg = int(parent[seg])
        out[int(row["sample_index"][j])] = np.concatenate(
            [np.arange(cu[s], cu[s + 1]) for s in chain[::-1]]
        )
    return out


def _long(x: object) -> torch.Tensor:
    """An int64 tensor of a NumPy array or a tensor (a copy: the reader's arrays are read-only)."""
    if isinstance(x, torch.Tensor):
        return x.long()
    return torch.from_numpy(np.array(x, dtype=np.int64))


def _token_logp(model: object, row: dict, shared: bool) -> torch.Tensor:
    """[N] log-prob of each stored token's target (0 where it has none)."""
    ids, pos = (_long(row[k])[None] for k in ("input_ids", "position_ids"))
    kw = {"prefix_index": row_prefix_tensors(row)} if shared else {}
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits[0]  # type: ignore[operator]
    target = _long(row["target_ids"])
    has = target >= 0
    out = logits.log_softmax(-1).gather(1, torch.where(has, target, 0)[:, None])[:, 0]
    return torch.where(has, out, torch.zeros_like(out))


def test_log_probs_from_the_shared_pack_equal_each_sample_alone(packs: dict[str, Path]) -> None:
    shared_model, alone_model = tiny_llamas(vocab=VOCAB)
    inp = input_samples(packs["input"])
    ds = rolltool.open_packed(packs["shared"])
    compared, prefixes = 0, 0
    for rank in range(ds.dp):
        numpy_rows = [r for s in range(ds.num_steps) for r in ds.micro_batches(s, rank)]
        torch_rows = list(ds.torch_dataset(rank))
        assert len(torch_rows) == len(numpy_rows)
        for row, item in zip(numpy_rows, torch_rows, strict=True):
            for key, value in row.items():  # the torch path serves the same shared view
                np.testing.assert_array_equal(item[key].numpy(), value, err_msg=key)
            prefixes += int((row["parent"] >= 0).any())
            logp = _token_logp(shared_model, item, shared=True)
            for i, rows in _leaves(row).items():
                x = torch.as_tensor(inp["input_ids"][i], dtype=torch.int64)
                with torch.no_grad():
                    alone = alone_model(input_ids=x[None], use_cache=False).logits[0]
                ref = alone.log_softmax(-1)[:-1].gather(1, x[1:, None])[:, 0]
                torch.testing.assert_close(logp[rows[:-1]], ref, rtol=0, atol=1e-10)
                compared += 1
    trained = sum(1 for _ in pq.read_table(packs["shared"] / "samples.parquet").to_pylist()
                  if _["status"] == "trained")  # fmt: skip
    assert compared == trained and prefixes > 0


def test_the_step_loss_equals_the_unshared_pack_s(packs: dict[str, Path]) -> None:
    """Both packs run with the segment-wise attention (a plain row as one with no parents:
    each sample attends to itself only)."""
    model, _ = tiny_llamas(vocab=VOCAB)
    totals = {}
    for name in ("shared", "plain"):
        ds = rolltool.open_packed(packs[name])
        loss = 0.0
        for s in range(ds.num_steps):
            for rank in range(ds.dp):
                for row in ds.micro_batches(s, rank):
                    if name == "plain":
                        row = shared_view(row, np.full(len(row["sample_index"]), -1))
                    logp = _token_logp(model, row, shared=True)
                    w = torch.as_tensor(row["target_loss_weight"], dtype=torch.float64)
                    loss += float((w * -logp).sum())
        totals[name] = loss
    assert totals["shared"] == pytest.approx(totals["plain"], rel=1e-6)
    assert totals["plain"] > 0
