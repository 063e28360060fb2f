"""Read a packed directory into the rows bench replays: one per (step, rank, micro-batch).

Only ``cu_seqlens`` and ``sample_index`` are read; the token values do not matter to the timing
(the layer input, or q, k, v, are random).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.reader import open_packed
from rolltool.workload import Workload


@dataclass(frozen=True, kw_only=True)
class Row:
    """One packed row (= one micro-batch of one rank in one step)."""

    step: int
    rank: int
    micro_batch: int
    """Index of the micro-batch within the rank's step."""
    cu_seqlens: np.ndarray
    """[S+1] int32 segment boundaries, first 0, last = row length (padding segments included)."""
    sample_index: np.ndarray
    """[S] int64 input row of each segment, -1 for padding."""
    predicted: float
    """The manifest workload's cost of the row's real samples (its units: FLOPs, tokens...)."""

    @property
    def lengths(self) -> np.ndarray:
        """[S] int64 segment lengths (attention runs over padding segments too)."""
        return np.diff(self.cu_seqlens.astype(np.int64))

    @property
    def tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def max_len(self) -> int:
        return int(self.lengths.max(initial=0))


@dataclass(frozen=True, kw_only=True)
class ReplayRows:
    """All rows of the chosen steps of one packed directory, to replay (not the writer's flat
    `rolltool.layout.PackedRows`)."""

    path: Path
    dp: int
    workload: Workload
    """The cost model the directory was balanced on (the manifest's)."""
    rows: list[Row]


def load_rows(path: str | Path, steps: Sequence[int] | None = None) -> ReplayRows:
    """Rows of ``steps`` (all steps if None), in (step, rank, micro_batch) order."""
    ds = open_packed(path)
    workload = Workload.from_dict(ds.manifest.workload)
    chosen = range(ds.num_steps) if steps is None else steps
    for s in chosen:
        if not 0 <= s < ds.num_steps:
            raise RolltoolError(
                f"{path}: step {s} out of range (the run has {ds.num_steps} steps)",
                hint=f"--steps takes numbers from 0 to {ds.num_steps - 1}",
            )
    rows = []
    for s in chosen:
        for rank in range(ds.dp):
            for j, mb in enumerate(ds.micro_batches(s, rank)):
                cu = np.asarray(mb["cu_seqlens"], dtype=np.int32).copy()
                idx = np.asarray(mb["sample_index"], dtype=np.int64).copy()
                real = np.diff(cu.astype(np.int64))[idx >= 0]
                predicted = float(workload.cost(real).sum())
                rows.append(
                    Row(step=s, rank=rank, micro_batch=j, cu_seqlens=cu, sample_index=idx,
                        predicted=predicted)
                )  # fmt: skip
    if not rows:
        raise RolltoolError(f"{path}: no rows to replay in the chosen steps")
    return ReplayRows(path=Path(path), dp=ds.dp, workload=workload, rows=rows)
