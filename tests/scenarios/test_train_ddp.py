"""The headline guarantee with a real distributed runtime: the gradient does not depend on the
layout.

One input (synthetic math and agent rollouts: multi-turn masks, branches, one sample with no
trainable token) is packed for 1, 2 and 4 ranks with different budgets, balance methods, row
padding and alignment, once per loss aggregation. ``examples/train_ddp.py`` trains one optimizer
step on each under ``python -m torch.distributed.run`` (gloo, one process per rank, each reading
only its rank's files; the 2-rank run loads through a DataLoader worker, the 4-rank run syncs
through DistributedDataParallel). Every rank's parameters must equal a reference that runs every
sample of the step alone, outside any packing, and applies the aggregation's formula directly:
float64, |difference| <= 1e-10.

The reference reads the input Parquet with pyarrow (tokens, loss masks, behaviour log-probs) and
samples.parquet only for which samples the step trains and their advantages (themselves checked
against GRPO by hand). It shares the example's model and per-token loss, not its data path.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pack_helpers import grpo_reference, input_samples, pack

from rolltool.input.synth import SynthConfig, generate

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
LR = 1.0  # SGD: the parameters after the step are p - LR * gradient
SCALE = 384.0  # --loss-scale-factor of seq-mean-token-sum-norm
TOL = 1e-10
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LAYOUTS: dict[int, tuple[tuple[Any, ...], tuple[str, ...]]] = {  # world size: pack, train args
    1: (("--micro-batch-tokens", 2048, "--balance", "tokens"), ()),
    2: (("--micro-batch-tokens", 700, "--balance", "flops", "--align", "total"), ("--workers", "1")),
    4: (("--micro-batch-tokens", 400, "--row-len", 448, "--balance", "count"), ("--sync", "ddp")),
}  # fmt: skip


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(world: int, dirs: list[Path], out: Path, extra: tuple[str, ...]) -> Any:
    """Start ``python -m torch.distributed.run`` (= torchrun) on a free port of 127.0.0.1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(EXAMPLE), *map(str, dirs),
           "--steps", "1", "--lr", str(LR), "--dtype", "float64", "--out", str(out), *extra]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _cut(table: pa.Table) -> pa.Table:
    """Every sample cut to a random window of 24..320 tokens that starts a few prompt tokens
    before its first trainable one (its multi-turn loss mask kept), so the test stays fast and
    lengths vary; the first sample gets no trainable token (it trains, but is not in S)."""
    rng = np.random.default_rng(0)
    cols = {c: table.column(c).to_pylist() for c in ("input_ids", "loss_mask", "logprobs")}
    windows = []
    for mask in cols["loss_mask"]:
        start = max(0, mask.index(True) - int(rng.integers(4, 33)))
        windows.append(slice(start, start + int(rng.integers(24, 321))))
    cols["loss_mask"][0] = [False] * len(cols["loss_mask"][0])
    for c, values in cols.items():
        cut = [v[w] for v, w in zip(values, windows, strict=True)]
        i = table.schema.get_field_index(c)
        table = table.set_column(i, c, pa.array(cut, table.schema.field(c).type))
    return table


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Pack the input 3 x 4 ways and train one step on each; the parameters per (world, agg)."""
    tmp = tmp_path_factory.mktemp("ddp")
    table = _cut(generate(SynthConfig(groups=3, envs=("math", "agent"), max_len=2048, seed=4)))
    pq.write_table(table, tmp / "in.parquet")
    launched = {}
    for world, (pack_args, train_args) in LAYOUTS.items():
        dirs = []
        for agg in AGGS:
            d = tmp / f"dp{world}" / agg
            d.parent.mkdir(exist_ok=True)
            norm = ("--loss-scale-factor", SCALE) if agg.endswith("norm") else ()
            m = pack(tmp / "in.parquet", d, "--dp", world, "--batch-size", 1000, "--keep-last",
                     "--loss-agg", agg, *norm, *pack_args)  # fmt: skip
            assert m["num_steps"] == 1 and m["samples"]["trained"] == table.num_rows
            dirs.append(d)
        launched[world] = _torchrun(world, dirs, tmp / f"out{world}", train_args)
    try:  # the three runs overlap (process start-up, mostly)
        for proc in launched.values():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{proc.args}\n{stdout[-3000:]}\n{stderr[-6000:]}"
            assert stdout.count("step 0: loss") == len(AGGS)  # rank 0's line per directory
    finally:
        for proc in launched.values():
            if proc.poll() is None:  # a hung or abandoned run: the launcher ends its workers
                proc.terminate()
                proc.wait(timeout=60)
    params = {
        (world, agg): [
            dict(np.load(tmp / f"out{world}" / f"{agg}.rank{r}.npz")) for r in range(world)
        ]
        for world in LAYOUTS
        for agg in AGGS
    }
    return {"input": tmp / "in.parquet", "dirs": tmp, "params": params}


def _step_samples(packed: Path) -> tuple[np.ndarray, np.ndarray]:
    """sample_index and advantage of the samples step 0 trains, from samples.parquet."""
    t = pq.read_table(packed / "samples.parquet")
    t = t.filter(pc.and_(pc.equal(t["step"], 0), pc.equal(t["status"], "trained")))
    return t["sample_index"].to_numpy(), t["advantage"].to_numpy().astype(np.float64)


def _weights(agg: str, trainable: np.ndarray) -> np.ndarray:
    """Loss weight of each trainable token of each sample, from the aggregation's definition
    (T: the step's trainable tokens, S: its samples with one), rounded to the stored float32."""
    T, S = trainable.sum(), np.count_nonzero(trainable)
    t = np.maximum(trainable, 1)
    w = {
        "token-mean": np.full(len(t), 1.0 / T),
        "seq-mean-token-mean": 1.0 / (S * t),
        "seq-mean-token-sum": np.full(len(t), 1.0 / S),
        "seq-mean-token-sum-norm": np.full(len(t), 1.0 / (S * SCALE)),
    }[agg]
    return np.where(trainable > 0, w.astype(np.float32).astype(np.float64), 0.0)


@pytest.fixture(scope="module")
def reference(runs: dict[str, Any]) -> dict[str, Any]:
    """Parameters after one SGD step of the single-process, one-sample-at-a-time reference."""
    ex = _example()
    inp = input_samples(runs["input"])
    index, adv = _step_samples(runs["dirs"] / "dp1" / AGGS[0])
    for world in LAYOUTS:  # every layout trains the same samples with the same advantages
        for agg in AGGS:
            i2, a2 = _step_samples(runs["dirs"] / f"dp{world}" / agg)
            assert np.array_equal(np.sort(i2), np.sort(index))
            assert np.array_equal(a2[np.argsort(i2)], adv[np.argsort(index)])
    np.testing.assert_allclose(adv, grpo_reference(inp)[index], atol=1e-6)
    model = ex.build_model(0, torch.float64)
    start = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    grads, trainable = [], []
    for i, a in zip(index.tolist(), adv.tolist(), strict=True):
        ids = torch.tensor(inp["input_ids"][i])
        mask = torch.tensor(inp["loss_mask"][i], dtype=torch.float64)
        old = torch.tensor(inp["logprobs"][i], dtype=torch.float32).to(torch.float64)
        n = len(ids)
        logp = ex.token_logprobs(model, ids, torch.arange(n), torch.tensor([0, n]))
        model.zero_grad()
        (mask * ex.token_loss(logp, torch.full((n,), a, dtype=torch.float64), old)).sum().backward()
        grads.append({k: p.grad.numpy().copy() for k, p in model.named_parameters()})
        trainable.append(int(mask.sum()))
    after = {}
    for agg in AGGS:
        w = _weights(agg, np.array(trainable))
        after[agg] = {
            k: start[k] - LR * sum(wi * g[k] for wi, g in zip(w, grads, strict=True)) for k in start
        }
    assert 0 in trainable  # the sample without a trainable token is in the step
    return {"start": start, "after": after}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_one_step_equals_every_sample_alone(
    runs: dict[str, Any], reference: dict[str, Any], world: int, agg: str
) -> None:
    ranks = runs["params"][world, agg]
    assert len(ranks) == world
    for r, params in enumerate(ranks):
        assert _max_diff(params, reference["after"][agg]) <= TOL, f"rank {r}"
        assert _max_diff(params, ranks[0]) == 0.0  # the all-reduce left every rank the same
    # The check can fail: each parameter really moved, and the other aggregations' steps lie
    # far outside the tolerance.
    for k, p in ranks[0].items():
        assert np.abs(p - reference["start"][k]).max() > 1e3 * TOL, k
    for other in AGGS:
        if other != agg:
            assert _max_diff(ranks[0], reference["after"][other]) > 1e4 * TOL


def test_the_model_honours_cu_seqlens_and_position_ids(runs: dict[str, Any]) -> None:
    """A packed row's log-probs equal each sample run alone, and only with its boundaries: the
    same row as one sequence, or with positions shifted, gives other values."""
    import rolltool

    ex = _example()
    model = ex.build_model(0, torch.float64)
    inp = input_samples(runs["input"])
    rows = rolltool.open_packed(runs["dirs"] / "dp2" / "token-mean").micro_batches(0, 0, torch=True)
    row = max(rows, key=lambda r: len(r["sample_index"]))
    ids, pos, cu = row["input_ids"], row["position_ids"], row["cu_seqlens"]
    assert len(row["sample_index"]) >= 2  # a row that packs several samples
    with torch.no_grad():
        packed = ex.token_logprobs(model, ids, pos, cu)
        for k, i in enumerate(row["sample_index"].tolist()):
            n = int(cu[k + 1] - cu[k])
            alone = ex.token_logprobs(
                model, torch.tensor(inp["input_ids"][i]), torch.arange(n), torch.tensor([0, n])
            )
            torch.testing.assert_close(packed[cu[k] : cu[k + 1]], alone, rtol=0, atol=1e-12)
        whole = ex.token_logprobs(model, ids, pos, torch.tensor([0, len(ids)]))
        shifted = ex.token_logprobs(model, ids, pos + 7, cu)
    assert not torch.allclose(whole, packed) and not torch.allclose(shifted, packed)
