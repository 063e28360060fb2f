"""Every row of a ``--cp C`` pack is valid THD for C (issue 21, defect 1).

TransformerEngine's THD partitioner (``thd_get_partitioned_indices``, what Megatron-Core's
``get_thd_batch_on_this_cp_rank`` calls) and ring-flash-attn's zigzag varlen ring attention need
every ``cu_seqlens_padded`` boundary to be a multiple of 2C: TE refuses any other row, and
ring-flash-attn runs on one and returns wrong outputs on real tokens. rolltool used to pad the
row end to a multiple of C only (an empty micro-batch's row of C tokens, rows of ``--row-len`` x C
with an odd ``--row-len``). Checked here:

- for cp 2 and 4, with and without ``--row-len``, empty micro-batches included: every stored row
  and every boundary of every CP view's ``cu_seqlens_padded`` is a multiple of 2C, and each
  view's tokens are those TE's partitioner selects (`te_partitioned_indices`, its CUDA kernel
  ported to Python);
- an odd ``--row-len`` with ``--cp`` (and a budget that cannot hold 2C tokens) is refused at plan
  time, with the reason;
- a pack laid out by the old rule (made here by packing with the old ``row_multiple``) is refused
  by the reader and by ``rolltool verify``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts
from te_thd import partitioned_indices
from verify_helpers import kinds

import rolltool
from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE
from rolltool.format.layout import SampleTokens, pack_rows, segment_positions
from rolltool.format.shards import read_shard
from rolltool.format.split import GroupSplit, cp_spans
from rolltool.packed.core import layout_problem
from rolltool.plan.config import PackConfig

# -- TransformerEngine's THD partitioner, ported (tests/te_thd.py) -----------------------------


def te_partitioned_indices(
    cu_seqlens_padded: Any, total_tokens: int, world_size: int, rank: int
) -> np.ndarray:
    """TransformerEngine's ``thd_get_partitioned_indices`` (`te_thd.partitioned_indices`): the
    row positions CP rank `rank` holds, in its local order; a RuntimeError where TE's checks
    fail (every boundary of ``cu_seqlens`` a multiple of 2 x world_size)."""
    out = partitioned_indices([int(x) for x in cu_seqlens_padded], total_tokens, world_size, rank)
    return np.array(out, dtype=np.int64)


def zigzag_indices(cu_seqlens_padded: Any, cp: int, rank: int) -> np.ndarray:
    """The same selection by its definition: each sequence of padded length L (L % 2C == 0) cut
    into 2C chunks, rank r takes chunks r and 2C-1-r."""
    out = []
    for a, b in itertools.pairwise(cu_seqlens_padded):
        length = int(b - a)
        assert length % (2 * cp) == 0
        c = length // (2 * cp)
        for q in (rank, 2 * cp - 1 - rank):
            out.extend(range(int(a) + q * c, int(a) + (q + 1) * c))
    return np.array(out, dtype=np.int64)


def test_the_te_port_is_the_zigzag_and_refuses_old_rows() -> None:
    assert te_partitioned_indices([0, 12], 12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert te_partitioned_indices([0, 12], 12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    for cu, cp in (([0, 8, 24, 32], 2), ([0, 16, 24, 56, 64], 4), ([0, 24], 3)):
        for r in range(cp):
            got = te_partitioned_indices(cu, cu[-1], cp, r)
            assert got.tolist() == zigzag_indices(np.array(cu), cp, r).tolist()
    # The rows the issue names: an empty micro-batch's row at --cp 2 (C = 2 padding tokens) and
    # a row of --row-len 201 x cp 2 (a sample of 12 padded tokens, then 390 of row-end padding).
    for cu in ([0, 2], [0, 12, 402]):
        with pytest.raises(RuntimeError, match="world_size \\* 2"):
            te_partitioned_indices(cu, cu[-1], 2, 0)


# -- packs: every row valid THD, every view TE's selection ------------------------------------

LENGTHS = [[9, 23], [31, 8], [5, 40], [17, 12], [24, 16], [3, 44]]
"""Six groups of two rollouts: lengths that are and are not multiples of 2C."""

BUDGET = 24  # per GPU: a cp-2 group holds 48 tokens, the 44-token sample fits every layout

PLANS = {
    "few": ("--dp", 4, "--batch-size", 2),  # two samples a step over four ranks: two empty rows
    "full": ("--dp", 2, "--batch-size", 12),  # one step, several micro-batches a rank
}

VIEWED = ("input_ids", "loss_mask", "advantages", "logprobs", "loss_weight")
"""Per-token arrays compared with TE's selection of the group row everywhere; ``position_ids``
only on real tokens (a view continues a sample's positions into its padding, the stored row
restarts them: the documented convention)."""


@pytest.fixture(scope="module")
def thd_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(21)
    groups = [G("math" if g % 2 else "agent", rng.random(2).round(2).tolist(), lens)
              for g, lens in enumerate(LENGTHS)]  # fmt: skip
    path = tmp_path_factory.mktemp("thd") / "in.parquet"
    pq.write_table(rollouts(groups, seed=7), path)
    return path


def _real_positions(row: dict[str, np.ndarray]) -> np.ndarray:
    """[n] bool: the group row's tokens that belong to a sample (not padding)."""
    lens = np.diff(row["cu_seqlens"].astype(np.int64))
    return np.repeat(row["sample_index"] >= 0, lens)


