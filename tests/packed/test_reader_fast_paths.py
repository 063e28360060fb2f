"""The reader's fast paths (issue 25) give exactly what the plain code they stand in for gives.

Each fast path is compared with the straightforward code: the views of a shard's bytes
(`core._views`) with `tensors_in` (on good and malformed headers alike), the spelling of a
shard's path (`PackedReader._shown`) with ``str(Path)``, the in-range test of a shard's values
(`core._values_in_range`) with the one-by-one checks of `value_problem` on random corruptions,
`segment_positions` with ``arange - repeat(starts)`` and the targets of a row with many padding
segments with those of a row with few.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack

import rolltool
import rolltool.packed.core as core
from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE
from rolltool.format.layout import check_rows, segment_positions
from rolltool.format.shards import _DTYPES, header_of, tensors_in
from rolltool.format.targets import _FEW_PADS, next_token_targets, no_target


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> Path:
    tmp = tmp_path_factory.mktemp("fast")
    pq.write_table(synth_table, tmp / "in.parquet")
    pack(tmp / "in.parquet", tmp / "out", "--dp", 2, "--batch-size", 24, "--keep-last",
         "--row-len", 4096, "--shard-mb", 0.05)  # fmt: skip
    return tmp / "out"


def _shard(out: Path, padded: bool = False) -> tuple[Any, Any]:
    """The first shard of rank 1 (`padded`: the first with padding and samples)."""
    ds = rolltool.open_packed(out)
    for ref in ds.rank_rows(1):
        mapped = core._open_local(out / ref.file.path)
        assert mapped is not None
        head = header_of(mapped, "shard")
        index = core._views(mapped, head, "shard")["sample_index"]
        if not padded or ((index == PAD_SAMPLE).any() and (index != PAD_SAMPLE).any()):
            return mapped, head
    raise AssertionError("no shard with padding")


def _read_only(mapped: Any) -> np.ndarray:
    """The shard's bytes as the reader's read-only uint8 array (its map is private, writable)."""
    whole = np.frombuffer(mapped, np.uint8)
    whole.flags.writeable = False
    return whole


def _outcome(fn: Any) -> Any:
    try:
        arrays = fn()
    except RolltoolError as e:
        return ("error", e.message)
    return {k: (a.dtype, a.shape, a.tobytes(), a.flags.writeable) for k, a in arrays.items()}


def test_views_are_tensors_in(out: Path) -> None:
    mapped, head = _shard(out)
    views = core._views(mapped, head, "shard")
    assert _outcome(lambda: views) == _outcome(
        lambda: tensors_in(_read_only(mapped), head, "shard")
    )
    assert not any(a.flags.writeable for a in views.values())  # read-only views of the map
    assert isinstance(mapped, core.PrivateRead) and mapped.copy_on_write  # a small shard, read
    assert set(core._VIEW_DTYPES) <= set(_DTYPES)
    assert all(np.dtype(_DTYPES[k]) == v for k, v in core._VIEW_DTYPES.items())


EDITS: list[tuple[str, Any]] = [
    ("data_offsets", [0, 10**9]),  # outside the file
    ("data_offsets", [-4, 4]),
    ("data_offsets", [4, 0]),
    ("data_offsets", [0, 3]),  # no whole number of int32 (input_ids) or a short uint8
    ("data_offsets", [0.0, 4.0]),
    ("data_offsets", [True, 5]),
    ("data_offsets", [0]),
    ("data_offsets", None),
    ("dtype", "F64"),  # a code tensors_in reads and _views leaves to it
    ("dtype", "BF16"),
    ("dtype", None),
    ("shape", [3, 5]),
    ("shape", [-1]),
    ("shape", "x"),
    (None, None),  # the entry itself is not an object
]


@pytest.mark.parametrize(("key", "value"), EDITS)
def test_views_give_tensors_ins_verdict_on_a_malformed_header(
    out: Path, key: str | None, value: Any
) -> None:
    mapped, head = _shard(out)
    for name in head.tensors:
        edited = copy.deepcopy(head)
        if key is None:
            edited.tensors[name] = value
        else:
            edited.tensors[name][key] = value
        got = _outcome(lambda e=edited: core._views(mapped, e, "shard"))
        want = _outcome(lambda e=edited: tensors_in(_read_only(mapped), e, "shard"))
        assert got == want, (name, key, value)


@pytest.mark.parametrize("kind", [float, bool, str])
def test_views_reshape_whatever_is_not_a_plain_int_length(out: Path, kind: type) -> None:
    """`_views` skips the reshape of a 1-D tensor whose shape is ``[count]``: a shape that only
    compares equal (``[n.0]``, ``[True]`` for one value) is still tensors_in's to judge."""
    mapped, head = _shard(out)
    tried = 0
    for name, info in head.tensors.items():
        edited = copy.deepcopy(head)
        (n,) = info["shape"]
        edited.tensors[name]["shape"] = [kind(n)]
        got = _outcome(lambda e=edited: core._views(mapped, e, "shard"))
        want = _outcome(lambda e=edited: tensors_in(_read_only(mapped), e, "shard"))
        assert got == want, (name, kind)
        tried += got[0] == "error"
    assert tried == len(head.tensors)  # every such shape refused


