"""`rolltool pack` end to end on synthetic data: every sample lands once, unchanged; verify.

One pack of a small synth dataset (24 groups, samples up to 8,192 tokens, split over two files)
with uniform-group dropping, over-long dropping and leftovers, so every sample status occurs.
Expected values come from the input Parquet read directly, not from rolltool.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, grpo_reference, input_samples, pack, placements, samples
from safetensors.numpy import load_file, save_file

import rolltool
from rolltool.errors import RolltoolError
from rolltool.format.shards import file_record
from rolltool.input.synth import SynthConfig, generate

ROOT = Path(__file__).resolve().parents[2]
ARGS = ("--dp", 3, "--batch-size", 48, "--micro-batch-tokens", 6144, "--overlong", "drop",
        "--uniform", "drop")  # fmt: skip
NOT_TRAINED = {"uniform_dropped", "overlong_dropped", "leftover"}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Synth data written as two files (sorted path order != generation order), packed once."""
    tmp = tmp_path_factory.mktemp("e2e")
    table = generate(SynthConfig(groups=24, seed=0, max_len=8192))
    half = table.num_rows // 2
    (tmp / "in").mkdir()
    pq.write_table(table.slice(half), tmp / "in" / "a.parquet")
    pq.write_table(table.slice(0, half), tmp / "in" / "b.parquet")
    inputs = [tmp / "in" / "a.parquet", tmp / "in" / "b.parquet"]
    out = tmp / "packed"
    manifest = pack(inputs, out, *ARGS)
    return {
        "inputs": inputs,
        "out": out,
        "manifest": manifest,
        "input": input_samples(inputs),
        "samples": samples(out),
        "placed": placements(out),
    }


def test_every_sample_is_trained_once_or_reported(e2e: dict[str, Any]) -> None:
    inp, s, placed = e2e["input"], e2e["samples"], e2e["placed"]
    n = len(inp["sample_id"])
    assert len(s["sample_index"]) == n and s["sample_index"].tolist() == list(range(n))
    statuses = Counter(s["status"].tolist())
    # Not vacuous: the run trains most samples and reports some of each kind of exclusion.
    assert statuses["trained"] > n // 3, statuses
    assert all(statuses[k] > 0 for k in NOT_TRAINED), statuses
    assert set(statuses) <= {"trained"} | NOT_TRAINED
    for i in range(n):
        segs = placed.get(i, [])
        if s["status"][i] == "trained":
            assert len(segs) == 1, (i, len(segs))
            seg = segs[0]
            assert (seg.step, seg.rank, seg.micro_batch) == (
                s["step"][i],
                s["rank"][i],
                s["micro_batch"][i],
            )
        else:
            assert segs == [], (i, s["status"][i])
    assert sum(len(v) for v in placed.values()) == statuses["trained"]
    assert set(placed) <= set(range(n))
    # samples.parquet carries the input's ids (sample_index = row in sorted-path order).
    for key in ("sample_id", "group_id", "rollout_id", "env"):
        assert s[key].tolist() == inp[key], key
    # Manifest counts agree with samples.parquet, and the inputs are listed with their rows.
    m = e2e["manifest"]
    assert m["samples"]["total"] == n
    assert all(m["samples"][k] == statuses[k] for k in statuses)
    assert [(Path(x["path"]).name, x["rows"]) for x in m["inputs"]] == [
        (p.name, pq.read_metadata(p).num_rows) for p in e2e["inputs"]
    ]


def test_tokens_mask_advantage_logprobs_unchanged(e2e: dict[str, Any]) -> None:
    inp, placed = e2e["input"], e2e["placed"]
    expected_adv = grpo_reference(inp)
    checked = 0
    for i, segs in placed.items():
        a = segs[0].arrays
        ids = np.asarray(inp["input_ids"][i], dtype=np.int64)
        assert np.array_equal(a["input_ids"], ids), i
        assert np.array_equal(a["loss_mask"], np.asarray(inp["loss_mask"][i], dtype=np.uint8)), i
        assert np.array_equal(a["logprobs"], np.asarray(inp["logprobs"][i], dtype=np.float32)), i
        assert np.array_equal(a["position_ids"], np.arange(len(ids))), i
        np.testing.assert_allclose(a["advantages"], expected_adv[i], rtol=1e-5, atol=1e-6)
        assert np.all(a["advantages"] == a["advantages"][0])
        checked += 1
    assert checked == sum(1 for v in e2e["samples"]["status"] if v == "trained") > 100


def test_groups_are_never_split_and_dropped_groups_are_whole(e2e: dict[str, Any]) -> None:
    inp, s = e2e["input"], e2e["samples"]
    by_group: dict[str, set[tuple[str, int]]] = {}
    for g, st, step in zip(inp["group_id"], s["status"], s["step"], strict=True):
        if st != "overlong_dropped":  # an over-long sample leaves its group, the group stays
            by_group.setdefault(g, set()).add((st, int(step)))
    assert len(by_group) > 10
    for g, where in by_group.items():
        assert len(where) == 1, (g, where)
    # Uniform dropping only ever drops groups whose rewards are all equal.
    for g, where in by_group.items():
        if next(iter(where))[0] == "uniform_dropped":
            rewards = {r for gg, r in zip(inp["group_id"], inp["reward"], strict=True) if gg == g}
            assert len(rewards) == 1, g


