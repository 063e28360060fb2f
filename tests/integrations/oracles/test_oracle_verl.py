"""rolltool against verl 0.9.1's own code, over a real gloo group of 2 processes
(`oracle_worker.py verl`, one run for every test here):

- Ulysses: ``ulysses_pad_and_slice_inputs`` and ``slice_input_tensor`` of every ``--sp 2`` group
  row equal rolltool's ``sp_rank`` views (verl adds no padding: rolltool's row is already a
  multiple of sp; with ``--row-len`` the slices are verl's slices of rolltool's padded row), and
  ``gather_outputs_and_unpad`` of a per-token output computed on the views gives back the row,
  or, unpadding the row-end padding, each sample's own values; the labels verl's actor rolls
  over the whole row and slices equal the views' ``target_ids`` wherever a target exists;
- ``rearrange_micro_batches`` with ``dp_group`` the gloo group, as verl ships it and after
  ``rolltool.integrations.verl.patch()``: the same types, every sample once, the token cap held,
  the same micro-batch count on both ranks, and no heavier micro-batch than verl's;
- ``RayPPOTrainer._balance_batch`` (on rank 0, a trainer made with ``__new__``: the method only
  reads its actor worker group's dispatch info, faked as 4 workers on 2 DP ranks), patched and
  not: a permutation of the batch, equal halves, the same metrics, no heavier rank than verl's.

Nothing of verl is stubbed; verl is installed without its dependencies (see .ci/run).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import oracle_ports
import pytest
from pack_helpers import input_samples

import rolltool

torch = pytest.importorskip("torch")
oracle_ports.require("verl", "verl, in the oracles extra")

pytestmark = pytest.mark.slow
SP = 2
SEED = 5
CASES = {"sp2": (), "sp2-row-len": ("--row-len", 50)}
VERL_MODULES = {"verl.utils.seqlen_balancing"}
PER_TOKEN = ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "loss_weight")


@pytest.fixture(scope="module")
def verl_runs(packs: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    dirs = {
        name: packs("--sp", SP, "--micro-batch-tokens", 40, *args) for name, args in CASES.items()
    }
    assert all(isinstance(d, Path) for d in dirs.values())
    out = tmp_path_factory.mktemp("verl")
    return dirs, oracle_ports.run_gloo("verl", SP, out, *map(str, dirs.values()), "--", SEED)


def _workload(lengths: Any) -> float:
    return float(sum(24576 * n + n * n for n in lengths))


@pytest.mark.parametrize("case", CASES)
def test_ulysses_slices_equal_views_and_gather_gives_back_samples(
    case: str, verl_runs: Any, oracle_input: Path
) -> None:
    dirs, results = verl_runs
    path = dirs[case]
    ds = rolltool.open_packed(path)
    logprobs = input_samples(oracle_input)["logprobs"]
    rows, padded, targeted, samples_seen = 0, 0, 0, set()
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            views = [ds.micro_batches(step, rank, sp_rank=r) for r in range(SP)]
            for j, row in enumerate(ds.micro_batches(step, rank)):
                cu, samples = row["cu_seqlens"], row["sample_index"]
                real = samples >= 0
                assert np.all(real[:-1])  # an SP row's padding is its tail only
                for r in range(SP):
                    got = results[r]["ulysses"][(str(path), step, rank, j)]
                    assert got["pad"] == 0  # rolltool's row is already a multiple of sp
                    for k in PER_TOKEN:
                        assert np.array_equal(got[k].numpy(), views[r][j][k]), k
                    # the next-token targets: verl's rolled labels wherever a target exists
                    targets = views[r][j]["target_ids"]
                    has = targets != -100
                    assert np.array_equal(got["rolled"].numpy()[has], targets[has])
                    targeted += int(has.sum())
                    assert np.array_equal(got["gathered"][:, 0].numpy(), row["logprobs"])
                    values = got["unpadded"][:, 0].numpy()
                    assert len(values) == cu[real.sum()]
                    for s, a, b in zip(samples[real], cu[:-1], cu[1:], strict=False):
                        assert np.array_equal(values[a:b], np.float32(logprobs[s]))
                        samples_seen.add(int(s))
                rows += 1
                padded += not real[-1]
    assert rows >= 8 and padded >= 1 and len(samples_seen) == len(logprobs)
    assert targeted == sum(len(x) - 1 for x in logprobs)  # every token but each sample's last


def test_rearrange_micro_batches_patched_over_the_dp_group(verl_runs: Any) -> None:
    _, results = verl_runs
    per_rank = [r["rearrange"] for r in results]
    assert VERL_MODULES <= set(per_rank[0]["patched"])
    for name in ("verl", "rolltool"):
        assert all(r[name]["rolltool's"] == (name == "rolltool") for r in per_rank)
        counts = {len(r[name]["idx"]) for r in per_rank}
        assert len(counts) == 1, (name, counts)  # the MAX over the gloo group
    for r in per_rank:
        batch, cap = r["batch"], r["cap"]
        lengths = batch["attention_mask"].sum(-1).tolist()
        theirs, ours = r["verl"], r["rolltool"]
        assert len(ours["idx"]) == len(theirs["idx"]) > 1
        assert type(ours["idx"]) is type(theirs["idx"]) is list
        assert sorted(i for p in ours["idx"] for i in p) == list(range(len(lengths)))
        for p, mb, their_mb in zip(ours["idx"], ours["micro_batches"], theirs["micro_batches"], strict=True):  # fmt: skip
            assert type(mb) is type(their_mb) and all(type(i) is int for i in p)
            assert sum(lengths[i] for i in p) <= cap
            for key in ("input_ids", "attention_mask"):
                assert torch.equal(mb[key], batch[key][p])
        heaviest = [max(_workload(lengths[i] for i in p) for p in x["idx"]) for x in (ours, theirs)]
        assert heaviest[0] <= heaviest[1] * (1 + 1e-12), heaviest


def test_balance_batch_patched(verl_runs: Any) -> None:
    _, results = verl_runs
    run = results[0]["balance_batch"]
    assert VERL_MODULES | {"verl.trainer.ppo.ray_trainer"} <= set(run["patched"])
    before = run["input"].batch
    lengths = before["attention_mask"].sum(-1).tolist()
    heaviest = []
    for name in ("verl", "rolltool"):
        assert run[name]["rolltool's"] == (name == "rolltool")
        after, metrics = run[name]["batch"].batch, run[name]["metrics"]
        n = len(lengths)
        # the reorder is a permutation: every sample once (matched by its tokens)
        rows_before = sorted(map(tuple, before["input_ids"].tolist()))
        assert sorted(map(tuple, after["input_ids"].tolist())) == rows_before
        halves = after["attention_mask"].sum(-1).split(n // 2)  # what dispatch gives each rank
        heaviest.append(max(_workload(h.tolist()) for h in halves))
        assert metrics["global_seqlen/balanced_max"] == max(int(h.sum()) for h in halves)
        assert set(metrics) == set(run["verl"]["metrics"])
    assert heaviest[1] <= heaviest[0] * (1 + 1e-12), heaviest