def _check_thd_pack(out: Path, cp: int, row_len: int | None) -> int:
    """Every row and view of the pack is valid THD for cp and each view is TE's selection of
    its group row; returns how many rows are empty micro-batches."""
    ds = rolltool.open_packed(out)
    m = 2 * cp
    empty = 0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            rows = ds.micro_batches(step, rank)
            views = [ds.micro_batches(step, rank, cp_rank=g) for g in range(cp)]
            for j, row in enumerate(rows):
                n = len(row["input_ids"])
                assert n % m == 0, (step, rank, j, n)
                if row_len is not None:
                    assert n == row_len * cp
                if np.all(row["sample_index"] == PAD_SAMPLE):
                    empty += 1
                    assert n == (row_len * cp if row_len else m)  # was cp before the fix
                real = _real_positions(row)
                for g in range(cp):
                    view = views[g][j]
                    padded = view["cu_seqlens_padded"].astype(np.int64)
                    assert np.all(padded % m == 0), (step, rank, j, padded.tolist())
                    assert padded[-1] == n
                    assert np.array_equal(padded, cp * view["cu_seqlens"].astype(np.int64))
                    index = te_partitioned_indices(padded, n, cp, g)
                    assert np.array_equal(index, zigzag_indices(padded, cp, g))
                    for key in VIEWED:
                        assert np.array_equal(view[key], row[key][index]), key
                    on = real[index]
                    assert np.array_equal(view["position_ids"][on], row["position_ids"][index][on])
    return empty


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("row_len", [None, BUDGET])
@pytest.mark.parametrize("cp", [2, 4])
def test_every_cp_row_is_valid_thd(
    thd_input: Path, tmp_path: Path, cp: int, row_len: int | None, plan: str
) -> None:
    out = tmp_path / "p"
    extra = () if row_len is None else ("--row-len", row_len)
    pack(thd_input, out, *PLANS[plan], "--cp", cp, "--micro-batch-tokens", BUDGET, *extra)
    empty = _check_thd_pack(out, cp, row_len)
    assert empty > 0 if plan == "few" else empty == 0
    assert kinds(out) == {}


# -- the layout and the reader's check, directly ----------------------------------------------


def _tokens(lengths: list[int]) -> SampleTokens:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    return SampleTokens(offsets, np.arange(1, n + 1, dtype=np.int32), np.ones(n, np.uint8),
                        np.zeros(n, np.float32))  # fmt: skip


def _rows(lengths: list[int], groups: list[list[int]], split: GroupSplit, **kw: Any) -> Any:
    n = len(lengths)
    return pack_rows(
        _tokens(lengths),
        [np.array(g, dtype=np.int64) for g in groups],
        sample_index=np.arange(n, dtype=np.int64),
        advantage=np.zeros(n, np.float32),
        weight=np.ones(n),
        sample_multiple=split.sample_multiple,
        **kw,
    )


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_pack_rows_pads_cp_rows_to_2cp(cp: int) -> None:
    split = GroupSplit(cp=cp)
    assert split.row_multiple == 2 * cp
    rng = np.random.default_rng(cp)
    lengths = rng.integers(1, 30, 12).tolist()
    groups = [[0, 1, 2], [], [3], [4, 5, 6, 7], [], [8, 9, 10, 11]]
    for row_len in (None, 4 * 2 * cp * 10):
        rows = _rows(lengths, groups, split, row_len=row_len, row_multiple=split.row_multiple)
        arrays = rows.arrays()
        assert layout_problem(arrays, split, row_len) is None
        sizes = np.diff(rows.row_offsets)
        assert np.all(sizes % (2 * cp) == 0)
        assert sizes[1] == sizes[4] == (row_len or 2 * cp)  # the empty micro-batches
        for r in range(len(groups)):
            s0, s1 = rows.row_segments[r], rows.row_segments[r + 1]
            cu = np.concatenate([[0], np.cumsum(rows.seq_lens[s0:s1])])
            spans = cp_spans(cu, rows.sample_index[s0:s1], cp)
            assert np.all(spans.padded % (2 * cp) == 0)
        positions = segment_positions(rows.seq_lens)
        assert len(positions) == rows.row_offsets[-1]