def test_writable_views_are_the_read_only_ones(out: Path) -> None:
    mapped, head = _shard(out)
    plain, mine = core._views(mapped, head, "shard"), core._views(mapped, head, "s", writable=True)
    assert list(plain) == list(mine)
    for key, a in plain.items():
        b = mine[key]
        assert not a.flags.writeable and b.flags.writeable
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes())
        assert np.shares_memory(a, b)


@pytest.mark.parametrize("spelling", ["abs", "rel", "dot", "dotslash", "trailing"])
def test_a_shards_path_is_spelled_as_path_spells_it(
    out: Path, spelling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(out.parent)
    given = {"abs": str(out), "rel": out.name, "dot": ".", "dotslash": f"./{out.name}",
             "trailing": f"{out.name}/"}[spelling]  # fmt: skip
    if spelling == "dot":
        monkeypatch.chdir(out)
    ds = rolltool.open_packed(given)
    rels = [ref.file.path for ref in ds.rank_rows(0)]
    odd = ["rank-0000//x.safetensors", "./rank-0000/x", "rank-0000/./x", "rank-0000/", "/abs/x",
           "rank-0000/x/.", ".", ""]  # fmt: skip
    for rel in [*rels, *odd]:
        assert ds._shown(rel) == str(ds._at(rel)), rel
    assert sum(1 for _ in ds.rank_iter(0)) == len(rels)
    assert os.path.exists(ds._shown(rels[0]))


def _one_by_one(arrays: dict[str, np.ndarray]) -> str | None:
    """`value_problem` with the fast test taken away: every check in its order."""
    saved = core._values_in_range
    core._values_in_range = lambda arrays: False  # type: ignore[assignment]
    try:
        return core.value_problem(arrays)
    finally:
        core._values_in_range = saved


def test_the_in_range_test_never_passes_what_a_check_refuses(out: Path) -> None:
    mapped, head = _shard(out, padded=True)
    good = {k: np.array(a) for k, a in core._views(mapped, head, "shard").items()}
    assert core.value_problem(good) is None and core._values_in_range(good)
    pad = np.flatnonzero(good["sample_index"] == PAD_SAMPLE)
    real = np.flatnonzero(good["sample_index"] != PAD_SAMPLE)
    assert len(pad) and len(real)
    big = float(np.finfo(np.float32).max)
    edits: list[tuple[str, Any, Any]] = [
        ("input_ids", 0, -1), ("loss_mask", 0, 2), ("loss_mask", -1, 255),
        ("logprobs", 0, np.nan), ("logprobs", -1, np.inf), ("logprobs", 1, -np.inf),
        ("sample_index", 0, -2), ("seg_advantage", 0, np.nan), ("seg_advantage", 0, np.inf),
        ("seg_weight", 0, -1e-30), ("seg_weight", 0, np.nan), ("seg_weight", 0, np.inf),
        ("seg_weight", 0, -0.0), ("seg_weight", int(pad[0]), 0.5),
        ("seg_advantage", int(pad[0]), -0.25), ("seg_advantage", int(pad[0]), -0.0),
        ("seg_advantage", int(real[0]), big), ("seg_advantage", int(real[-1]), big),
        ("seg_weight", int(real[0]), big),
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    singles = list(edits)
    for _ in range(200):  # and random pairs of them
        a, b = rng.choice(len(singles), 2)
        edits.append(("pair", singles[a], singles[b]))
    for edit in edits:
        arrays = {k: a.copy() for k, a in good.items()}
        for key, i, v in [edit[1], edit[2]] if edit[0] == "pair" else [edit]:
            arrays[key][i] = v
        want = _one_by_one(arrays)
        assert core.value_problem(arrays) == want, edit
        if want is not None:
            assert not core._values_in_range(arrays), edit


def _checks_one_by_one(arrays: dict[str, np.ndarray], rows: int) -> str | None:
    """What `PackedReader._open_shard` asks of a shard's arrays before its layout when
    `core.shard_in_order` does not vouch for them: `check_rows`, the manifest's row count,
    `value_problem` (each check in its order)."""
    broken = check_rows(arrays)
    if broken is None and len(arrays["row_offsets"]) - 1 != rows:
        broken = "rows"
    return broken if broken is not None else _one_by_one(arrays)


def _edited(good: dict[str, np.ndarray], edit: tuple[str, Any, Any]) -> dict[str, np.ndarray]:
    """A copy of `good` with `edit`: (array, index, value) sets one value; ("dtype", k, t)
    casts array k; ("drop", k, _) removes it; ("extra", k, shape) adds one more array;
    ("2d", k, _) makes array k 2-D; ("cut", k, n) drops its last n values."""
    arrays = {k: a.copy() for k, a in good.items()}
    kind, key, value = edit
    if kind == "dtype":
        arrays[key] = arrays[key].astype(value)
    elif kind == "drop":
        del arrays[key]
    elif kind == "extra":
        arrays[key] = np.zeros(value, np.int64)
    elif kind == "2d":
        arrays[key] = arrays[key].reshape(1, -1)
    elif kind == "cut":
        arrays[key] = arrays[key][:-value]
    else:
        arrays[kind][key] = value
    return arrays


def test_the_shard_check_never_passes_what_a_check_refuses(out: Path) -> None:
    """`core.shard_in_order` (the reader's one pass over a shard's few segments) vouches for a
    shard only when `check_rows`, the row count and `value_problem` find nothing, and then
    gives `shard_counts`; on an untouched pack it vouches for every shard (the fast path
    really runs)."""
    ds = rolltool.open_packed(out)
    vouched = 0
    for ref in {r.file.path: r for rank in range(ds.dp) for r in ds.rank_rows(rank)}.values():
        mapped = core._open_local(out / ref.file.path)
        arrays = core._views(mapped, header_of(mapped, "s"), "s")
        assert core.shard_in_order(arrays, ref.file.rows) == core.shard_counts(arrays)
        vouched += 1
    assert vouched > 3
    mapped, head = _shard(out, padded=True)
    good = {k: np.array(a) for k, a in core._views(mapped, head, "shard").items()}
    rows = len(good["row_offsets"]) - 1
    pad = int(np.flatnonzero(good["sample_index"] == PAD_SAMPLE)[0])
    real = int(np.flatnonzero(good["sample_index"] != PAD_SAMPLE)[0])
    lens, big = int(good["seq_lens"][real]), float(np.finfo(np.float32).max)
    edits: list[tuple[str, Any, Any]] = [
        ("input_ids", 0, -1), ("loss_mask", 0, 2), ("logprobs", 0, np.nan), ("logprobs", 0, big),
        ("logprobs", -1, -np.inf), ("sample_index", 0, -2), ("sample_index", real, -1),
        ("sample_index", pad, 0), ("seg_advantage", 0, np.nan), ("seg_advantage", 0, np.inf),
        ("seg_advantage", real, big), ("seg_weight", 0, -1e-30), ("seg_weight", 0, np.nan),
        ("seg_weight", 0, -np.inf), ("seg_weight", 0, np.inf), ("seg_weight", -1, np.nan),
        ("seg_weight", 0, -0.0), ("seg_weight", real, big),
        ("seg_weight", pad, 0.5), ("seg_advantage", pad, -0.25), ("seg_advantage", pad, -0.0),
        ("seq_lens", real, lens + 1), ("seq_lens", real, 0), ("seq_lens", real, -lens),
        ("seq_lens", pad, 0), ("row_offsets", 0, 1), ("row_offsets", 1, 0),
        ("row_offsets", -1, 0), ("row_segments", 1, 0), ("row_segments", -1, 1),
        ("row_segments", 0, -1), ("dtype", "seq_lens", np.int64),
        ("dtype", "row_offsets", np.int32), ("dtype", "logprobs", np.float64),
        ("drop", "seg_weight", None), ("extra", "more", 3), ("extra", "more", (1, 3)), ("2d", "input_ids", None),
        ("cut", "input_ids", 1), ("cut", "loss_mask", 1), ("cut", "seg_weight", 1),
        ("cut", "row_offsets", 1), ("cut", "row_segments", 1),
    ]  # fmt: skip
    rng = np.random.default_rng(3)
    values = [e for e in edits if e[0] in good]
    for _ in range(300):  # random pairs of value edits, and values set at random
        a, b = rng.choice(len(values), 2)
        edits.append(("pair", values[a], values[b]))
        key = str(rng.choice(list(good)))
        i = int(rng.integers(len(good[key])))
        edits.append(("pair", (key, i, rng.choice([-1, 0, 1, 2, 7])), values[a]))
    refused = 0
    for edit in edits:
        if edit[0] == "pair":
            arrays = _edited(_edited(good, edit[1]), edit[2])
        else:
            arrays = _edited(good, edit)
        for n in (rows, rows + 1):
            want = _checks_one_by_one(arrays, n)
            got = core.shard_in_order(arrays, n)
            if want is None:  # it may still leave an odd shard to the checks (an extra array)
                assert got is None or got == core.shard_counts(arrays), edit
            else:
                assert got is None, (edit, want)
                refused += 1
    assert refused > len(edits)  # every rows + 1 and most edits refused


def test_the_shard_check_raises_no_floating_point_error() -> None:
    """`core.shard_in_order`'s sum of squares of the logprobs says nothing of its own under
    ``np.errstate(all="raise")`` or warnings as errors: a tiny logprob (its square underflows)
    is a shard as the checks one by one see it, a signalling NaN one they refuse."""
    arrays = {
        "input_ids": np.array([1, 2, 3], np.int32), "loss_mask": np.ones(3, np.uint8),
        "logprobs": np.array([-1e-20, -0.5, -1.0], np.float32),
        "seq_lens": np.array([3], np.int32), "sample_index": np.array([0], np.int64),
        "seg_advantage": np.array([0.5], np.float32), "seg_weight": np.ones(1, np.float32),
        "row_offsets": np.array([0, 3], np.int64), "row_segments": np.array([0, 1], np.int64),
    }  # fmt: skip
    signalling = arrays | {"logprobs": arrays["logprobs"].copy()}
    signalling["logprobs"][1:2].view(np.uint32)[0] = 0x7F800001
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _checks_one_by_one(arrays, 1) is None
        assert core.shard_in_order(arrays, 1) == core.shard_counts(arrays) == (1, 3, 3)
        assert core.shard_in_order(signalling, 1) is None
    assert _checks_one_by_one(signalling, 1) == "a non-finite logprob"


def test_the_lengths_test_never_passes_what_the_lengths_check_refuses() -> None:
    """`core._lengths_agree` (a few segments compared as lists) says True only where
    `lengths_problem`'s plain checks find nothing, and `lengths_problem` says the same with it
    or without it."""
    rng = np.random.default_rng(4)
    agreed = 0
    for _ in range(2000):
        k, n = int(rng.integers(0, 12)), int(rng.integers(1, 20))
        lengths = rng.integers(1, 6, n).astype(np.int64)
        index = rng.integers(-1, n + rng.choice([0, 0, 0, 2]), k).astype(np.int64)
        lens = np.where(index >= 0, lengths[np.clip(index, 0, n - 1)], rng.integers(1, 6, k))
        if k and rng.random() < 0.3:
            lens[rng.integers(k)] += rng.choice([-1, 1])
        arrays = {"sample_index": index, "seq_lens": lens.astype(np.int32),
                  "row_segments": np.array([0, k])}  # fmt: skip
        fast = core._lengths_agree(index, arrays["seq_lens"], lengths)
        saved = core._lengths_agree
        core._lengths_agree = lambda *a: False  # type: ignore[assignment]
        try:
            plain = core.lengths_problem(arrays, lengths)
        finally:
            core._lengths_agree = saved
        assert core.lengths_problem(arrays, lengths) == plain
        assert not (fast and plain is not None), (index, lens, lengths)
        agreed += fast
    assert 300 < agreed < 2000


def _positions(lens: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    return np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)


def test_segment_positions_is_arange_minus_repeated_starts() -> None:
    rng = np.random.default_rng(1)
    for _ in range(500):
        lens = rng.integers(0, rng.choice([4, 300, 5000]), size=rng.integers(0, 30))
        for dtype in (np.int64, np.int32):
            got = segment_positions(lens, dtype)
            assert got.dtype == dtype and np.array_equal(got, _positions(lens).astype(dtype))
    assert segment_positions([3, 2]).tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError):
        segment_positions(np.array([300, -1]))


def test_targets_of_many_padding_segments_are_those_of_few() -> None:
    """A row with more than _FEW_PADS padding segments (--cp) takes `no_target`'s gathered
    index, one with fewer fills slices: the same arrays either way."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        k = int(rng.integers(1, 40))
        lens = rng.integers(1, 50, size=k)
        index = np.where(rng.random(k) < rng.choice([0.0, 0.2, 0.6, 1.0]), -1, np.arange(k))
        cu = np.zeros(k + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        n = int(cu[-1])
        row = {"input_ids": rng.integers(0, 9, n).astype(np.int32),
               "loss_weight": rng.random(n).astype(np.float32),
               "advantages": rng.random(n).astype(np.float32),
               "logprobs": rng.random(n).astype(np.float32),
               "cu_seqlens": cu, "sample_index": index}  # fmt: skip
        got = next_token_targets(row)
        none = no_target(cu, index)
        for key, source, fill in (("target_ids", "input_ids", -100),
                                  ("target_loss_weight", "loss_weight", 0),
                                  ("target_advantages", "advantages", 0),
                                  ("target_logprobs", "logprobs", 0)):  # fmt: skip
            want = np.empty(n, dtype=row[source].dtype)
            want[:-1] = row[source][1:]
            want[none] = fill
            assert got[key].dtype == want.dtype and np.array_equal(got[key], want), key
    assert _FEW_PADS >= 1


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_dataloaders_workers_inherit_the_listing_and_the_lengths(
    out: Path, tmp_path: Path
) -> None:
    """torch_dataset(rank) lists the rank's shards and reads samples.parquet's lengths in the
    process that makes it: its workers read no samples.parquet (gone here after it was made)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    shutil.copytree(out, tmp_path / "out")
    ds = rolltool.open_packed(tmp_path / "out")
    data = ds.torch_dataset(1)
    (tmp_path / "out" / "samples.parquet").rename(tmp_path / "samples.parquet")
    items = list(DataLoader(data, batch_size=None, num_workers=2))
    assert len(items) == len(ds.rank_rows(1)) and isinstance(items[0]["input_ids"], torch.Tensor)
    with pytest.raises(RolltoolError, match=r"samples\.parquet"):  # a fresh one still needs it
        list(rolltool.open_packed(tmp_path / "out").torch_dataset(1))


def test_a_micro_batch_copies_as_a_dict(out: Path) -> None:
    pytest.importorskip("torch")
    import rolltool.packed.torch_data as torch_data

    item = next(iter(rolltool.open_packed(out).torch_dataset(0)))
    clone = copy.copy(item)
    assert type(clone) is torch_data.MicroBatch and clone == item and clone is not item
    assert all(clone[k] is item[k] for k in item)
