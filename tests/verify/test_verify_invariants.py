"""One test per `verify` invariant: tamper with one thing, assert exactly the expected kinds.

Every edit rewrites the hashes of what it touched (see verify_helpers), so only the invariant
under test can tell; the expected kinds are all that may be reported, so a defect reported twice
fails the test.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack
from verify_helpers import (
    ARGS,
    Arrays,
    copier,
    edit_manifest,
    edit_samples,
    edit_segment,
    edit_shard,
    kinds,
    pack_layouts,
    rehash,
    samples,
    shards,
    trained_with_prompt,
)

from rolltool.format.shards import read_shard
from rolltool.verify import verify

LAYOUTS = {
    "base": ARGS,
    "padded": (*ARGS, "--row-len", 8192),
    "count": ("--dp", 2, "--batch-size", 16, "--micro-batch-size", 3, "--row-len", 16384),
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return pack_layouts(tmp_path_factory.mktemp("invariants"), LAYOUTS, groups=16, seed=3)


@pytest.fixture
def copy(packs: dict[str, Path], tmp_path: Path) -> Any:
    """copy(layout) -> a fresh copy of that pack to tamper with."""
    return copier(packs, tmp_path, default="base")


def _segments(out: Path) -> list[tuple[str, int, int, int]]:
    """(shard, segment k, its row in the shard, sample_index) of every segment."""
    found = []
    for name in shards(out):
        a = read_shard(out / name)
        rows = np.repeat(np.arange(len(a["row_segments"]) - 1), np.diff(a["row_segments"]))
        found += [(name, k, int(rows[k]), int(i)) for k, i in enumerate(a["sample_index"])]
    return found


def _status(out: Path, status: str) -> int:
    return int(np.flatnonzero(samples(out)["status"] == status)[0])


# -- files and hashes (they gate everything else) ------------------------------------------------


def test_files_and_hashes(copy: Any) -> None:
    out = copy()
    name = shards(out)[1]
    data = bytearray((out / name).read_bytes())
    data[-3] ^= 0x01
    (out / name).write_bytes(bytes(data))
    assert kinds(out) == {"file.hash": 1}
    (out / name).write_bytes(bytes(data) + b"x")
    assert kinds(out) == {"file.size": 1}
    (out / name).unlink()
    assert kinds(out) == {"file.missing": 1}


def test_a_file_the_steps_name_is_listed(copy: Any) -> None:
    out = copy()
    edit_manifest(out, lambda m: m["files"].pop("samples.parquet"))
    assert kinds(out) == {"file.unlisted": 1}


# -- samples.parquet -----------------------------------------------------------------------------


def _swap_first_two(v: np.ndarray) -> None:
    v[[0, 1]] = v[[1, 0]]


def test_samples_table(copy: Any) -> None:
    out = copy()
    edit_samples(out, "sample_index", _swap_first_two)
    assert kinds(out) == {"samples.order": 1}

    out = copy("padded")
    left = _status(out, "leftover")

    def too_many(v: np.ndarray) -> None:
        v[left] = 10**6

    edit_samples(out, "trainable_tokens", too_many)
    assert kinds(out) == {"samples.tokens": 1}


def test_samples_statuses_are_one_problem(copy: Any) -> None:
    out = copy()
    left = _status(out, "leftover")

    def rename(v: np.ndarray) -> None:
        v[left] = "bogus"

    edit_samples(out, "status", rename)
    assert kinds(out) == {"samples.status": 1}
    text = verify(out)["problems"][0]["text"]
    assert "'bogus' (unknown status)" in text and "leftover (the manifest says" in text


def test_a_trained_sample_outside_the_run(copy: Any) -> None:
    out = copy()
    i = _status(out, "trained")

    def far(v: np.ndarray) -> None:
        v[i] = 2  # dp is 2

    edit_samples(out, "rank", far)
    assert kinds(out) == {"samples.place": 1}


def test_unreadable_samples_parquet(copy: Any) -> None:
    out = copy()
    (out / "samples.parquet").write_bytes(b"not parquet")
    rehash(out, "samples.parquet")
    assert kinds(out) == {"samples.unreadable": 1}


# -- the ranks' records --------------------------------------------------------------------------


def test_rank_files(copy: Any) -> None:
    out = copy()
    edit_manifest(out, lambda m: m["steps"][0]["ranks"][1]["files"][0].update(first_row=1))
    assert kinds(out) == {"rank.files": 1}
    out = copy("padded")
    edit_manifest(out, lambda m: m["steps"][0]["ranks"][1].update(micro_batches=99))
    # The ranks disagree, and rank 1's files do not hold what its record says.
    assert kinds(out) == {"step.ranks": 1, "rank.files": 1}


@pytest.mark.parametrize("key", ["samples", "real_tokens", "tokens"])
def test_rank_counts(copy: Any, key: str) -> None:
    out = copy()
    edit_manifest(out, lambda m: m["steps"][1]["ranks"][0].update({key: 1}))
    assert kinds(out) == {"rank.counts": 1}


def test_env_records(copy: Any) -> None:
    out = copy()
    env = sorted(json.loads((out / "manifest.json").read_text())["steps"][0]["envs"])[0]
    edit_manifest(out, lambda m: m["steps"][0]["envs"][env].update(sampled_tokens=1))
    assert kinds(out) == {"step.counts": 1}
    edit_manifest(out, lambda m: m["steps"][0]["envs"].pop(env))
    assert kinds(out) == {"step.counts": 1}


# -- shards and rows -------------------------------------------------------------------------------


def test_a_corrupt_shard_is_one_problem(copy: Any) -> None:
    out = copy()
    name = shards(out)[0]
    data = bytearray((out / name).read_bytes())
    n = int.from_bytes(data[:8], "little")
    a, _ = json.loads(data[8 : 8 + n])["row_offsets"]["data_offsets"]
    data[8 + n + a] ^= 0x10
    (out / name).write_bytes(bytes(data))
    assert kinds(out) == {"file.hash": 1}
    # Its samples are not also missing, nor its rank's token count off.
    assert kinds(out, hashes=False) == {"shard.corrupt": 1}


def test_row_budget_size_and_length(copy: Any) -> None:
    out = copy()
    edit_manifest(out, lambda m: m["steps"][0]["plan"].update(max_tokens=1000))
    assert set(kinds(out)) == {"row.budget"}
    out = copy("count")
    edit_manifest(out, lambda m: m["steps"][0]["plan"].update(micro_batch_size=1))
    assert set(kinds(out)) == {"row.size"}
    out = copy("padded")
    edit_manifest(out, lambda m: m["config"].update(row_len=4096))
    assert kinds(out) == {"row.length": verify(out)["checked"]["rows"]}


def test_loss_mask_values_other_than_0_and_1(copy: Any) -> None:
    out = copy()
    i = trained_with_prompt(out)

    def two(a: Arrays, k: int, start: int) -> None:
        t = start + int(np.flatnonzero(a["loss_mask"][start:] == 1)[0])
        a["loss_mask"][t] = 2

    edit_segment(out, i, two)
    assert kinds(out) == {"row.mask": 1}


def _edit_padding(out: Path, edit: Any) -> None:
    name, k, _, _ = next(s for s in _segments(out) if s[3] == -1)

    def at(a: Arrays) -> None:
        edit(a, k, int(a["seq_lens"][:k].astype(np.int64).sum()))

    edit_shard(out, name, at)


PADDING_EDITS = {
    "loss_mask": lambda a, k, t: a["loss_mask"].__setitem__(t + 1, 1),
    "token": lambda a, k, t: a["input_ids"].__setitem__(t, 7),
    "logprob": lambda a, k, t: a["logprobs"].__setitem__(t, -1.0),
    "weight": lambda a, k, t: a["seg_weight"].__setitem__(k, 0.5),
    "advantage": lambda a, k, t: a["seg_advantage"].__setitem__(k, 0.5),
    "everything": lambda a, k, t: [f(a, k, t) for f in list(PADDING_EDITS.values())[:5]],
}


@pytest.mark.parametrize("what", PADDING_EDITS)
def test_padding_that_carries_something_is_one_problem(copy: Any, what: str) -> None:
    out = copy("padded")
    _edit_padding(out, PADDING_EDITS[what])
    assert kinds(out) == {"row.padding": 1}
    assert kinds(out, recorded_inputs=False) == {"row.padding": 1}


# -- where samples are -----------------------------------------------------------------------------


def test_a_bad_sample_index(copy: Any) -> None:
    out = copy("padded")
    _edit_padding(out, lambda a, k, t: a["sample_index"].__setitem__(k, -5))
    assert kinds(out) == {"segment.index": 1}


def _two_rows(out: Path) -> tuple[tuple[str, int, int], tuple[int, int]]:
    """((shard, segment, sample), (segment, sample)): samples in two rows of one shard (the
    first shard that has two rows with samples)."""
    segs = [s for s in _segments(out) if s[3] >= 0]
    for name, k1, row1, i1 in segs:
        other = [(k, i) for n, k, r, i in segs if n == name and r != row1]
        if other:
            return (name, k1, i1), other[0]
    raise AssertionError("no shard has two rows with samples")


def test_two_samples_swapped_between_rows(copy: Any) -> None:
    out = copy()
    (name, k1, i1), (k2, i2) = _two_rows(out)

    def swap(a: Arrays) -> None:
        a["sample_index"][[k1, k2]] = [i2, i1]

    edit_shard(out, name, swap)
    assert kinds(out) == {"sample.placement": 2}


def test_a_duplicated_sample(copy: Any) -> None:
    out = copy()
    (name, _, i1), (k2, i2) = _two_rows(out)
    edit_shard(out, name, lambda a: a["sample_index"].__setitem__(k2, i1))
    # The copy is misplaced and the sample it replaced is gone: two facts, two problems.
    assert kinds(out) == {"sample.placement": 1, "sample.missing": 1}
    report = verify(out)
    assert any(f"sample {i2}" in p["where"] for p in report["problems"])


def test_a_sample_turned_into_clean_padding_is_missing(copy: Any) -> None:
    out = copy()
    i = trained_with_prompt(out)

    def blank(a: Arrays, k: int, t: int) -> None:
        n = int(a["seq_lens"][k])
        a["sample_index"][k] = -1
        a["seg_weight"][k] = a["seg_advantage"][k] = 0
        a["input_ids"][t : t + n] = 0
        a["loss_mask"][t : t + n] = 0
        a["logprobs"][t : t + n] = 0

    edit_segment(out, i, blank)
    assert kinds(out) == {"sample.missing": 1}


def test_a_repeated_sample(copy: Any) -> None:
    out = copy()
    segs = [s for s in _segments(out) if s[3] >= 0]
    name, k1, _, i1 = next(
        s for s, t in itertools.pairwise(segs) if s[:1] == t[:1] and s[2] == t[2]
    )
    edit_shard(out, name, lambda a: a["sample_index"].__setitem__(k1 + 1, i1))
    found = kinds(out)
    assert {"sample.repeated", "sample.missing"} <= set(found), found
    # The second copy also differs from the record in what the two samples do not share.
    assert set(found) <= {"sample.repeated", "sample.missing", "sample.length", "sample.advantage"}


# -- per-sample fields -------------------------------------------------------------------------------


def test_a_moved_segment_boundary_is_one_problem_per_sample(copy: Any) -> None:
    out = copy()

    def move(a: Arrays) -> None:
        rs = a["row_segments"]
        r = int(np.flatnonzero(np.diff(rs) >= 2)[0])
        a["seq_lens"][rs[r]] -= 1
        a["seq_lens"][rs[r] + 1] += 1

    edit_shard(out, shards(out)[0], move)
    # Lengths are off; trainable counts and tokens of mis-sized segments are not judged again.
    assert kinds(out) == {"sample.length": 2}


def test_a_shard_weight_differs_from_samples_parquet(copy: Any) -> None:
    out = copy()
    i = trained_with_prompt(out)
    edit_segment(out, i, lambda a, k, t: a["seg_weight"].__setitem__(k, a["seg_weight"][k] * 2))
    assert kinds(out) == {"sample.weight": 1}


def test_a_weight_off_the_formula_in_both_records(packs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "packed"
    pack(packs["input"], out, *ARGS, "--loss-agg", "seq-mean-token-mean")
    i = trained_with_prompt(out)
    w = np.float32(samples(out)["token_loss_weight"][i] * (1 + 1e-6))
    edit_segment(out, i, lambda a, k, t: a["seg_weight"].__setitem__(k, w))
    edit_samples(out, "token_loss_weight", lambda v: v.__setitem__(i, w))
    assert kinds(out) == {"sample.formula": 1}


# -- against the input -------------------------------------------------------------------------------


def _edited_input(packs: dict[str, Path], tmp_path: Path, i: int, edit: Any) -> Path:
    t = pq.read_table(packs["input"])
    cols = {c: t.column(c).to_pylist() for c in ("input_ids", "loss_mask", "logprobs")}
    edit(cols, i)
    for c, values in cols.items():
        t = t.set_column(
            t.schema.get_field_index(c), t.schema.field(c), pa.array(values, t.schema.field(c).type)
        )
    path = tmp_path / "edited.parquet"
    pq.write_table(t, path)
    return path


def _longer(cols: dict[str, list[Any]], i: int) -> None:
    for c in cols:
        cols[c][i] = [*cols[c][i], cols[c][i][-1]]


def _mask_flip(cols: dict[str, list[Any]], i: int) -> None:
    # the last token's: the first's is never a target, so flipping it changes nothing packed
    # (issue 21, defect 3)
    cols["loss_mask"][i] = [*cols["loss_mask"][i][:-1], not cols["loss_mask"][i][-1]]


@pytest.mark.parametrize(
    ("edit", "kind"), [(_longer, "input.length"), (_mask_flip, "input.loss_mask")]
)
def test_the_input_differs(packs: dict[str, Path], tmp_path: Path, edit: Any, kind: str) -> None:
    i = trained_with_prompt(packs["base"])
    inp = _edited_input(packs, tmp_path, i, edit)
    report = verify(packs["base"], inputs=[inp])
    assert report["counts"] == {kind: 1} and report["problems"][0]["where"].endswith(f"sample {i}")


def test_an_unreadable_recorded_input(packs: dict[str, Path], tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    shutil.copy(packs["input"], inp)
    out = tmp_path / "packed"
    pack(inp, out, *ARGS)
    inp.write_bytes(b"garbage")
    report = verify(out)
    assert report["counts"] == {"input.unreadable": 1}
    assert report["input"].startswith("not compared") and "input_samples" not in report["checked"]
