"""The one pass over the shards: every segment and row of the run as flat tables.

Each shard is memory-mapped, checked for self-consistency (`rolltool.format.layout.check_rows`: what
the reader relies on to derive ``cu_seqlens`` and ``position_ids``) and summarised per segment
and per row; the invariants then judge these tables, never the shards again (except the input
comparison, which needs the tokens). A (step, rank) with an unreadable or inconsistent shard is
``broken``: reported once, and left out of everything else.

Summaries per segment ``k`` (padding included): its place (step, rank, micro-batch), sample
(-1: padding), length, loss-mask count (values != 0), loss-mask values above 1, weight and
advantage; for padding also the tokens that are not ``pad_id`` and the non-zero logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE, Manifest, ShardRef
from rolltool.format.layout import check_rows, segment_positions
from rolltool.format.shards import read_shard
from rolltool.verify.shared import expand, parents_problem


@dataclass(frozen=True)
class Broken:
    """A (step, rank) whose shard `path` cannot be used, and why."""

    step: int
    rank: int
    path: str
    why: str


@dataclass(frozen=True)
class ShardPart:
    """A shard read: its (step, rank), path and its segments' range in `Segments`."""

    step: int
    rank: int
    path: str
    first: int
    end: int


@dataclass(frozen=True)
class Segments:
    """Every segment of every usable shard, in (step, rank, row) order, and every row."""

    step: np.ndarray  # [K] int64
    rank: np.ndarray  # [K] int64
    row: np.ndarray  # [K] int64, micro-batch (row of the rank in the step)
    sample: np.ndarray  # [K] int64, sample_index (-1: padding)
    length: np.ndarray  # [K] int64, tokens
    trainable: np.ndarray  # [K] int64, loss_mask values != 0
    mask_over_one: np.ndarray  # [K] int64, loss_mask values > 1
    weight: np.ndarray  # [K] float32, loss weight per trainable token
    advantage: np.ndarray  # [K] float32
    pad_ids: np.ndarray  # [K] int64, tokens != pad_id (padding segments; 0 for samples)
    pad_logprobs: np.ndarray  # [K] int64, logprobs != 0 (padding segments; 0 for samples)
    row_step: np.ndarray  # [R] int64
    row_rank: np.ndarray  # [R] int64
    row_index: np.ndarray  # [R] int64, micro-batch
    row_tokens: np.ndarray  # [R] int64, padding included
    row_real_tokens: np.ndarray  # [R] int64, tokens of segments with sample_index >= 0
    row_real_segments: np.ndarray  # [R] int64
    parts: tuple[ShardPart, ...]
    broken: tuple[Broken, ...]
    cp_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[K] int64 ``--hybrid-cp``: the first GPU of each segment's sub-group (``seg_cp_start``);
    empty in other packs."""
    row_cp_groups: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[R·C] int64 ``--hybrid-cp``: each row's C sub-group sizes, flat; empty in other packs."""

    def where(self, k: int | np.integer) -> str:
        """Segment k's place (its sample, if any, is named by the caller)."""
        return f"step {self.step[k]} rank {self.rank[k]} micro-batch {self.row[k]}"

    def row_where(self, r: int | np.integer) -> str:
        return f"step {self.row_step[r]} rank {self.row_rank[r]} micro-batch {self.row_index[r]}"

    def broken_pairs(self) -> set[tuple[int, int]]:
        return {(b.step, b.rank) for b in self.broken}


def read_segments(root: Path, manifest: Manifest, pad_id: int) -> Segments:
    """Read every shard once (see the module docstring)."""
    tables: list[dict[str, np.ndarray]] = []
    parts: list[ShardPart] = []
    broken: list[Broken] = []
    cp = manifest.config.cp if manifest.config.hybrid_cp else 0
    shared = manifest.config.share_prefix
    for s, step in enumerate(manifest.steps):
        for r, rank in enumerate(step.ranks):
            got = _read_rank(root, s, r, rank.files, pad_id, cp, shared)
            if isinstance(got, Broken):
                broken.append(got)
                continue
            for ref, table in got:
                first = parts[-1].end if parts else 0
                parts.append(ShardPart(s, r, ref.path, first, first + len(table["sample"])))
                tables.append(table)
    return _concat(tables, tuple(parts), tuple(broken))


