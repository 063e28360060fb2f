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
    """A Parquet string column (a pyarrow ChunkedArray or Array; plain strings, or read with
    ``read_dictionary`` as dictionary chunks) as ([n] int64 codes, the strings they stand for, in
    order of first appearance). ValueError for a column that is not strings without nulls.

    Dictionary chunks are decoded from their buffers (each chunk's small dictionary as Python
    strings, its indices remapped), without pyarrow.compute (~40 ms to import at a command's
    start); plain strings are dictionary-encoded by pyarrow.

    >>> import pyarrow as pa
    >>> codes, names = string_codes(pa.chunked_array([["b", "a"], ["b"]]))
    >>> codes.tolist(), names
    ([0, 1, 0], ['b', 'a'])
    >>> codes, names = string_codes(pa.chunked_array([pa.array(["a", "b", "a"]).dictionary_encode(),
    ...                                               pa.array(["c", "b"]).dictionary_encode()]))
    >>> codes.tolist(), names
    ([0, 1, 0, 2, 1], ['a', 'b', 'c'])
    """
    import pyarrow as pa

    def strings(t: Any) -> bool:
        return bool(pa.types.is_string(t) or pa.types.is_large_string(t))

    kind = column.type
    coded = pa.types.is_dictionary(kind)
    shown = kind.value_type if coded else kind  # messages name the values' type either way
    if not strings(shown):
        raise ValueError(f"{shown}, not strings")
    if column.null_count:
        raise ValueError(f"{shown} with {column.null_count} nulls")
    if not coded:
        encoded = column.combine_chunks().dictionary_encode()
        return int_column(encoded.indices), encoded.dictionary.to_pylist()
    index: dict[str, int] = {}
    parts = []
    for chunk in column.chunks if hasattr(column, "chunks") else [column]:
        local = np.array([index.setdefault(s, len(index)) for s in chunk.dictionary.to_pylist()])
        parts.append(local.astype(np.int64)[int_column(chunk.indices)])
    codes = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    # renumber in order of first appearance, dropping dictionary entries no row uses
    used, first = np.unique(codes, return_index=True)
    order = used[np.argsort(first, kind="stable")]
    renumber = np.zeros(len(index), dtype=np.int64)
    renumber[order] = np.arange(len(order))
    names = list(index)
    return renumber[codes], [names[i] for i in order.tolist()]
