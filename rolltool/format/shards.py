"""Sharded safetensors files: writing a (step, rank)'s rows and reading them back memory-mapped.

Layout of a packed directory (names zero-padded so they sort)::

    packed/
      manifest.json                      written last: the commit mark (see rolltool.packed.writer)
      samples.parquet                    where every input sample went, or why it did not train
      rank-0003/step-000012-00.safetensors
                                         rank 3's rows of step 12 (part 00), flat PackedRows

A rank reads only ``rank-<r>/``. A (step, rank) whose rows exceed the shard size limit is split
into several parts by whole rows. Files are plain safetensors (no pickle), mode 0644.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import (
    HYBRID_ROW_ARRAYS,
    HYBRID_SEGMENT_ARRAYS,
    ROW_ARRAYS,
    SEGMENT_ARRAYS,
    SHARED_SEGMENT_ARRAYS,
    TOKEN_ARRAYS,
    FileRecord,
    shard_name,
)
from rolltool.format.layout import PackedRows

_TOKEN_BYTES = sum(np.dtype(t).itemsize for t in TOKEN_ARRAYS.values())
_SEGMENT_BYTES = sum(np.dtype(t).itemsize for t in SEGMENT_ARRAYS.values())
_ROW_BYTES = sum(np.dtype(t).itemsize for t in ROW_ARRAYS.values())
_HYBRID_SEGMENT_BYTES = sum(np.dtype(t).itemsize for t in HYBRID_SEGMENT_ARRAYS.values())
_HYBRID_ROW_BYTES = sum(np.dtype(t).itemsize for t in HYBRID_ROW_ARRAYS.values())
_SHARED_SEGMENT_BYTES = sum(np.dtype(t).itemsize for t in SHARED_SEGMENT_ARRAYS.values())

_HINT = "run `rolltool verify` on the directory; pack again if files changed"
_DTYPES = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "F32": np.float32, "F64": np.float64}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


def row_bytes(rows: PackedRows) -> np.ndarray:
    """Bytes each row takes in a shard (9 per token, 20 per segment, 16 per row; a hybrid
    pack's rows 4 more per segment and 4 x C more per row, a shared-prefix pack's 4 more per
    segment)."""
    tokens = np.diff(rows.row_offsets)
    segments = np.diff(rows.row_segments)
    size = tokens * _TOKEN_BYTES + segments * _SEGMENT_BYTES + _ROW_BYTES
    extra = _hybrid_arrays(rows)
    if extra:
        cp = len(extra["row_cp_groups"]) // max(len(tokens), 1)
        size = size + segments * _HYBRID_SEGMENT_BYTES + cp * _HYBRID_ROW_BYTES
    if hasattr(rows, "seg_parent"):  # `rolltool.format.prefix.SharedRows`
        size = size + segments * _SHARED_SEGMENT_BYTES
    return size


def _hybrid_arrays(rows: PackedRows) -> dict[str, np.ndarray]:
    """A hybrid pack's extra arrays (`rolltool.format.hybrid.HybridRows`), else none."""
    names = (*HYBRID_SEGMENT_ARRAYS, *HYBRID_ROW_ARRAYS)
    return {k: getattr(rows, k) for k in names if hasattr(rows, k)}


