"""The reader's core: a packed directory opened, checked and read as NumPy rows.

`PackedReader` knows nothing of torch's dataset classes: the torch adapter
(`rolltool.packed.torch_data`) is built on it, and `rolltool.packed.reader.PackedDataset`, what
``rolltool.open_packed`` returns, is this class plus ``torch_dataset`` (see that module for the
consumer contract). The modules of `rolltool.packed`, each importing only those below it::

    reader       PackedDataset (PackedReader + torch_dataset), open_packed
    torch_data   RankRows, MicroBatch: a rank's rows as a resumable IterableDataset; prefetch
    core         PackedReader: open, check, read rows (this module)
    tensors      to_tensors: a row as torch tensors (plain, pinned or in shared memory)
    writer       PackedWriter (imports none of them)

``read_rows(..., torch=True)`` converts with `rolltool.packed.tensors.to_tensors`, imported
only then (it imports torch; opening and reading NumPy rows never does). ``sourced_rows`` also
says where each row lies (`RowSource`): `rebuild_row` makes the same row in another process of
the machine from it, reading the shard there, if it is still the file checked (a DataLoader's
main process: `rolltool.packed.torch_data.WorkerItem`).

**Integrity.** The reader never serves a row it can tell is wrong; whatever it refuses is a
`RolltoolError` naming the file, with the hint to run ``rolltool verify``. Always (cheap):

- on a rank's first read: the manifest lists each shard once, each with a file record, for the
  manifest's ``dp`` (each step's plan agrees); the ``rank-RRRR/`` folders on disk are those of
  ranks < dp; the rank's folder holds exactly the shards listed for it (none missing, none extra:
  a manifest forged to another ``dp`` or ``num_steps`` is refused, never an IndexError);
- on every shard it maps: the shard's own header (``step``, ``rank``, ``first_row``, written by
  `rolltool.format.shards.write_shard`) is where the manifest lists it (two shards swapped between
  ranks or steps: the error names both), its size is the recorded size, its rows hold together
  (`rolltool.format.layout.check_rows`) and its values are in range (`value_problem`: dtypes, token ids
  >= 0, loss_mask 0/1, finite logprobs/advantages/weights, weights >= 0, sample_index >= -1,
  padding weighing 0) and they are laid out as the manifest's config says (`layout_problem`:
  with ``--row-len`` every row of that length, with ``--sp``/``--cp`` every row a multiple of
  the group's size, with ``--cp`` every sample followed by its CP padding: a manifest whose
  ``cp``, ``sp`` or ``row_len`` was edited, or a sample boundary moved in a ``--cp`` pack; with
  ``--hybrid-cp`` each row's sub-groups, `rolltool.format.hybrid.hybrid_problem`); once
  all of a (step, rank)'s shards were mapped, its rows' samples, tokens and real tokens are its
  record's (`counts_problem`: a boundary moved between a sample and padding); every sample's
  segment holds that sample's own length (`lengths_problem`, against samples.parquet's
  ``length``, two columns read once on the first shard mapped: a token moved between two
  samples, one ``seq_lens`` +1 and the next -1, which changes no other array, no sum and,
  under token-mean, no weight). A shard of at most `_FEW_SEGMENTS` segments (nearly all) is
  told in order by `shard_in_order`, the row, value and count checks in one pass over its
  segments as Python lists (~12 us a shard instead of ~44 on the 776 shards of
  ``benchmarks/read_cpu.py``'s pack); only where it cannot vouch do the checks run one by one,
  and they say which fails. One vectorized pass over the mapped arrays: on the loading
  benchmark (102 small shards, 2.7 rows each) a rank's pass of NumPy views goes from ~9.1k to
  ~7.3-8.0k rows/s; the torch paths, which copy every stored array, are within noise; the
  length check adds ~2-6 ms (reading samples.parquet's two columns of 6.6k rows) and is within
  noise on a pass (the 512-group pack of ``benchmarks/loading.py``, median of 7 passes).

A flipped bit that leaves values in range (a token id, a logprob, a weight) passes these checks;
``open_packed(path, verify="hash")`` also hashes each shard on its first read through the
dataset object against the manifest's sha256 and refuses a mismatch. sha256 runs at ~1.9 GB/s
on one core of the development machine: the first pass over a rank takes ~2x the default's time
(65 MB: 37 -> 75 ms), later passes cost nothing more. Each DataLoader worker hashes the shards it
reads itself (workers share no state). ``rolltool verify`` checks everything, hashes included.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from glob import escape as glob_escape
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import (
    MANIFEST,
    PAD_SAMPLE,
    RANK_DIR_PATTERN,
    ROW_ARRAYS,
    SAMPLES,
    SEGMENT_ARRAYS,
    TOKEN_ARRAYS,
    Manifest,
    RankRecord,
    ShardRef,
    StepRecord,
)
from rolltool.format.hybrid import hybrid_fields, hybrid_problem, hybrid_view
from rolltool.format.layout import check_rows, unpack_row
from rolltool.format.prefix import row_parent, shared_problem, shared_view
from rolltool.format.shards import (
    ShardHeader,
    file_record,
    header_of,
    map_tensors,
    read_header,
    tensors_in,
)
from rolltool.format.split import GroupSplit, cp_view, recorded_split, sp_view
from rolltool.storage.fs import Location, locate, scheme
from rolltool.util.arrow import int_column

VerifyMode = Literal["checks", "hash"]
VERIFY_MODES: tuple[VerifyMode, ...] = get_args(VerifyMode)
"""``open_packed(verify=...)``: ``"checks"`` (default) runs the cheap checks on every shard it
maps; ``"hash"`` also hashes each shard on its first read against the manifest's sha256."""

_HINT = "run `rolltool verify` on the directory; pack again if files changed"
_DTYPES = {k: np.dtype(v) for k, v in {**TOKEN_ARRAYS, **SEGMENT_ARRAYS, **ROW_ARRAYS}.items()}


@dataclass(frozen=True)
class _Listed:
    """Where the manifest lists a shard: (step, rank) and its ShardRef."""

    step: int
    rank: int
    ref: ShardRef


def _list_shards(m: Manifest, where: Path | str) -> dict[str, _Listed]:
    """Every shard the manifest lists, by path; a path listed twice, a shard with no file
    record or a file record no step lists is a `RolltoolError`."""
    listed: dict[str, _Listed] = {}
    for s, st in enumerate(m.steps):
        if st.plan.dp != m.dp or len(st.plan.samples_per_rank) != m.dp:
            raise _bad(
                where,
                f"step {s}'s plan is for dp = {st.plan.dp} with {len(st.plan.samples_per_rank)} "
                f"ranks' samples, the manifest's dp = {m.dp}",
            )
        for r, rank in enumerate(st.ranks):
            for f in rank.files:
                if f.path in listed:
                    was = listed[f.path]
                    raise _bad(
                        where,
                        f"{f.path} is listed for step {was.step} rank {was.rank} and again for "
                        f"step {s} rank {r}",
                    )
                if f.path not in m.files:
                    raise _bad(where, f"{f.path} (step {s} rank {r}) has no file record")
                listed[f.path] = _Listed(s, r, f)
    unlisted = sorted(k for k in m.files if k.endswith(".safetensors") and k not in listed)
    if unlisted:
        raise _bad(where, f"{unlisted[0]} has a file record but no step lists it")
    return listed


def _bad(where: Path | str, text: str) -> RolltoolError:
    return RolltoolError(f"{where}: {text}", hint=_HINT)


