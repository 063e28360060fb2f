"""`rolltool stats` of a ``--share-prefix`` pack: what its rows store and compute, and what
sharing saved (issue 24).

samples.parquet gives each sample's own length; a shared row stores a prefix once, so its
tokens and cost are not the sum of its samples'. `shared_grid` reads them from the reader's rows
(their ``cu_seqlens``, ``position_ids``, ``parent`` and ``sample_index``): per micro-batch the
stored real tokens, and the cost of what is computed under the step's workload, ``c`` per
sample, ``a`` per stored token, ``b (end² - start²)`` per segment (its queries over its whole
context), as the plan priced it (`rolltool.plan.prefix_step`). `shared_figures` is a step's
sharing from its manifest record (tokens unshared and stored, per env, prefixes, attention
pairs, gathered K/V); `shared_totals` sums them over steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rolltool.format import StepRecord
from rolltool.packed.core import PackedReader
from rolltool.plan.workload import Workload


def shared_grid(
    ds: PackedReader, record: StepRecord, workload: Workload
) -> tuple[np.ndarray, np.ndarray]:
    """``[dp, m]`` stored real tokens and computed cost per micro-batch of a shared step, from
    the reader's rows (local or remote shards alike)."""
    dp, m = len(record.ranks), record.plan.micro_batches_per_rank
    tokens = np.zeros((dp, m), dtype=np.int64)
    costs = np.zeros((dp, m))
    for r in range(dp):
        for j, row in enumerate(ds.micro_batches(record.step, r)):
            lens = np.diff(row["cu_seqlens"].astype(np.int64))
            real = row["sample_index"] >= 0
            start = row["position_ids"][row["cu_seqlens"][:-1]].astype(np.float64)[real]
            end = start + lens[real]
            leaves = _leaves(row["parent"]) & real
            tokens[r, j] = int(lens[real].sum())
            costs[r, j] = float(
                workload.c * leaves.sum()
                + workload.a * (end - start).sum()
                + workload.b * (end * end - start * start).sum()
            )
    return tokens, costs


def _leaves(parent: np.ndarray) -> np.ndarray:
    """[s] bool: the segments no other continues (a sample's continuation, or padding)."""
    p = np.asarray(parent, dtype=np.int64)
    out = np.ones(len(p), dtype=bool)
    out[p[p >= 0]] = False
    return out


def shared_figures(record: StepRecord) -> dict[str, Any] | None:
    """A shared step's sharing (its plan record's ``shared``), or None for another pack's."""
    sh = record.plan.shared
    if sh is None:
        return None
    return {
        "prefixes": sh.prefixes,
        "tokens": sh.tokens,
        "stored": sh.stored,
        "saved": sh.tokens - sh.stored,
        "token_ratio": sh.tokens / sh.stored if sh.stored else 1.0,
        "attention_pairs": sh.attention_pairs,
        "attention_pairs_shared": sh.attention_pairs_shared,
        "attention_ratio": (
            sh.attention_pairs / sh.attention_pairs_shared if sh.attention_pairs_shared else 1.0
        ),
        "kv_tokens": sh.kv_tokens,
        "envs": {
            e: {"tokens": t.tokens, "stored": t.stored, "saved": t.tokens - t.stored}
            for e, t in sh.envs.items()
        },
    }


def shared_totals(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`shared_figures` summed over steps (ratios of the sums)."""
    keys = ("prefixes", "tokens", "stored", "saved", "attention_pairs", "attention_pairs_shared",
            "kv_tokens")  # fmt: skip
    out: dict[str, Any] = {k: sum(int(s[k]) for s in steps) for k in keys}
    out["token_ratio"] = out["tokens"] / out["stored"] if out["stored"] else 1.0
    pairs = out["attention_pairs_shared"]
    out["attention_ratio"] = out["attention_pairs"] / pairs if pairs else 1.0
    envs: dict[str, dict[str, int]] = {}
    for s in steps:
        for e, t in s["envs"].items():
            got = envs.setdefault(e, {"tokens": 0, "stored": 0, "saved": 0})
            for k in got:
                got[k] += t[k]
    out["envs"] = envs
    return out
