"""Fetch the token columns of chosen samples from the input Parquet files.

Planning works on light columns only; the packer then asks for the tokens of one step at a time
(`TokenReader.fetch(sample_indices)`). Row groups are decoded into flat NumPy arrays and kept in
a byte-bounded cache, so memory stays bounded by a step plus the cache, not by the dataset. A
scan that read the token columns may `offer` its row groups while the cache has room, so a
dataset that fits in the cache is read from disk once. Pack's scan is deferred
(`rolltool.schema.scan_deferred`: light columns and ``loss_mask`` only): the reader decodes each
row group's token columns once, where they are fetched, and runs the row rules the scan left
(`rolltool.schema.pieces.RowCheck`, the reader's ``check``) on every row group it reads before
any of its tokens are used.

An input that changes during a run is an error naming the file, never silently mixed data: each
file's size, modification time and inode are recorded when the reader is made (before the
scan) and checked before every read from disk, and every row group's sample lengths as the
scan saw them (`offer`, `expect_lengths`) are checked against the tokens later decoded.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rolltool.errors import RolltoolError
from rolltool.fetch.readplan import DECODED_BYTES_PER_TOKEN
from rolltool.format.layout import SampleTokens, segment_positions
from rolltool.input.parquet import (
    InputFile,
    file_schema,
    read_row_group,
    row_group_bytes,
    row_group_rows,
)
from rolltool.schema import FORMAT_COLUMNS, token_format


def _flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat values) of a list array (slice-safe, nulls as empty). The values are a
    read-only view of the Arrow buffer where NumPy can share it (numbers; booleans are
    unpacked), and a column of one chunk is not concatenated (that copies)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    if arr.null_count:
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    else:  # no Python scalar (pa.scalar's first call imports pandas: ~0.4 s a process)
        lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False))
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return lengths.astype(np.int64, copy=False), values


@dataclass(frozen=True)
class _Block:
    """One row group's token columns, flat NumPy (what the cache holds)."""

    offsets: np.ndarray  # [rows+1] int64
    input_ids: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] uint8
    logprobs: np.ndarray  # [N] float32

    @property
    def nbytes(self) -> int:
        return (
            self.offsets.nbytes
            + self.input_ids.nbytes
            + self.loss_mask.nbytes
            + self.logprobs.nbytes
        )


def _token_columns(file: InputFile, rename: Mapping[str, str]) -> list[str]:
    """The columns a file's tokens are read from (its token format's, plus logprobs)."""
    names = set(file_schema(file, rename).names)
    fmt = token_format(names)
    if fmt is None or not set(FORMAT_COLUMNS[fmt]) <= names:
        raise RolltoolError(
            f"{file.path}: has no token columns ('input_ids' and 'loss_mask', or "
            "'prompt_ids' and 'response_ids')"
        )
    return [*FORMAT_COLUMNS[fmt], *["logprobs"] * ("logprobs" in names)]


@dataclass(frozen=True)
class ReaderState:
    """A `TokenReader`'s input and its change checks, to hand to a worker process."""

    files: Sequence[InputFile]
    rename: Mapping[str, str]
    stats: Sequence[tuple[int, ...]]
    lengths: Mapping[int, np.ndarray]
    check: RowGroupCheck | None = None


RowGroupCheck = Callable[[int, pa.Table], None]
"""``check(file_index, table)``: the row rules on a row group's token columns as read from
disk, raising where a row breaks one (`rolltool.schema.pieces.RowCheck`)."""


