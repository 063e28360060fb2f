"""Fetch the token columns of chosen samples from the input Parquet files.

Planning works on light columns only; the packer then asks for the tokens of one step at a time
(`TokenReader.fetch(sample_indices)`). Row groups are read on demand and kept in a small
byte-bounded cache, so memory stays bounded by a step (plus the cache), not by the dataset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.packing import SampleTokens
from rolltool.source import InputFile


def _flat(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat values) of a list array (slice-safe, nulls as empty)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return lengths, values


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


class TokenReader:
    """Random access to the token columns of the ordered input, by sample_index."""

    def __init__(
        self,
        files: Sequence[InputFile],
        rename: Mapping[str, str],
        *,
        token_format: str,
        has_logprobs: bool,
        cache_bytes: int = 512 << 20,
    ) -> None:
        self.files = list(files)
        self.reverse = {new: old for old, new in rename.items()}
        self.token_format = token_format
        self.has_logprobs = has_logprobs
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, _Block] = OrderedDict()
        self._cached = 0
        names = (
            ["input_ids", "loss_mask"]
            if token_format == "input_ids"
            else ["prompt_ids", "response_ids"]
        )
        if has_logprobs:
            names.append("logprobs")
        self.columns = names
        # Global row number where each (file, row group) starts.
        starts: list[int] = []
        where: list[tuple[int, int]] = []
        row = 0
        self._handles = []
        for fi, f in enumerate(self.files):
            pf = pq.ParquetFile(f.path)
            self._handles.append(pf)
            for rg in range(pf.metadata.num_row_groups):
                starts.append(row)
                where.append((fi, rg))
                row += pf.metadata.row_group(rg).num_rows
        self._starts = np.array(starts, dtype=np.int64)
        self._where = where
        self.num_rows = row

    def _block(self, b: int) -> _Block:
        if b in self._cache:
            self._cache.move_to_end(b)
            return self._cache[b]
        fi, rg = self._where[b]
        try:
            table = self._handles[fi].read_row_group(
                rg, columns=[self.reverse.get(c, c) for c in self.columns]
            )
        except (pa.ArrowException, OSError) as e:
            raise RolltoolError(
                f"{self.files[fi].path}: could not read row group {rg} ({e})"
            ) from None
        block = self._to_block(table.rename_columns(self.columns))
        self._cache[b] = block
        self._cached += block.nbytes
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= old.nbytes
        return block

    def fetch(self, sample_index: np.ndarray) -> SampleTokens:
        """Tokens of the given samples, in the given order."""
        idx = np.asarray(sample_index, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError("sample_index out of range")
        block_of = np.searchsorted(self._starts, idx, side="right") - 1
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
        for b, blk in blocks.items():
            sel = np.flatnonzero(block_of == b)
            lens = lengths[sel]
            within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(lens) - lens, lens
            )
            src = np.repeat(blk.offsets[local[sel]], lens) + within
            dst = np.repeat(offsets[sel], lens) + within
            ids[dst] = blk.input_ids[src]
            mask[dst] = blk.loss_mask[src]
            logp[dst] = blk.logprobs[src]
        return SampleTokens(offsets=offsets, input_ids=ids, loss_mask=mask, logprobs=logp)

    def _to_block(self, table: pa.Table) -> _Block:
        if self.token_format == "input_ids":
            lengths, ids = _flat(table.column("input_ids"))
            _, mask = _flat(table.column("loss_mask"))
            mask = mask.astype(np.uint8)
        else:
            p_len, p_ids = _flat(table.column("prompt_ids"))
            r_len, r_ids = _flat(table.column("response_ids"))
            lengths = p_len + r_len
            ids, mask = _interleave(p_len, p_ids, r_len, r_ids)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if self.has_logprobs:
            lp_len, lp = _flat(table.column("logprobs"))
            lp = lp.astype(np.float32)
            if not np.array_equal(lp_len, lengths):  # null logprobs for some samples: zeros there
                full = np.zeros(int(offsets[-1]), dtype=np.float32)
                lp_off = np.concatenate([[0], np.cumsum(lp_len)])
                for k in np.flatnonzero(lp_len == lengths):
                    full[offsets[k] : offsets[k + 1]] = lp[lp_off[k] : lp_off[k + 1]]
                lp = full
        else:
            lp = np.zeros(int(offsets[-1]), dtype=np.float32)
        return _Block(offsets=offsets, input_ids=ids.astype(np.int32), loss_mask=mask, logprobs=lp)


def _interleave(
    p_len: np.ndarray, p_ids: np.ndarray, r_len: np.ndarray, r_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """input_ids = prompt + response per sample; loss_mask = 0 on the prompt, 1 on the response."""
    lengths = p_len + r_len
    total = int(lengths.sum())
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    is_resp = np.zeros(total, dtype=np.uint8)
    p_pos = np.repeat(start, p_len) + _ranks(p_len)
    r_pos = np.repeat(start + p_len, r_len) + _ranks(r_len)
    ids = np.empty(total, dtype=np.int64)
    ids[p_pos] = p_ids
    ids[r_pos] = r_ids
    is_resp[r_pos] = 1
    return ids, is_resp


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """[0..l0-1, 0..l1-1, ...] for the given lengths."""
    total = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
