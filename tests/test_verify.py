"""`rolltool verify` is independent and exact: hash-consistent tampering is caught.

Each tampering edits shard tensors and/or samples.parquet and then rewrites the manifest's sha256
and size, so hashes cannot tell: only cross-checks between the shards, samples.parquet, the
manifest, the aggregation formula and the input can. An untouched pack passes under every loss
aggregation and layout option.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, pack

from rolltool.loss import LOSS_AGGS
from rolltool.shards import file_record, read_shard, save_safetensors
from rolltool.synth import SynthConfig, generate
from rolltool.verify import verify

ARGS = ("--dp", 2, "--batch-size", 16, "--micro-batch-tokens", 8192)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("verify")
    inp = tmp / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=16, seed=3, max_len=4096)), inp)
    out = tmp / "packed"
    pack(inp, out, *ARGS)
    return {"input": inp, "out": out}


@pytest.fixture
def out(base: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of the base pack to tamper with (the input path stays where it was)."""
    dst = tmp_path / "packed"
    shutil.copytree(base["out"], dst)
    return dst


# -- tampering helpers: edit, then make the manifest's hashes agree ----------------------------


def _rehash(out: Path, name: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][name] = file_record(out / name)
    (out / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(out: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def _find(out: Path, i: int) -> tuple[str, int]:
    """(shard name, segment position in it) of sample i."""
    for shard in sorted(out.glob("rank-*/step-*.safetensors")):
        hit = np.flatnonzero(read_shard(shard)["sample_index"] == i)
        if len(hit):
            return shard.relative_to(out).as_posix(), int(hit[0])
    raise AssertionError(f"sample {i} not found")


def _edit_segment(
    out: Path, i: int, edit: Callable[[dict[str, np.ndarray], int, int], None]
) -> None:
    """edit(arrays, segment k, first token of k) on sample i's shard, then rehash it."""
    name, k = _find(out, i)
    arrays = {key: np.array(v) for key, v in read_shard(out / name).items()}
    start = int(arrays["seq_lens"][:k].astype(np.int64).sum())
    edit(arrays, k, start)
    save_safetensors(out / name, arrays, {})
    _rehash(out, name)


def _edit_samples(out: Path, column: str, edit: Callable[[np.ndarray], None]) -> None:
    t = pq.read_table(out / "samples.parquet")
    values = t.column(column).to_numpy().copy()
    edit(values)
    t = t.set_column(
        t.schema.get_field_index(column), column, pa.array(values, t.schema.field(column).type)
    )
    pq.write_table(t, out / "samples.parquet")
    _rehash(out, "samples.parquet")


def _samples(out: Path) -> dict[str, np.ndarray]:
    t = pq.read_table(out / "samples.parquet")
    return {c: np.asarray(t.column(c).to_pylist()) for c in t.column_names}


def _trained_with_prompt(out: Path) -> int:
    """A trained sample with an untrained (prompt) token."""
    s = _samples(out)
    ok = np.flatnonzero((s["status"] == "trained") & (s["trainable_tokens"] < s["length"]))
    return int(ok[0])


def _run(out: Path, *args: Any) -> str:
    result = cli("verify", out, *args)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.exit_code == 1, result.stdout
    assert result.stdout.startswith("FAILED"), result.stdout
    return result.stdout


def _flip_a_prompt_token(out: Path, i: int) -> None:
    def edit(a: dict[str, np.ndarray], k: int, start: int) -> None:
        t = start + int(np.flatnonzero(a["loss_mask"][start:] == 0)[0])
        a["loss_mask"][t] = 1

    _edit_segment(out, i, edit)


# -- tampering ----------------------------------------------------------------------------------


def test_untouched_pack_passes_and_is_compared_with_its_input(out: Path) -> None:
    result = cli("verify", out)
    assert result.exit_code == 0, result.stdout
    assert "compared with the input" in result.stdout
    report = verify(out)
    assert report["ok"] and report["checked"]["input_samples"] == report["checked"]["segments"]
    assert "input_samples" not in verify(out, recorded_inputs=False)["checked"]


def test_a_flipped_loss_mask_token_is_caught(out: Path) -> None:
    i = _trained_with_prompt(out)
    _flip_a_prompt_token(out, i)
    text = _run(out, "--no-input")
    assert f"sample {i}: " in text and "samples.parquet trainable_tokens says" in text
    assert "loss_mask differ from the input at 1 of" in _run(out)


def test_a_flipped_mask_with_samples_parquet_edited_to_match_is_caught(out: Path) -> None:
    i = _trained_with_prompt(out)
    _flip_a_prompt_token(out, i)

    def plus_one(v: np.ndarray) -> None:
        v[i] += 1

    _edit_samples(out, "trainable_tokens", plus_one)
    text = _run(out, "--no-input")
    step = int(_samples(out)["step"][i])
    # T recomputed from samples.parquet no longer matches the manifest; the step's token counts
    # no longer match the rows' metadata.
    assert f"step {step}: denominators trainable_tokens" in text
    assert f"step {step}: " in text and "trainable tokens in the rows, the manifest says" in text


def test_a_raised_advantage_is_caught(out: Path) -> None:
    i = _trained_with_prompt(out)

    def raise_adv(a: dict[str, np.ndarray], k: int, start: int) -> None:
        a["seg_advantage"][k] += 5

    _edit_segment(out, i, raise_adv)
    text = _run(out)
    assert f"sample {i}: advantage" in text and "samples.parquet says" in text

    # Edited in samples.parquet too: the step's advantage mean no longer matches the manifest.
    def raise5(v: np.ndarray) -> None:
        v[i] += 5

    _edit_samples(out, "advantage", raise5)
    text = _run(out)
    assert "advantage_mean of the rows" in text and f"sample {i}: advantage" not in text


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_weight_moved_between_samples_is_caught(
    base: dict[str, Path], tmp_path: Path, agg: str
) -> None:
    out = tmp_path / "packed"
    pack(base["input"], out, *ARGS, "--loss-agg", agg)
    s = _samples(out)
    step0 = np.flatnonzero(
        (s["status"] == "trained") & (s["step"] == 0) & (s["trainable_tokens"] > 0)
    )
    i, j = int(step0[0]), int(step0[1])
    t_i, t_j = int(s["trainable_tokens"][i]), int(s["trainable_tokens"][j])
    w_i, w_j = float(s["token_loss_weight"][i]), float(s["token_loss_weight"][j])
    new_i = np.float32(w_i + w_j * t_j / t_i)  # the step's weight sum stays the same

    def set_weight(value: float) -> Callable[[dict[str, np.ndarray], int, int], None]:
        def edit(a: dict[str, np.ndarray], k: int, start: int) -> None:
            a["seg_weight"][k] = value

        return edit

    _edit_segment(out, i, set_weight(float(new_i)))
    _edit_segment(out, j, set_weight(0.0))

    def move(v: np.ndarray) -> None:
        v[i], v[j] = new_i, 0

    _edit_samples(out, "token_loss_weight", move)
    text = _run(out, "--no-input")
    assert f"sample {i}: loss weights" in text and f"the {agg} formula gives" in text
    assert f"sample {j}: loss weights 0 per trainable token" in text
    assert "samples.parquet token_loss_weight says" not in text  # the two records agree...
    assert "loss weights sum to" not in text  # ...and the sum is kept: only the formula tells


def test_edited_tokens_and_logprobs_are_caught_only_with_the_input(
    out: Path, base: dict[str, Path]
) -> None:
    s = _samples(out)
    i, j = np.flatnonzero(s["status"] == "trained")[:2].tolist()

    def new_token(a: dict[str, np.ndarray], k: int, start: int) -> None:
        a["input_ids"][start + 1] += 1

    def new_logprob(a: dict[str, np.ndarray], k: int, start: int) -> None:
        a["logprobs"][start + 2] -= 0.5

    _edit_segment(out, i, new_token)
    _edit_segment(out, j, new_logprob)
    assert cli("verify", out, "--no-input").exit_code == 0
    text = _run(out)
    assert f"sample {i}: input_ids differ from the input at 1 of" in text
    assert f"sample {j}: logprobs differ from the input at 1 of" in text
    # The input moved elsewhere: given explicitly.
    moved = out.parent / "moved.parquet"
    shutil.copy(base["input"], moved)
    assert "input_ids differ from the input" in _run(out, "--input", moved)


def test_a_different_input_is_reported(out: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(generate(SynthConfig(groups=3, seed=9, max_len=1024)), other)
    assert "the pack was made from" in _run(out, "--input", other)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda m: m["steps"][0]["denominators"].update(trainable_tokens=1),
            "step 0: denominators trainable_tokens",
        ),
        (
            lambda m: m["steps"][0]["denominators"].update(trained_samples=1),
            "step 0: denominators trained_samples",
        ),
        (
            lambda m: m["steps"][0]["denominators"].update(weight_sum=1.01),
            "step 0: denominators weight_sum",
        ),
        (lambda m: m["steps"][0].update(samples=1), "step 0: "),
        (lambda m: m["steps"][0].update(sampled_tokens=1), "sampled tokens in the rows"),
        (lambda m: m["steps"][0].update(trainable_tokens=1), "trainable tokens in the rows"),
        (lambda m: m["loss"].update(agg="seq-mean-token-sum"), "formula gives"),
        (lambda m: m["samples"].update(total=1), "the manifest says 1"),
    ],
)
def test_manifest_records_are_recomputed(out: Path, edit: Any, words: str) -> None:
    _edit_manifest(out, edit)
    assert words in _run(out, "--no-input")


