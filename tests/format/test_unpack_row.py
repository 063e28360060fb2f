"""`unpack_row` (lists for a row's few segments, NumPy for the tokens) equals a per-token loop.

Random flat `PackedRows` arrays: rows of no, few and many segments (past `_SLICED_SEGMENTS`, where
positions take ``arange - repeat``), long and short segments, padding segments anywhere (more
than `_FEW_PADS` in some rows), every dtype as the reader stores it.
"""

from __future__ import annotations

import numpy as np

from rolltool.format import PAD_SAMPLE
from rolltool.format.layout import _SLICED_SEGMENTS, unpack_row
from rolltool.format.targets import _FEW_PADS, IGNORE_INDEX


def _random_rows(rng: np.random.Generator) -> dict[str, np.ndarray]:
    counts = [int(rng.choice([0, 1, 3, 12, _SLICED_SEGMENTS + 5])) for _ in range(3)]
    # long segments take the sliced positions; past _SLICED_SEGMENTS any length takes the other
    longest = 3 if max(counts) > _SLICED_SEGMENTS else int(rng.choice([3, 40, 600]))
    lens = rng.integers(1, longest + 1, size=sum(counts)).astype(np.int32)
    index = np.arange(len(lens), dtype=np.int64)
    index[rng.random(len(lens)) < rng.choice([0.0, 0.1, 0.7])] = PAD_SAMPLE
    n = int(lens.sum())
    pad = index == PAD_SAMPLE
    row_segments = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    return {
        "input_ids": rng.integers(0, 1000, n).astype(np.int32),
        "loss_mask": rng.integers(0, 2, n).astype(np.uint8),
        "logprobs": -rng.random(n).astype(np.float32),
        "row_offsets": bounds[row_segments],
        "seq_lens": lens,
        "sample_index": index,
        "seg_advantage": np.where(pad, 0, rng.normal(size=len(lens))).astype(np.float32),
        "seg_weight": np.where(pad, 0, rng.random(len(lens))).astype(np.float32),
        "row_segments": row_segments,
    }


def _loop_row(rows: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """Row r token by token: positions counted, each segment's values repeated, each target
    the next token's value when it is in the same real segment."""
    a, b = int(rows["row_offsets"][r]), int(rows["row_offsets"][r + 1])
    s0, s1 = int(rows["row_segments"][r]), int(rows["row_segments"][r + 1])
    seg, pos, cu = [], [], [0]
    for s in range(s0, s1):
        n = int(rows["seq_lens"][s])
        seg += [s] * n
        pos += list(range(n))
        cu.append(cu[-1] + n)
    mask = rows["loss_mask"][a:b]
    row = {
        "input_ids": rows["input_ids"][a:b],
        "position_ids": np.array(pos, dtype=np.int32),
        "loss_mask": mask,
        "advantages": np.array([rows["seg_advantage"][s] for s in seg], dtype=np.float32),
        "logprobs": rows["logprobs"][a:b],
        "loss_weight": np.array(
            [rows["seg_weight"][s] * m for s, m in zip(seg, mask, strict=True)], dtype=np.float32
        ),
    }
    for key, source in (("target_ids", "input_ids"), ("target_loss_weight", "loss_weight"),
                        ("target_advantages", "advantages"), ("target_logprobs", "logprobs")):  # fmt: skip
        fill = IGNORE_INDEX if key == "target_ids" else 0
        values = [
            row[source][t + 1]
            if t + 1 < len(seg)
            and seg[t + 1] == seg[t]
            and rows["sample_index"][seg[t]] != PAD_SAMPLE
            else fill
            for t in range(len(seg))
        ]
        row[key] = np.array(values, dtype=np.int32 if key == "target_ids" else np.float32)
    row["cu_seqlens"] = np.array(cu, dtype=np.int32)
    row["sample_index"] = rows["sample_index"][s0:s1]
    return row


def test_unpack_row_equals_the_token_loop() -> None:
    rng = np.random.default_rng(5)
    seen = {"empty": 0, "many": 0, "pads": 0}
    for _ in range(40):
        rows = _random_rows(rng)
        for r in range(len(rows["row_offsets"]) - 1):
            got, want = unpack_row(rows, r), _loop_row(rows, r)
            assert list(got) == list(want)
            for key in want:
                assert got[key].dtype == want[key].dtype, key
                assert np.array_equal(got[key], want[key]), key
            segs = len(got["sample_index"])
            seen["empty"] += segs == 0
            seen["many"] += segs > _SLICED_SEGMENTS
            seen["pads"] += int(np.count_nonzero(got["sample_index"] == PAD_SAMPLE)) > _FEW_PADS
    assert all(seen.values()), seen  # every kind of row was made
