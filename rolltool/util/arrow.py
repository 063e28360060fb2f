"""Parquet columns as NumPy arrays without pandas.

pyarrow's ``to_numpy`` and ``np.asarray`` of an Arrow array import pandas (~0.2 s at a
command's start); these read the columns' data buffers instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def int_column(column: Any) -> np.ndarray:
    """A Parquet integer column (a pyarrow ChunkedArray or Array) as [n] int64, from its data
    buffers. ValueError for a column that is not integers without nulls, or a uint64 value
    int64 cannot hold."""
    import pyarrow as pa

    parts = []
    for chunk in column.chunks if hasattr(column, "chunks") else [column]:
        if not pa.types.is_integer(chunk.type) or chunk.null_count:
            raise ValueError(f"{chunk.type} with {chunk.null_count} nulls, not integers")
        kind = "u" if pa.types.is_unsigned_integer(chunk.type) else "i"
        dtype = np.dtype(f"<{kind}{chunk.type.bit_width // 8}")
        data = chunk.buffers()[1]
        part = np.frombuffer(
            data, dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize
        )
        if dtype == np.uint64 and len(part) and int(part.max()) >= 2**63:
            raise ValueError(f"{chunk.type} with a value of {int(part.max())}, past int64")
        parts.append(part)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def string_codes(column: Any) -> tuple[np.ndarray, list[str]]:
    """A Parquet string column (a pyarrow ChunkedArray) as ([n] int64 codes, the strings they
    stand for, in order of first appearance). ValueError for a column that is not strings
    without nulls.

    >>> import pyarrow as pa
    >>> codes, names = string_codes(pa.chunked_array([["b", "a"], ["b"]]))
    >>> codes.tolist(), names
    ([0, 1, 0], ['b', 'a'])
    """
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{column.type}, not strings")
    if column.null_count:
        raise ValueError(f"{column.type} with {column.null_count} nulls")
    encoded = column.combine_chunks().dictionary_encode()
    return int_column(encoded.indices), encoded.dictionary.to_pylist()