def _rank_dirs(root: Path) -> set[int]:
    """The ranks whose ``rank-RRRR`` folder is in `root`."""
    try:
        names = os.listdir(root)
    except OSError as e:
        raise RolltoolError(f"{root}: unreadable directory ({e.strerror})") from None
    return {int(m.group(1)) for n in names if (m := RANK_DIR_PATTERN.fullmatch(n))}


def _shard_file(name: str) -> bool:
    """A file of a rank folder that counts as one of its shards: any ``*.safetensors`` name, not
    only `rolltool.format.spec.SHARD_PATTERN`'s (a shard copied in under another name is refused
    as unlisted, not skipped)."""
    return name.endswith(".safetensors")


FileIdentity = tuple[int, int, int, int]
"""A file as ``os.stat`` tells it apart: (st_dev, st_ino, st_size, st_mtime_ns). A shard
rewritten or replaced in place of another has another (`RowSource`)."""


class PrivateMap(mmap.mmap):
    """A shard mapped private (copy-on-write, ``mmap.ACCESS_COPY``): the reader's NumPy views
    of it are read-only, and a tensor may wrap it without a copy (`rolltool.packed.tensors`):
    a write to such a tensor copies the page written into this process's memory, never into
    the file or another process's view of it (what torch's own ``from_file(shared=False)``
    and safetensors' torch loader do). A shard over `READ_WHOLE_BYTES`; a smaller one is a
    `PrivateRead`."""

    copy_on_write = True
    path: str = ""
    """The file mapped (absolute), set by `_open_local`."""
    identity: FileIdentity = (0, 0, 0, 0)
    """The file's `FileIdentity` when it was mapped (``fstat`` of the descriptor mapped)."""


class PrivateRead(np.ndarray):
    """A shard read whole into this process's own memory (uint8, the array that owns it): as
    private as a `PrivateMap` (a write to a tensor wrapping it changes this process's copy,
    never the file), with the same ``path`` and ``identity``. A shard of at most
    `READ_WHOLE_BYTES`, whose ``read`` into memory the heap already holds costs less than
    mapping it and faulting its pages in (`_open_local`)."""

    copy_on_write = True
    path: str = ""
    """The file read (absolute), set by `_open_local`."""
    identity: FileIdentity = (0, 0, 0, 0)
    """The file's `FileIdentity` when it was read (``fstat`` of the descriptor read)."""


PrivateShard = PrivateMap | PrivateRead
"""A local shard's bytes as the reader holds them, private to this process."""


def _identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


READ_WHOLE_BYTES = 2 << 20
"""A local shard of at most this size is read whole (`PrivateRead`), a larger one mapped
(`PrivateMap`). Read into memory the heap keeps (`prime_allocator` raised glibc's mmap threshold
to 4 MB, so such blocks come from the heap and are not faulted in again), a shard that fits the
L2 cache is then checked and unpacked from it; mapped, its pages are faulted in first (~5-10 us
a fault on the development VM, a fault-around of 16 pages each). Opened and read twice there
(`timeit` minima, shards written by `save_safetensors`): 0.73 MB 84 us read / 99 us mapped, 1.05
MB 107 / 113, 2.1 MB 178 / 170, 3.15 MB 424 / 220 (the copy no longer fits the cache), 4.19 MB
1,260 / 463 (the buffer a fresh mmap, faulted in page by page); the 776 shards of
``benchmarks/read_cpu.py``'s pack (0.3-1.1 MB) ~47 us read against ~106 us mapped and touched."""


def _open_local(path: str | Path) -> PrivateShard | None:
    """The whole file as a `PrivateShard` (one open: read into memory up to
    `READ_WHOLE_BYTES`, memory-mapped above; the map outlives the descriptor), or None when it
    cannot be (missing, unreadable, empty, shorter than it said): the caller's reader says why
    (`read_header`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        shard: PrivateShard
        if 0 < st.st_size <= READ_WHOLE_BYTES:
            shard = PrivateRead(st.st_size, np.uint8)
            if _read_into(fd, shard) != st.st_size:
                return None
        else:
            shard = PrivateMap(fd, 0, access=mmap.ACCESS_COPY)
        shard.path, shard.identity = os.path.abspath(path), _identity(st)
        return shard
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _read_into(fd: int, buf: np.ndarray) -> int:
    """Bytes read from `fd`'s start into `buf`, until it is full or the file ends."""
    got, view = 0, buf.data
    while got < len(buf):
        n = os.preadv(fd, [view[got:]], got)
        if n <= 0:
            break
        got += n
    return got


def _private_shard(a: np.ndarray) -> PrivateShard | None:
    """The `PrivateShard` array `a` is a view of, or None (bytes read from a remote,
    `map_tensors`)."""
    owner: object = a
    while isinstance(owner, np.ndarray) and not isinstance(owner, PrivateRead):
        owner = owner.base
    if isinstance(owner, memoryview):  # np.frombuffer's hold on the map
        owner = owner.obj
    return owner if isinstance(owner, PrivateShard) else None


