"""A sample's first token is never a target (issue 21, defect 3).

Nothing precedes token 0, so no logit predicts it: HF's and TRL's collators label it -100. A
sample whose ``loss_mask[0]`` is 1 (no prompt) used to give token 0 weight 1/T and count it in
T, so every weight of its step was off by T_hf / T. Packs of such input are checked against
the obvious definition (per sample, the ones of ``loss_mask[1:]``) and against the label count
of transformers' own ``DataCollatorWithFlattening``, step by step.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli
from verify_helpers import kinds

import rolltool

GROUPS, SIZE = 8, 4


def _input(fmt: str, seed: int = 0) -> pa.Table:
    """GROUPS groups of SIZE samples; about half have no prompt (their first token trained)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[Any]] = {"group_id": [], "reward": []}
    ids, masks, prompts, responses = [], [], [], []
    for g in range(GROUPS):
        for _ in range(SIZE):
            n, prompt = int(rng.integers(3, 40)), int(rng.integers(0, 3)) * (rng.random() < 0.5)
            prompt = min(prompt, n - 1)
            tokens = rng.integers(1, 1000, n).tolist()
            mask = [0] * prompt + (rng.random(n - prompt) < 0.8).astype(int).tolist()
            if prompt == 0:
                mask[0] = 1  # the case: no prompt, the first token marked trained
            cols["group_id"].append(f"g{g}")
            cols["reward"].append(float(rng.random()))
            ids.append(tokens)
            masks.append(mask)
            prompts.append(tokens[:prompt])
            responses.append(tokens[prompt:])
    if fmt == "input_ids":
        cols |= {"input_ids": ids, "loss_mask": masks}
    else:
        cols |= {"prompt_ids": prompts, "response_ids": responses}
    return pa.table(cols)


def _masks(table: pa.Table) -> list[list[int]]:
    """Each input sample's loss_mask as the input gives it."""
    if "loss_mask" in table.column_names:
        return [list(map(int, m)) for m in table.column("loss_mask").to_pylist()]
    p, r = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    return [[0] * len(a) + [1] * len(b) for a, b in zip(p, r, strict=True)]


@pytest.fixture(scope="module", params=["input_ids", "prompt_response"])
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp(f"first-{request.param}")
    table = _input(request.param)
    pq.write_table(table, tmp / "in.parquet")
    done = cli("pack", tmp / "in.parquet", "-o", tmp / "out", "--dp", 2, "--batch-size", 16)
    assert done.exit_code == 0, done.stderr
    return table, tmp / "out", done.stderr


def test_the_first_token_is_never_trained_nor_counted(packed: Any) -> None:
    table, out, _ = packed
    masks = _masks(table)
    targets = [sum(m[1:]) for m in masks]
    cleared = sum(m[0] == 1 for m in masks)
    assert cleared >= GROUPS  # the case is there
    samples = pq.read_table(out / "samples.parquet").to_pydict()
    for i, t in zip(samples["sample_index"], samples["trainable_tokens"], strict=True):
        assert t == targets[i]
    ds = rolltool.open_packed(out)
    seen = 0
    for step, rank in np.ndindex(ds.num_steps, ds.dp):
        for row in ds.micro_batches(step, rank):
            for k, i in enumerate(row["sample_index"].tolist()):
                if i < 0:
                    continue
                a, b = int(row["cu_seqlens"][k]), int(row["cu_seqlens"][k + 1])
                assert row["loss_mask"][a] == 0 and row["loss_weight"][a] == 0
                assert row["loss_mask"][a + 1 : b].tolist() == masks[i][1:]
                seen += 1
    assert seen == sum(s == "trained" for s in samples["status"]) > 0
    manifest = json.loads((out / "manifest.json").read_text())
    note = [w for w in manifest["warnings"] if "first token" in w]
    assert len(note) == 1 and note[0].startswith(f"{cleared} sample(s)")
    assert kinds(out) == {}  # verify agrees, the input compared


def test_each_step_counts_the_labels_hf_counts(packed: Any) -> None:
    """T of every step (its recorded denominator and the token-mean weight 1/T) equals the
    number of labels transformers' DataCollatorWithFlattening leaves for that step's samples
    (-100 for untrained tokens; the collator itself drops each sequence's first label)."""
    collator = pytest.importorskip("transformers").DataCollatorWithFlattening(
        return_position_ids=True
    )
    table, out, _ = packed
    ids = (
        table.column("input_ids").to_pylist()
        if "input_ids" in table.column_names
        else [a + b for a, b in zip(*(table.column(c).to_pylist() for c in ("prompt_ids", "response_ids")), strict=True)]
    )  # fmt: skip
    masks = _masks(table)
    samples = pq.read_table(out / "samples.parquet").to_pydict()
    manifest = json.loads((out / "manifest.json").read_text())
    ds = rolltool.open_packed(out)
    for step, record in enumerate(manifest["steps"]):
        mine = [
            i
            for i, s, st in zip(samples["sample_index"], samples["step"], samples["status"], strict=True)
            if s == step and st == "trained"
        ]  # fmt: skip
        features = [
            {"input_ids": ids[i], "labels": [t if m else -100 for t, m in zip(ids[i], masks[i], strict=True)]}
            for i in mine
        ]  # fmt: skip
        labels = collator(features)["labels"]
        hf_count = int((labels != -100).sum())
        assert record["denominators"]["trainable_tokens"] == hf_count
        weights = np.concatenate(
            [mb["loss_weight"] for r in range(ds.dp) for mb in ds.micro_batches(step, r)]
        )
        assert np.all(weights[weights > 0] == np.float32(1 / hf_count))  # token-mean: 1/T
        assert np.count_nonzero(weights) == hf_count


def test_the_scan_warns_once_with_the_count(packed: Any) -> None:
    table, _, stderr = packed
    cleared = sum(m[0] == 1 for m in _masks(table))
    assert stderr.count("on their first token") == 1
    assert f"{cleared} sample(s) have loss_mask 1 on their first token" in stderr
