"""Row rules: the checks of one record batch of one file, row by row.

`row_batch` decodes a batch's light values once (lengths, trainable tokens, reward, ...); each
rule in `ROW_RULES` takes the `RowBatch` and yields `Flagged(kind, rows, text)`: the rows it
flags and a sentence for one of them. A null is reported once, by `nulls`; the rules about a
column's contents skip null rows, so a null token list is one problem, not also a length
mismatch and an empty sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolltool.schema.columns import FORMAT_COLUMNS, MAX_ID


class Flagged(NamedTuple):
    """Rows a rule flags, all of one problem kind."""

    kind: str
    rows: np.ndarray
    """[k] int64 row indices (into the batch; into the whole input for cross-row rules)."""
    text: Callable[[int], str]
    """What is wrong with row i, for people; called only for the rows that are listed."""


@dataclass(frozen=True)
class RowBatch:
    """One batch of one file as the row rules see it: columns plus their decoded light values."""

    cols: Mapping[str, pa.Array]
    """Schema name -> column; mistyped optional columns left out."""
    fmt: str
    """Token format: "input_ids" or "prompt_response"."""
    length: np.ndarray  # [n] int64: tokens per sample (0 where a token list is null)
    tokens_null: np.ndarray  # [n] bool: a token list of the sample is null
    trainable: np.ndarray  # [n] int64: targets, loss_mask ones but the first token's
    first_cleared: np.ndarray  # [n] bool: loss_mask 1 on the first token (never a target)
    reward: np.ndarray  # [n] float64, nan where null (0 in a batch without it: token columns only)

    def floats(self, col: str) -> np.ndarray | None:
        """float64 values of a numeric (or timestamp: seconds) column; nan where null."""
        if col not in self.cols:
            return None
        return _floats(self.cols[col])


def _floats(arr: pa.Array) -> np.ndarray:
    """float64 values; timestamps as seconds since the epoch (nanoseconds kept as far as
    float64 holds them: a cast to microseconds would refuse to lose them)."""
    if pa.types.is_timestamp(arr.type) and arr.type.unit == "ns":
        ns = arr.view(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        return np.where(_null(arr), np.nan, ns / 1e9)
    if pa.types.is_timestamp(arr.type):
        arr = pc.divide(pc.cast(pc.cast(arr, pa.timestamp("us")), pa.int64()), 1e6)
    return np.asarray(pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(offsets rebased to 0, flat values) of a list array, slice-safe."""
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    return offsets - offsets[0], values


