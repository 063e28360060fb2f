"""Read a packed directory into the rows bench replays: one per (step, rank, micro-batch), and
with ``--cp C`` / ``--sp S`` (or ``--hybrid-cp``) packs one per GPU of the group: (step, rank,
micro-batch, gpu), each with its `GpuShare` derived from that GPU's view
(``ds.micro_batches(..., cp_rank=i)``; a hybrid GPU's: `rolltool.bench.shares.hybrid_share`).

Only ``cu_seqlens`` and ``sample_index`` (and a view's boundaries) are read; the token values do
not matter to the timing (the layer input, or q, k, v, are random).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from rolltool.bench.shares import GpuShare, cp_share, hybrid_share, sp_share
from rolltool.errors import RolltoolError
from rolltool.format.split import GroupSplit
from rolltool.packed.reader import PackedDataset, open_packed
from rolltool.plan.workload import Workload


@dataclass(frozen=True)
class PrefixRow:
    """A ``--share-prefix`` row's attention (`rolltool.format.prefix.SHARED_FIELDS`): each
    segment's queries over its gathered keys, ``k[kv_index]`` bounded by ``cu_seqlens_k``."""

    kv_index: np.ndarray
    """[K] int64: the stored token behind each gathered key and value."""
    cu_seqlens_k: np.ndarray
    """[S+1] int32."""
    start: np.ndarray
    """[S] int64: each segment's first position (what its chain stores before it)."""
    parent: np.ndarray
    """[S] int64: the segment each continues, or -1."""
    max_seqlen_q: int
    max_seqlen_k: int
    samples: int
    """Samples whose continuation the row holds (its segments minus prefixes and padding)."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One packed row (= one micro-batch of one rank in one step)."""

    step: int
    rank: int
    micro_batch: int
    """Index of the micro-batch within the rank's step."""
    cu_seqlens: np.ndarray
    """[S+1] int32 segment boundaries, first 0, last = row length (padding segments included);
    with a split, the group's row."""
    sample_index: np.ndarray
    """[S] int64 input row of each segment, -1 for padding."""
    predicted: float
    """The manifest workload's cost of the row's real samples (its units: FLOPs, tokens...;
    with a split the workload is per GPU, so this is each GPU's predicted share)."""
    gpu: int = 0
    """The GPU within the data-parallel rank's group (CP or SP rank; 0 without a split)."""
    share: GpuShare | None = None
    """With ``--cp``/``--sp``: this GPU's work on the group row (None: the whole row, one GPU)."""
    prefix: PrefixRow | None = None
    """With ``--share-prefix``: the gathered keys each segment attends to (None: its own)."""

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

    @property
    def work_tokens(self) -> int:
        """Tokens the GPU's linear part processes: the row's, or its share's."""
        return self.tokens if self.share is None else self.share.tokens

    @property
    def work_sum_sq(self) -> float:
        """The GPU's attention work in Σ L² units (`GpuShare.sum_sq`; the row's Σ L²; a shared
        row's Σ (end² - start²): each segment's queries over its whole context)."""
        if self.prefix is not None:
            start = self.prefix.start.astype(np.float64)
            end = start + self.lengths
            return float(np.sum(end * end - start * start))
        if self.share is None:
            return float(np.sum(self.lengths.astype(np.float64) ** 2))
        return self.share.sum_sq

    @property
    def samples(self) -> int:
        """Samples the row trains (a shared row's continuations; padding not counted)."""
        if self.prefix is not None:
            return self.prefix.samples
        return int(np.sum(self.sample_index >= 0))


@dataclass(frozen=True, kw_only=True)
class ReplayRows:
    """All rows of the chosen steps of one packed directory, to replay (not the writer's flat
    `rolltool.format.layout.PackedRows`)."""

    path: Path
    dp: int
    workload: Workload
    """The cost model the directory was balanced on (the manifest's)."""
    rows: list[Row]
    split: GroupSplit = field(default_factory=GroupSplit)
    """How each rank's rows are shared by its GPUs (``--sp``/``--cp``; none: one row each)."""


