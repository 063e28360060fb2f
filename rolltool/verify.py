"""`rolltool verify`: check a packed directory's files and every layout invariant.

Checks, each reported with the step, rank and micro-batch it concerns:

- every file listed in the manifest exists with its recorded size and sha256;
- every rank has the same number of micro-batches in a step (manifest and files agree);
- no micro-batch holds more real tokens than ``micro_batch_tokens``; rows have ``row_len``
  tokens when it is set;
- ``cu_seqlens`` starts at 0, increases, and ends at the row length; ``position_ids`` restart at
  0 at every segment start and count up within it;
- loss weights are 0 on untrained tokens and padding, equal the sample's recorded per-token
  weight on its trained tokens, and sum over the step (all ranks) to the recorded denominator;
- every sample the plan trains in a step appears exactly once in that step, at its recorded rank
  and micro-batch and with its recorded length, and nothing else appears.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.reader import open_packed
from rolltool.shards import file_record

MAX_LISTED = 20


def verify(path: str | os.PathLike[str], *, hashes: bool = True) -> dict[str, Any]:
    """Check a packed directory; returns {"ok", "problems", "checked"} (never raises on data)."""
    ds = open_packed(path)
    root = Path(path)
    m = ds.manifest
    problems: list[str] = []
    checked: dict[str, int] = defaultdict(int)

    def problem(text: str) -> None:
        if len(problems) < MAX_LISTED:
            problems.append(text)
        checked["problems"] += 1

    for name, rec in m["files"].items():
        f = root / name
        if not f.is_file():
            problem(f"{name}: listed in the manifest but missing")
            continue
        if f.stat().st_size != rec["bytes"]:
            problem(f"{name}: {f.stat().st_size} bytes, the manifest says {rec['bytes']}")
        elif hashes and file_record(f)["sha256"] != rec["sha256"]:
            problem(f"{name}: sha256 differs from the manifest (file changed or corrupt)")
        checked["files"] += 1
    if checked["problems"]:
        return _result(problems, checked)

    samples = pq.read_table(root / "samples.parquet")
    s_step = samples.column("step").to_numpy()
    s_status = np.array(samples.column("status").to_pylist(), dtype=object)
    s_rank = samples.column("rank").to_numpy()
    s_mb = samples.column("micro_batch").to_numpy()
    s_len = samples.column("length").to_numpy()
    s_w = samples.column("token_loss_weight").to_numpy().astype(np.float64)
    cfg = m["config"]
    cap = cfg.get("micro_batch_tokens")
    row_len = cfg.get("row_len")

    for step in range(ds.num_steps):
        meta = ds.step_meta(step)
        counts = [r["micro_batches"] for r in meta["ranks"]]
        if len(set(counts)) != 1:
            problem(f"step {step}: ranks have different micro-batch counts {counts}")
        seen = np.zeros(len(s_step), dtype=np.int64)
        weight_sum = 0.0
        for rank in range(ds.dp):
            try:
                rows = ds.micro_batches(step, rank)
            except RolltoolError as e:  # a shard that cannot be read or is inconsistent
                problem(f"step {step} rank {rank}: {e.message}")
                continue
            if len(rows) != counts[rank]:
                problem(
                    f"step {step} rank {rank}: {len(rows)} rows in files, manifest says {counts[rank]}"
                )
            for j, row in enumerate(rows):
                where = f"step {step} rank {rank} micro-batch {j}"
                checked["rows"] += 1
                _check_row(row, where, cap, row_len, problem)
                idx = row["sample_index"]
                cu = row["cu_seqlens"]
                real = idx >= 0
                seg_len = np.diff(cu.astype(np.int64))
                for k in np.flatnonzero(real):
                    i = int(idx[k])
                    if not 0 <= i < len(s_step):
                        problem(f"{where}: sample_index {i} is not an input sample")
                        continue
                    seen[i] += 1
                    if (s_step[i], s_rank[i], s_mb[i]) != (step, rank, j):
                        problem(
                            f"{where}: sample {i} is recorded at step {s_step[i]} rank {s_rank[i]} micro-batch {s_mb[i]}"
                        )
                    if seg_len[k] != s_len[i]:
                        problem(
                            f"{where}: sample {i} has {seg_len[k]} tokens, the input has {s_len[i]}"
                        )
                    a, b = int(cu[k]), int(cu[k + 1])
                    w = row["loss_weight"][a:b].astype(np.float64)
                    mask = row["loss_mask"][a:b] != 0
                    if np.any(w[~mask] != 0) or not np.allclose(w[mask], s_w[i], rtol=1e-6, atol=0):
                        problem(
                            f"{where}: sample {i} has loss weights other than its recorded {s_w[i]:.6g}"
                        )
                    checked["segments"] += 1
                weight_sum += float(row["loss_weight"].astype(np.float64).sum())
        planned = (s_step == step) & (s_status == "trained")
        missing = np.flatnonzero(planned & (seen == 0))
        repeated = np.flatnonzero(seen > 1)
        extra = np.flatnonzero(~planned & (seen > 0))
        for label, bad in (
            ("missing", missing),
            ("repeated", repeated),
            ("not planned for this step", extra),
        ):
            if len(bad):
                problem(
                    f"step {step}: {len(bad)} sample(s) {label}, e.g. sample_index {int(bad[0])}"
                )
        expected = float(meta["denominators"]["weight_sum"])
        if not np.isclose(weight_sum, expected, rtol=1e-4, atol=1e-9):
            problem(
                f"step {step}: loss weights sum to {weight_sum:.6g}, the aggregation needs {expected:.6g}"
            )
        checked["steps"] += 1
    return _result(problems, checked)


def _check_row(
    row: dict[str, np.ndarray], where: str, cap: int | None, row_len: int | None, problem: Any
) -> None:
    cu = row["cu_seqlens"].astype(np.int64)
    n = len(row["input_ids"])
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
        problem(f"{where}: cu_seqlens {cu.tolist()[:8]}... inconsistent with a row of {n} tokens")
        return
    if len(row["sample_index"]) != len(cu) - 1:
        problem(
            f"{where}: {len(row['sample_index'])} sample_index entries for {len(cu) - 1} segments"
        )
        return
    for k in ("position_ids", "loss_mask", "advantages", "logprobs", "loss_weight"):
        if len(row[k]) != n:
            problem(f"{where}: {k} has {len(row[k])} values for {n} tokens")
            return
    starts = np.repeat(cu[:-1], np.diff(cu))
    if not np.array_equal(row["position_ids"].astype(np.int64), np.arange(n) - starts):
        problem(f"{where}: position_ids do not restart at 0 at every segment")
    pad = row["sample_index"] < 0
    seg_len = np.diff(cu)
    real_tokens = int(seg_len[~pad].sum())
    if cap is not None and real_tokens > cap:
        problem(f"{where}: {real_tokens} tokens, over the {cap}-token budget")
    if row_len is not None and n != row_len:
        problem(f"{where}: row of {n} tokens, --row-len is {row_len}")
    pad_tok = np.repeat(pad, seg_len)
    if np.any(row["loss_mask"][pad_tok] != 0) or np.any(row["loss_weight"][pad_tok] != 0):
        problem(f"{where}: padding carries loss mask or loss weight")


def _result(problems: list[str], checked: dict[str, int]) -> dict[str, Any]:
    return {"ok": not checked.get("problems"), "problems": problems, "checked": dict(checked)}
