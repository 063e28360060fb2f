"""The reader refuses corrupted data: every corruption is a `RolltoolError` naming the file.

A pristine pack (3 ranks, several steps, shards split by rows) is copied per test and corrupted
in place the way a disk, a copy or a hand edit would: a byte of a shard's arrays, two shards
swapped, a shard missing or extra, a manifest forged to another ``dp`` or ``num_steps``. Each is
refused through ``ds.micro_batches`` and through iterating ``ds.torch_dataset`` (the two ways a
trainer reads). An untouched pack reads the same rows as a reference read built with the
``safetensors`` library (independent of rolltool's shard reader).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack
from safetensors import safe_open
from verify_helpers import kinds

import rolltool
import rolltool.packed.core as core
import rolltool.packed.reader as reader
from rolltool.errors import RolltoolError
from rolltool.format import ShardRef

DP = 3


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> Path:
    tmp = tmp_path_factory.mktemp("integrity")
    pq.write_table(synth_table, tmp / "in.parquet")
    pack(tmp / "in.parquet", tmp / "out", "--dp", DP, "--batch-size", 24, "--keep-last",
         "--micro-batch-tokens", 4096, "--shard-mb", 0.05)  # fmt: skip
    return tmp / "out"


@pytest.fixture(autouse=True, params=["read", "mapped"])
def opened_as(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test twice: the reader reading each shard whole (`core.PrivateRead`, as it does
    these small ones) and mapping it (`core.PrivateMap`, as it does a shard over
    `core.READ_WHOLE_BYTES`): the same refusals with the same messages either way."""
    want = core.PrivateRead if request.param == "read" else core.PrivateMap
    if request.param == "mapped":
        monkeypatch.setattr(core, "READ_WHOLE_BYTES", 0)
    real, opened = core._open_local, []

    def spy(path: Any) -> Any:
        shard = real(path)
        opened.append(type(shard))
        return shard

    monkeypatch.setattr(core, "_open_local", spy)
    yield request.param
    assert all(kind in (want, type(None)) for kind in opened), opened


@pytest.fixture
def out(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "out")
    return tmp_path / "out"