def _read_rank(
    root: Path,
    step: int,
    rank: int,
    files: tuple[ShardRef, ...],
    pad_id: int,
    cp: int,
    shared: bool = False,
) -> list[tuple[ShardRef, dict[str, np.ndarray]]] | Broken:
    """A (step, rank)'s files summarised, or its first unusable file (`cp`: a hybrid pack's
    C, else 0; `shared`: a ``--share-prefix`` pack's, read through `rolltool.verify.shared`)."""
    got, rows = [], 0
    for ref in files:
        table = _summarise(root, step, rank, ref, pad_id, rows, cp, shared)
        if isinstance(table, str):
            return Broken(step, rank, ref.path, table)
        got.append((ref, table))
        rows += ref.rows
    return got


def _concat(
    tables: list[dict[str, np.ndarray]], parts: tuple[ShardPart, ...], broken: tuple[Broken, ...]
) -> Segments:
    arrays = {}
    for f in fields(Segments):
        if f.name in ("parts", "broken"):
            continue
        dtype = np.float32 if f.name in ("weight", "advantage") else np.int64
        pieces = [t[f.name] for t in tables if f.name in t]
        arrays[f.name] = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
    return Segments(**arrays, parts=parts, broken=broken)


def _summarise(
    root: Path,
    step: int,
    rank: int,
    ref: ShardRef,
    pad_id: int,
    first_row: int,
    cp: int,
    shared: bool = False,
) -> dict[str, np.ndarray] | str:
    """One shard's per-segment and per-row summaries, or why it cannot be used. `first_row`:
    rows of the rank's files before it (its recorded ``first_row`` is judged by `rank_files`);
    `cp`: a hybrid pack's C (its two arrays are read too), else 0; `shared`: its segments are
    its samples reassembled (`rolltool.verify.shared.expand`), its rows what they store."""
    try:
        a = read_shard(root / ref.path)
    except RolltoolError as e:
        return e.message
    why = check_rows(a)
    if why is None and len(a["row_offsets"]) - 1 != ref.rows:
        why = f"{len(a['row_offsets']) - 1} rows, the manifest says {ref.rows}"
    if why is None and cp:
        why = _hybrid_arrays_problem(a, cp)
    if why is None and shared:
        why = parents_problem(a)
    if why is not None:
        return f"{ref.path}: corrupt shard ({why})"
    stored = _row_summaries(a)
    if shared:
        a = expand(a)
    lens = a["seq_lens"].astype(np.int64)
    idx = a["sample_index"].astype(np.int64)
    n_rows = len(a["row_offsets"]) - 1
    per_row = np.diff(a["row_segments"]).astype(np.int64)
    local = np.repeat(np.arange(n_rows), per_row)
    starts = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    mask = a["loss_mask"]
    table = {
        "step": np.full(len(lens), step),
        "rank": np.full(len(lens), rank),
        "row": first_row + local,
        "sample": idx,
        "length": lens,
        "trainable": _count(mask != 0, starts),
        "mask_over_one": _count(mask > 1, starts),
        "weight": a["seg_weight"],
        "advantage": a["seg_advantage"],
        **_padding(a, idx == PAD_SAMPLE, starts, lens, pad_id),
        "row_step": np.full(n_rows, step),
        "row_rank": np.full(n_rows, rank),
        "row_index": first_row + np.arange(n_rows),
        **stored,
    }
    if cp:
        table["cp_start"] = a["seg_cp_start"]
        table["row_cp_groups"] = a["row_cp_groups"]
    return table


