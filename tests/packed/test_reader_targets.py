"""Next-token targets served by the reader, end to end: packs made by ``rolltool pack`` (plain,
``--row-len``, ``--sp 2``, ``--cp 2``, ``--cp 4``), every GPU's view of every row.

- Every view's ``target_*`` arrays equal a per-sample Python loop over the *input Parquet*
  (token ids, log-probs) and the whole row (weights, advantages): token (s, p)'s target is token
  (s, p+1), none at a sample's last token and on padding.
- A loss computed on each GPU from its own view's arrays only, summed over the group, equals the
  loss over each unsplit sample (every token but the first, whose weight is 0, predicted from the
  token before it), term for term: exactly, with `math.fsum`.
- The torch paths carry the targets with their dtypes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, input_samples, pack, rollouts

import rolltool
from rolltool.format.split import cp_gather
from rolltool.format.targets import IGNORE_INDEX, TARGET_FIELDS

LENGTHS = [[9, 23, 4, 17], [40, 6, 31, 12], [3, 58, 21, 8], [14, 27, 5, 44], [61, 19, 7, 33]]
LAYOUTS = {
    "plain": ("--micro-batch-tokens", 64),
    "row-len": ("--micro-batch-tokens", 64, "--row-len", 72),
    "sp2": ("--sp", 2, "--micro-batch-tokens", 32),
    "cp2": ("--cp", 2, "--micro-batch-tokens", 36),
    "cp4": ("--cp", 4, "--micro-batch-tokens", 18),
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Five groups of four rollouts (3..61 tokens, the first 2 of each not trained on), packed
    in every layout of `LAYOUTS` at --dp 2."""
    tmp = tmp_path_factory.mktemp("targets")
    rng = np.random.default_rng(3)
    groups = [G("math", rng.random(4).round(2).tolist(), lens) for lens in LENGTHS]
    path = tmp / "in.parquet"
    pq.write_table(rollouts(groups, seed=5), path)
    for name, args in LAYOUTS.items():
        pack(path, tmp / name, "--dp", 2, "--keep-last", "--batch-size", 10, *args)
    return {"dir": tmp, "input": input_samples(path)}


def gpu_views(out: Path) -> list[tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]]:
    """(whole group row, [every GPU's view of it]) for every row of the pack."""
    ds = rolltool.open_packed(out)
    kind, size = ds.split.kind, ds.split.size
    found = []
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            whole = ds.micro_batches(step, rank)
            per_gpu = [
                ds.micro_batches(step, rank, **({f"{kind}_rank": g} if kind else {}))
                for g in range(size)
            ]
            for j, row in enumerate(whole):
                found.append((row, [views[j] for views in per_gpu]))
    return found


