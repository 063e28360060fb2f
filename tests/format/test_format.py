"""The packed format's owner: manifest records round-trip exactly, anything else is refused with
a message naming the key; the writer commits only complete directories and bounds its queue."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from pack_helpers import pack

from rolltool.errors import RolltoolError
from rolltool.format import (
    MANIFEST,
    FileRecord,
    Manifest,
    is_packed_dir,
    shard_name,
)
from rolltool.format.layout import SampleTokens, pack_rows
from rolltool.format.shards import read_shard
from rolltool.packed.writer import PackedWriter


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fmt") / "packed"
    example = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
    pack(example, out, "--dp", 3, "--batch-size", 64)
    return out


def test_a_written_manifest_round_trips_exactly(packed: Path) -> None:
    doc = json.loads((packed / MANIFEST).read_text())
    m = Manifest.load(packed)
    assert m.to_json() == doc
    assert Manifest.from_json(m.to_json()) == m
    assert m.num_steps == doc["num_steps"] >= 2 and len(m.steps[0].ranks) == m.dp == 3
    assert is_packed_dir(packed) and not is_packed_dir(packed / "rank-0000")
    named = {f.path for st in m.steps for r in st.ranks for f in r.files}
    assert named | {"samples.parquet"} == set(m.files)
    assert all(Path(i.path).is_absolute() and i.given for i in m.inputs)


def _broken(packed: Path, edit: Any) -> Any:
    """The fixture's manifest edited in place by `edit`, or replaced by what it returns in a
    1-tuple (a lambda cannot assign)."""
    doc = json.loads((packed / MANIFEST).read_text())
    out = edit(doc)
    return out[0] if isinstance(out, tuple) else doc


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: ([],), "a JSON array, not an object"),
        (lambda d: ("x",), "a JSON string, not an object"),
        (lambda d: d.update(format="other"), "not a rolltool packed manifest"),
        (lambda d: d.update(format_version=99), "format version 99 is not supported"),
        (lambda d: d.pop("dp"), "key 'dp' is missing"),
        (lambda d: d.update(dp="8"), "'dp' must be an integer"),
        (lambda d: d["steps"][0].update(samples=True), "'steps[0].samples' must be an integer"),
        (lambda d: d["steps"][1]["ranks"].pop(), "steps[1] is step 1 with 2 ranks"),
        (lambda d: d.update(num_steps=7), "num_steps is 7"),
        (lambda d: d["steps"][0]["ranks"][0].update(files={}), "must be an array"),
        (lambda d: d["files"].update(x=[]), "'files.x' must be an object"),
        (lambda d: d["steps"][0]["envs"].update(math=None), "'steps[0].envs.math' must be"),
    ],
)
def test_a_manifest_of_another_shape_is_an_error_naming_the_key(
    packed: Path, edit: Any, message: str
) -> None:
    with pytest.raises(RolltoolError, match=message.replace("[", r"\[").replace(".", r"\.")):
        Manifest.from_json(_broken(packed, edit), "m.json")


def test_unknown_keys_are_ignored_and_defaults_fill_new_fields(packed: Path) -> None:
    def edit(d: dict) -> None:
        d["future_key"] = {"anything": 1}
        for i in d["inputs"]:
            i.pop("given")

    m = Manifest.from_json(_broken(packed, edit))
    assert all(i.given is None for i in m.inputs)


def test_the_recorded_config_is_typed_and_old_packs_get_its_defaults(packed: Path) -> None:
    """``config`` as packs before --sp/--cp, --equal-count-trim, --mini-batches and --epochs
    wrote it: what those packs did; a value of the wrong type names its key."""

    def old(d: dict) -> None:
        for key in ("sp", "cp", "equal_count_trim"):
            d["config"].pop(key)
        for key in ("mini_batches", "epochs"):
            d["config"]["steps"].pop(key)

    m = Manifest.from_json(_broken(packed, old))
    assert (m.config.sp, m.config.cp, m.config.equal_count_trim) == (1, 1, False)
    assert (m.config.steps.mini_batches, m.config.steps.epochs) == (1, 1)
    assert m.config.steps.batch_size == 64 and m.workload.kind == "flops"
    with pytest.raises(RolltoolError, match=r"'config\.steps\.epochs' must be an integer"):
        Manifest.from_json(_broken(packed, lambda d: d["config"]["steps"].update(epochs="2")))


def _rows(n_rows: int, tokens_per_row: int) -> Any:
    n = n_rows
    lengths = np.full(n, tokens_per_row, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    toks = SampleTokens(
        offsets=offsets,
        input_ids=np.arange(total, dtype=np.int32),
        loss_mask=np.ones(total, np.uint8),
        logprobs=np.zeros(total, np.float32),
    )
    return pack_rows(
        toks,
        [np.array([k]) for k in range(n)],
        sample_index=np.arange(n),
        advantage=np.ones(n, np.float32),
        weight=np.ones(n),
    )


def _manifest(packed: Path, ranks: list[Any] | None = None) -> Manifest:
    """The fixture's manifest with one step holding `ranks` (no steps without) and no files."""
    m = Manifest.load(packed)
    if ranks is None:
        return replace(m, steps=(), files={})
    return replace(m, dp=len(ranks), steps=(replace(m.steps[0], ranks=tuple(ranks)),), files={})


