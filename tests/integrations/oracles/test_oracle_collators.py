"""A packed row is what the padding-free collators of transformers and TRL build from its
samples: tokens, position ids, boundaries and which tokens are trained.

transformers 4.57's ``DataCollatorWithFlattening`` and TRL's
``DataCollatorForLanguageModeling(padding_free=True)`` (``trl.trainer.sft_trainer``) collate
each row's samples (their input tokens, labels = tokens where the input's loss mask is set,
-100 elsewhere). The row's real part must equal their ``input_ids``, ``position_ids`` and
``cu_seq_lens_q``; a token has loss weight exactly where their label is not -100 (both collators
label each sample's first token -100: nothing precedes it); and with ``--loss-agg token-mean``
every weight of a step is float32(1 / the number of such labels over the step's rows). TRL's
collator fed the packed row itself (its ``seq_lengths``) gives the row's own position ids and
boundaries, row-end padding included. The input has a sample trained from its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pack_helpers import input_samples

import rolltool

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.data.data_collator", reason="transformers (test extra)")
trl = pytest.importorskip(
    "trl.trainer.sft_trainer",
    reason="trl or its imports (datasets, accelerate: the oracles extra) are not installed",
)

CASES = {"plain": (), "row-len": ("--row-len", 96)}
COLLATORS = {
    "transformers": lambda: hf.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=True
    ),
    "trl": lambda: trl.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
}


def _features(inp: dict[str, list[Any]], samples: np.ndarray) -> list[dict[str, list[int]]]:
    out = []
    for s in samples.tolist():
        ids, mask = inp["input_ids"][s], inp["loss_mask"][s]
        out.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]})  # fmt: skip
    return out


@pytest.mark.parametrize("collator", COLLATORS)
@pytest.mark.parametrize("case", CASES)
def test_rows_equal_padding_free_collation(
    case: str, collator: str, packs: Callable[..., Any], oracle_input: Path
) -> None:
    out = packs("--micro-batch-tokens", 80, *CASES[case])
    ds, inp, collate = rolltool.open_packed(out), input_samples(oracle_input), COLLATORS[collator]()
    first_token_trained = 0
    for step in range(ds.num_steps):
        labelled, weights = 0, []
        for rank in range(ds.dp):
            for row in ds.micro_batches(step, rank):
                real = row["sample_index"] >= 0
                assert np.all(real[: real.sum()])  # a plain row's padding is its tail only
                if not real.any():
                    continue
                cu = row["cu_seqlens"][: real.sum() + 1]
                n = int(cu[-1])
                got = collate(_features(inp, row["sample_index"][real]))
                assert got["input_ids"][0].tolist() == row["input_ids"][:n].tolist()
                assert got["position_ids"][0].tolist() == row["position_ids"][:n].tolist()
                assert got["cu_seq_lens_q"].tolist() == cu.tolist()
                assert got["max_length_q"] == int(np.diff(cu).max())
                labels = got["labels"][0].numpy()
                trained = labels != -100
                assert np.array_equal(trained, row["loss_weight"][:n] > 0)
                assert np.array_equal(labels[trained], row["input_ids"][:n][trained])
                first_token_trained += sum(
                    inp["loss_mask"][s][0] for s in row["sample_index"][real]
                )
                labelled += int(trained.sum())
                weights.append(row["loss_weight"][row["loss_weight"] > 0])
        w = np.concatenate(weights)
        assert np.all(w == np.float32(1 / labelled)), (step, labelled, np.unique(w))
    assert first_token_trained == 1  # the case the first-token rule is about was packed


@pytest.mark.parametrize("case", CASES)
def test_trl_collates_a_packed_row_with_its_own_positions(
    case: str, packs: Callable[..., Any]
) -> None:
    ds = rolltool.open_packed(packs("--micro-batch-tokens", 80, *CASES[case]))
    collate = trl.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    padded = 0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for row in ds.micro_batches(step, rank):
                lengths = np.diff(row["cu_seqlens"]).tolist()
                got = collate([{"input_ids": row["input_ids"].tolist(), "seq_lengths": lengths}])
                assert got["position_ids"][0].tolist() == row["position_ids"].tolist()
                assert got["cu_seq_lens_q"].tolist() == row["cu_seqlens"].tolist()
                padded += bool(row["sample_index"][-1] < 0)
    assert padded >= 1