class TokenReader:
    """Random access to the token columns of the ordered input, by sample_index.

    The cache holds row groups (as Arrow tables offered by the scan, or decoded `_Block`s) in
    least-recently-used order; `cached_bytes`, their real size, never exceeds `cache_bytes`:
    decoding a kept table (bit-packed bool masks become bytes, missing logprobs zeros) re-counts
    it and evicts. Apart from the cache, the last decoded row group is kept (also with
    ``cache_bytes=0``), so consecutive steps that share a row group decode it once: memory is the
    cache plus one decoded row group. No file is held open between reads. `check` runs on every
    row group read from disk before its tokens are used (see the module docstring); `checked`
    lists the row groups it ran on.
    """

    def __init__(
        self,
        files: Sequence[InputFile],
        rename: Mapping[str, str],
        *,
        cache_bytes: int = 1 << 30,
        check: RowGroupCheck | None = None,
    ) -> None:
        self.files = list(files)
        self.rename = dict(rename)
        self.cache_bytes = cache_bytes
        self.check = check
        self.checked: set[int] = set()  # blocks `check` passed on
        self._cache: OrderedDict[int, _Block | pa.Table] = OrderedDict()
        self._cached = 0
        self._columns = [_token_columns(f, self.rename) for f in self.files]
        # Block b = (file, row group), numbered over the ordered input.
        self._where: list[tuple[int, int]] = []
        sizes: list[int] = []
        for fi, f in enumerate(self.files):
            for rg, rows in enumerate(row_group_rows(f)):
                self._where.append((fi, rg))
                sizes.append(rows)
        self._block_of = {w: b for b, w in enumerate(self._where)}
        # Global row number where each block starts.
        self._starts = np.cumsum([0, *sizes], dtype=np.int64)[:-1]
        self.num_rows = int(sum(sizes))
        self._stats = [_identity(f.path) for f in self.files]
        self._lengths: dict[int, np.ndarray] = {}  # block -> sample lengths the scan saw
        self._last: tuple[int, _Block] | None = None  # the last decoded block, outside the cache

    def handoff(self) -> ReaderState:
        """What another process needs to read the same input with the same checks: the file
        identities recorded at the start of the run and the sample lengths the scan saw."""
        return ReaderState(
            self.files, self.rename, list(self._stats), dict(self._lengths), self.check
        )

    @classmethod
    def resume(cls, state: ReaderState, *, cache_bytes: int) -> TokenReader:
        """A reader in another process that checks the input against `state` (`handoff`), as
        the reader that made it does: a file changed since the run started is refused."""
        reader = cls(state.files, state.rename, cache_bytes=cache_bytes, check=state.check)
        reader._stats = list(state.stats)
        reader._lengths = dict(state.lengths)
        return reader

    def expect_lengths(self, length: np.ndarray) -> None:
        """Record the scan's tokens per sample (`length`, [n] over the ordered input) as every
        row group's expected lengths, as `offer` does for the row groups it is given (int32:
        4 bytes a sample kept for the run)."""
        bounds = np.append(self._starts, self.num_rows)
        for b in range(len(self._starts)):
            self._lengths.setdefault(b, length[bounds[b] : bounds[b + 1]].astype(np.int32))

    def block_of(self, sample_index: np.ndarray) -> np.ndarray:
        """[k] int64: the row group (block) that holds each sample."""
        return np.searchsorted(self._starts, sample_index, side="right") - 1

    def check_blocks(self, blocks: Iterable[int]) -> None:
        """Read row groups `blocks` and run `check` on them (no tokens kept): for those no
        fetch reads, so that every row of the input is checked."""
        if self.check is None:
            return
        for b in blocks:
            if b not in self.checked:
                fi, rg = self._where[b]
                self._check_unchanged(fi)
                self._check_table(b, read_row_group(self.files[fi], self.rename,
                                                    self._columns[fi], rg))  # fmt: skip

    def _check_table(self, b: int, table: pa.Table) -> None:
        if self.check is not None and b not in self.checked:
            self.check(self._where[b][0], table)
            self.checked.add(b)

    def preload(self, stop: threading.Event | None = None) -> None:
        """Decode row groups in input order into the cache while it has room for the next one
        (by its expected lengths), until `stop` is set: what the steps of a plan in input order
        fetch first, decoded and checked on a thread while the driver plans (`preloaded`)."""
        for b, want in sorted(self._lengths.items()):
            if stop is not None and stop.is_set():
                return
            held = self._cache.get(b)
            if isinstance(held, _Block):
                continue
            size = DECODED_BYTES_PER_TOKEN * int(want.sum()) + 8 * len(want)
            if held is None and self._cached + size > self.cache_bytes:
                return
            self._block(b)  # an offered table is converted, a row group read and checked

    def clear(self) -> None:
        """Forget every decoded row group (the cache and the last one): where other processes
        pack the steps, what this one preloaded is of no use."""
        self._cache.clear()
        self._cached = 0
        self._last = None

    @property
    def block_starts(self) -> np.ndarray:
        """[B] int64: the first sample (over the ordered input) of each row group."""
        return self._starts

    def block_bytes(self) -> np.ndarray:
        """[B] int64: compressed bytes of each row group's token columns (from the footers)."""
        sizes = [
            row_group_bytes(f, self.rename, cols)
            for f, cols in zip(self.files, self._columns, strict=True)
        ]
        return np.array([b for per_file in sizes for b in per_file], dtype=np.int64)

    @property
    def cached_bytes(self) -> int:
        """Bytes the cache holds now (at most `cache_bytes`)."""
        return self._cached

    def offer(self, file_index: int, row_group: int, table: pa.Table) -> None:
        """Keep a row group another reader already decoded, while the cache has room."""
        b = self._block_of[(file_index, row_group)]
        if not set(self._columns[file_index]) <= set(table.column_names):
            return  # a malformed file: the scan reports it
        self._lengths.setdefault(b, _lengths(table))
        if b in self._cache:
            return
        # Kept as Arrow and converted on first use, on the fetching thread, off the scan's path.
        kept = table.select(self._columns[file_index])
        if self._cached + kept.nbytes <= self.cache_bytes:
            self._put(b, kept)

    def _put(self, b: int, block: _Block | pa.Table) -> None:
        """Keep `block` as the most recently used and evict until the cache fits: first the
        blocks already used (decoded), least recent first, then row groups the scan offered but
        nobody used yet (the next steps' data when steps follow the input), `block` itself last
        when it alone is larger than the cache."""
        old = self._cache.pop(b, None)
        if old is not None:
            self._cached -= old.nbytes
        self._cache[b] = block
        self._cached += block.nbytes
        if self._cached <= self.cache_bytes:
            return
        used = [k for k, v in self._cache.items() if isinstance(v, _Block) and k != b]
        unused = [k for k, v in self._cache.items() if not isinstance(v, _Block) and k != b]
        for k in [*used, *unused, b]:
            if self._cached <= self.cache_bytes:
                break
            self._cached -= self._cache.pop(k).nbytes

    def _block(self, b: int) -> _Block:
        if self._last is not None and self._last[0] == b:
            return self._last[1]
        cached = self._cache.get(b)
        if isinstance(cached, _Block):
            self._cache.move_to_end(b)
            return cached
        if cached is None:
            fi, rg = self._where[b]
            self._check_unchanged(fi)
            cached = read_row_group(self.files[fi], self.rename, self._columns[fi], rg)
            self._check_table(b, cached)
        block = _to_block(cached)
        self._check_lengths(b, block)
        self._put(b, block)
        self._last = (b, block)
        return block

    def _check_unchanged(self, fi: int) -> None:
        path = self.files[fi].path
        if _identity(path) != self._stats[fi]:
            raise RolltoolError(
                f"{path}: changed while rolltool was reading it (size, modification time or "
                "inode differ from the start of the run)",
                hint="wait until the file is completely written, then run again",
            )

    def _check_lengths(self, b: int, block: _Block) -> None:
        want = self._lengths.get(b)
        if want is None or np.array_equal(np.diff(block.offsets), want):
            return
        fi, rg = self._where[b]
        raise RolltoolError(
            f"{self.files[fi].path}: row group {rg} changed since the scan (sample lengths "
            "differ from the ones the scan checked)",
            hint="wait until the file is completely written, then run again",
        )

    def fetch(self, sample_index: np.ndarray) -> SampleTokens:
        """Tokens of the given samples, in the given order."""
        idx = np.asarray(sample_index, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError("sample_index out of range")
        block_of = self.block_of(idx)
        local = idx - self._starts[block_of] if len(idx) else idx
        lengths = np.zeros(len(idx), dtype=np.int64)
        blocks = {int(b): self._block(int(b)) for b in np.unique(block_of)}
        for b, blk in blocks.items():
            sel = block_of == b
            lengths[sel] = np.diff(blk.offsets)[local[sel]]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        ids = np.empty(total, dtype=np.int32)
        mask = np.empty(total, dtype=np.uint8)
        logp = np.empty(total, dtype=np.float32)
        # One slice copy per sample: far cheaper than index arithmetic over every token.
        for j, (b, row) in enumerate(zip(block_of.tolist(), local.tolist(), strict=True)):
            blk = blocks[b]
            src, dst, n = int(blk.offsets[row]), int(offsets[j]), int(lengths[j])
            ids[dst : dst + n] = blk.input_ids[src : src + n]
            mask[dst : dst + n] = blk.loss_mask[src : src + n]
            logp[dst : dst + n] = blk.logprobs[src : src + n]
        return SampleTokens(offsets=offsets, input_ids=ids, loss_mask=mask, logprobs=logp)


@contextlib.contextmanager
def preloaded(reader: TokenReader, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """`reader.preload` on a thread for the block (nothing where not `enabled`); yields
    ``ready()``, which stops it after the row group it is decoding, waits for that, and raises
    what it raised (a row that breaks a rule, an input that changed): the plan is done, and the
    row groups not preloaded yet are decoded when the steps fetch them, on the fetch thread,
    while earlier steps are laid out and written (waiting for the whole preload left the
    driver idle: 1.14x slower, `benchmarks/pack.py`). Call ``ready()`` before the reader is
    used again: the reader is not shared between threads. Leaving the block stops the thread
    and waits for it."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            reader.preload(stop)
        except BaseException as e:  # raised by ready(), on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=run, name="rolltool-preload", daemon=True)
    if enabled:
        thread.start()

    def ready() -> None:
        stop.set()  # the rest is decoded when fetched, overlapping the packing of earlier steps
        if enabled:
            thread.join()
        if failed:
            raise failed[0]

    try:
        yield ready
    finally:
        stop.set()
        if enabled:
            thread.join()


def _identity(path: str) -> tuple[int, ...]:
    """What tells a file's versions apart cheaply: size, mtime (ns), inode, device."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _lengths(table: pa.Table) -> np.ndarray:
    """Tokens per sample of a row group holding either token format (int32: 4 bytes a sample
    kept for the whole run)."""
    names = ["input_ids"] if "input_ids" in table.column_names else ["prompt_ids", "response_ids"]
    total = np.zeros(table.num_rows, dtype=np.int64)
    for name in names:
        lengths = pc.list_value_length(table.column(name)).fill_null(0)
        total += lengths.to_numpy(zero_copy_only=False).astype(np.int64)
    return total.astype(np.int32)


def _to_block(table: pa.Table) -> _Block:
    """Flat NumPy token columns of a row group (either token format; logprobs optional)."""
    if "input_ids" in table.column_names:
        lengths, ids = _flat(table.column("input_ids"))
        _, mask = _flat(table.column("loss_mask"))
        # Booleans come unpacked into a new array, reused as bytes; integers are copied (the
        # first token's mask is cleared below, in place).
        mask = mask.view(np.uint8) if mask.dtype == np.bool_ else mask.astype(np.uint8)
    else:
        p_len, p_ids = _flat(table.column("prompt_ids"))
        r_len, r_ids = _flat(table.column("response_ids"))
        lengths = p_len + r_len
        ids, mask = _interleave(p_len, p_ids, r_len, r_ids)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask[offsets[:-1][lengths > 0]] = 0  # a sample's first token is never a target (schema)
    if "logprobs" in table.column_names:
        lp_len, lp = _flat(table.column("logprobs"))
        lp = lp.astype(np.float32, copy=False)
        if not np.array_equal(lp_len, lengths):  # null logprobs for some samples: zeros there
            full = np.zeros(int(offsets[-1]), dtype=np.float32)
            lp_off = np.concatenate([[0], np.cumsum(lp_len)])
            for k in np.flatnonzero(lp_len == lengths):
                full[offsets[k] : offsets[k + 1]] = lp[lp_off[k] : lp_off[k + 1]]
            lp = full
    else:
        lp = np.zeros(int(offsets[-1]), dtype=np.float32)
    return _Block(
        offsets=offsets, input_ids=ids.astype(np.int32, copy=False), loss_mask=mask, logprobs=lp
    )


def _interleave(
    p_len: np.ndarray, p_ids: np.ndarray, r_len: np.ndarray, r_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """input_ids = prompt + response per sample; loss_mask = 0 on the prompt, 1 on the response."""
    lengths = p_len + r_len
    total = int(lengths.sum())
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    is_resp = np.zeros(total, dtype=np.uint8)
    p_pos = np.repeat(start, p_len) + segment_positions(p_len)
    r_pos = np.repeat(start + p_len, r_len) + segment_positions(r_len)
    ids = np.empty(total, dtype=np.int64)
    ids[p_pos] = p_ids
    ids[r_pos] = r_ids
    is_resp[r_pos] = 1
    return ids, is_resp