def test_the_writer_commits_only_after_finish(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="without finish"):
        with PackedWriter(out) as w:
            w.write_rank(0, 0, _rows(2, 5))
    assert list(tmp_path.iterdir()) == []  # no output, no temp sibling

    with pytest.raises(ValueError, match="boom"):
        with PackedWriter(out) as w:
            w.write_rank(0, 0, _rows(2, 5))
            raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_finish_refuses_a_manifest_that_does_not_name_the_files_written(
    tmp_path: Path, packed: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="manifest and files disagree"):
        with PackedWriter(out) as w:
            w.write_rank(0, 0, _rows(2, 5))
            w.write_samples(pa.table({"sample_index": [0, 1]}))
            w.finish(_manifest(packed))
    assert list(tmp_path.iterdir()) == []


def test_the_writer_bounds_queued_bytes_and_records_every_file(
    tmp_path: Path, packed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rolltool.packed.writer as writer_mod

    seen: list[int] = []
    real = writer_mod.write_shard

    def slow(*args: Any) -> Any:
        seen.append(w._pending_bytes)
        return real(*args)

    monkeypatch.setattr(writer_mod, "write_shard", slow)
    out = tmp_path / "out"
    # Rows of 100 tokens: 9 * 100 + 20 + 16 bytes each; shards of at most 2 rows.
    row = 9 * 100 + 20 + 16
    with PackedWriter(out, shard_bytes=2 * row, max_pending_bytes=3 * row, threads=1) as w:
        ranks = [w.write_rank(0, r, _rows(7, 100)) for r in range(3)]
        assert w._pending_bytes <= 3 * row
        w.write_samples(pa.table({"sample_index": np.arange(3)}))
        m = w.finish(_manifest(packed, ranks))
    assert len(seen) == 3 * 4  # 7 rows in parts of 2: 4 shards per rank
    assert max(seen) <= 3 * row
    for r, rank in enumerate(ranks):
        assert [f.path for f in rank.files] == [shard_name(0, r, p) for p in range(4)]
        assert [(f.first_row, f.rows) for f in rank.files] == [(0, 2), (2, 2), (4, 2), (6, 1)]
        assert rank.micro_batches == 7 and rank.samples == 7 and rank.real_tokens == 700
        got = np.concatenate([read_shard(out / f.path)["input_ids"] for f in rank.files])
        assert np.array_equal(got, np.arange(700))
    assert set(m.files) == {f.path for r in ranks for f in r.files} | {"samples.parquet"}
    assert all(isinstance(f, FileRecord) for f in m.files.values())
    assert Manifest.load(out) == m


def test_opening_an_output_a_killed_force_run_moved_aside_says_so(tmp_path: Path) -> None:
    import rolltool

    (tmp_path / ".packed.old-999999").mkdir()
    with pytest.raises(RolltoolError, match=r"moved aside") as e:
        rolltool.open_packed(tmp_path / "packed")
    assert e.value.hint and "restores it" in e.value.hint
    with pytest.raises(RolltoolError, match=r"no such directory$"):
        rolltool.open_packed(tmp_path / "other")