@pytest.fixture(scope="module")
def padded_pristine(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> Path:
    """The same pack with every row padded to 4,096 tokens (``--row-len``): padding segments
    (sample_index -1) beside trainable tokens in every shard, whatever the plan (a plan with no
    empty micro-batch has none otherwise)."""
    tmp = tmp_path_factory.mktemp("integrity-padded")
    pq.write_table(synth_table, tmp / "in.parquet")
    pack(tmp / "in.parquet", tmp / "out", "--dp", DP, "--batch-size", 24, "--keep-last",
         "--micro-batch-tokens", 4096, "--row-len", 4096, "--shard-mb", 0.05)  # fmt: skip
    return tmp / "out"


@pytest.fixture
def padded_out(padded_pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(padded_pristine, tmp_path / "out")
    return tmp_path / "out"


# -- helpers ---------------------------------------------------------------------------------


def _refs(out: Path) -> list[tuple[int, int, ShardRef]]:
    """(step, rank, shard) of every shard the manifest lists."""
    m = rolltool.open_packed(out).manifest
    return [
        (s, r, f) for s, st in enumerate(m.steps) for r, rk in enumerate(st.ranks) for f in rk.files
    ]


def _poke(path: Path, name: str, index: int, value: Any) -> None:
    """Set element `index` of tensor `name` in the file itself (header and metadata untouched)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
    dtype = {"I32": "<i4", "I64": "<i8", "U8": "u1", "F32": "<f4"}[info["dtype"]]
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    a, b = info["data_offsets"]
    mm[8 + n + a : 8 + n + b].view(dtype)[index] = value
    mm.flush()
    del mm


def _edit_manifest(out: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    doc = json.loads((out / "manifest.json").read_text())
    edit(doc)
    (out / "manifest.json").write_text(json.dumps(doc))


def _refused(out: Path, step: int, rank: int, match: str, **kwargs: Any) -> None:
    """Both read paths refuse (step, rank) with a RolltoolError matching `match` + the hint."""
    with pytest.raises(RolltoolError, match=match) as e:
        rolltool.open_packed(out, **kwargs).micro_batches(step, rank)
    assert e.value.hint is not None and "rolltool verify" in e.value.hint
    with pytest.raises(RolltoolError, match=match):
        list(rolltool.open_packed(out, **kwargs).torch_dataset(rank))


def _reference_rows(out: Path, step: int, rank: int) -> list[dict[str, np.ndarray]]:
    """The rows of (step, rank), read with the safetensors library and plain loops."""
    rows = []
    for f in json.loads((out / "manifest.json").read_text())["steps"][step]["ranks"][rank]["files"]:
        with safe_open(out / f["path"], framework="numpy") as st:
            a = {k: st.get_tensor(k) for k in st.keys()}
        for r in range(len(a["row_offsets"]) - 1):
            t0, t1 = a["row_offsets"][r], a["row_offsets"][r + 1]
            s0, s1 = a["row_segments"][r], a["row_segments"][r + 1]
            adv, weight, pos = [], [], []
            for s in range(s0, s1):
                n = int(a["seq_lens"][s])
                adv += [a["seg_advantage"][s]] * n
                weight += [a["seg_weight"][s]] * n
                pos += list(range(n))
            mask = a["loss_mask"][t0:t1]
            row = {
                "input_ids": a["input_ids"][t0:t1],
                "position_ids": np.array(pos),
                "loss_mask": mask,
                "advantages": np.array(adv, dtype=np.float32),
                "logprobs": a["logprobs"][t0:t1],
                "loss_weight": np.array(weight, dtype=np.float32) * mask,
            }
            lens, index = a["seq_lens"][s0:s1], a["sample_index"][s0:s1]
            segments = {"cu_seqlens": np.concatenate([[0], np.cumsum(lens)]), "sample_index": index}
            rows.append(row | _reference_targets(row, lens, index) | segments)
    return rows


def _reference_targets(
    row: dict[str, np.ndarray], seq_lens: np.ndarray, sample_index: np.ndarray
) -> dict[str, np.ndarray]:
    """The next-token targets, a loop per segment: token t of a sample has token t+1's id,
    weight, advantage and log-prob; a sample's last token and padding have -100 / 0."""
    shifted = {"target_ids": "input_ids", "target_loss_weight": "loss_weight",
               "target_advantages": "advantages", "target_logprobs": "logprobs"}  # fmt: skip
    out: dict[str, list[Any]] = {k: [] for k in shifted}
    start = 0
    for n, sample in zip(seq_lens.tolist(), sample_index.tolist(), strict=True):
        for t in range(start, start + n):
            has = sample >= 0 and t < start + n - 1
            for key, source in shifted.items():
                out[key].append(row[source][t + 1] if has else -100 if key == "target_ids" else 0)
        start += n
    dtype = {k: np.int32 if k == "target_ids" else np.float32 for k in shifted}
    return {k: np.array(v, dtype=dtype[k]) for k, v in out.items()}


# -- an untouched pack -----------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["checks", "hash"])
def test_an_untouched_pack_reads_the_reference_rows(pristine: Path, verify: str) -> None:
    ds = rolltool.open_packed(pristine, verify=verify)
    assert ds.dp == DP and ds.num_steps > 2
    compared = 0
    for step in range(ds.num_steps):
        for rank in range(DP):
            got, want = ds.micro_batches(step, rank), _reference_rows(pristine, step, rank)
            assert len(got) == len(want) > 0
            for g, w in zip(got, want, strict=True):
                assert g.keys() == w.keys()
                for k in g:
                    assert np.array_equal(g[k], w[k]), (step, rank, k)
                compared += 1
    assert compared == sum(len(ds.rank_rows(r)) for r in range(DP))
    streamed = sum(1 for r in range(DP) for _ in ds.torch_dataset(r))
    assert streamed == compared


def test_an_unknown_verify_mode_is_refused(pristine: Path) -> None:
    with pytest.raises(RolltoolError, match="verify='sha'"):
        reader.open_packed(pristine, verify="sha")  # type: ignore[arg-type]


# -- shard bytes -----------------------------------------------------------------------------


def _head(path: Path) -> dict[str, np.ndarray]:
    with safe_open(path, framework="numpy") as st:
        return {k: st.get_tensor(k) for k in ("loss_mask", "sample_index")}


def _has_padding_and_trained(a: dict[str, np.ndarray]) -> bool:
    return bool(a["loss_mask"].any() and (a["sample_index"] == -1).any())


VALUE_CORRUPTIONS = [
    ("loss_mask", lambda a: int(np.argmax(a["loss_mask"])), 254, "loss_mask value other than 0/1"),
    ("input_ids", lambda a: 0, -7, "negative token id"),
    ("logprobs", lambda a: 0, np.nan, "non-finite logprob"),
    ("seg_weight", lambda a: 0, -1.0, "negative or NaN loss weight"),
    ("seg_weight", lambda a: 0, np.nan, "negative or NaN loss weight"),
    ("seg_weight", lambda a: 0, np.inf, "infinite loss weight"),
    ("seg_advantage", lambda a: 0, np.inf, "non-finite advantage"),
    ("sample_index", lambda a: 0, -5, "sample_index below -1"),
    ("seg_weight", lambda a: int(np.argmin(a["sample_index"])), 3.0, "padding segment"),
    ("seq_lens", lambda a: 0, 0, "a segment has no tokens"),
    ("seq_lens", lambda a: 0, 10**6, "segment lengths do not add up"),
    ("row_offsets", lambda a: 1, 10**9, "row_offsets do not run"),
]


@pytest.mark.parametrize(("name", "where", "value", "match"), VALUE_CORRUPTIONS)
def test_a_corrupted_value_is_refused(
    padded_out: Path, name: str, where: Callable[[Any], int], value: Any, match: str
) -> None:
    # a shard with padding (sample_index -1) and a trainable token, so every case applies
    out = padded_out
    step, rank, f, a = next(
        (s, r, f, a) for s, r, f in _refs(out) if _has_padding_and_trained(a := _head(out / f.path))
    )
    _poke(out / f.path, name, where(a), value)
    _refused(out, step, rank, f"{f.path}: corrupt shard.*{match}")


def test_a_flipped_byte_in_range_is_refused_by_hash(out: Path) -> None:
    step, rank, f = _refs(out)[-1]
    with safe_open(out / f.path, framework="numpy") as st:
        token = int(st.get_tensor("input_ids")[3])
    _poke(out / f.path, "input_ids", 3, token ^ 1)  # still a valid token id: only a hash sees it
    assert rolltool.open_packed(out).micro_batches(step, rank)  # the cheap checks cannot
    _refused(out, step, rank, f"{f.path}: sha256 differs", verify="hash")


def test_hash_mode_hashes_each_shard_once(pristine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    real = core.sha256_of

    def spy(data: Any) -> str:
        hashed.append(data.path)  # local shards are hashed as mapped
        return real(data)

    monkeypatch.setattr(core, "sha256_of", spy)
    ds = rolltool.open_packed(pristine, verify="hash")
    for _ in range(2):
        assert sum(1 for _ in ds.rank_iter(1)) == len(ds.rank_rows(1))
    assert sorted(hashed) == sorted({str((pristine / r.file.path).absolute())
                                     for r in ds.rank_rows(1)})  # fmt: skip
    rolltool.open_packed(pristine).micro_batches(0, 1)
    assert len(hashed) == len(set(hashed))  # the default mode hashes nothing


def test_hash_mode_hashes_the_bytes_it_serves_not_the_path(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the shard is mapped, then replaced by a good copy under its name: the hash must be of the
    # mapped (flipped) bytes that the rows are read from, not of the file the path now names
    step, rank, f = _refs(out)[-1]
    good = out / "good.copy"
    shutil.copyfile(out / f.path, good)
    with safe_open(out / f.path, framework="numpy") as st:
        token = int(st.get_tensor("input_ids")[3])
    _poke(out / f.path, "input_ids", 3, token ^ 1)  # a valid token id: only a hash sees it
    real = core._open_local

    def map_then_replace(path: Any) -> Any:
        mapped = real(path)
        if good.exists():
            good.replace(out / f.path)
        return mapped

    monkeypatch.setattr(core, "_open_local", map_then_replace)
    with pytest.raises(RolltoolError, match=f"{f.path}: sha256 differs"):
        rolltool.open_packed(out, verify="hash").micro_batches(step, rank)


def test_any_flipped_byte_is_refused_by_hash_and_never_a_traceback(out: Path) -> None:
    # header (length prefix, JSON, metadata) and data alike; the default mode serves the flips
    # it cannot tell from data (a token id, a logprob) and refuses the rest as RolltoolError
    step, rank, f = _refs(out)[0]
    path = out / f.path
    good = path.read_bytes()
    rng = np.random.default_rng(0)
    positions = [*range(16), *rng.integers(0, len(good), 80)]
    refused = 0
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(bad)
        with pytest.raises(RolltoolError, match=r"rolltool verify|sha256"):
            rolltool.open_packed(out, verify="hash").micro_batches(step, rank)
        try:
            rolltool.open_packed(out).micro_batches(step, rank)
        except RolltoolError:  # any other exception fails the test
            refused += 1
    path.write_bytes(good)
    assert 0 < refused < len(positions)  # both outcomes were exercised
    restored = rolltool.open_packed(out, verify="hash").micro_batches(step, rank)
    assert len(restored) == len(_reference_rows(out, step, rank))


def test_a_truncated_shard_is_refused(out: Path) -> None:
    step, rank, f = _refs(out)[0]
    data = (out / f.path).read_bytes()
    (out / f.path).write_bytes(data[:-4])
    _refused(out, step, rank, f"{f.path}: {len(data) - 4} bytes, the manifest says {len(data)}")


# -- shards swapped, missing or extra -----------------------------------------------------------


def _swap(out: Path, a: str, b: str) -> None:
    tmp = out / "swap.tmp"
    (out / a).rename(tmp)
    (out / b).rename(out / a)
    tmp.rename(out / b)


@pytest.mark.parametrize("between", ["ranks", "steps"])
def test_swapped_shards_are_refused_naming_both(out: Path, between: str) -> None:
    refs = [(s, r, f) for s, r, f in _refs(out) if f.first_row == 0]
    s0, r0, a = refs[0]
    s1, r1, b = next(
        (s, r, f)
        for s, r, f in refs
        if (s == s0 and r != r0 if between == "ranks" else r == r0 and s != s0)
    )
    _swap(out, a.path, b.path)
    match = (
        f"{a.path}: holds step {s1} rank {r1} rows from 0 .*lists it as step {s0} rank {r0} "
        f".*belong in {b.path}"
    )
    _refused(out, s0, r0, match)


def test_a_missing_shard_is_refused(out: Path) -> None:
    _, rank, f = _refs(out)[-1]
    (out / f.path).unlink()
    # any step of that rank: the rank's folder is compared with the manifest on its first read
    _refused(out, 0, rank, f"{f.path}: listed in the manifest but missing")


def test_an_extra_shard_is_refused(out: Path) -> None:
    step, rank, f = _refs(out)[0]
    extra = f.path.replace("-00.", "-77.")
    shutil.copy(out / f.path, out / extra)
    _refused(out, step, rank, f"{extra}: present but not listed in the manifest")


# -- forged manifests ------------------------------------------------------------------------


def _set_dp(doc: dict[str, Any], dp: int, ranks: Callable[[list[Any]], list[Any]]) -> None:
    doc["dp"] = doc["config"]["dp"] = dp
    for st in doc["steps"]:
        st["ranks"] = ranks(st["ranks"])
        st["plan"]["dp"] = dp
        st["plan"]["samples_per_rank"] = (st["plan"]["samples_per_rank"] * 2)[:dp]


def _dp_down(doc: dict[str, Any]) -> None:
    _set_dp(doc, DP - 1, lambda ranks: ranks[: DP - 1])
    doc["files"] = {k: v for k, v in doc["files"].items() if not k.startswith(f"rank-{DP - 1:04d}")}


def _drop_steps_after(doc: dict[str, Any], n: int) -> None:
    gone = {f["path"] for st in doc["steps"][n:] for rk in st["ranks"] for f in rk["files"]}
    doc["steps"] = doc["steps"][:n]
    doc["num_steps"] = n
    doc["files"] = {k: v for k, v in doc["files"].items() if k not in gone}


def _repeat_last_step(doc: dict[str, Any]) -> None:
    doc["steps"].append(dict(doc["steps"][-1], step=len(doc["steps"])))
    doc["num_steps"] = len(doc["steps"])


FORGED = {
    "dp down": (_dp_down, "dp = 2 but the directory holds rank-0002/"),
    "dp up, ranks repeated": (lambda d: _set_dp(d, DP + 1, lambda ranks: ranks + ranks[:1]), "is listed for step 0 rank 0 and again for step 0 rank 3"),
    "dp up, ranks empty": (lambda d: _set_dp(d, DP + 1, lambda ranks: [*ranks, dict(ranks[0], files=[])]), "step 0 rank 3: its files do not hold rows"),
    "dp only": (lambda d: d.update(dp=DP + 1), "expected step 0 with dp = 4"),
    "plan dp only": (lambda d: d["steps"][1]["plan"].update(dp=DP + 1), "step 1's plan is for dp = 4"),
    "num_steps down": (lambda d: _drop_steps_after(d, 2), "present but not listed in the manifest"),
    "num_steps up": (_repeat_last_step, "is listed for step .* and again for step"),
    "num_steps only": (lambda d: d.update(num_steps=d["num_steps"] + 1), "num_steps is"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_manifest_is_refused_not_an_index_error(out: Path, case: str) -> None:
    edit, match = FORGED[case]
    _edit_manifest(out, edit)
    try:
        ds = rolltool.open_packed(out)
    except RolltoolError as e:  # from_json's own shape checks
        assert str(out / "manifest.json") in e.message and match.split(".*")[0] in e.message
        return
    refused = set()
    for rank in range(ds.dp):  # any other exception (IndexError, KeyError) fails the test
        for read in (
            lambda r=rank: ds.micro_batches(0, r),
            lambda r=rank: list(ds.torch_dataset(r)),
        ):
            try:
                read()
            except RolltoolError as e:
                assert re.search(match, e.message), e.message
                refused.add(rank)
    # an added rank that lists no files is refused only when it is read
    assert refused == ({DP} if case == "dp up, ranks empty" else set(range(ds.dp)))


# -- rows that hold together but do not fit the manifest (issue 20) -----------------------------

LAYOUTS = {"sp": ("--sp", 2), "cp": ("--cp", 2), "epochs": ("--epochs", 2)}
"""The newer pack kinds: --sp 2 and --cp 2 groups, and --epochs 2 (format version 2)."""


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("layouts")
    pq.write_table(synth_table, tmp / "in.parquet")
    for name, args in LAYOUTS.items():
        pack(tmp / "in.parquet", tmp / name, "--dp", DP, "--batch-size", 24, "--keep-last",
             "--micro-batch-tokens", 4096, "--shard-mb", 0.05, *args)  # fmt: skip
    return {name: tmp / name for name in LAYOUTS}


def _copy_of(layouts: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    shutil.copytree(layouts[kind], tmp_path / kind)
    return tmp_path / kind


def _rehash(out: Path, name: str) -> None:
    """The manifest's size and sha256 of `name` made current: only the structure can tell."""
    _edit_manifest(out, lambda d: d["files"].update({name: vars(core.file_record(out / name))}))


def _move_a_token(out: Path, into: str) -> tuple[int, int, str]:
    """One token of the first row with a sample followed by a segment of kind `into`
    ("sample": the next sample's first token, "padding": its own CP padding's) moved into that
    sample: its seq_lens +1, the next one's -1, nothing else changed; the shard rehashed.
    Returns (step, rank, shard)."""
    for step, rank, f in _refs(out):
        with safe_open(out / f.path, framework="numpy") as st:
            lens, index = st.get_tensor("seq_lens"), st.get_tensor("sample_index")
            starts = set(st.get_tensor("row_segments").tolist())
        for k in range(len(lens) - 1):
            nxt = index[k + 1] >= 0 if into == "sample" else index[k + 1] == -1 and lens[k + 1] > 1
            if index[k] >= 0 and nxt and k + 1 not in starts:
                _poke(out / f.path, "seq_lens", k, int(lens[k]) + 1)
                _poke(out / f.path, "seq_lens", k + 1, int(lens[k + 1]) - 1)
                _rehash(out, f.path)
                return step, rank, f.path
    raise AssertionError(f"no sample followed by a {into} segment")


def _read_all(out: Path, **kwargs: Any) -> int:
    """Every rank's rows (and each GPU's view of them, with --sp/--cp); the rows read."""
    ds = rolltool.open_packed(out, **kwargs)
    rows = sum(1 for r in range(ds.dp) for _ in ds.rank_iter(r))
    for key, size in (("sp_rank", ds.split.sp), ("cp_rank", ds.split.cp)):
        for g in range(size if size > 1 else 0):
            assert sum(1 for r in range(ds.dp) for _ in ds.rank_iter(r, **{key: g})) == rows
    return rows


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_untouched_split_and_epoch_packs_read_and_verify(
    layouts: dict[str, Path], kind: str
) -> None:
    assert kinds(layouts[kind]) == {}
    ds = rolltool.open_packed(layouts[kind], verify="hash")
    assert _read_all(layouts[kind]) == sum(len(ds.rank_rows(r)) for r in range(DP)) > 0


MOVED = {
    "cp": r"rows not laid out .*--cp 2",  # the sample is no longer CP-padded
    "sp": r"rows not as samples.parquet says \(row \d+: sample \d+ holds \d+ tokens, "
    r"samples.parquet says \d+\)",
    "epochs": r"rows not as samples.parquet says \(row \d+: sample \d+ holds",
}
"""What the reader says of a token moved between two samples: in (a) --sp 2 and (b) --epochs 2
packs every array but seq_lens, every sum and every (token-mean) weight stay the same: only
the samples' own lengths (samples.parquet) show it."""


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_token_moved_across_a_sample_boundary_is_refused(
    layouts: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    out = _copy_of(layouts, kind, tmp_path)
    step, rank, path = _move_a_token(out, "sample")
    assert kinds(out).get("sample.length") == 2  # verify: both samples, by their records
    for verify in ("checks", "hash"):
        _refused(out, step, rank, f"{re.escape(path)}: {MOVED[kind]}", verify=verify)


def test_a_padding_token_moved_into_its_sample_is_refused(
    layouts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --cp 2: the sample stays CP-padded (n + 1 tokens, padding - 1), but it holds one real
    # token more than samples.parquet and the rank's record say
    out = _copy_of(layouts, "cp", tmp_path)
    step, rank, path = _move_a_token(out, "padding")
    assert kinds(out).get("sample.length") == 1
    _refused(out, step, rank, f"{re.escape(path)}: rows not as samples.parquet says")
    # without the length check, the counts: a (step, rank) split over shards is judged when
    # the last of them is mapped
    monkeypatch.setattr(core, "lengths_problem", lambda arrays, lengths: None)
    shard = re.escape(path.rsplit("-", 1)[0]) + r"-\d+\.safetensors"
    _refused(out, step, rank, f"{shard}: step {step} rank {rank}: its rows hold .* real tokens")


def test_a_manifest_cp_edited_is_refused(layouts: dict[str, Path], tmp_path: Path) -> None:
    # (c): an --epochs 2 pack (cp 1) whose config says cp 2; the manifest's own hash is in no
    # record, so verify="hash" has nothing to compare: the shards' layout shows it
    out = _copy_of(layouts, "epochs", tmp_path)
    _edit_manifest(out, lambda d: d["config"].update(cp=2))
    assert kinds(out).get("row.split", 0) > 0
    for verify in ("checks", "hash"):
        with pytest.raises(RolltoolError, match=r"rows not laid out .*--cp 2") as e:
            _read_all(out, verify=verify)
        assert e.value.hint is not None and "rolltool verify" in e.value.hint


@pytest.mark.parametrize("damage", ["deleted", "not parquet", "no length column"])
def test_samples_parquet_that_cannot_give_the_lengths_is_refused(out: Path, damage: str) -> None:
    # the reader's length check reads samples.parquet: a directory without a usable one is not
    # served (it is a listed file of every pack), and the error names it
    target = out / "samples.parquet"
    if damage == "deleted":
        target.unlink()
    elif damage == "not parquet":
        target.write_bytes(b"not a parquet file")
    else:
        pq.write_table(pq.read_table(target).drop_columns(["length"]), target)
    _refused(out, 0, 0, re.escape(str(target)) + ": (missing or unreadable|corrupt)")