def load_rows(path: str | Path, steps: Sequence[int] | None = None) -> ReplayRows:
    """Rows of ``steps`` (all steps if None), in (step, rank, micro_batch) order."""
    ds = open_packed(path)
    workload = Workload.from_record(ds.manifest.workload)
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
                row = Row(step=s, rank=rank, micro_batch=j, cu_seqlens=cu, sample_index=idx,
                          predicted=float(workload.cost(real).sum()))  # fmt: skip
                rows.append(_shared(row, mb, workload) if ds.shared else row)
    if not rows:
        raise RolltoolError(f"{path}: no rows to replay in the chosen steps")
    if ds.split.size > 1:
        rows = gpu_rows(ds, rows)
    return ReplayRows(path=Path(path), dp=ds.dp, workload=workload, rows=rows, split=ds.split)


def _shared(row: Row, mb: dict[str, np.ndarray], workload: Workload) -> Row:
    """`row` of a ``--share-prefix`` pack: its `PrefixRow` from the reader's shared view, its
    predicted cost what is computed (c per sample, a per stored token, b (end² - start²))."""
    parent = np.asarray(mb["parent"], dtype=np.int64)
    leaf = np.ones(len(parent), dtype=bool)
    leaf[parent[parent >= 0]] = False
    real = row.sample_index >= 0
    prefix = PrefixRow(
        kv_index=np.asarray(mb["kv_index"], dtype=np.int64).copy(),
        cu_seqlens_k=np.asarray(mb["cu_seqlens_k"], dtype=np.int32).copy(),
        start=np.asarray(mb["position_ids"], dtype=np.int64)[row.cu_seqlens[:-1]],
        parent=parent,
        max_seqlen_q=int(mb["max_seqlen_q"][0]),
        max_seqlen_k=int(mb["max_seqlen_k"][0]),
        samples=int(np.sum(leaf & real)),
    )
    start = prefix.start[real].astype(np.float64)
    end = start + row.lengths[real]
    predicted = (
        workload.c * prefix.samples
        + workload.a * float((end - start).sum())
        + workload.b * float((end * end - start * start).sum())
    )
    return replace(row, prefix=prefix, predicted=predicted)


def unshared_twin(packed: ReplayRows) -> ReplayRows:
    """A shared pack's rows as they would be unshared: each micro-batch's samples whole, one
    segment each (a continuation's full length: its start plus its own tokens), padding kept;
    named ``<path> (unshared)`` (what ``rolltool bench`` times beside the shared rows)."""
    rows = []
    for r in packed.rows:
        if r.prefix is None:
            rows.append(r)
            continue
        leaf = np.ones(len(r.lengths), dtype=bool)
        leaf[r.prefix.parent[r.prefix.parent >= 0]] = False
        keep = leaf | (r.sample_index < 0)
        whole = np.where(r.sample_index >= 0, r.prefix.start + r.lengths, r.lengths)[keep]
        cu = np.zeros(len(whole) + 1, dtype=np.int32)
        np.cumsum(whole, out=cu[1:])
        index = r.sample_index[keep]
        predicted = float(packed.workload.cost(whole[index >= 0]).sum())
        rows.append(replace(r, cu_seqlens=cu, sample_index=index, prefix=None,
                            predicted=predicted))  # fmt: skip
    name = packed.path.with_name(f"{packed.path.name} (unshared)")
    return replace(packed, path=name, rows=rows)


def gpu_rows(ds: PackedDataset, rows: Sequence[Row]) -> list[Row]:
    """Each group row once per GPU of its group, in (step, rank, micro-batch, gpu) order, with
    the GPU's `GpuShare` made from its view (the reader's, as a trainer reads it)."""
    split = ds.split
    out: list[Row] = []
    views: dict[tuple[int, int, int], list[dict[str, np.ndarray]]] = {}
    for r in rows:
        for gpu in range(split.size):
            key = (r.step, r.rank, gpu)
            if key not in views:
                cp = split.kind == "cp"
                views[key] = ds.micro_batches(r.step, r.rank, sp_rank=None if cp else gpu,
                                              cp_rank=gpu if cp else None)  # fmt: skip
            view = views[key][r.micro_batch]
            if split.hybrid:  # the GPU's own sub-group (`rolltool.format.hybrid`)
                share = hybrid_share(view)
            elif split.kind == "cp":
                share = cp_share(view, split.cp, gpu)
            else:
                share = sp_share(view, split.sp, gpu)
            out.append(replace(r, gpu=gpu, share=share))
    return out
