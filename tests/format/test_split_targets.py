"""Next-token targets (`rolltool.format.targets`) on hand-laid rows: the fast derivation equals a
per-sample Python loop, on the whole row and in every SP and CP view (`rolltool.format.split`).

Rows are laid out by `rolltool.format.layout.pack_rows` with the split's own multiples (each
sample followed by its CP padding, the row padded for the group) and read back by `unpack_row`,
so the views see exactly what the reader serves. The pack-level tests (targets against the input
Parquet, losses summed over CP ranks) are tests/packed/test_reader_targets.py.
"""

from __future__ import annotations

import doctest

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import rolltool.format.split as split
import rolltool.format.targets as targets
from rolltool.format.layout import SampleTokens, pack_rows, unpack_row
from rolltool.format.split import GroupSplit, cp_gather, cp_view, sp_view
from rolltool.format.targets import IGNORE_INDEX, SHIFTED_FROM, TARGET_FIELDS, next_token_targets


def slow_targets(row: dict[str, np.ndarray]) -> dict[str, list[float]]:
    """The obvious way: walk every segment; inside a sample's segment token t's target is
    token t+1, the segment's last token and every padding token have none."""
    n = len(row["input_ids"])
    out = {k: [float(IGNORE_INDEX if k == "target_ids" else 0)] * n for k in TARGET_FIELDS}
    cu = row["cu_seqlens"].tolist()
    for q, sample in enumerate(row["sample_index"].tolist()):
        if sample < 0:
            continue
        for t in range(cu[q], cu[q + 1] - 1):
            for key, source in SHIFTED_FROM.items():
                out[key][t] = float(row[source][t + 1])
    return out


def assert_targets(got: dict[str, np.ndarray], want: dict[str, list[float]]) -> None:
    for key, dtype in TARGET_FIELDS.items():
        assert got[key].dtype == dtype, key
        assert got[key].tolist() == want[key], key


def laid_out(lengths: list[int], g: GroupSplit, row_len: int | None, seed: int) -> dict:
    """One row of samples of `lengths` laid out for split `g`, as the reader's dict."""
    rng = np.random.default_rng(seed)
    n = len(lengths)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    tokens = SampleTokens(
        offsets=offsets,
        input_ids=rng.integers(1, 50_000, total).astype(np.int32),
        loss_mask=(rng.random(total) < 0.7).astype(np.uint8),
        logprobs=-rng.random(total).astype(np.float32),
    )
    need = int(g.padded(np.array(lengths)).sum()) if n else 0
    m = g.row_multiple
    rows = pack_rows(
        tokens,
        [np.arange(n)],
        sample_index=np.arange(n + 1) * 3 + 1,  # one spare: the arrays of an empty row
        advantage=rng.normal(size=n + 1).astype(np.float32),
        weight=rng.random(n + 1).astype(np.float32) + 0.5,
        row_len=None if row_len is None else -(-max(row_len, need) // m) * m,
        pad_id=7,
        sample_multiple=g.sample_multiple,
        row_multiple=g.row_multiple,
    )
    return unpack_row(rows.arrays(), 0)


lengths_st = st.lists(st.integers(1, 40), min_size=0, max_size=6)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, pad=st.sampled_from([None, 0, 17, 64]), seed=st.integers(0, 2**16))
def test_whole_row_targets_equal_the_loop(lengths: list[int], pad: int | None, seed: int) -> None:
    """Plain rows (with or without row-end padding): the reader's targets are the loop's."""
    row = laid_out(lengths, GroupSplit(), pad, seed)
    assert_targets(row, slow_targets(row))
    assert_targets(next_token_targets(row), slow_targets(row))
    ends = row["cu_seqlens"][1:] - 1
    assert np.all(row["target_ids"][ends] == IGNORE_INDEX)  # each sample's last token