@pytest.mark.parametrize("cp", [2, 4])
def test_rows_of_the_old_rule_are_refused(cp: int) -> None:
    """Rows laid out with row-end padding a multiple of cp only (what rolltool wrote before)."""
    split = GroupSplit(cp=cp)
    lengths = [2 * cp + 1, 3]
    rows = _rows(lengths, [[0], [], [1]], split, row_multiple=cp)  # an empty row of cp tokens
    assert np.diff(rows.row_offsets)[1] == cp
    why = layout_problem(rows.arrays(), split, None)
    assert why is not None and f"{cp} padding tokens are not a multiple of 2 x cp" in why
    assert "pack it again" in why
    odd = (2 * cp * 3 + 1) * cp  # an odd --row-len x cp
    rows = _rows(lengths, [[0], [], [1]], split, row_len=odd, row_multiple=cp)
    why = layout_problem(rows.arrays(), split, odd)
    assert why is not None and f"is not a multiple of 2 x cp = {2 * cp}" in why
    cu = np.array([0, cp])
    with pytest.raises(RolltoolError, match=f"not a multiple of 2 x cp = {2 * cp}"):
        cp_spans(cu, np.array([PAD_SAMPLE]), cp)


# -- refused at plan time ---------------------------------------------------------------------


def test_an_odd_row_len_with_cp_is_refused(thd_input: Path, tmp_path: Path) -> None:
    with pytest.raises(RolltoolError, match=r"--row-len 201 with --cp 2: .* 2 x cp = 4") as e:
        PackConfig(dp=2, cp=2, row_len=201)
    assert e.value.hint is not None and "even --row-len" in e.value.hint
    for ok in ({"cp": 2, "row_len": 202}, {"cp": 1, "row_len": 201}, {"sp": 2, "row_len": 201}):
        PackConfig(dp=2, **ok)
    result = cli("pack", thd_input, "-o", tmp_path / "out", "--dp", 2, "--cp", 2, "--row-len", 201)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: --row-len 201 with --cp 2: every CP row must be a multiple")
    assert "TransformerEngine" in lines[0] and "ring-flash-attn" in lines[0]
    assert lines[1:] == ["Hint: use an even --row-len, e.g. 202"]
    assert not (tmp_path / "out").exists()


def test_a_budget_that_cannot_hold_2cp_tokens_is_refused() -> None:
    with pytest.raises(RolltoolError, match=r"--micro-batch-tokens 1 with --cp 4: .* 8 tokens"):
        PackConfig(dp=2, cp=4, micro_batch_tokens=1)
    PackConfig(dp=2, cp=4, micro_batch_tokens=2)
    PackConfig(dp=2, micro_batch_tokens=1)


# -- packs of the old rule: refused by the reader and by verify -------------------------------


def _old_pack(
    monkeypatch: pytest.MonkeyPatch, inp: Path, out: Path, cp: int, *args: Any
) -> list[int]:
    """A pack laid out as rolltool did before this rule (row-end padding a multiple of cp, odd
    --row-len accepted); returns the stored length of every row."""
    with monkeypatch.context() as m:
        m.setattr(GroupSplit, "row_multiple", property(lambda s: s.size))
        m.setattr(PackConfig, "_check_thd_rows", lambda self: None)
        pack(inp, out, *PLANS["few"], "--cp", cp, *args)
    sizes = []
    for path in sorted(out.glob("rank-*/step-*.safetensors")):
        sizes += np.diff(read_shard(path)["row_offsets"]).tolist()
    return sizes


@pytest.mark.parametrize("row_len", [None, 25])
def test_an_old_cp_pack_is_refused(
    monkeypatch: pytest.MonkeyPatch, thd_input: Path, tmp_path: Path, row_len: int | None
) -> None:
    out, cp = tmp_path / "old", 2
    extra = () if row_len is None else ("--row-len", row_len)
    sizes = _old_pack(monkeypatch, thd_input, out, cp, "--micro-batch-tokens", BUDGET, *extra)
    uneven = [n for n in sizes if n % (2 * cp)]
    assert uneven and (row_len is not None or set(uneven) == {cp})
    ds = rolltool.open_packed(out)
    what = "padding tokens" if row_len is None else f"row 0 of {row_len * cp} tokens"
    refused = 0
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            try:
                ds.micro_batches(step, rank)
            except RolltoolError as e:
                assert "rows not laid out as the manifest's config says" in e.message
                assert what in e.message and "not a multiple of 2 x cp = 4" in e.message
                assert "not valid THD" in e.message and "pack it again" in e.message
                assert e.hint is not None and "rolltool verify" in e.hint
                refused += 1
    assert refused > 0
    assert kinds(out, recorded_inputs=False) == {"row.split": len(uneven)}  # one per row
    result = cli("verify", out, "--no-input")
    assert result.exit_code == 1 and "not a multiple of 2 x cp = 4" in result.stdout