def test_verify_accepts_the_output(e2e: dict[str, Any]) -> None:
    result = cli("verify", e2e["out"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK")
    report = json.loads(cli("verify", e2e["out"], "--json").stdout)
    assert report["ok"] and report["checked"]["segments"] == len(e2e["placed"])
    assert report["checked"]["files"] == len(e2e["manifest"]["files"])


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob("rank-*/step-*.safetensors"))


def test_a_corrupt_shard_byte_fails_verify(e2e: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "packed"
    shutil.copytree(e2e["out"], out)
    shard = _shards(out)[len(_shards(out)) // 2]
    data = bytearray(shard.read_bytes())
    data[len(data) - 7] ^= 0x01  # inside the tensor data, same size
    shard.write_bytes(bytes(data))
    result = cli("verify", out)
    assert result.exit_code == 1
    assert shard.relative_to(out).as_posix() in result.stdout and "sha256" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def _tamper_first_shard(out: Path, edit: Any) -> None:
    """Edit the first shard's arrays and record its new hash, so only the invariants can tell."""
    shard = _shards(out)[0]
    arrays = {k: v.copy() for k, v in load_file(shard).items()}
    edit(arrays)
    save_file(arrays, shard)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][shard.relative_to(out).as_posix()] = vars(file_record(shard))
    manifest_path.write_text(json.dumps(manifest))


def _double_weights(a: dict[str, np.ndarray]) -> None:
    # Shards store per-token loss_weight, or one weight per segment that the reader broadcasts.
    a["loss_weight" if "loss_weight" in a else "seg_weight"] *= 2


def _duplicate_sample(a: dict[str, np.ndarray]) -> None:
    real = np.flatnonzero(a["sample_index"] >= 0)
    a["sample_index"][real[1]] = a["sample_index"][real[0]]


def _move_a_boundary(a: dict[str, np.ndarray]) -> None:
    # Inside a row with two segments or more, the first gives a token to the second.
    rs = a["row_segments"]
    r = int(np.flatnonzero(np.diff(rs) >= 2)[0])
    a["seq_lens"][rs[r]] -= 1
    a["seq_lens"][rs[r] + 1] += 1


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_double_weights, "loss weights"),
        (_duplicate_sample, "sample"),
        (_move_a_boundary, "tokens, samples.parquet says"),
    ],
)
def test_verify_checks_invariants_not_just_hashes(
    e2e: dict[str, Any], tmp_path: Path, edit: Any, words: str
) -> None:
    out = tmp_path / "packed"
    shutil.copytree(e2e["out"], out)
    _tamper_first_shard(out, edit)
    result = cli("verify", out)
    assert result.exit_code == 1, result.stdout
    assert "FAILED" in result.stdout and words in result.stdout, result.stdout


def _flip_in(tensor: str) -> Any:
    def edit(data: bytearray) -> None:
        n = int.from_bytes(data[:8], "little")
        a, _ = json.loads(data[8 : 8 + n])[tensor]["data_offsets"]
        data[8 + n + a] ^= 0x10

    return edit


def _header(old: bytes, new: bytes) -> Any:
    def edit(data: bytearray) -> None:
        n = int.from_bytes(data[:8], "little")
        assert len(old) == len(new) and old in data[8 : 8 + n]
        data[8 : 8 + n] = data[8 : 8 + n].replace(old, new, 1)

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _flip_in("seq_lens"),
        _flip_in("row_offsets"),
        _flip_in("row_segments"),
        _header(b'"I32"', b'"X32"'),
        _header(b'"data_offsets":[0,', b'"data_offsets":[9,'),
    ],
)
def test_verify_without_hashes_reports_corrupt_shards(
    e2e: dict[str, Any], tmp_path: Path, edit: Any
) -> None:
    out = tmp_path / "packed"
    shutil.copytree(e2e["out"], out)
    shard = _shards(out)[0]
    data = bytearray(shard.read_bytes())
    edit(data)
    shard.write_bytes(bytes(data))
    result = cli("verify", out, "--no-hash")  # raises if anything escapes as a traceback
    assert result.exit_code == 1, result.stdout
    assert "FAILED" in result.stdout and shard.name in result.stdout
    with pytest.raises(RolltoolError, match=shard.name):
        rolltool.open_packed(out).micro_batches(0, 0)


def test_verify_of_a_directory_without_manifest_is_an_error(tmp_path: Path) -> None:
    result = cli("verify", tmp_path)
    assert result.exit_code == 1
    assert "manifest" in result.stderr and "Traceback" not in result.stderr


def test_example_train_loop_runs_on_packed_example(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "packed"
    args = ["pack", str(ROOT / "examples" / "rollouts.parquet"), "-o", str(out), "--dp", "2",
            "--batch-size", "256", "--micro-batch-tokens", "16384"]  # fmt: skip
    packed = subprocess.run(
        [sys.executable, "-m", "rolltool", *args], capture_output=True, text=True, timeout=120
    )
    assert packed.returncode == 0, packed.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_steps"] >= 1
    assert manifest["command"] == ["rolltool", *args]  # the command line, as given
    proc = subprocess.run(
        [sys.executable, ROOT / "examples" / "train_loop.py", out],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == manifest["num_steps"]
    assert all("nan" not in x for x in lines)


def test_source_date_epoch_fixes_created_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SOURCE_DATE_EPOCH (reproducible builds) sets the manifest's created_at; a value that is
    not whole seconds stops the run before it writes anything."""
    src = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    m = pack(src, tmp_path / "a", "--dp", 2)
    assert m["created_at"] == "2023-11-14T22:13:20+00:00"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    r = cli("pack", src, "-o", tmp_path / "b", "--dp", 2)
    assert r.exit_code == 1 and "SOURCE_DATE_EPOCH='soon'" in r.stderr
    assert not (tmp_path / "b").exists()