def _row_summaries(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per row of a shard as stored: tokens (padding included), real tokens and real segments."""
    lens = a["seq_lens"].astype(np.int64)
    n_rows = len(a["row_offsets"]) - 1
    local = np.repeat(np.arange(n_rows), np.diff(a["row_segments"]).astype(np.int64))
    real = a["sample_index"] >= 0
    return {
        "row_tokens": np.diff(a["row_offsets"].astype(np.int64)),
        "row_real_tokens": np.bincount(local, weights=lens * real, minlength=n_rows),
        "row_real_segments": np.bincount(local[real], minlength=n_rows),
    }


def _hybrid_arrays_problem(a: dict[str, np.ndarray], cp: int) -> str | None:
    """Why a hybrid shard's two arrays cannot be read with its rows (missing, not 1-D integers,
    or of the wrong length), or None; their values are judged by `rolltool.verify.hybrid`."""
    rows, segments = len(a["row_offsets"]) - 1, len(a["seq_lens"])
    for name, want in (("seg_cp_start", segments), ("row_cp_groups", rows * cp)):
        if name not in a:
            return f"missing array {name} (a --hybrid-cp pack's)"
        if a[name].ndim != 1 or a[name].dtype.kind not in "iu" or len(a[name]) != want:
            return f"{name} is not {want} integers"
    return None


def _count(flags: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per segment (non-empty, starting at `starts`), how many of its `flags` are set."""
    if not len(starts):
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(flags, starts, dtype=np.int64)


def _padding(
    a: dict[str, np.ndarray], pad: np.ndarray, starts: np.ndarray, lens: np.ndarray, pad_id: int
) -> dict[str, np.ndarray]:
    """Per segment, padding tokens that are not ``pad_id`` and non-zero padding logprobs."""
    out = {"pad_ids": np.zeros(len(lens), np.int64), "pad_logprobs": np.zeros(len(lens), np.int64)}
    k = np.flatnonzero(pad)
    if len(k):
        tok = np.repeat(starts[k], lens[k]) + segment_positions(lens[k])
        at = np.zeros(len(k), dtype=np.int64)
        np.cumsum(lens[k][:-1], out=at[1:])
        out["pad_ids"][k] = _count(a["input_ids"][tok] != pad_id, at)
        out["pad_logprobs"][k] = _count(a["logprobs"][tok] != 0, at)
    return out


def row_ids(seg: Segments) -> np.ndarray:
    """[K] int64: each segment's row (an index into the ``row_*`` arrays), by its (step, rank,
    micro-batch): both tables are in that order, and a row without segments (which no writer
    makes) shifts nothing."""
    if not len(seg.sample):
        return np.zeros(0, np.int64)
    ranks = int(max(seg.rank.max(), seg.row_rank.max())) + 1
    rows = int(max(seg.row.max(), seg.row_index.max())) + 1

    def key(step: np.ndarray, rank: np.ndarray, row: np.ndarray) -> np.ndarray:
        return (step.astype(np.int64) * ranks + rank) * rows + row

    return np.searchsorted(key(seg.row_step, seg.row_rank, seg.row_index),
                           key(seg.step, seg.rank, seg.row)).astype(np.int64)  # fmt: skip


def segment_degrees(seg: Segments, cp: int) -> np.ndarray:
    """[K] int64: the size of each segment's sub-group as its row's ``row_cp_groups`` says, in
    a hybrid pack of `cp` GPUs per group (all 1 in other packs, whose tables have no
    ``row_cp_groups``; a start outside the row's GPUs reads GPU 0's: `rolltool.verify.hybrid`
    reports it)."""
    if not len(seg.row_cp_groups) or not len(seg.sample):
        return np.ones(len(seg.sample), dtype=np.int64)
    start = np.where((seg.cp_start >= 0) & (seg.cp_start < cp), seg.cp_start, 0)
    return seg.row_cp_groups[row_ids(seg) * cp + start].astype(np.int64)