def row_sums(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of `values` (bool or int) over each row [offsets[i], offsets[i+1]); 0 for empty rows.

    One pass with np.add.reduceat over the non-empty rows: their starts increase strictly and
    each one's span ends where the next non-empty row starts (empty rows hold no values).
    """
    n = len(offsets) - 1
    sums = np.zeros(n, dtype=np.int64)
    full = np.flatnonzero(offsets[1:] > offsets[:-1])
    if len(full):
        vals = values.view(np.uint8) if values.dtype == np.bool_ else values
        sums[full] = np.add.reduceat(vals, offsets[:-1][full], dtype=np.int64)
    return sums


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)
"""Set bits of each byte value."""


def bit_row_sums(offsets: np.ndarray, values: pa.Array) -> np.ndarray:
    """`row_sums` of a boolean array without nulls, counted on its bitmap without unpacking
    it (8x fewer elements; and no polars: its thread pool deadlocks a forked worker).

    Ones before bit position p = the set bits of the whole bytes before it + those of its
    partial byte; a row's ones are the difference at its bounds: the whole bytes between them
    (`_byte_sums`) plus the partial byte at its end, less the one at its start. Positions are
    ``values.offset + offsets`` (a sliced array starts mid-byte).
    """
    n = len(offsets) - 1
    if not len(values):
        return np.zeros(n, dtype=np.int64)
    bitmap = np.frombuffer(values.buffers()[1], dtype=np.uint8)
    pos = values.offset + np.asarray(offsets, dtype=np.int64)
    byte, bit = pos >> 3, pos & 7
    low = bitmap[np.minimum(byte, len(bitmap) - 1)] & ((1 << bit) - 1)  # 0 where bit == 0
    partial = _POPCOUNT[low]
    return _byte_sums(_popcount(bitmap), byte) + partial[1:] - partial[:-1]


def _popcount(bitmap: np.ndarray) -> np.ndarray:
    """[B] uint8 set bits of each byte (NumPy >= 2's ``bitwise_count``, else the table)."""
    count = getattr(np, "bitwise_count", None)
    return count(bitmap) if count is not None else _POPCOUNT[bitmap].astype(np.uint8)


def _byte_sums(counts: np.ndarray, byte: np.ndarray) -> np.ndarray:
    """[n] int64: ``counts[byte[i]:byte[i + 1]].sum()`` for each i (`byte` non-decreasing,
    at most ``len(counts)``): one ``reduceat`` over (start, end) pairs, no running sum over
    every byte (three arrays of 8 bytes a byte, where the bitmap has one)."""
    lo, hi = byte[:-1], byte[1:]
    sums = np.zeros(len(lo), dtype=np.int64)
    some = np.flatnonzero(hi > lo)
    if len(some):
        padded = np.append(counts, np.uint8(0))  # an end index may be len(counts)
        pairs = np.stack([lo[some], hi[some]], axis=1).ravel()
        sums[some] = np.add.reduceat(padded, pairs, dtype=np.int64)[::2]
    return sums


def _rows_of(offsets: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Rows (list indices) holding at least one flagged value; `bad` is [values] bool."""
    return np.unique(np.searchsorted(offsets, np.flatnonzero(bad), side="right") - 1)


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _null(arr: pa.Array) -> np.ndarray:
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _clean_mask(values: pa.Array) -> bool:
    """No null and nothing but 0/1 among a mask's flat values (one pass, no copy)."""
    if values.null_count or not len(values) or pa.types.is_boolean(values.type):
        return not values.null_count
    lo_hi = pc.min_max(values)
    return bool(lo_hi["min"].as_py() >= 0 and lo_hi["max"].as_py() <= 1)


def _trainable(mask: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(targets, first_cleared) per loss_mask list: its ones but the first token's, and whether
    the first token's is one (values other than 0/1 count as 0: `mask_values` reports them).

    The first token of a sample is never a target (`rolltool.schema` docstring): nothing
    precedes it to predict it, so its loss_mask 1 is cleared.

    >>> t, first = _trainable(pa.array([[1, 1, 0, 1], [0, 1], []]))
    >>> t.tolist(), first.tolist()
    ([2, 1, 0], [True, False, False])
    """
    offsets, values = _list_parts(mask)
    if pa.types.is_boolean(values.type) and not values.null_count:
        ones = bit_row_sums(offsets, values)
    elif _clean_mask(values):
        ones = row_sums(offsets, values.to_numpy(zero_copy_only=False))
    else:
        mvals = pc.cast(values, pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
        ones = row_sums(offsets, mvals == 1)
    first = np.zeros(len(ones), dtype=bool)
    full = np.flatnonzero(offsets[1:] > offsets[:-1])
    if len(full):
        head = pc.take(values, pa.array(offsets[:-1][full]))
        first[full] = (
            pc.equal(pc.cast(head, pa.int64()), 1).fill_null(False).to_numpy(zero_copy_only=False)
        )
    return ones - first, first


def row_batch(batch: pa.RecordBatch, fmt: str, skip: Collection[str] = ()) -> RowBatch:
    """Decode a batch's light values; columns in `skip` (mistyped) are left out.

    A batch without ``input_ids`` (a deferred scan: `rolltool.schema.pieces`) takes the
    sequence length from ``loss_mask``: equal once `mask_length` has seen both columns. A batch
    of the token columns alone (pack's check where it fetches, `rolltool.fetch.tokens`) has
    no light column to flag.
    """
    cols = {k: v for k, v in zip(batch.schema.names, batch.columns, strict=True) if k not in skip}
    if fmt == "input_ids":
        mask = cols["loss_mask"]
        ids = cols.get("input_ids", mask)
        length = _lengths(ids)
        trainable, first = _trainable(mask)
        tokens_null = _null(ids) | _null(mask)
    else:
        p, r = cols["prompt_ids"], cols["response_ids"]
        response, prompt = _lengths(r), _lengths(p)
        first = (prompt == 0) & (response > 0)  # no prompt: the response's first token
        trainable = response - first
        length = prompt + response
        tokens_null = _null(p) | _null(r)
    return RowBatch(
        cols=cols,
        fmt=fmt,
        length=length,
        tokens_null=tokens_null,
        trainable=trainable,
        first_cleared=first,
        reward=_floats(cols["reward"]) if "reward" in cols else np.zeros(batch.num_rows),
    )


def _says(text: str) -> Callable[[int], str]:
    """The same sentence for every flagged row."""
    return lambda i: text


# -- the rules -----------------------------------------------------------------------------------

NOT_NULL = ("sample_id", "group_id", "rollout_id", "env", "reward", "finished_at", "advantage")
"""Columns without nulls (besides the token format's lists; a null ``logprobs`` list is fine)."""


def nulls(b: RowBatch) -> Iterator[Flagged]:
    """``null``: a null in a column that must have a value (one problem per column and row)."""
    for col in (*NOT_NULL, *FORMAT_COLUMNS[b.fmt]):
        if col in b.cols and b.cols[col].null_count:
            rows = np.flatnonzero(_null(b.cols[col]))
            yield Flagged("null", rows, _says(f"column '{col}' is null"))


def _non_finite(b: RowBatch, col: str, kind: str) -> Iterator[Flagged]:
    """`kind` for the non-null values of numeric column `col` that are nan or infinite."""
    values = b.reward if col == "reward" else b.floats(col)
    if values is None or col not in b.cols:
        return
    rows = np.flatnonzero(~np.isfinite(values) & ~_null(b.cols[col]))
    if len(rows):
        yield Flagged(kind, rows, lambda i: f"column '{col}' is not finite ({values[i]})")


def reward_values(b: RowBatch) -> Iterator[Flagged]:
    """``reward.value``: a reward that is nan or infinite."""
    return _non_finite(b, "reward", "reward.value")


def finished_at_values(b: RowBatch) -> Iterator[Flagged]:
    """``finished_at.value``: a finish time that is nan or infinite."""
    return _non_finite(b, "finished_at", "finished_at.value")


def advantage_values(b: RowBatch) -> Iterator[Flagged]:
    """``advantage.value``: a given advantage that is nan or infinite; ``advantage.range``: a
    finite one that float32 (the packed dtype) cannot hold: it would be packed as inf."""
    yield from _non_finite(b, "advantage", "advantage.value")
    values = b.floats("advantage")
    if values is None:
        return
    rows = np.flatnonzero(np.isfinite(values) & (np.abs(values) >= FLOAT32_LIMIT))
    if len(rows):
        yield Flagged("advantage.range", rows, lambda i: _too_big("advantage", values[i]))


FLOAT32_LIMIT = float(np.finfo(np.float32).max) + 2.0**103
"""Smallest magnitude that float32 rounds to inf: its maximum, (2 - 2**-23) * 2**127, plus
half an ulp (2**103; a tie rounds to even, which is inf)."""


def _too_big(col: str, value: float) -> str:
    return (
        f"column '{col}' holds {value:.6g}, beyond float32's range (+-3.4e38): it would be "
        "packed as inf"
    )


def mask_length(b: RowBatch) -> Iterator[Flagged]:
    """``loss_mask.length``: a loss_mask list not as long as its input_ids list."""
    if b.fmt != "input_ids":
        return
    mask_len = _lengths(b.cols["loss_mask"])
    rows = np.flatnonzero((mask_len != b.length) & ~b.tokens_null)
    yield Flagged(
        "loss_mask.length",
        rows,
        lambda i: f"column 'loss_mask' has {mask_len[i]} values, 'input_ids' has {b.length[i]}",
    )


def mask_values(b: RowBatch) -> Iterator[Flagged]:
    """``loss_mask.value``: a loss_mask value other than 0/1 (or a null inside the list)."""
    if b.fmt != "input_ids":
        return
    offsets, values = _list_parts(b.cols["loss_mask"])
    if _clean_mask(values):
        return
    mvals = pc.cast(values, pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
    rows = _rows_of(offsets, (mvals != 0) & (mvals != 1))
    yield Flagged(
        "loss_mask.value", rows, lambda i: "column 'loss_mask' holds values other than 0/1"
    )


def token_ids(b: RowBatch) -> Iterator[Flagged]:
    """``token.range``: a token id that is null, negative, or above 2**31 - 1 (packed as int32)."""
    for col in FORMAT_COLUMNS[b.fmt]:
        if col == "loss_mask" or col not in b.cols:  # not read by a deferred scan
            continue
        offsets, values = _list_parts(b.cols[col])
        if values.null_count == 0:
            lo_hi = pc.min_max(values)
            if len(values) == 0 or (lo_hi["min"].as_py() >= 0 and lo_hi["max"].as_py() <= MAX_ID):
                continue  # the common case, checked in one pass
        flat = values.fill_null(0).to_numpy(zero_copy_only=False)
        null = _null(values)
        for bad, what in (
            ((flat < 0) | null, "negative or null token ids"),
            (flat > MAX_ID, "token ids above 2**31 - 1 (the int32 maximum, 2,147,483,647)"),
        ):
            rows = _rows_of(offsets, bad)
            yield Flagged("token.range", rows, _says(f"column '{col}' holds {what}"))


def logprobs_length(b: RowBatch) -> Iterator[Flagged]:
    """``logprobs.length``: a logprobs list not as long as the sequence (a null list is fine)."""
    if "logprobs" not in b.cols:
        return
    lp = b.cols["logprobs"]
    lp_len = _lengths(lp)
    rows = np.flatnonzero((lp_len != b.length) & ~_null(lp) & ~b.tokens_null)
    yield Flagged(
        "logprobs.length",
        rows,
        lambda i: (
            f"column 'logprobs' has {lp_len[i]} values, the sequence has {b.length[i]} tokens"
        ),
    )


def logprobs_values(b: RowBatch) -> Iterator[Flagged]:
    """``logprobs.value``: a null or non-finite value inside a logprobs list (the trainer's
    importance ratios would become nan); a null list means "no logprobs", packed as 0."""
    if "logprobs" not in b.cols:
        return
    offsets, values = _list_parts(b.cols["logprobs"])
    if _plain_floats(values):
        return  # the common case: neither rule flags anything
    if pa.types.is_floating(values.type):
        finite = pc.is_finite(values).fill_null(False)
    else:  # integers: only a null can be wrong
        finite = values.is_valid()
    if len(values) and not pc.all(finite).as_py():
        rows = _rows_of(offsets, ~finite.to_numpy(zero_copy_only=False))
        text = _says("column 'logprobs' holds null or non-finite values")
        yield Flagged("logprobs.value", rows, text)
    yield from _logprobs_range(offsets, values)


def _plain_floats(values: pa.Array) -> bool:
    """Floats without a null, a nan, an infinity or a value float32 cannot hold, decided
    without a copy: a float64 sum is finite only if every value is (it may overflow where they
    all are: then the exact rules run); every finite float32 is in range, float64 extremes are
    compared. NumPy's reductions, not Arrow's: ``pc.min_max`` of floats takes ~13x as long
    (0.45 s against 0.034 s for 59 M float32)."""
    if values.null_count or values.type not in (pa.float32(), pa.float64()) or not len(values):
        return False
    flat = values.to_numpy(zero_copy_only=True)
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(np.sum(flat, dtype=np.float64)):
            return False
    return flat.dtype == np.float32 or max(-flat.min(), flat.max()) < FLOAT32_LIMIT


def _logprobs_range(offsets: np.ndarray, values: pa.Array) -> Iterator[Flagged]:
    """``logprobs.range``: a finite logprob float32 (the packed dtype) cannot hold."""
    if not len(values) or values.type not in (pa.float64(), pa.float16(), pa.float32()):
        return
    lo_hi = pc.min_max(pc.if_else(pc.is_finite(values), values, 0.0))
    if max(-(lo_hi["min"].as_py() or 0.0), lo_hi["max"].as_py() or 0.0) < FLOAT32_LIMIT:
        return  # the common case, one pass
    flat = values.fill_null(0.0).to_numpy(zero_copy_only=False)
    rows = _rows_of(offsets, np.isfinite(flat) & (np.abs(flat) >= FLOAT32_LIMIT))
    worst = float(flat[np.isfinite(flat)][np.argmax(np.abs(flat[np.isfinite(flat)]))])
    yield Flagged("logprobs.range", rows, lambda i: _too_big("logprobs", worst))


def empty_sequence(b: RowBatch) -> Iterator[Flagged]:
    """``sequence.empty``: a sample without a single token."""
    rows = np.flatnonzero((b.length == 0) & ~b.tokens_null)
    yield Flagged("sequence.empty", rows, _says("the sequence is empty"))


ROW_RULES: tuple[Callable[[RowBatch], Iterator[Flagged]], ...] = (
    nulls,
    reward_values,
    mask_length,
    mask_values,
    token_ids,
    logprobs_length,
    logprobs_values,
    empty_sequence,
    finished_at_values,
    advantage_values,
)