def split_rows(rows: PackedRows, max_bytes: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [a, b) whose bytes stay within max_bytes (a single row may not)."""
    sizes = row_bytes(rows)
    parts: list[tuple[int, int]] = []
    start, acc = 0, 0
    for r, size in enumerate(sizes):
        if r > start and acc + size > max_bytes:
            parts.append((start, r))
            start, acc = r, 0
        acc += int(size)
    parts.append((start, len(sizes)))
    return parts


def _slice(rows: PackedRows, a: int, b: int) -> dict[str, np.ndarray]:
    t0, t1 = int(rows.row_offsets[a]), int(rows.row_offsets[b])
    s0, s1 = int(rows.row_segments[a]), int(rows.row_segments[b])
    out = {k: np.ascontiguousarray(getattr(rows, k)[t0:t1]) for k in TOKEN_ARRAYS}
    for k in SEGMENT_ARRAYS:
        out[k] = np.ascontiguousarray(getattr(rows, k)[s0:s1])
    out["row_offsets"] = rows.row_offsets[a : b + 1] - t0
    out["row_segments"] = rows.row_segments[a : b + 1] - s0
    extra = _hybrid_arrays(rows)
    if extra:
        cp = len(extra["row_cp_groups"]) // (len(rows.row_offsets) - 1)
        for k in HYBRID_SEGMENT_ARRAYS:
            out[k] = np.ascontiguousarray(extra[k][s0:s1])
        for k in HYBRID_ROW_ARRAYS:
            out[k] = np.ascontiguousarray(extra[k][a * cp : b * cp])
    for k in SHARED_SEGMENT_ARRAYS:  # `rolltool.format.prefix.SharedRows`: row-relative
        if hasattr(rows, k):
            out[k] = np.ascontiguousarray(getattr(rows, k)[s0:s1])
    return out


def write_shard(
    root: Path, step: int, rank: int, part: int, rows: PackedRows, a: int, b: int
) -> tuple[str, FileRecord]:
    """Write rows [a, b) of a (step, rank) as shard `part`; returns its name and record."""
    name = shard_name(step, rank, part)
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    # Shards are 0644; their folder must be traversable by others too, whatever the umask.
    os.chmod(path.parent, 0o755)
    meta = {"step": str(step), "rank": str(rank), "first_row": str(a)}
    size, digest = save_safetensors(path, _slice(rows, a, b), meta)
    os.chmod(path, 0o644)  # readers may be other users
    return name, FileRecord(bytes=size, sha256=digest)


def save_safetensors(
    path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]
) -> tuple[int, str]:
    """Write a safetensors file straight from the arrays (no serialized copy in memory).

    Layout per the safetensors format: u64 little-endian header size, a JSON header (padded with
    spaces to a multiple of 8) mapping names to dtype, shape and byte offsets, then the raw
    little-endian data, wider dtypes first so every tensor stays aligned. Returns (bytes, sha256).
    """
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {
            "dtype": _CODES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            h.update(chunk)
        for name in order:
            view = np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8).data
            f.write(view)
            h.update(view)
    return 8 + len(head) + offset, h.hexdigest()


def file_record(path: Path) -> FileRecord:
    """Size and sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return FileRecord(bytes=path.stat().st_size, sha256=h.hexdigest())


@dataclass(frozen=True)
class ShardHeader:
    """A shard's safetensors header, read without mapping its data."""

    size: int
    """The file's size in bytes."""
    meta: Any
    """``__metadata__`` as stored (``write_shard`` records ``step``, ``rank`` and ``first_row``)."""
    tensors: dict[str, Any]
    """Tensor name -> {dtype, shape, data_offsets}."""
    base: int
    """Byte offset of the data (8 + header length)."""


def read_header(path: Path) -> ShardHeader:
    """Parse a shard's header (one small read); `map_tensors` then maps its data."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"header size {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise RolltoolError(f"{path}: not a readable safetensors shard ({e})", hint=_HINT) from None
    if not isinstance(header, dict):
        raise RolltoolError(f"{path}: corrupt safetensors header (not a JSON object)", hint=_HINT)
    meta = header.pop("__metadata__", {})
    return ShardHeader(size=size, meta=meta, tensors=header, base=8 + n)


def header_of(data: bytes | mmap.mmap | np.ndarray, where: str) -> ShardHeader:
    """`read_header` of a shard's bytes held in memory (bytes read from object storage, a
    memory map, or a uint8 array read whole); `where` names it in errors."""
    try:
        n = int.from_bytes(data[:8], "little")
        if not 0 < n <= len(data) - 8:
            raise ValueError(f"header size {n} does not fit a file of {len(data)} bytes")
        header = json.loads(bytes(data[8 : 8 + n]))  # a slice of an array is an array
    except ValueError as e:
        raise RolltoolError(
            f"{where}: not a readable safetensors shard ({e})", hint=_HINT
        ) from None
    if not isinstance(header, dict):
        raise RolltoolError(f"{where}: corrupt safetensors header (not a JSON object)", hint=_HINT)
    meta = header.pop("__metadata__", {})
    return ShardHeader(size=len(data), meta=meta, tensors=header, base=8 + n)


def map_tensors(path: Path, head: ShardHeader) -> dict[str, np.ndarray]:
    """Memory-map the tensors `head` describes as read-only NumPy arrays (plain ndarray views
    of the map, no copy)."""
    try:
        # plain ndarray views of the map: np.memmap's subclass hooks cost more than the
        # reader's per-row slicing and the integrity checks themselves
        mm = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    except (OSError, ValueError) as e:
        raise RolltoolError(f"{path}: not a readable safetensors shard ({e})", hint=_HINT) from None
    return tensors_in(mm, head, str(path))


def tensors_in(buf: np.ndarray, head: ShardHeader, where: str) -> dict[str, np.ndarray]:
    """The tensors `head` describes as views of `buf` (a shard's bytes as uint8: a memory map,
    or bytes read whole); `where` names the shard in errors."""
    out: dict[str, np.ndarray] = {}
    try:
        for name, info in head.tensors.items():
            a, b = info["data_offsets"]
            if not 0 <= a <= b <= len(buf) - head.base:
                raise ValueError(f"tensor {name!r} lies outside the file")
            dtype = _DTYPES[info["dtype"]]
            out[name] = buf[head.base + a : head.base + b].view(dtype).reshape(info["shape"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RolltoolError(f"{where}: corrupt safetensors header ({e!r})", hint=_HINT) from None
    return out


def read_shard(path: Path) -> dict[str, np.ndarray]:
    """Memory-map a shard's tensors as read-only NumPy arrays (no copy)."""
    return map_tensors(path, read_header(path))