@settings(max_examples=120, deadline=None)
@given(
    lengths=lengths_st,
    size=st.sampled_from([2, 3, 4]),
    pad=st.sampled_from([None, 48]),
    seed=st.integers(0, 2**16),
)
def test_sp_views_hold_the_whole_rows_targets(
    lengths: list[int], size: int, pad: int | None, seed: int
) -> None:
    """SP rank i's targets are the whole row's loop targets at its slice: a slice's last token
    keeps its target, the next slice's first token."""
    row = laid_out(lengths, GroupSplit(sp=size), pad, seed)
    want = slow_targets(row)
    parts = [sp_view(row, size, i) for i in range(size)]
    for view in parts:
        a = int(view["sp_offset"][0])
        b = a + len(view["input_ids"])
        assert_targets(view, {k: v[a:b] for k, v in want.items()})
    joined = {k: np.concatenate([p[k] for p in parts]) for k in TARGET_FIELDS}
    assert_targets(joined, want)


@settings(max_examples=120, deadline=None)
@given(
    lengths=lengths_st,
    size=st.sampled_from([2, 3, 4]),
    pad=st.sampled_from([None, 96]),
    seed=st.integers(0, 2**16),
)
def test_cp_views_hold_the_whole_samples_targets(
    lengths: list[int], size: int, pad: int | None, seed: int
) -> None:
    """CP rank r's targets are the loop's at the tokens it holds, and gathered back over the CP
    ranks (`cp_gather`) each sample's targets are its whole-sample shift: no chunk-end target
    lost or taken from the wrong token."""
    row = laid_out(lengths, GroupSplit(cp=size), pad, seed)
    want = slow_targets(row)
    start = {
        int(i): int(a)
        for i, a in zip(row["sample_index"], row["cu_seqlens"][:-1], strict=True)
        if i >= 0
    }
    none = {k: float(IGNORE_INDEX if k == "target_ids" else 0) for k in TARGET_FIELDS}
    parts = [cp_view(row, size, r) for r in range(size)]
    for view in parts:
        seg = np.repeat(view["sample_index"], np.diff(view["cu_seqlens"]))
        # a token of sample s at position p is row token start[s] + p (its CP padding follows
        # it in the row); row-end padding has no target
        expect = {
            k: [
                v[start[s] + p] if s >= 0 else none[k]
                for s, p in zip(seg.tolist(), view["position_ids"].tolist(), strict=True)
            ]
            for k, v in want.items()
        }
        assert_targets(view, expect)
    gathered = 0
    for q, sample in enumerate(parts[0]["sample_index"].tolist()):
        if sample < 0:
            continue
        real = int(np.diff(parts[0]["cu_seqlens_unpadded"])[q])
        local = [p["target_ids"][p["cu_seqlens"][q] : p["cu_seqlens"][q + 1]] for p in parts]
        ids = [p["input_ids"][p["cu_seqlens"][q] : p["cu_seqlens"][q + 1]] for p in parts]
        sample_ids = cp_gather(ids, real)
        shift = [*sample_ids[1:].tolist(), IGNORE_INDEX]
        assert cp_gather(local, real).tolist() == shift
        gathered += real
    assert gathered == sum(lengths)


def test_worked_example_10_tokens_over_cp_2() -> None:
    """The docstring's example: a 10-token sample over cp 2, padded to 12."""
    row = laid_out([10], GroupSplit(cp=2), None, 0)
    ids = row["input_ids"]
    x = IGNORE_INDEX
    assert row["target_ids"].tolist() == [*ids[1:10].tolist(), x, x, x]
    rank0, rank1 = (cp_view(row, 2, r) for r in range(2))
    assert rank0["position_ids"].tolist() == [0, 1, 2, 9, 10, 11]
    assert rank0["target_ids"].tolist() == [ids[1], ids[2], ids[3], x, x, x]
    assert rank1["target_ids"].tolist() == ids[4:10].tolist()
    assert rank0["target_loss_weight"].tolist()[3:] == [0, 0, 0]
    assert rank0["target_loss_weight"][2] == row["loss_weight"][3]  # on rank 1 as a token


def test_views_derive_targets_for_a_row_built_without_them() -> None:
    """A row dict without the target arrays (built by hand) gets them derived on the whole row
    before the split, the same as the reader's."""
    row = laid_out([5, 9, 2], GroupSplit(cp=2), None, 1)
    bare = {k: v for k, v in row.items() if k not in TARGET_FIELDS}
    for r in range(2):
        a, b = cp_view(row, 2, r), cp_view(bare, 2, r)
        assert all(np.array_equal(a[k], b[k]) for k in TARGET_FIELDS)


def test_doctests() -> None:
    for module in (targets, split):
        assert doctest.testmod(module).failed == 0
