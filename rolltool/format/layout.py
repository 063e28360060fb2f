"""Packing: the physical layout of one rank's micro-batches as dense rows.

Each micro-batch becomes one row: its samples concatenated, ``position_ids`` restarting at 0 for
each sample, explicit segment boundaries, and per-token ``loss_mask``, ``advantages`` (the
sample's advantage on each of its tokens), behaviour ``logprobs`` and ``loss_weight``. With a fixed
``row_len`` the row is padded to that length; the padding is a segment of its own (sample index
-1, loss weight 0). An empty micro-batch becomes an all-padding row (``row_len`` tokens, or
without a fixed length the group split's ``row_multiple``: one token, S with ``--sp S``, 2C with
``--cp C``) so that every rank runs the same number of micro-batches.

Worked example: samples of 3 and 2 tokens in a row of length 8 give
``cu_seqlens = [0, 3, 5, 8]``, ``position_ids = [0 1 2 0 1 0 1 2]``,
``sample_index = [i, j, -1]``. With context or sequence parallelism the row is the group's
(`rolltool.format.split` derives each GPU's view): each sample padded for the CP split, the row to a
multiple of S with SP, of 2C with CP (every ``cu_seqlens_padded`` boundary a multiple of 2C, the
THD layout TransformerEngine and ring-flash-attn require).

Rows of one (step, rank) are stored flat and compact (`PackedRows`): the per-token columns that
carry information (``input_ids``, ``loss_mask``, ``logprobs``) concatenated over rows with
``row_offsets`` into them, and per segment its length, ``sample_index``, advantage and per-token
loss weight, with ``row_segments`` offsets. `unpack_row` derives ``position_ids``,
``advantages``, ``loss_weight`` (= segment weight x loss_mask) and ``cu_seqlens`` exactly from
them, so files hold 9 bytes per token instead of 21 and nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from rolltool.format import PAD_SAMPLE, ROW_ARRAYS, SEGMENT_ARRAYS, TOKEN_ARRAYS
from rolltool.format.targets import next_token_targets_of


@dataclass(frozen=True)
class SampleTokens:
    """Token columns of n samples, ragged arrays as offsets + flat values."""

    offsets: np.ndarray  # [n+1] int64, sample k's tokens are [offsets[k], offsets[k+1])
    input_ids: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] uint8, 1 = trained on
    logprobs: np.ndarray  # [N] float32, behaviour log-probabilities (0 where absent)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class PackedRows:
    """R rows, flat. Row r holds tokens [row_offsets[r], row_offsets[r+1]) and segments
    [row_segments[r], row_segments[r+1])."""

    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8
    logprobs: np.ndarray  # [T] float32
    row_offsets: np.ndarray  # [R+1] int64
    seq_lens: np.ndarray  # [S] int32, segment lengths (padding included)
    sample_index: np.ndarray  # [S] int64, -1 for padding
    seg_advantage: np.ndarray  # [S] float32, the sample's advantage (0 for padding)
    seg_weight: np.ndarray  # [S] float32, loss weight of each trainable token (0 for padding)
    row_segments: np.ndarray  # [R+1] int64

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def pack_rows(
    tokens: SampleTokens,
    rows: Sequence[np.ndarray],
    *,
    sample_index: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    row_len: int | None = None,
    pad_id: int = 0,
    sample_multiple: int = 1,
    row_multiple: int = 1,
) -> PackedRows:
    """Lay out `rows` (each an array of positions k into `tokens`) as packed rows.

    `sample_index`, `advantage` (float32) and `weight` (per trainable token, float) are indexed
    by k like `tokens`. Raises AssertionError if a row does not fit `row_len`: the plan must have
    guaranteed it. Context parallelism (`rolltool.format.split`): ``sample_multiple`` (2C) pads each
    sample with a padding segment right after it to a multiple of it, ``row_multiple``
    (`GroupSplit.row_multiple`: 2C with CP, S with sequence parallelism) pads each row without a
    ``row_len`` to a multiple of it (an empty row holds ``row_multiple`` padding tokens); a
    ``row_len`` must be a multiple of it (the plan refuses an odd ``--row-len`` with ``--cp``), so
    with CP every padding segment, row-end padding included, is a multiple of 2C (valid THD).
    """
    assert row_len is None or row_len % row_multiple == 0, (
        f"row_len {row_len} is not a multiple of {row_multiple}"
    )
    lengths = tokens.lengths()
    seg_len: list[np.ndarray] = []
    seg_src: list[np.ndarray] = []  # position k of each segment, -1 for padding
    for members in rows:
        members = np.asarray(members, dtype=np.int64)
        lens = lengths[members]
        if sample_multiple > 1:
            lens, members = _pad_samples(lens, members, sample_multiple)
        used = int(lens.sum())
        if row_len is not None:
            assert used <= row_len, f"row of {used} tokens exceeds row_len {row_len}"
            pad = row_len - used
        else:
            pad = -(-used // row_multiple) * row_multiple - used if len(members) else row_multiple
        if pad:
            lens = np.append(lens, pad)
            members = np.append(members, PAD_SAMPLE)
        seg_len.append(lens)
        seg_src.append(members)
    row_segments = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seg_len], out=row_segments[1:])
    lens = np.concatenate(seg_len) if seg_len else np.zeros(0, np.int64)
    src = np.concatenate(seg_src) if seg_src else np.zeros(0, np.int64)
    row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([int(s.sum()) for s in seg_len], out=row_offsets[1:])

    # One slice copy per segment; padding keeps the fill values.
    real_seg = src >= 0
    src_safe = np.where(real_seg, src, 0)
    total = int(row_offsets[-1])
    input_ids = np.full(total, pad_id, dtype=np.int32)
    loss_mask = np.zeros(total, dtype=np.uint8)
    logprobs = np.zeros(total, dtype=np.float32)
    # Copy runs of segments whose tokens are consecutive in `tokens` with one slice each (the
    # packer fetches a rank's tokens in row order, so a run is usually a whole row).
    pos = 0
    run_dst = run_src = run_len = 0
    prev = -2
    for k, n in zip(src.tolist(), lens.tolist(), strict=True):
        if k >= 0 and k == prev + 1:
            run_len += n
        else:
            if run_len:
                _copy(tokens, run_src, run_dst, run_len, input_ids, loss_mask, logprobs)
            run_len = 0
            if k >= 0:
                run_dst, run_src, run_len = pos, int(tokens.offsets[k]), n
        prev = k
        pos += n
    if run_len:
        _copy(tokens, run_src, run_dst, run_len, input_ids, loss_mask, logprobs)
    return PackedRows(
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        row_offsets=row_offsets,
        seq_lens=lens.astype(np.int32),
        sample_index=np.where(real_seg, sample_index[src_safe], PAD_SAMPLE).astype(np.int64),
        seg_advantage=np.where(real_seg, advantage[src_safe], 0).astype(np.float32),
        seg_weight=np.where(real_seg, weight[src_safe], 0).astype(np.float32),
        row_segments=row_segments,
    )


def _pad_samples(
    lens: np.ndarray, members: np.ndarray, multiple: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each sample followed by a padding segment up to a multiple of `multiple` (none where it
    is one already): (segment lengths, segment sources, -1 for padding)."""
    pad = -(-lens // multiple) * multiple - lens
    seg = np.stack([lens, pad], axis=1).ravel()
    src = np.stack([members, np.full_like(members, PAD_SAMPLE)], axis=1).ravel()
    keep = (src != PAD_SAMPLE) | (seg > 0)
    return seg[keep], src[keep]


def step_rows(
    tokens: SampleTokens,
    micro_batches: Sequence[Sequence[np.ndarray]],
    *,
    sample_index: np.ndarray,
    advantage: np.ndarray,
    weight: np.ndarray,
    row_len: int | None = None,
    pad_id: int = 0,
    sample_multiple: int = 1,
    row_multiple: int = 1,
) -> Iterator[PackedRows]:
    """Each rank's rows of one step: `micro_batches[r][j]` lists the samples of rank r's j-th
    micro-batch; `tokens` and the per-sample arrays hold the step's samples in row order (rank
    0's micro-batches first), so every row is one run of consecutive positions k.

    Example: ``micro_batches = [[a, b], [c]]`` with ``len(a), len(b), len(c) = 2, 1, 3`` gives
    rank 0 the rows of positions [0, 1] and [2], rank 1 the row of [3, 4, 5].
    """
    start = 0
    for mbs in micro_batches:
        spans = []
        for m in mbs:
            spans.append(np.arange(start, start + len(m)))
            start += len(m)
        yield pack_rows(
            tokens,
            spans,
            sample_index=sample_index,
            advantage=advantage,
            weight=weight,
            row_len=row_len,
            pad_id=pad_id,
            sample_multiple=sample_multiple,
            row_multiple=row_multiple,
        )


def _copy(
    tokens: SampleTokens,
    src: int,
    dst: int,
    n: int,
    ids: np.ndarray,
    mask: np.ndarray,
    logp: np.ndarray,
) -> None:
    ids[dst : dst + n] = tokens.input_ids[src : src + n]
    mask[dst : dst + n] = tokens.loss_mask[src : src + n]
    logp[dst : dst + n] = tokens.logprobs[src : src + n]


def segment_positions(lens: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """Position of every token inside its segment: [0..l0-1, 0..l1-1, ...] (int64, or `dtype`).

    >>> segment_positions(np.array([3, 2]))
    array([0, 1, 2, 0, 1])

    Rows of long segments (packed samples: hundreds to thousands of tokens each) are copies of
    one shared ``arange`` (`_counting`), one slice per segment, about 3x faster than
    ``arange - repeat(starts)``; many short segments use the latter (per-token work, no
    per-segment Python).
    """
    lens = np.asarray(lens, dtype=np.int64)
    return _positions(lens, lens.tolist() if len(lens) <= _SLICED_SEGMENTS else None, dtype)


def _positions(lens: np.ndarray, sizes: list[int] | None, dtype: type) -> np.ndarray:
    """`segment_positions` of `lens` (any integer dtype), given ``lens.tolist()`` as `sizes`
    (None: more than `_SLICED_SEGMENTS`, not listed)."""
    if sizes:  # a row's few segments: Python's sum/min/max beat NumPy calls
        if len(sizes) * _SHORT_SEGMENT <= sum(sizes) and min(sizes) >= 0:
            counting = _counting(max(sizes), dtype)
            return np.concatenate([counting[:n] for n in sizes])
    starts = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    out: np.ndarray = np.arange(int(lens.sum()), dtype=dtype)
    out -= np.repeat(starts.astype(dtype, copy=False), lens)
    return out


_SHORT_SEGMENT = 256
"""Mean segment length (tokens) below which `segment_positions` subtracts repeated starts."""
_SLICED_SEGMENTS = 4096
"""Segments above which `segment_positions` subtracts repeated starts whatever their length."""

_COUNTINGS: dict[np.dtype, np.ndarray] = {}


def _counting(n: int, dtype: type) -> np.ndarray:
    """A read-only ``arange`` of at least `n` values of `dtype`, kept and grown per dtype."""
    have = _COUNTINGS.get(np.dtype(dtype))
    if have is None or len(have) < n:
        have = np.arange(max(n, 2 * len(have) if have is not None else 4096), dtype=dtype)
        have.flags.writeable = False
        _COUNTINGS[np.dtype(dtype)] = have
    return have


def check_rows(rows: dict[str, np.ndarray]) -> str | None:
    """Why flat `PackedRows` arrays (as read from a shard) are not self-consistent, or None.

    Checks what `unpack_row` relies on: every array present and 1-D, ``row_offsets`` and
    ``row_segments`` start at 0, never decrease and end at their arrays' lengths, segments are
    non-empty and each row's segment lengths add up to its token count.
    """
    missing = [k for k in (*TOKEN_ARRAYS, *SEGMENT_ARRAYS, *ROW_ARRAYS) if k not in rows]
    if missing:
        return f"missing array(s) {', '.join(missing)}"
    if any(a.ndim != 1 for a in rows.values()):
        return "arrays are not 1-D"
    ro = rows["row_offsets"].astype(np.int64, copy=False)
    rs = rows["row_segments"].astype(np.int64, copy=False)
    n_tok, n_seg = len(rows["input_ids"]), len(rows["seq_lens"])
    if len(ro) != len(rs) or not len(ro):
        return "row_offsets and row_segments disagree on the number of rows"
    if any(len(rows[k]) != n_tok for k in TOKEN_ARRAYS) or any(
        len(rows[k]) != n_seg for k in SEGMENT_ARRAYS
    ):
        return "per-token or per-segment arrays have different lengths"
    for name, off, end in (("row_offsets", ro, n_tok), ("row_segments", rs, n_seg)):
        if not _runs_up(off, end):
            return f"{name} do not run from 0 to {end}"
    lens = rows["seq_lens"].astype(np.int64)
    if n_seg and lens.min() <= 0:
        return "a segment has no tokens"
    bounds = np.zeros(n_seg + 1, dtype=np.int64)
    np.cumsum(lens, out=bounds[1:])
    if not np.array_equal(bounds[rs], ro):
        return "segment lengths do not add up to the row lengths"
    return None


def _runs_up(offsets: np.ndarray, end: int) -> bool:
    """Whether `offsets` start at 0, never decrease and end at `end`. A shard's few rows
    (tens, usually) are compared as Python ints: a handful of NumPy calls cost more there."""
    if len(offsets) <= _FEW_ROWS:
        off = offsets.tolist()
        return off[0] == 0 and off[-1] == end and off == sorted(off)
    return bool(offsets[0] == 0 and offsets[-1] == end and not (offsets[1:] < offsets[:-1]).any())


_FEW_ROWS = 64
"""Row offsets up to this many are checked in Python by `_runs_up`, more with NumPy."""


def unpack_row(rows: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """Row r of flat `PackedRows` arrays as the reader's dict.

    Keys: the READER_FIELDS arrays of the row (``input_ids``, ``loss_mask``, ``logprobs`` are views
    of the stored arrays; ``position_ids``, ``advantages``, ``loss_weight`` are derived), the
    next-token `rolltool.format.targets.TARGET_FIELDS` (derived over the whole row, before any
    SP/CP split), ``cu_seqlens`` (int32, first 0, last = row length) and ``sample_index``
    (int64, one per segment, -1 for padding). Every derived array is fresh memory, made with
    one NumPy pass each (`segment_positions`, ``repeat``, an in-place multiply).
    """
    a, b = rows["row_offsets"][r : r + 2].tolist()
    s0, s1 = rows["row_segments"][r : r + 2].tolist()
    lens = rows["seq_lens"][s0:s1]  # np.repeat takes them as they are stored (int32)
    sizes: list[int] = lens.tolist()  # a row's few segments: one list instead of NumPy calls
    cu = np.array([0, *accumulate(sizes)], dtype=np.int32)
    loss_mask = rows["loss_mask"][a:b]
    loss_weight = np.repeat(rows["seg_weight"][s0:s1], lens)
    loss_weight *= loss_mask  # float32 x uint8, in place: seg_weight x loss_mask per token
    listed = sizes if len(sizes) <= _SLICED_SEGMENTS else None
    row = {
        "input_ids": rows["input_ids"][a:b],
        "position_ids": _positions(lens, listed, np.int32),
        "loss_mask": loss_mask,
        "advantages": np.repeat(rows["seg_advantage"][s0:s1], lens),
        "logprobs": rows["logprobs"][a:b],
        "loss_weight": loss_weight,
    }
    sample_index = rows["sample_index"][s0:s1]
    row.update(next_token_targets_of(row, cu, sample_index))
    row["cu_seqlens"], row["sample_index"] = cu, sample_index
    return row
