"""TokenReader: random access to the input's tokens, with a byte-bounded cache.

Fetches equal a slow reference read straight from the Parquet rows, in any order, through any
cache size; the cache never holds more than its budget, also when the row groups the scan
offered as Arrow grow on decoding (bit-packed bool masks become one byte per token); no file
stays open between reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolltool.errors import RolltoolError
from rolltool.fetch.tokens import TokenReader
from rolltool.input.parquet import InputFile
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import scan


def _table(
    rng: np.random.Generator,
    n: int,
    fmt: str,
    logprobs: bool,
    mask_type: Any,
    id_type: pa.DataType | None = None,
) -> pa.Table:
    lengths = rng.integers(1, 40, size=n)
    ids = [rng.integers(0, 50_000, size=k).tolist() for k in lengths]
    cols: dict[str, Any] = {"group_id": [f"g{i // 4}" for i in range(n)], "reward": [0.0] * n}
    if fmt == "input_ids":
        cols["input_ids"] = pa.array(ids, pa.list_(id_type or pa.int64()))
        mask = [(rng.random(k) < 0.6).tolist() for k in lengths]
        cols["loss_mask"] = pa.array(
            mask if mask_type == pa.bool_() else [[int(v) for v in m] for m in mask],
            pa.list_(mask_type),
        )
    else:
        cut = [int(rng.integers(0, k + 1)) for k in lengths]
        cols["prompt_ids"] = pa.array([x[:c] for x, c in zip(ids, cut, strict=True)])
        cols["response_ids"] = pa.array([x[c:] for x, c in zip(ids, cut, strict=True)])
    if logprobs:
        lp = [(-rng.random(k)).astype(np.float32).tolist() for k in lengths]
        lp[0] = None  # a null list: no logprobs for this sample, packed as 0
        cols["logprobs"] = pa.array(lp, pa.list_(pa.float32()))
    return pa.table(cols)


def _reference(tables: list[pa.Table]) -> list[tuple[list, list, list]]:
    """(input_ids, loss_mask, logprobs) per sample, in input order, by the plain definition."""
    out = []
    for t in tables:
        for row in t.to_pylist():
            if "input_ids" in row:
                ids, mask = row["input_ids"], [int(v) for v in row["loss_mask"]]
            else:
                ids = row["prompt_ids"] + row["response_ids"]
                mask = [0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"])
            lp = row.get("logprobs") or [0.0] * len(ids)
            mask[:1] = [0]  # the first token is never a target (issue 21, defect 3)
            out.append((ids, mask, lp))
    return out


def _write(tmp_path: Path, tables: list[pa.Table], row_group: int) -> list[InputFile]:
    paths = []
    for k, t in enumerate(tables):
        paths.append(tmp_path / f"part-{k}.parquet")
        pq.write_table(t, paths[-1], row_group_size=row_group)
    return resolve_inputs(paths)


@pytest.mark.parametrize(
    ("fmt", "logprobs", "mask_type"),
    [
        ("input_ids", True, pa.int8()),
        ("input_ids", False, pa.bool_()),
        ("prompt_response", True, None),
        ("prompt_response", False, None),
    ],
)
@pytest.mark.parametrize("cache_kb", [0, 2, 10_000])
def test_fetch_equals_the_rows_in_any_order(
    tmp_path: Path, fmt: str, logprobs: bool, mask_type: Any, cache_kb: int
) -> None:
    rng = np.random.default_rng(cache_kb + len(fmt) + logprobs)
    tables = [_table(rng, n, fmt, logprobs, mask_type) for n in (13, 1, 30)]
    files = _write(tmp_path, tables, row_group=7)
    ref = _reference(tables)
    reader = TokenReader(files, {}, cache_bytes=cache_kb * 1000)
    assert reader.num_rows == len(ref)
    fetched = 0
    for _ in range(6):
        idx = rng.choice(len(ref), size=int(rng.integers(0, len(ref) + 1)), replace=False)
        got = reader.fetch(idx)
        assert got.offsets[0] == 0 and len(got.offsets) == len(idx) + 1
        for j, i in enumerate(idx):
            lo, hi = got.offsets[j], got.offsets[j + 1]
            ids, mask, lp = ref[i]
            assert got.input_ids[lo:hi].tolist() == ids
            assert got.loss_mask[lo:hi].tolist() == mask
            np.testing.assert_array_equal(got.logprobs[lo:hi], np.asarray(lp, np.float32))
            fetched += 1
        assert reader.cached_bytes <= reader.cache_bytes
        assert reader.cached_bytes == sum(b.nbytes for b in reader._cache.values())
    assert fetched > 0
    with pytest.raises(IndexError):
        reader.fetch(np.array([len(ref)]))


def test_decoding_offered_row_groups_stays_within_the_cache(tmp_path: Path) -> None:
    """Bool masks offered as Arrow (1 bit a token) decode to one byte a token and absent
    logprobs to 4 zero bytes (int32 ids stay 4): a block about doubles, so the cache re-counts
    each decoded block and evicts."""
    rng = np.random.default_rng(0)
    table = _table(rng, 400, "input_ids", False, pa.bool_(), pa.int32())
    files = _write(tmp_path, [table], row_group=40)
    budget = 40_000
    reader = TokenReader(files, {}, cache_bytes=budget)
    offered = 0

    def offer(k: int, rg: int, t: pa.Table) -> None:
        nonlocal offered
        before = reader.cached_bytes
        reader.offer(k, rg, t)
        offered += reader.cached_bytes > before

    scan(files, on_row_group=offer)
    assert offered >= 3  # several Arrow row groups were kept before decoding
    assert reader.cached_bytes <= budget
    for start in range(0, 400, 40):  # every block once: each decoded block is larger
        reader.fetch(np.arange(start, start + 40))
        assert reader.cached_bytes <= budget
        assert reader.cached_bytes == sum(b.nbytes for b in reader._cache.values())
    assert len(reader._cache) >= 1


def test_a_block_larger_than_the_cache_is_returned_but_not_kept(tmp_path: Path) -> None:
    table = _table(np.random.default_rng(1), 20, "input_ids", True, pa.int8())
    files = _write(tmp_path, [table], row_group=20)
    reader = TokenReader(files, {}, cache_bytes=100)
    got = reader.fetch(np.arange(20))
    assert len(got.input_ids) == sum(len(x) for x in table["input_ids"].to_pylist())
    assert reader.cached_bytes == 0 and not reader._cache


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_no_file_stays_open_between_reads(tmp_path: Path) -> None:
    table = _table(np.random.default_rng(2), 4, "input_ids", True, pa.int8())
    paths = []
    for k in range(60):
        paths.append(tmp_path / f"f{k:02d}.parquet")
        pq.write_table(table, paths[-1])
    before = _open_fds()
    files = resolve_inputs(paths)
    reader = TokenReader(files, {}, cache_bytes=0)
    reader.fetch(np.arange(0, 240, 3))
    assert _open_fds() <= before + 2  # not one per file


def test_a_file_without_token_columns_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"group_id": ["g"], "reward": [0.0], "loss_mask": [[1]]}), path)
    with pytest.raises(RolltoolError, match="no token columns"):
        TokenReader(resolve_inputs([path]), {})