def token_places(view: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """(sample, position in it) of every token of `view` (sample -1: padding of the row's end),
    the slow way: a token's segment from the view's boundaries (an SP view has the row's, and
    its slice starts at ``sp_offset``)."""
    cu = view["cu_seqlens"].tolist()
    offset = int(view["sp_offset"][0]) if "sp_offset" in view else 0
    places = []
    for j, p in enumerate(view["position_ids"].tolist()):
        q = next(q for q in range(len(cu) - 1) if cu[q] <= j + offset < cu[q + 1])
        places.append((int(view["sample_index"][q]), p))
    return places


def by_sample(row: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """The whole row's unshifted arrays per sample (its real tokens only)."""
    cu = row["cu_seqlens"]
    return {
        int(s): {k: row[k][cu[q] : cu[q + 1]] for k in ("loss_weight", "advantages", "logprobs")}
        for q, s in enumerate(row["sample_index"].tolist())
        if s >= 0
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_views_targets_equal_the_loop_over_the_input(packs: dict, layout: str) -> None:
    inp = packs["input"]
    checked = targets = 0
    for row, views in gpu_views(packs["dir"] / layout):
        whole = by_sample(row)
        for view in views:
            for j, (s, p) in enumerate(token_places(view)):
                n = len(inp["input_ids"][s]) if s >= 0 else 0
                got = {k: view[k][j].item() for k in TARGET_FIELDS}
                if s < 0 or p >= n - 1:  # padding or a sample's last token: no target
                    want = {k: 0 for k in TARGET_FIELDS} | {"target_ids": IGNORE_INDEX}
                else:
                    want = {
                        "target_ids": inp["input_ids"][s][p + 1],
                        "target_logprobs": np.float32(inp["logprobs"][s][p + 1]).item(),
                        "target_loss_weight": whole[s]["loss_weight"][p + 1].item(),
                        "target_advantages": whole[s]["advantages"][p + 1].item(),
                    }
                    targets += 1
                assert got == want, (layout, s, p)
                checked += 1
    real = sum(len(x) for x in inp["input_ids"])
    assert targets == real - len(inp["input_ids"])  # every token but each sample's last, once
    assert checked >= real


def test_cp_ranks_together_hold_each_samples_shift(packs: dict) -> None:
    """Gathered back over the CP ranks (`cp_gather`), each sample's ``target_ids`` are its input
    tokens shifted by one: no target lost or wrong at a chunk end."""
    inp = packs["input"]
    for layout, cp in (("cp2", 2), ("cp4", 4)):
        seen = 0
        for _row, views in gpu_views(packs["dir"] / layout):
            assert len(views) == cp
            for q, s in enumerate(views[0]["sample_index"].tolist()):
                if s < 0:
                    continue
                real = len(inp["input_ids"][s])
                parts = [
                    v["target_ids"][v["cu_seqlens"][q] : v["cu_seqlens"][q + 1]] for v in views
                ]
                assert cp_gather(parts, real).tolist() == [*inp["input_ids"][s][1:], IGNORE_INDEX]
                seen += 1
        assert seen == len(inp["input_ids"])


def fake_logprob(sample: int, position: int, target: int) -> float:
    """A stand-in for log p(target | the sample's tokens up to `position`): what a model's
    logits at that token give its target, the same on any GPU."""
    h = (sample * 0x9E3779B1 + position * 0x85EBCA77 + target * 0xC2B2AE3D) % 2**32
    return -h / 2**32 * 5


def ppo_term(weight: float, logp: float, old: float, adv: float) -> float:
    return weight * (-adv * math.exp(logp - old) - 0.1 * logp)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_from_local_arrays_equals_the_unsplit_loss(packs: dict, layout: str) -> None:
    """sum over GPUs of sum_t target_loss_weight[t] * f(logits[t], target_ids[t],
    target_logprobs[t], target_advantages[t]), each GPU's own arrays only, equals sum over every
    unsplit sample of sum_t loss_weight[t] * f(logits[t-1], input_ids[t], logprobs[t],
    advantages[t]), the same terms: fsum is exact, so the sums are equal."""
    inp = packs["input"]
    local_terms: list[float] = []
    whole_terms: list[float] = []
    for row, views in gpu_views(packs["dir"] / layout):
        for view in views:
            for j, (s, p) in enumerate(token_places(view)):
                if view["target_ids"][j] == IGNORE_INDEX:
                    assert view["target_loss_weight"][j] == 0
                    continue
                logp = fake_logprob(s, p, int(view["target_ids"][j]))
                local_terms.append(
                    ppo_term(
                        float(view["target_loss_weight"][j]),
                        logp,
                        float(view["target_logprobs"][j]),
                        float(view["target_advantages"][j]),
                    )
                )
        for s, a in by_sample(row).items():
            ids = inp["input_ids"][s]
            assert a["loss_weight"][0] == 0  # a first token has no prediction in its sample
            for t in range(1, len(ids)):
                logp = fake_logprob(s, t - 1, ids[t])
                whole_terms.append(
                    ppo_term(
                        float(a["loss_weight"][t]),
                        logp,
                        float(a["logprobs"][t]),
                        float(a["advantages"][t]),
                    )
                )
    assert sorted(local_terms) == sorted(whole_terms)
    assert math.fsum(local_terms) == math.fsum(whole_terms) != 0


def test_torch_paths_carry_the_targets(packs: dict) -> None:
    torch = pytest.importorskip("torch")
    from rolltool.packed.tensors import to_tensors

    want = {k: torch.int32 if k == "target_ids" else torch.float32 for k in TARGET_FIELDS}
    ds = rolltool.open_packed(packs["dir"] / "cp2")
    arrays = ds.micro_batches(0, 1, cp_rank=1)
    tensors = ds.micro_batches(0, 1, cp_rank=1, torch=True)
    items = [x for x in ds.torch_dataset(1, cp_rank=1) if x["step"] == 0]
    assert len(arrays) == len(tensors) == len(items) > 0
    for a, t, item in zip(arrays, tensors, items, strict=True):
        shared = to_tensors(a, shared=True)
        for key, dtype in want.items():
            for got in (t[key], item[key], shared[key]):
                assert got.dtype == dtype and got.tolist() == a[key].tolist(), key