def test_report_is_json_and_bounded(out: Path) -> None:
    def all_plus_one(v: np.ndarray) -> None:
        v += 1

    _edit_samples(out, "trainable_tokens", all_plus_one)
    result = cli("verify", out, "--json", "--no-input")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert not report["ok"] and len(report["problems"]) == 20
    assert report["checked"]["problems"] > 20


# -- untouched packs pass ------------------------------------------------------------------------

PASSING = [
    *[("--loss-agg", agg) for agg in LOSS_AGGS if not agg.endswith("norm")],
    ("--loss-agg", "seq-mean-token-sum-norm", "--loss-scale-factor", 777.0),
    ("--row-len", 8192),
    ("--micro-batch-tokens", None, "--micro-batch-size", 3, "--row-len", 16384),
    (
        "--micro-batch-tokens",
        3000,
        "--overlong",
        "drop",
        "--uniform",
        "drop",
        "--loss-agg",
        "seq-mean-token-mean",
    ),
]


@pytest.mark.parametrize("extra", PASSING, ids=lambda a: " ".join(str(x) for x in a))
def test_untouched_packs_pass(
    base: dict[str, Path], tmp_path: Path, extra: tuple[Any, ...]
) -> None:
    args = list(ARGS)
    extra = tuple(extra)
    if "--micro-batch-tokens" in extra:  # replaces the base budget (None: none at all)
        k = args.index("--micro-batch-tokens")
        del args[k : k + 2]
        j = extra.index("--micro-batch-tokens")
        value = extra[j + 1]
        extra = (
            extra[:j] + extra[j + 2 :] + (() if value is None else ("--micro-batch-tokens", value))
        )
    manifest = pack(base["input"], tmp_path / "packed", *args, *extra)
    report = verify(tmp_path / "packed")
    assert report["ok"], report["problems"]
    c = report["checked"]
    assert c["steps"] == manifest["num_steps"] and c["input_samples"] == c["segments"] > 0
    if "--overlong" in extra:
        s = manifest["samples"]
        assert s["overlong_dropped"] > 0 and s["uniform_dropped"] > 0, s


def test_columns_mapping_is_recorded_and_used(base: dict[str, Path], tmp_path: Path) -> None:
    t = pq.read_table(base["input"])
    renamed = tmp_path / "renamed.parquet"
    pq.write_table(
        t.rename_columns(["toks" if c == "input_ids" else c for c in t.column_names]), renamed
    )
    manifest = pack(renamed, tmp_path / "packed", *ARGS, "--column", "input_ids=toks")
    assert manifest["columns"] == {"input_ids": "toks"}
    report = verify(tmp_path / "packed")
    assert report["ok"] and report["checked"]["input_samples"] > 0, report["problems"]
