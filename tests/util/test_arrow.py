"""`rolltool.util.arrow`: Parquet columns as NumPy from their buffers equal pyarrow's own
conversion, over several chunks and slices; anything else is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolltool.util.arrow import int_column, string_codes


@pytest.mark.parametrize("kind", ["int64", "int32", "uint16", "int8"])
def test_parquet_integers_are_read_as_pyarrow_reads_them(kind: str) -> None:
    """Over several chunks, one of them a slice at an offset; nulls or floats are refused."""
    values = np.arange(40, dtype=kind)
    chunks = [pa.array(values[:7]), pa.array(values).slice(9, 20), pa.array(values[3:4])]
    column = pa.chunked_array(chunks)
    assert np.array_equal(int_column(column), column.to_numpy().astype(np.int64))
    assert np.array_equal(int_column(chunks[1]), values[9:29].astype(np.int64))
    assert int_column(pa.chunked_array([], type=pa.int64())).shape == (0,)
    for bad in (pa.chunked_array([pa.array([1, None])]), pa.chunked_array([pa.array([1.5])])):
        with pytest.raises(ValueError):
            int_column(bad)
    big = pa.array([1, 2**63], pa.uint64())
    with pytest.raises(ValueError, match="past int64"):
        int_column(big)
    assert int_column(pa.array([1, 2**63 - 1], pa.uint64())).tolist() == [1, 2**63 - 1]


def _dictionary_chunks(words: np.ndarray, kind: pa.DataType) -> pa.ChunkedArray:
    """`words` as dictionary chunks: one with a dictionary in another order than the rows' and
    entries no row uses, one a slice at an offset, one encoded by pyarrow."""
    vocab = ["unused", "agent", "chat", "code", "math", "never"]
    index = {w: i for i, w in enumerate(vocab)}
    first = pa.DictionaryArray.from_arrays(
        pa.array([index[w] for w in words[:50].tolist()], pa.int32()), pa.array(vocab, kind)
    )
    middle = pa.DictionaryArray.from_arrays(
        pa.array([0] + [index[w] for w in words[50:120].tolist()], pa.int32()),
        pa.array(vocab, kind),
    ).slice(1)
    last = pa.array(words[120:].tolist(), kind).dictionary_encode()
    return pa.chunked_array([first, middle, last])


def _parquet_dictionary(words: np.ndarray, kind: pa.DataType, tmp: Path) -> pa.ChunkedArray:
    """`words` written to Parquet in row groups of 30 and read back with ``read_dictionary``,
    as `rolltool.stats.packed.read_samples` reads samples.parquet."""
    pq.write_table(pa.table({"w": pa.array(words.tolist(), kind)}), tmp / "w.parquet",
                   row_group_size=30)  # fmt: skip
    return pq.ParquetFile(tmp / "w.parquet", read_dictionary=["w"]).read().column("w")


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("form", ["plain", "dictionary", "parquet"])
def test_strings_are_coded_in_order_of_first_appearance(
    large: bool, form: str, tmp_path: Path
) -> None:
    """Plain strings, dictionary chunks (dictionaries in any order, with unused entries,
    sliced) and a Parquet column read as dictionaries give the same codes and names."""
    rng = np.random.default_rng(3)
    words = np.array(["math", "code", "chat", "agent"])[rng.integers(0, 4, 200)]
    kind = pa.large_string() if large else pa.string()
    if form == "plain":
        column = pa.chunked_array(
            [pa.array(words[:50].tolist(), kind), pa.array(words.tolist(), kind).slice(50, 150)]
        )
    elif form == "dictionary":
        column = _dictionary_chunks(words, kind)
    else:
        column = _parquet_dictionary(words, kind, tmp_path)
        assert pa.types.is_dictionary(column.type)
    codes, names = string_codes(column)
    assert [names[c] for c in codes.tolist()] == words.tolist()
    assert names == list(dict.fromkeys(words.tolist()))  # first appearance
    assert codes.dtype == np.int64
    for empty in (kind, pa.dictionary(pa.int32(), kind)):
        codes, names = string_codes(pa.chunked_array([], type=empty))
        assert codes.shape == (0,) and names == []
    with pytest.raises(ValueError, match="nulls"):
        string_codes(pa.chunked_array([pa.array(["a", None], kind)]))
    with pytest.raises(ValueError, match="nulls"):
        string_codes(pa.chunked_array([pa.array(["a", None], kind).dictionary_encode()]))
    with pytest.raises(ValueError, match="not strings"):
        string_codes(pa.chunked_array([pa.array([1, 2])]))