def _writable(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Writable views of a `PrivateShard`'s read-only arrays (after the checks): what
    `rolltool.packed.tensors.to_tensors` wraps a stored array in (a write copies the page
    written, never reaching the file), made once a shard instead of once for each array of
    each row (~1 us each: the map found through the array's bases, a view made)."""
    out = {}
    for key, a in arrays.items():
        view = a.view()
        view.flags.writeable = True
        out[key] = view
    return out


def _odd_path(rel: str) -> bool:
    """A relative path `Path` would spell otherwise than as written (``//``, ``.`` parts, a
    leading or trailing slash): a shard listed in a manifest never has one."""
    return (
        not rel
        or rel.startswith(("/", "./"))
        or rel.endswith(("/", "/."))
        or "//" in rel
        or "/./" in rel
        or rel == "."
    )


_VIEW_DTYPES: dict[str, np.dtype[Any]] = {
    code: np.dtype(t) for code, t in (("I32", np.int32), ("I64", np.int64), ("U8", np.uint8),
                                      ("F32", np.float32))
}  # fmt: skip
"""The safetensors codes `_views` takes itself (a subset of what `tensors_in` reads)."""


def _views(
    mapped: Any, head: ShardHeader, where: str, *, writable: bool = False
) -> dict[str, np.ndarray]:
    """`rolltool.format.shards.tensors_in` of a shard's whole bytes (a `PrivateShard`, or bytes),
    one ``np.frombuffer`` per tensor: the same views, read-only (``writable``: writable, for rows
    made for tensors from a `PrivateShard`, `_writable`'s views made here at once). A tensor it
    does not take as it is (an offset outside the file, a size that is no whole number of its
    dtype, another dtype code, a malformed entry) sends the shard to `tensors_in`, which says why
    (or reads it: read-only views, or `_writable` ones)."""
    base, room = head.base, len(mapped) - head.base
    out: dict[str, np.ndarray] = {}
    try:
        for name, info in head.tensors.items():
            a, b = info["data_offsets"]
            dtype = _VIEW_DTYPES[info["dtype"]]
            if type(a) is not int or type(b) is not int or not 0 <= a <= b <= room:
                raise ValueError
            count, odd = divmod(b - a, dtype.itemsize)
            if odd:
                raise ValueError
            view = np.frombuffer(mapped, dtype, count, base + a)
            shape = info["shape"]
            if not (shape == [count] and type(shape[0]) is int):  # 1-D as it is: no reshape
                view = view.reshape(shape)
            # a private shard is writable; the reader's NumPy rows are not (``setflags``:
            # ~0.5 us a tensor less than setting ``flags.writeable``, which makes a flags object)
            view.setflags(write=writable)
            out[name] = view
    except Exception:  # whatever it is, tensors_in's verdict is the reader's
        whole = np.frombuffer(mapped, np.uint8)
        whole.flags.writeable = False
        arrays = tensors_in(whole, head, where)
        return _writable(arrays) if writable else arrays
    return out


def value_problem(arrays: dict[str, np.ndarray]) -> str | None:
    """Why a shard's stored values are out of range, or None (vectorized: one pass per array).

    Expects arrays that passed `rolltool.format.layout.check_rows`. Checks the dtypes, token ids >= 0,
    ``loss_mask`` 0/1, ``logprobs``, ``seg_advantage`` and ``seg_weight`` finite, ``seg_weight``
    >= 0, ``sample_index`` >= -1 and padding segments (-1) weighing 0 with advantage 0.

    A shard in range (nearly all) is told by `_values_in_range`, a few reductions; only one
    that is not goes through the checks one by one, for the first that fails.
    """
    wrong = [k for k, t in _DTYPES.items() if arrays[k].dtype != t]
    if wrong:
        return f"{wrong[0]} is {arrays[wrong[0]].dtype}, not {_DTYPES[wrong[0]]}"
    if not len(arrays["input_ids"]) or _values_in_range(arrays):
        return None
    checks = (
        (lambda: arrays["input_ids"].min() < 0, "a negative token id"),
        (lambda: arrays["loss_mask"].max() > 1, "a loss_mask value other than 0/1"),
        (lambda: not np.isfinite(arrays["logprobs"]).all(), "a non-finite logprob"),
        (lambda: arrays["sample_index"].min() < PAD_SAMPLE, "a sample_index below -1"),
        (lambda: not np.isfinite(arrays["seg_advantage"]).all(), "a non-finite advantage"),
        (lambda: not (arrays["seg_weight"] >= 0).all(), "a negative or NaN loss weight"),
        (lambda: not np.isfinite(arrays["seg_weight"]).all(), "an infinite loss weight"),
        (lambda: _padding_weighs(arrays), "a padding segment with a weight or advantage"),
    )
    return next((text for failed, text in checks if failed()), None)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


_MIN, _MAX, _ALL = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce
"""The reductions `_values_in_range` calls straight (``a.min()`` goes through NumPy's Python
wrappers first: ~1 us a call, ~8 us of the ~50 a shard)."""


def _values_in_range(arrays: dict[str, np.ndarray]) -> bool:
    """True only when every check of `value_problem` passes (False: look at each): the same
    conditions in fewer NumPy calls: a NaN or infinity among the advantages makes their sum
    (in float64, which float32 values cannot overflow) non-finite, NaN fails every comparison,
    a min and a max bound the weights. Expects non-empty token arrays (`value_problem`)."""
    index, weight, advantage = arrays["sample_index"], arrays["seg_weight"], arrays["seg_advantage"]
    if _MIN(arrays["input_ids"]) < 0 or _MAX(arrays["loss_mask"]) > 1:
        return False
    if not _ALL(np.isfinite(arrays["logprobs"])):
        return False
    if len(index) and not (
        _MIN(index) >= PAD_SAMPLE
        and np.isfinite(np.add.reduce(advantage, dtype=np.float64))
        and _MIN(weight) >= 0
        and _MAX(weight) <= _FLOAT32_MAX
    ):
        return False
    return not _padding_weighs(arrays)


_FEW_SEGMENTS = 512
"""A shard of at most this many segments (and rows) is told in order by `shard_in_order`, its
segment and row arrays as Python numbers; one of more by the checks one by one (vectorized)."""


def shard_in_order(arrays: dict[str, np.ndarray], rows: int) -> tuple[int, int, int] | None:
    """`shard_counts` of a shard's arrays when they pass every check of
    `rolltool.format.layout.check_rows` and `value_problem` and hold `rows` rows (the
    manifest's count); None when one of them may fail (they then say which, in their order) or
    the shard has more than `_FEW_SEGMENTS` segments or rows.

    The same conditions in fewer steps: a shard's few segments and rows (tens, usually) as
    Python lists (~30 NumPy calls on arrays that small cost ~40 us a shard, more than the
    three reductions over its tokens), a NaN or infinity among the advantages or weights made
    visible by their sum (in float64, which float32 values cannot overflow). E.g. segments of
    3 and 2 tokens in one row: ``seq_lens [3, 2]`` add up to ``row_offsets [0, 5]`` at
    ``row_segments [0, 2]``."""
    lens = _segments_in_order(arrays, rows)
    if lens is None:
        return None
    if not lens:  # no segments, no tokens (`value_problem` has nothing to check)
        return 0, 0, 0
    return _values_counted(arrays, lens)


def _segments_in_order(arrays: dict[str, np.ndarray], rows: int) -> list[int] | None:
    """``seq_lens`` as a list when `check_rows` finds nothing, the dtypes are `_DTYPES`' and
    the shard has `rows` rows (at most `_FEW_SEGMENTS` rows and segments), else None."""
    if len(arrays) != len(_DTYPES):
        return None
    for key, dtype in _DTYPES.items():
        a = arrays.get(key)
        if a is None or a.ndim != 1 or a.dtype != dtype:
            return None
    n_tok, n_seg = len(arrays["input_ids"]), len(arrays["seq_lens"])
    if not (n_seg <= _FEW_SEGMENTS and 0 <= rows <= _FEW_SEGMENTS):
        return None
    if not (len(arrays["loss_mask"]) == len(arrays["logprobs"]) == n_tok):
        return None
    per_segment = (arrays[k] for k in ("sample_index", "seg_advantage", "seg_weight"))
    if any(len(a) != n_seg for a in per_segment):
        return None
    ro, rs = arrays["row_offsets"].tolist(), arrays["row_segments"].tolist()
    if not (len(ro) == len(rs) == rows + 1 and ro[0] == rs[0] == 0):
        return None
    if not (ro[-1] == n_tok and rs[-1] == n_seg and ro == sorted(ro) and rs == sorted(rs)):
        return None
    lens: list[int] = arrays["seq_lens"].tolist()
    if n_seg and min(lens) <= 0:
        return None
    bounds = list(accumulate(lens, initial=0))
    return lens if [bounds[i] for i in rs] == ro else None


def _values_counted(arrays: dict[str, np.ndarray], lens: list[int]) -> tuple[int, int, int] | None:
    """`shard_counts` when `value_problem` finds nothing, else None; for arrays that passed
    `_segments_in_order` (``lens``: their segment lengths), some segments."""
    ids, n_tok = arrays["input_ids"], len(arrays["input_ids"])
    if not (_MIN(ids) >= 0 and _MAX(arrays["loss_mask"]) <= 1):
        return None
    if not _squares_finite(arrays["logprobs"]):
        return None
    index = arrays["sample_index"].tolist()
    weight, advantage = arrays["seg_weight"].tolist(), arrays["seg_advantage"].tolist()
    if min(index) < PAD_SAMPLE or not math.isfinite(sum(advantage)):
        return None
    if not (math.isfinite(sum(weight)) and min(weight) >= 0):
        return None
    pads = index.count(PAD_SAMPLE)
    if not pads:
        return len(lens), n_tok, n_tok
    padding = [k for k, i in enumerate(index) if i == PAD_SAMPLE]
    if any(weight[k] or advantage[k] for k in padding):
        return None
    return len(lens) - pads, n_tok, n_tok - sum(lens[k] for k in padding)


def _squares_finite(a: np.ndarray) -> bool:
    """True only when every value of `a` (float32) is finite: their sum of squares (one BLAS
    ``dot``, one read of `a`: ~10 against ~14.5 ms of CPU a pass for ``isfinite`` + ``all``,
    which writes and reads a mask) is finite only then (a NaN or infinity makes it NaN or
    infinite; squares never cancel). False where it overflows (values past ~1e19): then the
    checks one by one look. Silently (~1 us for the ``errstate``), whatever the caller's
    ``np.seterr``: a tiny logprob's square underflows, a signalling NaN's is invalid."""
    with np.errstate(all="ignore"):
        return math.isfinite(float(np.dot(a, a)))


def _padding_weighs(arrays: dict[str, np.ndarray]) -> bool:
    """Whether a padding segment has a weight or an advantage other than 0 (a float's truth is
    ``!= 0``: NaN counts, -0.0 does not)."""
    pad = arrays["sample_index"] == PAD_SAMPLE
    return bool(arrays["seg_weight"][pad].any() or arrays["seg_advantage"][pad].any())


def layout_problem(
    arrays: dict[str, np.ndarray],
    split: GroupSplit,
    row_len: int | None,
    gpu_tokens: int | None = None,
) -> str | None:
    """Why a shard's rows are not laid out as the manifest's config says, or None (vectorized,
    O(rows + segments): the cheap part of `rolltool verify`'s ``row.length`` and ``row.split``).

    Expects arrays that passed `value_problem`. ``row_len``: every (group) row's length when
    the pack pads rows to one (``--row-len`` x sp or cp). With ``--sp`` every row is a multiple
    of sp, with ``--cp`` of 2 x cp (`_rows_split`, `GroupSplit.row_multiple`), and every sample
    is followed by its CP padding and every other padding segment is a multiple of 2 x cp
    (`_cp_padding`): each ``cu_seqlens_padded`` boundary of a CP view a multiple of 2 x cp, valid
    THD. A manifest whose ``sp``/``cp``/``row_len`` was edited, rows whose segment lengths
    changed, or a ``--cp`` pack made before row-end padding was a multiple of 2 x cp (an empty
    micro-batch's row of cp tokens, an odd ``--row-len``) fail here instead of being split into
    wrong GPU views. A ``--hybrid-cp`` pack's rows are judged by
    `rolltool.format.hybrid.hybrid_problem` instead (``gpu_tokens``: the per-GPU budget).
    """
    if split.hybrid:  # each row's own sub-groups (`rolltool.format.hybrid`)
        per_gpu = None if row_len is None else row_len // split.cp
        return hybrid_problem(arrays, split.cp, per_gpu, gpu_tokens)
    if row_len is None and split.size == 1:
        return None
    if split.cp > 1 and row_len is None:  # its padding rule makes every row a multiple of 2cp
        return _cp_padding(arrays, split.cp)
    rows = np.diff(arrays["row_offsets"])
    return (
        _rows_of_length(rows, row_len) or _rows_split(rows, split) or _cp_padding(arrays, split.cp)
    )


def _rows_of_length(rows: np.ndarray, row_len: int | None) -> str | None:
    """Every row has the recorded length (a pack made with ``--row-len``)."""
    if row_len is None:
        return None
    off = np.flatnonzero(rows != row_len)
    if not len(off):
        return None
    r = int(off[0])
    return f"row {r} has {rows[r]} tokens, the manifest's row length is {row_len}"


def _rows_split(rows: np.ndarray, split: GroupSplit) -> str | None:
    """Every row splits evenly over the group's GPUs: a multiple of sp, or of 2 x cp with cp
    (`GroupSplit.row_multiple`: valid THD)."""
    k = split.row_multiple
    if k == 1:
        return None
    off = np.flatnonzero(rows % k)
    if not len(off):
        return None
    r = int(off[0])
    if split.cp > 1:
        return (
            f"row {r} of {rows[r]} tokens is not a multiple of 2 x cp = {k} (the manifest's "
            f"--cp {split.cp}: not valid THD; packed with an odd --row-len before rolltool "
            "refused one? pack it again)"
        )
    return f"row {r} of {rows[r]} tokens does not split over the manifest's --{split.kind} {k}"


def _cp_padding(arrays: dict[str, np.ndarray], cp: int) -> str | None:
    """With ``--cp``: every sample is followed, in its row, by exactly the padding segment that
    brings it to a multiple of 2 x cp (none where it is one), and every other padding segment
    (row-end padding, an empty micro-batch's row) is a multiple of 2 x cp too: the layout
    `rolltool.format.split.cp_spans` reads (and `rolltool verify`'s ``row.split`` judges), every
    ``cu_seqlens_padded`` boundary a multiple of 2 x cp (THD). A few NumPy calls over the
    segments; the first wrong segment is looked for only when there is one."""
    lens = arrays["seq_lens"]
    if cp == 1 or not len(lens):
        return None
    pad = arrays["sample_index"] == PAD_SAMPLE
    m = 2 * cp
    want = np.where(pad, 0, -lens % m)  # the CP padding each sample needs
    after = np.where(pad, lens, -1)  # as the segment after another: its padding, if any
    after[arrays["row_segments"][:-1]] = -1  # a row's first segment follows nothing
    follows = want[:-1] == after[1:]  # followed by exactly its padding (never where want is 0)
    uneven = pad & (lens % m != 0)  # padding that may only be a sample's own
    own = np.zeros(len(lens), dtype=bool)  # padding that is a sample's own
    own[1:] = follows
    if np.count_nonzero(want) == np.count_nonzero(follows) and not np.any(uneven > own):
        return None
    bad = np.flatnonzero((want > 0) & ~np.append(follows, False) | (uneven & ~own))
    k = int(bad[0])
    row = int(np.searchsorted(arrays["row_segments"], k, side="right")) - 1
    if pad[k]:
        return (
            f"row {row}: {lens[k]} padding tokens are not a multiple of 2 x cp = {m} (the "
            f"manifest's --cp {cp}: not valid THD; packed before rolltool padded --cp rows to "
            "2 x cp? pack it again)"
        )
    return (
        f"row {row}: sample {arrays['sample_index'][k]} ({lens[k]} tokens) is not followed by "
        f"the {want[k]} padding tokens that bring it to a multiple of 2 x cp = {m} (the "
        f"manifest's --cp {cp})"
    )


def lengths_problem(arrays: dict[str, np.ndarray], lengths: np.ndarray) -> str | None:
    """Why a shard's samples do not have their own lengths, or None: every segment of a sample
    holds ``lengths[sample_index]`` tokens (`PackedReader._sample_lengths`, from
    samples.parquet). What shows a token moved between two samples (one ``seq_lens`` +1, the
    next -1) when no array, sum or weight changes. Expects arrays that passed `value_problem`
    (``sample_index`` >= -1); two NumPy passes over the segments."""
    index, lens = arrays["sample_index"], arrays["seq_lens"]
    if len(index) <= _FEW_SEGMENTS and _lengths_agree(index, lens, lengths):
        return None
    real = index != PAD_SAMPLE
    if not real.any():
        return None
    i = index[real]
    if int(i.max()) >= len(lengths):
        return f"sample_index {int(i.max())} is not a sample of the input ({len(lengths)} samples)"
    wrong = lens[real] != lengths[i]
    if not wrong.any():
        return None
    k = int(np.flatnonzero(real)[np.flatnonzero(wrong)[0]])
    row = int(np.searchsorted(arrays["row_segments"], k, side="right")) - 1
    return (
        f"row {row}: sample {int(index[k])} holds {int(lens[k])} tokens, "
        f"{SAMPLES} says {int(lengths[index[k]])}"
    )


def _lengths_agree(index: np.ndarray, lens: np.ndarray, lengths: np.ndarray) -> bool:
    """True only when `lengths_problem` finds nothing (False: let it look): a few segments'
    lengths compared as Python lists, one ``take`` of the samples' lengths."""
    idx = index.tolist()
    real = [k for k, i in enumerate(idx) if i != PAD_SAMPLE] if PAD_SAMPLE in idx else None
    if real == [] or not idx:
        return True
    if max(idx) >= len(lengths):
        return False
    got, have = lengths.take(index).tolist(), lens.tolist()  # -1 takes the last: not compared
    if real is None:
        return bool(got == have)
    return all(got[k] == have[k] for k in real)


def shard_counts(arrays: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """(samples, tokens, real tokens) in a shard's rows: what a rank's record (`RankRecord`'s
    ``samples``, ``tokens``, ``real_tokens``) sums over its shards. Expects arrays that passed
    `rolltool.format.layout.check_rows` (``row_offsets`` ends at the segments' sum)."""
    real = arrays["sample_index"] != PAD_SAMPLE
    real_tokens = int(arrays["seq_lens"][real].sum(dtype=np.int64))
    return int(np.count_nonzero(real)), int(arrays["row_offsets"][-1]), real_tokens


def counts_problem(counted: tuple[int, int, int], record: RankRecord) -> str | None:
    """Why a (step, rank)'s rows, summed over its shards (`shard_counts`), are not what its
    record says, or None: a sample's boundary moved into padding, or padding into a sample."""
    recorded = (record.samples, record.tokens, record.real_tokens)
    if counted == recorded:
        return None
    for name, got, want in zip(
        ("samples", "tokens", "real tokens"), counted, recorded, strict=True
    ):
        if got != want:
            return f"its rows hold {got} {name}, the manifest says {want}"
    return None


@dataclass(frozen=True)
class RowRecipe:
    """How a row is made from its shard's arrays: the directory's layout and one GPU's view
    (`PackedReader.row_recipe`). Picklable: a DataLoader worker's item carries it to the main
    process (`RowSource`), whose `rebuild_row` makes the same row with it."""

    hybrid_cp: int | None = None
    """``--hybrid-cp``: the group's cp (`rolltool.format.hybrid.hybrid_fields`); else None."""
    shared: bool = False
    """``--share-prefix``: rows served with `rolltool.format.prefix.shared_view`."""
    view: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    """One GPU's view (`PackedReader.gpu_view`: a ``functools.partial``), None: the whole row."""

    def make(self, arrays: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
        """Row `r` of a shard's arrays (a view's RolltoolError is the caller's to place)."""
        row = unpack_row(arrays, r)
        if self.hybrid_cp is not None:
            row |= hybrid_fields(arrays, r, self.hybrid_cp)
        elif self.shared:  # prefixes stored once (`rolltool.format.prefix`)
            row = shared_view(row, row_parent(arrays, r))
        return row if self.view is None else self.view(row)


class RowSource(NamedTuple):
    """Where a row of a local shard lies and what makes it: enough for another process of the
    machine to map the same file and make the same row (`rebuild_row`) without the checks,
    which the process that made this ran on the file `identity` names. A NamedTuple: made for
    every row, pickled for every DataLoader worker's item (~0.5 kB with it)."""

    path: str  # the shard (absolute), as `_open_local` opened it
    identity: FileIdentity  # that file's, when mapped (and checked)
    row: int  # its row in the shard
    recipe: RowRecipe


_REBUILT: OrderedDict[str, tuple[FileIdentity, dict[str, np.ndarray]]] = OrderedDict()
"""This process's maps of the shards `rebuild_row` reads (their arrays by path), the most
recent last; a DataLoader's workers interleave a few shards at a time. A map of a file since
deleted or replaced is dropped when the next shard is mapped (`_drop_stale`), so at most
``_REBUILT_KEEP`` deleted shards stay held on disk, and only until the process maps another;
`release_rebuilt_maps` lets them all go at once."""
_REBUILT_KEEP = 8
_REBUILT_LOCK = threading.Lock()  # the DataLoader's pin-memory thread unpickles items too


def rebuild_row(source: RowSource) -> dict[str, np.ndarray]:
    """The row `source` names, made in this process as the process that checked it made it
    (for tensors, `PackedReader.sourced_rows`): the shard read or mapped private here
    (`_open_local`; the last few kept), the same writable views of it (`_views`) and
    `RowRecipe.make`, no checks. A shard that is no longer the file checked
    (another `FileIdentity`: replaced, rewritten, gone) is a `RolltoolError`, never other rows.

    A shard kept here is the file checked for as long as it is kept: a file replaced since
    leaves it as it was (its old inode); only a write into the file itself reaches a map (a
    shard over `READ_WHOLE_BYTES`), as for any reader of a memory-mapped file."""
    with _REBUILT_LOCK:
        kept = _REBUILT.get(source.path)
        if kept is None or kept[0] != source.identity:
            _drop_stale()
            kept = (source.identity, _remap(source))
            _REBUILT[source.path] = kept
            while len(_REBUILT) > _REBUILT_KEEP:
                _REBUILT.popitem(last=False)
        else:
            _REBUILT.move_to_end(source.path)
    try:
        return source.recipe.make(kept[1], source.row)
    except RolltoolError as e:
        raise _bad(source.path, f"row {source.row}: {e.message}") from None


def _drop_stale() -> None:
    """Forget the kept maps whose file is gone or is another file now (caller holds the lock)."""
    for path, (identity, _) in list(_REBUILT.items()):
        try:
            now = _identity(os.stat(path))
        except OSError:
            now = None
        if now != identity:
            del _REBUILT[path]


def release_rebuilt_maps() -> None:
    """Let go of every shard map `rebuild_row` keeps in this process (a trainer that deletes a
    packed directory it read with DataLoader workers, and wants its disk space back before it
    reads another: tensors still held keep their own shard mapped)."""
    with _REBUILT_LOCK:
        _REBUILT.clear()


def _remap(source: RowSource) -> dict[str, np.ndarray]:
    mapped = _open_local(source.path)
    if mapped is None or mapped.identity != source.identity:
        was = dict(zip(("device", "inode", "size", "mtime_ns"), source.identity, strict=True))
        now = (
            "it is gone or unreadable"
            if mapped is None
            else "; ".join(
                f"{k} {was[k]} -> {v}"
                for k, v in zip(was, mapped.identity, strict=True)
                if was[k] != v
            )
        )
        raise RolltoolError(
            f"{source.path}: the shard changed on disk after a DataLoader worker read and "
            f"checked it ({now}); its rows are not served",
            hint="do not rewrite or replace a packed directory while a trainer reads it; " + _HINT,
        )
    return _views(mapped, header_of(mapped, source.path), source.path, writable=True)


@dataclass(frozen=True)
class RowRef:
    """Where one micro-batch (a packed row) of a rank lies: row `row` of shard `file`."""

    step: int
    micro_batch: int
    file: ShardRef
    row: int


def sha256_of(data: Any) -> str:
    """The hex sha256 of a shard's bytes (a `PrivateShard` or bytes read from a remote)."""
    return hashlib.sha256(data).hexdigest()


ALLOCATOR_PRIME_BYTES = 4 << 20
"""`prime_allocator`'s block: over glibc's first mmap threshold (128 kB), under its cap (32 MB)."""


@functools.cache
def prime_allocator() -> None:
    """Allocate and free one 4 MB block, once per process, so that the rows' derived arrays are
    not handed back to the system and faulted in again after every row.

    glibc serves a block over its mmap threshold (128 kB at start) by ``mmap`` and, when one is
    freed, raises the threshold to that block's size and the heap's trim threshold to twice it
    (mallopt(3): the dynamic mmap threshold). A packed row's derived arrays (positions, weights,
    targets: ~110 kB each at 27k tokens) come from the heap, and freeing a row trimmed the heap,
    so every next row faulted its pages in anew: ~120k page faults a pass of issue 25's pack,
    against ~9k once the threshold has moved. Importing torch or making any large array moves
    it too; a process that only reads NumPy views did not, and took 1.7x the CPU for a pass
    (1.15 -> 0.68 s, fresh processes, `rolltool.open_packed` rank by rank). Outside glibc this
    is one allocation and one free."""
    np.empty(ALLOCATOR_PRIME_BYTES, dtype=np.uint8)


class PackedReader:
    """A packed directory written by `rolltool pack`, read as NumPy rows (see the module
    docstring); `rolltool.packed.reader.PackedDataset` adds ``torch_dataset``.

    ``verify``: one of `VERIFY_MODES`; ``"checks"`` (default) the cheap checks on every shard,
    ``"hash"`` also each shard's sha256 on its first read."""

    def __init__(self, path: str | os.PathLike[str], *, verify: VerifyMode = "checks") -> None:
        if verify not in VERIFY_MODES:
            raise RolltoolError(
                f"verify={verify!r}: not one of {', '.join(map(repr, VERIFY_MODES))}"
            )
        prime_allocator()
        self.verify: VerifyMode = verify
        self.location: Location = locate(path)
        """Where the directory is (`rolltool.storage.fs`): local shards are read whole or
        memory-mapped (`_open_local`), remote ones (object storage) read whole."""
        self.path = Path(path) if scheme(os.fspath(path)) is None else Path(self.location.path)
        self._remote: dict[str, int] | None = None
        """A remote directory's files and sizes, listed once on open."""
        if self.location.local:
            self._check_local()
            self.manifest: Manifest = Manifest.load(self.path)
        else:
            self.manifest = self._open_remote()
        self.split: GroupSplit = recorded_split(self.manifest.config, str(self._at(MANIFEST)))
        """How each rank's rows are shared by its sp or cp GPUs (`rolltool.format.split`)."""
        row_len = self.manifest.config.row_len
        self._row_len: int | None = None if row_len is None else row_len * self.split.size
        """Every (group) row's length when the pack pads rows to one (--row-len x sp or cp)."""
        self.shared: bool = self.manifest.config.share_prefix
        """A ``--share-prefix`` pack: rows served with `rolltool.format.prefix.shared_view`."""
        self._rank_rows: dict[int, tuple[RowRef, ...]] = {}
        self._listed_cache: dict[str, _Listed] | None = None
        self._ranks_checked: set[int] = set()
        self._counted: dict[str, tuple[int, int, int]] = {}
        """`shard_counts` of each shard of a (step, rank) split over shards mapped so far."""
        self._hashed: set[str] = set()

    def _at(self, rel: str) -> Path | str:
        """How messages name `rel` in the directory (a path, or a URI for a remote one)."""
        return self.path / rel if self.location.local else self.location.show(rel)

    def _open_remote(self) -> Manifest:
        """A remote directory's listing and manifest; without a manifest it is no output."""
        loc = self.location
        self._remote = loc.sizes()
        if MANIFEST not in self._remote:
            raise RolltoolError(
                f"{loc.shown}: no {MANIFEST}: not a finished rolltool output"
                + (" (files of an unfinished or killed run)" if self._remote else " (empty)"),
                hint="on object storage the manifest, written last, marks a finished output; "
                "an interrupted `rolltool pack` leaves none: run it again",
            )
        return Manifest.loads(loc.read_bytes(MANIFEST), loc.show(MANIFEST))

    def _check_local(self) -> None:
        if not self.path.is_dir():
            aside = sorted(self.path.parent.glob(f".{glob_escape(self.path.name)}.old-*"))
            raise RolltoolError(
                f"{self.path}: no such directory"
                + (
                    f" ({aside[0].name} is an output a killed --force run moved aside)"
                    if aside
                    else ""
                ),
                hint="the next `rolltool pack` to this path restores it" if aside else None,
            )
        if not (self.path / MANIFEST).is_file():
            raise RolltoolError(
                f"{self.path}: no {MANIFEST}: not a finished rolltool output",
                hint="an interrupted `rolltool pack` leaves no manifest; run it again",
            )

    @property
    def _listed(self) -> dict[str, _Listed]:
        """The shards the manifest lists, checked against the directory on the first read (not
        on open: `rolltool verify` opens a directory to report such problems, not raise)."""
        if self._listed_cache is None:
            listed = _list_shards(self.manifest, self._at(MANIFEST))
            self._check_rank_dirs(listed)
            self._listed_cache = listed
        return self._listed_cache

    def _check_rank_dirs(self, listed: dict[str, _Listed]) -> None:
        """The rank-RRRR folders on disk are those of ranks 0..dp-1 that the manifest gives
        files (cheap: one listing of the directory)."""
        if self._remote is None:
            on_disk = _rank_dirs(self.path)
        else:
            tops = {n.partition("/")[0] for n in self._remote}
            on_disk = {int(m.group(1)) for n in tops if (m := RANK_DIR_PATTERN.fullmatch(n))}
        beyond = sorted(r for r in on_disk if r >= self.dp)
        if beyond:
            raise _bad(
                self._at(MANIFEST),
                f"dp = {self.dp} but the directory holds rank-{beyond[0]:04d}/",
            )
        missing = sorted({x.rank for x in listed.values()} - on_disk)
        if missing:
            raise _bad(self._at(MANIFEST), f"rank-{missing[0]:04d}/ is listed but missing")

    def _check_rank_files(self, rank: int) -> None:
        """The rank's folder holds exactly the shards the manifest lists for it (once per rank)."""
        if rank in self._ranks_checked:
            return
        listed = {p for p, x in self._listed.items() if x.rank == rank}
        folder = f"rank-{rank:04d}"
        present = self._rank_files(folder)
        for text, paths in (
            ("listed in the manifest but missing", listed - present),
            ("present but not listed in the manifest", present - listed),
        ):
            if paths:
                raise _bad(self._at(min(paths)), f"{text} ({len(paths)} shard(s) of rank {rank})")
        self._ranks_checked.add(rank)

    def _rank_files(self, folder: str) -> set[str]:
        """The shards in a rank's folder, as paths relative to the directory."""
        if self._remote is not None:
            inside = (n for n in self._remote if n.startswith(f"{folder}/"))
            return {n for n in inside if "/" not in n[len(folder) + 1 :] and _shard_file(n)}
        try:
            names = os.listdir(self.path / folder) if (self.path / folder).exists() else []
        except OSError as e:
            raise RolltoolError(f"{self.path / folder}: unreadable ({e.strerror})") from None
        return {f"{folder}/{n}" for n in names if _shard_file(n)}

    @property
    def num_steps(self) -> int:
        return self.manifest.num_steps

    @property
    def dp(self) -> int:
        return self.manifest.dp

    def step_meta(self, step: int) -> StepRecord:
        """The step's record: counts overall (its own fields) and per env (``envs``), loss
        ``denominators``, the partition ``plan`` and its ``ranks``."""
        self._check(step, 0)
        return self.manifest.steps[step]

    def _check(self, step: int, rank: int) -> None:
        if not 0 <= step < self.num_steps:
            raise RolltoolError(f"step {step} out of range (the run has {self.num_steps} steps)")
        self._check_rank(rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise RolltoolError(f"rank {rank} out of range (dp = {self.dp})")

    def step_rows(self, step: int, rank: int) -> tuple[RowRef, ...]:
        """Where each of rank `rank`'s micro-batches of step `step` lies, in order."""
        self._check(step, rank)
        self._check_rank_files(rank)
        rec = self.manifest.steps[step].ranks[rank]
        refs: list[RowRef] = []
        for f in rec.files:
            if f.first_row != len(refs):
                break
            refs.extend(RowRef(step, f.first_row + r, f, r) for r in range(f.rows))
        if len(refs) != rec.micro_batches or sum(f.rows for f in rec.files) != len(refs):
            raise RolltoolError(
                f"{self._at(MANIFEST)}: step {step} rank {rank}: its files do not hold rows "
                f"0..{rec.micro_batches - 1} in order",
                hint="the manifest was changed; pack again",
            )
        return tuple(refs)

    def rank_rows(self, rank: int) -> tuple[RowRef, ...]:
        """Every micro-batch of rank `rank`, step after step: the rank's stream (cached)."""
        self._check_rank(rank)
        if rank not in self._rank_rows:
            refs = [ref for step in range(self.num_steps) for ref in self.step_rows(step, rank)]
            self._rank_rows[rank] = tuple(refs)
        return self._rank_rows[rank]

    def stream_position(self, rank: int, step: int, micro_batch: int = 0) -> int:
        """Index in `rank_rows(rank)` of (step, micro_batch); the stream's length for
        (num_steps, 0), the end. ``micro_batch`` may equal the step's count (= the next step)."""
        if step == self.num_steps and micro_batch == 0:
            return len(self.rank_rows(rank))
        self._check(step, rank)
        count = self.manifest.steps[step].ranks[rank].micro_batches
        if not 0 <= micro_batch <= count:
            raise RolltoolError(
                f"micro-batch {micro_batch} out of range (rank {rank} has {count} in step {step})"
            )
        before = sum(self.manifest.steps[s].ranks[rank].micro_batches for s in range(step))
        return before + micro_batch

    def read_rows(
        self,
        refs: Iterable[RowRef],
        *,
        torch: bool = False,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The rows `refs` point to, in order; a shard is mapped (and checked) once while
        consecutive refs stay in it. ``torch=True``: tensors (`rolltool.packed.tensors`).
        ``sp_rank`` / ``cp_rank``: that GPU's view of each row (see `gpu_view`)."""
        to_tensors: Callable[..., dict[str, Any]] | None = None
        if torch:
            # below this module; imported here, not on top, because it imports torch
            from rolltool.packed.tensors import to_tensors
        rows = self.sourced_rows(refs, sp_rank=sp_rank, cp_rank=cp_rank, for_tensors=torch)
        for row, source in rows:
            # a row of a shard private to this process (source) is writable throughout
            yield row if to_tensors is None else to_tensors(row, writable=source is not None)

    def sourced_rows(
        self,
        refs: Iterable[RowRef],
        *,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
        for_tensors: bool = False,
    ) -> Iterator[tuple[dict[str, np.ndarray], RowSource | None]]:
        """`read_rows`' NumPy rows, each with its `RowSource`: where another process finds it
        (`rebuild_row`); None for a shard in no `PrivateShard` (read whole from object storage,
        or through `map_tensors`). ``for_tensors``: rows about to be wrapped as tensors
        (`rolltool.packed.tensors.to_tensors`), their stored arrays writable views of the
        private map (`_writable`)."""
        recipe = self.row_recipe(sp_rank=sp_rank, cp_rank=cp_rank)
        path, arrays, mapped = None, None, None
        for ref in refs:
            if ref.file.path != path:
                path, arrays = ref.file.path, self._open_shard(ref.file, writable=for_tensors)
                mapped = _private_shard(arrays["row_offsets"])
            assert arrays is not None
            try:
                row = recipe.make(arrays, ref.row)
            except RolltoolError as e:
                raise _bad(self._at(ref.file.path), f"row {ref.row}: {e.message}") from None
            source = (
                None if mapped is None else RowSource(mapped.path, mapped.identity, ref.row, recipe)
            )
            yield row, source

    def row_recipe(self, *, sp_rank: int | None = None, cp_rank: int | None = None) -> RowRecipe:
        """How this directory's rows are made, for one GPU's view (`gpu_view`)."""
        return RowRecipe(
            hybrid_cp=self.split.cp if self.split.hybrid else None,
            shared=self.shared,
            view=self.gpu_view(sp_rank=sp_rank, cp_rank=cp_rank),
        )

    def gpu_view(
        self, *, sp_rank: int | None = None, cp_rank: int | None = None
    ) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None:
        """The function from a rank's (group's) row to one GPU's view of it: ``sp_rank`` with a
        pack made with ``--sp``, ``cp_rank`` with ``--cp`` (`rolltool.format.split.sp_view`,
        `rolltool.format.split.cp_view`; with ``--hybrid-cp`` the GPU's sub-group view,
        `rolltool.format.hybrid.hybrid_view`); None when neither is given (the whole row). Naming the
        other kind, or a rank outside the group, is a RolltoolError."""
        split = self.split
        for name, given, size in (("sp_rank", sp_rank, split.sp), ("cp_rank", cp_rank, split.cp)):
            if given is None:
                continue
            if size == 1:
                made = f"--{split.kind} {split.size}" if split.kind else "neither --sp nor --cp"
                raise RolltoolError(
                    f"{name}={given}: {self._at('')} was packed with {made}",
                    hint="pass the rank kind the pack was made for, or none for the whole row",
                )
            if not isinstance(given, int | np.integer) or not 0 <= given < size:
                raise RolltoolError(f"{name} {given} out of range (the group has {size} GPUs)")
        if sp_rank is not None and split.sp > 1:
            return functools.partial(sp_view, sp=split.sp, rank=int(sp_rank))
        if cp_rank is not None and split.hybrid:
            return functools.partial(hybrid_view, cp=split.cp, rank=int(cp_rank))
        if cp_rank is not None and split.cp > 1:
            return functools.partial(cp_view, cp=split.cp, rank=int(cp_rank))
        return None

    def _open_shard(self, f: ShardRef, *, writable: bool = False) -> dict[str, np.ndarray]:
        """Map shard `f` after the cheap checks (its header names the (step, rank, first row)
        the manifest lists it for, its size, rows and values); ``verify="hash"``: its sha256 on
        the first read too. ``writable``: a local shard's arrays writable views of its private
        bytes (`_views`), for tensors.

        A local shard is opened once: read whole or memory-mapped (`_open_local`), its header
        read from those bytes, its arrays views of them (`_views`; a file that cannot be opened
        so, empty or unreadable, goes through `read_header` and `map_tensors`, which say why).
        A remote one is read whole."""
        where = self._shown(f.path)
        mapped: Any = None  # the shard's bytes: a PrivateShard, or bytes read from a remote
        if self._remote is not None:
            mapped = self.location.read_bytes(f.path)
            head = header_of(mapped, where)
        else:
            mapped = _open_local(where)
            head = read_header(self.path / f.path) if mapped is None else header_of(mapped, where)
        self._check_identity(f, head.meta)
        record = self.manifest.files[f.path]
        if head.size != record.bytes:
            raise _bad(where, f"{head.size} bytes, the manifest says {record.bytes}")
        if self.verify == "hash" and f.path not in self._hashed:
            # the bytes served: the map (not the path, which a replaced file would point away
            # from) or what was read; a file that cannot be mapped is read by path below too
            digest = file_record(self.path / f.path).sha256 if mapped is None else sha256_of(mapped)
            if digest != record.sha256:
                raise _bad(where, "sha256 differs from the manifest's (the file changed)")
            self._hashed.add(f.path)
        arrays = (
            map_tensors(self.path / f.path, head)
            if mapped is None
            else _views(mapped, head, where, writable=writable and self._remote is None)
        )
        counted = shard_in_order(arrays, f.rows)  # None: the checks one by one say
        if counted is None:
            broken = check_rows(arrays)
            if broken is None and len(arrays["row_offsets"]) - 1 != f.rows:
                broken = f"{len(arrays['row_offsets']) - 1} rows, the manifest says {f.rows}"
            if broken is None:
                broken = value_problem(arrays)
            if broken is not None:
                raise _bad(where, f"corrupt shard ({broken})")
        misfit = layout_problem(
            arrays, self.split, self._row_len, self.manifest.config.micro_batch_tokens
        )
        if misfit is not None:
            raise _bad(where, f"rows not laid out as the manifest's config says ({misfit})")
        self._check_counts(f, shard_counts(arrays) if counted is None else counted)
        if self.shared:
            wrong = shared_problem(arrays, self._sample_lengths)
            if wrong is not None:
                raise _bad(where, f"corrupt shared-prefix rows ({wrong})")
        wrong = None if self.shared else lengths_problem(arrays, self._sample_lengths)
        if wrong is not None:
            raise _bad(where, f"rows not as {SAMPLES} says ({wrong})")
        return arrays

    def _shown(self, rel: str) -> str:
        """``str(self._at(rel))`` (how messages name `rel`), for a local shard's plain relative
        path without building a Path: the directory's own spelling (`_prefix`) + `rel`."""
        if self._remote is None and not _odd_path(rel):
            return self._prefix + rel
        return str(self._at(rel))

    @functools.cached_property
    def _prefix(self) -> str:
        """What ``str(self.path / rel)`` puts before a plain relative `rel`."""
        root = str(self.path)
        return "" if root == "." else root if root.endswith("/") else root + "/"

    @functools.cached_property
    def _sample_lengths(self) -> np.ndarray:
        """[n] int64: each input sample's length (tokens), samples.parquet's ``length`` by
        ``sample_index`` (its first epoch's rows with --epochs): two columns, read on the first
        shard mapped (through the directory's filesystem: only those column chunks)."""
        where = self._at(SAMPLES)
        try:
            with self.location.parquet(SAMPLES) as pf:
                t = pf.read(columns=["sample_index", "length"], use_threads=False)
            index, length = int_column(t.column("sample_index")), int_column(t.column("length"))
        except (OSError, ValueError, KeyError) as e:  # pyarrow's errors are OSError/ValueError
            raise _bad(where, f"missing or unreadable ({e})") from None
        if len(index) and (index.min() < 0 or index.max() >= len(index)):
            raise _bad(where, "corrupt (a sample_index out of range)")
        lengths = np.zeros(int(index.max()) + 1 if len(index) else 0, dtype=np.int64)
        lengths[index] = length
        return lengths

    def _check_counts(self, f: ShardRef, counted: tuple[int, int, int]) -> None:
        """Once all of a (step, rank)'s shards were mapped, its rows' samples, tokens and real
        tokens (`shard_counts` of each shard: `counted` of `f`'s) against its record
        (`counts_problem`): before any of its rows is served when it has one shard, as most
        do; when its rows are split over shards, on mapping the last (the error names that
        one), so rows of the others may have been served."""
        listed = self._listed[f.path]
        record = self.manifest.steps[listed.step].ranks[listed.rank]
        if len(record.files) > 1:
            self._counted[f.path] = counted
            if any(g.path not in self._counted for g in record.files):
                return
            parts = [self._counted[g.path] for g in record.files]
            counted = (sum(c[0] for c in parts), sum(c[1] for c in parts), sum(c[2] for c in parts))
        wrong = counts_problem(counted, record)
        if wrong is not None:
            where = f"step {listed.step} rank {listed.rank}"
            raise _bad(self._at(f.path), f"{where}: {wrong}")

    def _check_identity(self, f: ShardRef, meta: Any) -> None:
        """The shard's own header (step, rank, first_row) against where the manifest lists it."""
        want = self._listed[f.path]
        if not isinstance(meta, dict):
            raise _bad(self._at(f.path), "corrupt safetensors header (metadata is not an object)")
        try:
            got = (int(meta["step"]), int(meta["rank"]), int(meta["first_row"]))
        except (KeyError, ValueError, TypeError):
            where = self._at(f.path)
            raise _bad(where, "corrupt shard (no step/rank/first_row in its header)") from None
        if got == (want.step, want.rank, f.first_row):
            return
        at = {(x.step, x.rank, x.ref.first_row): p for p, x in self._listed.items()}
        other = at.get(got)
        raise _bad(
            self._at(f.path),
            f"holds step {got[0]} rank {got[1]} rows from {got[2]} (its header), but the manifest "
            f"lists it as step {want.step} rank {want.rank} rows from {f.first_row}"
            + (f"; those rows belong in {other} (shards swapped or renamed)" if other else ""),
        )

    def micro_batches(
        self,
        step: int,
        rank: int,
        *,
        torch: bool = False,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
    ) -> list[dict[str, Any]]:
        """Rank `rank`'s micro-batches of step `step`, in order (one dict per packed row): the
        whole group's row, or with ``sp_rank`` / ``cp_rank`` that GPU's view (`gpu_view`)."""
        refs = self.step_rows(step, rank)
        return list(self.read_rows(refs, torch=torch, sp_rank=sp_rank, cp_rank=cp_rank))

    def rank_iter(
        self,
        rank: int,
        *,
        torch: bool = False,
        start_step: int = 0,
        start_micro_batch: int = 0,
        sp_rank: int | None = None,
        cp_rank: int | None = None,
    ) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(step, micro_batch, row) for every row of `rank` from (start_step, start_micro_batch)
        on, step after step (one GPU's view with ``sp_rank`` / ``cp_rank``)."""
        refs = self.rank_rows(rank)
        first = self.stream_position(rank, start_step, start_micro_batch)
        rows = self.read_rows(refs[first:], torch=torch, sp_rank=sp_rank, cp_rank=cp_rank)
        for ref, row in zip(refs[first:], rows, strict=True):
            yield ref.step, ref.micro_batch, row
