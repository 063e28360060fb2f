"""`rolltool verify` is independent and exact: hash-consistent tampering is caught, once.

Each tampering edits shard tensors and/or samples.parquet and then rewrites the manifest's sha256
and size, so hashes cannot tell: only cross-checks between the shards, samples.parquet, the
manifest, the aggregation formula and the input can. Each test asserts exactly which problem
kinds are reported (one defect, one problem where the defect is one fact). An untouched pack
passes under every loss aggregation and layout option. One test per invariant is in
test_verify_invariants.py; finding the input and malformed manifests in test_verify_input.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, pack
from verify_helpers import (
    ARGS,
    Arrays,
    edit_manifest,
    edit_samples,
    edit_segment,
    flip_a_prompt_token,
    kinds,
    samples,
    trained_with_prompt,
)

from rolltool.input.synth import SynthConfig, generate
from rolltool.plan.loss import LOSS_AGGS
from rolltool.verify import verify


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


def _run(out: Path, *args: Any) -> str:
    result = cli("verify", out, *args)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.exit_code == 1, result.stdout
    assert result.stdout.startswith("FAILED"), result.stdout
    return result.stdout


# -- tampering ----------------------------------------------------------------------------------


def test_untouched_pack_passes_and_is_compared_with_its_input(out: Path) -> None:
    result = cli("verify", out)
    assert result.exit_code == 0, result.stdout
    assert "compared with the input" in result.stdout and not result.stderr
    report = verify(out)
    assert report["ok"] and report["input"] == "compared"
    assert report["checked"]["input_samples"] == report["checked"]["segments"] > 0
    skipped = verify(out, recorded_inputs=False)
    assert skipped["input"] == "skipped" and "input_samples" not in skipped["checked"]


def test_a_flipped_loss_mask_token_is_one_problem(out: Path) -> None:
    i = trained_with_prompt(out)
    flip_a_prompt_token(out, i)
    text = _run(out, "--no-input")
    assert f"sample {i}: " in text and "samples.parquet trainable_tokens says" in text
    # The rows disagree with samples.parquet: reported there, not again against the input.
    assert kinds(out, recorded_inputs=False) == {"sample.trainable": 1}
    assert kinds(out) == {"sample.trainable": 1}


def test_a_flipped_mask_with_samples_parquet_edited_to_match_is_caught(out: Path) -> None:
    i = trained_with_prompt(out)
    flip_a_prompt_token(out, i)

    def plus_one(v: np.ndarray) -> None:
        v[i] += 1

    edit_samples(out, "trainable_tokens", plus_one)
    text = _run(out, "--no-input")
    step = int(samples(out)["step"][i])
    # T recomputed from samples.parquet no longer matches the step's denominators nor its
    # trainable-token counts (overall and the sample's env); the rows agree with samples.parquet.
    assert f"step {step}: denominators trainable_tokens" in text
    assert kinds(out, recorded_inputs=False) == {"step.denominators": 1, "step.counts": 2}
    assert kinds(out) == {"step.denominators": 1, "step.counts": 2, "input.loss_mask": 1}


def test_a_raised_advantage_is_caught(out: Path) -> None:
    i = trained_with_prompt(out)

    def raise_adv(a: Arrays, k: int, start: int) -> None:
        a["seg_advantage"][k] += 5

    edit_segment(out, i, raise_adv)
    assert f"sample {i}: advantage" in _run(out)
    assert kinds(out) == {"sample.advantage": 1}

    # Edited in samples.parquet too: the step's advantage mean (overall and the sample's env)
    # no longer matches the manifest.
    def raise5(v: np.ndarray) -> None:
        v[i] += 5

    edit_samples(out, "advantage", raise5)
    assert "the trained samples have advantage_mean" in _run(out)
    assert kinds(out) == {"step.advantage": 2}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_weight_moved_between_samples_is_caught(
    base: dict[str, Path], tmp_path: Path, agg: str
) -> None:
    out = tmp_path / "packed"
    pack(base["input"], out, *ARGS, "--loss-agg", agg)
    s = samples(out)
    step0 = np.flatnonzero(
        (s["status"] == "trained") & (s["step"] == 0) & (s["trainable_tokens"] > 0)
    )
    i, j = int(step0[0]), int(step0[1])
    t_i, t_j = int(s["trainable_tokens"][i]), int(s["trainable_tokens"][j])
    w_i, w_j = float(s["token_loss_weight"][i]), float(s["token_loss_weight"][j])
    new_i = np.float32(w_i + w_j * t_j / t_i)  # the step's weight sum stays the same

    def set_weight(value: float) -> Callable[[Arrays, int, int], None]:
        def edit(a: Arrays, k: int, start: int) -> None:
            a["seg_weight"][k] = value

        return edit

    edit_segment(out, i, set_weight(float(new_i)))
    edit_segment(out, j, set_weight(0.0))

    def move(v: np.ndarray) -> None:
        v[i], v[j] = new_i, 0

    edit_samples(out, "token_loss_weight", move)
    text = _run(out, "--no-input")
    assert f"sample {i}: loss weights" in text and f"the {agg} formula gives" in text
    assert f"sample {j}: loss weights 0 per trainable token" in text
    # The two records agree and the sum is kept: only the formula tells.
    assert kinds(out) == {"sample.formula": 2}


def test_edited_tokens_and_logprobs_are_caught_only_with_the_input(
    out: Path, base: dict[str, Path]
) -> None:
    s = samples(out)
    i, j = np.flatnonzero(s["status"] == "trained")[:2].tolist()

    def new_token(a: Arrays, k: int, start: int) -> None:
        a["input_ids"][start + 1] += 1

    def new_logprob(a: Arrays, k: int, start: int) -> None:
        a["logprobs"][start + 2] -= 0.5

    edit_segment(out, i, new_token)
    edit_segment(out, j, new_logprob)
    assert cli("verify", out, "--no-input").exit_code == 0
    text = _run(out)
    assert f"sample {i}: input_ids differ from the input at 1 of" in text
    assert f"sample {j}: logprobs differ from the input at 1 of" in text
    assert kinds(out) == {"input.input_ids": 1, "input.logprobs": 1}
    # The input moved elsewhere: given explicitly.
    moved = out.parent / "moved.parquet"
    shutil.copy(base["input"], moved)
    assert "input_ids differ from the input" in _run(out, "--input", moved)


def test_a_different_input_is_reported(out: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(generate(SynthConfig(groups=3, seed=9, max_len=1024)), other)
    assert "the pack was made from" in _run(out, "--input", other)
    report = verify(out, inputs=[other])
    assert report["counts"] == {"input.mismatch": 1}
    assert report["input"].startswith("not compared") and "input_samples" not in report["checked"]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda m: m["steps"][0]["denominators"].update(trainable_tokens=1),
            {"step.denominators": 1},
        ),
        (
            lambda m: m["steps"][0]["denominators"].update(trained_samples=1),
            {"step.denominators": 1},
        ),
        (
            lambda m: m["steps"][0]["denominators"].update(weight_sum=1.01),
            {"step.denominators": 1},
        ),
        (lambda m: m["steps"][0].update(samples=1), {"step.counts": 1}),
        (lambda m: m["steps"][0].update(sampled_tokens=1), {"step.counts": 1}),
        (lambda m: m["steps"][0].update(trainable_tokens=1), {"step.counts": 1}),
        (lambda m: m["steps"][0].update(loss_weight_sum=0.5), {"step.weight_sum": 1}),
        (lambda m: m["steps"][0].update(advantage_std=9.0), {"step.advantage": 1}),
        (lambda m: m["samples"].update(total=1), {"samples.total": 1}),
        (lambda m: m["samples"].update(leftover=0), {"samples.status": 1}),
        (lambda m: m["loss"].update(agg="nonsense"), {"loss.formula": 1}),
    ],
)
def test_manifest_records_are_recomputed(
    out: Path, edit: Callable[[dict[str, Any]], Any], expected: dict[str, int]
) -> None:
    edit_manifest(out, edit)
    assert kinds(out, recorded_inputs=False) == expected
    _run(out, "--no-input")


def test_another_aggregation_in_the_manifest_is_one_problem_per_step(out: Path) -> None:
    edit_manifest(out, lambda m: m["loss"].update(agg="seq-mean-token-sum"))
    steps = len(json.loads((out / "manifest.json").read_text())["steps"])
    # Every step's weight sum (1 for token-mean, T/S now) is off; its samples' weights are not
    # judged again by a formula whose denominators are wrong.
    assert kinds(out, recorded_inputs=False) == {"step.denominators": steps}
    assert "aggregation gives" in _run(out, "--no-input")


def test_report_is_json_and_bounded(out: Path) -> None:
    def all_plus_one(v: np.ndarray) -> None:
        v += 1

    edit_samples(out, "trainable_tokens", all_plus_one)
    result = cli("verify", out, "--json", "--no-input")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert not report["ok"] and report["input"] == "skipped"
    assert set(report) == {"ok", "problems", "counts", "checked", "input", "notes"}
    assert report["counts"]["sample.trainable"] == report["checked"]["segments"] > 8
    for kind, n in report["counts"].items():
        assert len([p for p in report["problems"] if p["kind"] == kind]) == min(n, 8)
    assert all(set(p) == {"kind", "where", "text"} for p in report["problems"])
    text = _run(out, "--no-input")
    assert f"FAILED: {sum(report['counts'].values())} problem(s)" in text
    assert "more like the above (sample.trainable)" in text


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
