"""Invariants of the packed rows: shards, row shapes, padding, where samples are, their fields.

They judge the `Segments` tables read in one pass over the shards. A segment is compared with
its samples.parquet record only where that record plans it (else the one problem is that it is
misplaced), and its trainable count only when its length is right (a moved boundary is one
problem per sample, not two).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from rolltool.format import PAD_SAMPLE
from rolltool.util.problems import Problem
from rolltool.verify.context import Context
from rolltool.verify.segments import row_ids, segment_degrees


def shards_readable(ctx: Context) -> Iterator[Problem]:
    """Every shard is readable and self-consistent (offsets, segment lengths, its row count);
    then ``cu_seqlens`` and ``position_ids`` as the reader derives them are right by
    construction."""
    for b in ctx.segments.broken:
        yield Problem("shard.corrupt", f"step {b.step} rank {b.rank}", b.why)


def row_structure(ctx: Context) -> Iterator[Problem]:
    """No row holds more sample tokens (padded for cp) than the step's budget or more samples
    than its micro-batch size; with a fixed row length every row has it; loss_mask values are
    0 or 1."""
    seg, steps = ctx.segments, ctx.manifest.steps
    budget = np.array([st.plan.max_tokens or -1 for st in steps], dtype=np.int64)[seg.row_step]
    used = seg.row_real_tokens
    if ctx.split.hybrid:  # each sample padded for its own sub-group (k = 1: not at all)
        deg = segment_degrees(seg, ctx.split.cp)
        own = np.where(deg > 1, -(-seg.length // (2 * deg)) * 2 * deg, seg.length)
        occupied = np.where(seg.sample >= 0, own, 0)
        used = np.bincount(row_ids(seg), weights=occupied, minlength=len(used)).astype(np.int64)
    elif ctx.split.cp > 1:  # the budget counts each sample padded for the CP split
        occupied = np.where(seg.sample >= 0, ctx.split.padded(seg.length), 0)
        used = np.bincount(row_ids(seg), weights=occupied, minlength=len(used)).astype(np.int64)
    for r in np.flatnonzero((budget >= 0) & (used > budget)):
        padded = " (padded for --cp)" if ctx.split.cp > 1 else ""
        text = f"{used[r]} tokens{padded}, over the {budget[r]}-token budget"
        yield Problem("row.budget", seg.row_where(r), text)
    size = np.array([st.plan.micro_batch_size or -1 for st in steps], dtype=np.int64)
    size = size[seg.row_step]
    for r in np.flatnonzero((size >= 0) & (seg.row_real_segments > size)):
        text = f"{seg.row_real_segments[r]} samples, the micro-batch size is {size[r]}"
        yield Problem("row.size", seg.row_where(r), text)
    if ctx.row_len is not None:
        for r in np.flatnonzero(seg.row_tokens != ctx.row_len):
            text = f"row of {seg.row_tokens[r]} tokens, --row-len is {ctx.row_len}"
            yield Problem("row.length", seg.row_where(r), text)
    for k in np.flatnonzero((seg.sample >= 0) & (seg.mask_over_one > 0)):
        text = f"{seg.mask_over_one[k]} loss_mask value(s) other than 0 and 1"
        yield Problem("row.mask", f"{seg.where(k)} sample {seg.sample[k]}", text)


def padding(ctx: Context) -> Iterator[Problem]:
    """Padding carries nothing: no loss mask, weight or advantage, only ``pad_id`` tokens with
    logprobs 0 (one problem per padding segment, whatever it carries)."""
    seg = ctx.segments
    pad = seg.sample == PAD_SAMPLE
    carries = (seg.trainable > 0) | (seg.weight != 0) | (seg.advantage != 0)
    carries |= (seg.pad_ids > 0) | (seg.pad_logprobs > 0)
    for k in np.flatnonzero(pad & carries):
        what = [
            f"loss mask on {seg.trainable[k]} token(s)" * bool(seg.trainable[k]),
            f"weight {seg.weight[k]:.9g}" * bool(seg.weight[k] != 0),
            f"advantage {seg.advantage[k]:.9g}" * bool(seg.advantage[k] != 0),
            f"{seg.pad_ids[k]} token(s) other than pad_id {ctx.pad_id}" * bool(seg.pad_ids[k]),
            f"{seg.pad_logprobs[k]} non-zero logprob(s)" * bool(seg.pad_logprobs[k]),
        ]
        yield Problem(
            "row.padding", seg.where(k), "padding carries " + ", ".join(filter(None, what))
        )


def at_plan(ctx: Context) -> np.ndarray:
    """[K] bool: the segment is a trained sample at the step, rank and micro-batch samples.parquet
    plans for it."""
    seg, s = ctx.segments, ctx.samples
    valid = (seg.sample >= 0) & (seg.sample < s.n)
    i = np.where(valid, seg.sample, 0)
    same = (s.step[i] == seg.step) & (s.rank[i] == seg.rank) & (s.micro_batch[i] == seg.row)
    return valid & s.trained[i] & same


def agreeing(ctx: Context) -> np.ndarray:
    """[K] bool: at its planned place with the length, trainable count and mask values of its
    record (the segments whose tokens are worth comparing with the input)."""
    seg, s = ctx.segments, ctx.samples
    ok = at_plan(ctx)
    i = np.where(ok, seg.sample, 0)
    return (
        ok
        & (seg.length == s.length[i])
        & (seg.trainable == s.trainable[i])
        & (seg.mask_over_one == 0)
    )


def placement(ctx: Context) -> Iterator[Problem]:
    """Every segment is padding or a sample of the input; every trained sample appears exactly
    once, at the step, rank and micro-batch samples.parquet says; nothing else appears."""
    seg, s, m = ctx.segments, ctx.samples, ctx.manifest
    for k in np.flatnonzero((seg.sample < PAD_SAMPLE) | (seg.sample >= s.n)):
        text = f"sample_index {seg.sample[k]} is not a sample of the input ({s.n} samples)"
        yield Problem("segment.index", seg.where(k), text)
    valid = (seg.sample >= 0) & (seg.sample < s.n)
    inside = s.inside_run(m.num_steps, m.dp)  # trained elsewhere: samples.place says so
    ok = at_plan(ctx)
    for k in np.flatnonzero(valid & ~ok):
        i = seg.sample[k]
        if s.trained[i] and not inside[i]:
            continue
        text = (
            f"samples.parquet has it at step {s.step[i]} rank {s.rank[i]} micro-batch "
            f"{s.micro_batch[i]}"
            if s.trained[i]
            else "samples.parquet says it is not trained"
        )
        yield Problem("sample.placement", f"{seg.where(k)} sample {i}", text)
    here = np.bincount(seg.sample[ok], minlength=s.n)
    for i in np.flatnonzero(here > 1):
        yield Problem("sample.repeated", s.where(i), f"appears {here[i]} times in its micro-batch")
    unread = np.zeros((m.num_steps, m.dp), dtype=bool)
    for b in seg.broken:
        unread[b.step, b.rank] = True
    expected = s.trained & inside
    expected[expected] &= ~unread[s.step[expected], s.rank[expected]]
    seen = np.bincount(seg.sample[valid], minlength=s.n)
    for i in np.flatnonzero(expected & (seen == 0)):
        yield Problem("sample.missing", s.where(i), "planned but missing from the packed rows")


def sample_fields(ctx: Context) -> Iterator[Problem]:
    """A sample's segment has samples.parquet's length, trainable tokens (loss-mask count, when
    the length is right), advantage (bitwise) and token_loss_weight (exactly)."""
    seg, s = ctx.segments, ctx.samples
    k = np.flatnonzero(at_plan(ctx))
    i = seg.sample[k]
    same_length = seg.length[k] == s.length[i]
    checks = (
        ("sample.length", ~same_length, seg.length, s.length,
         "{} tokens, samples.parquet says {}"),
        ("sample.trainable", same_length & (seg.trainable[k] != s.trainable[i]), seg.trainable,
         s.trainable, "{} trainable tokens (loss_mask), samples.parquet trainable_tokens says {}"),
        ("sample.advantage", seg.advantage[k].view(np.uint32) != s.advantage[i].view(np.uint32),
         seg.advantage, s.advantage, "advantage {}, samples.parquet says {}"),
        ("sample.weight", seg.weight[k] != s.weight[i], seg.weight, s.weight,
         "loss weights {} per trainable token, samples.parquet token_loss_weight says {}"),
    )  # fmt: skip
    for kind, off, got, want, text in checks:
        for j in np.flatnonzero(off):
            where = f"{seg.where(int(k[j]))} sample {i[j]}"
            yield Problem(kind, where, text.format(_num(got[k[j]]), _num(want[i[j]])))


def _num(x: np.generic) -> str:
    return f"{x:.9g}" if isinstance(x, np.floating) else str(x)


def group_split(ctx: Context) -> Iterator[Problem]:
    """With --sp or --cp, every row splits evenly over the group's GPUs: its length is a
    multiple of sp, or of 2 x cp with cp (`GroupSplit.row_multiple`); with cp every sample is
    followed by exactly the padding that brings it to a multiple of 2 x cp, and every other
    padding segment (row-end padding, an empty micro-batch's row) is a multiple of 2 x cp too:
    every ``cu_seqlens_padded`` boundary of a CP view is a multiple of 2 x cp, valid THD for
    TransformerEngine and ring-flash-attn (a pack made before this rule is refused: pack it
    again)."""
    split, seg = ctx.split, ctx.segments
    if split.size == 1 or split.hybrid:  # a hybrid row's blocks: `rolltool.verify.hybrid`
        return
    multiple = split.row_multiple
    uneven_row = seg.row_tokens % multiple != 0
    for r in np.flatnonzero(uneven_row):
        text = (
            f"row of {seg.row_tokens[r]} tokens is not a multiple of 2 x cp = {multiple} (--cp "
            f"{split.cp}: not valid THD; packed before rolltool padded --cp rows to 2 x cp? "
            "pack again)"
            if split.cp > 1
            else f"row of {seg.row_tokens[r]} tokens does not split over --{split.kind} {multiple}"
        )
        yield Problem("row.split", seg.row_where(r), text)
    if split.cp == 1:
        return
    row = row_ids(seg)
    real = seg.sample >= 0
    want = np.where(real, split.padded(seg.length) - seg.length, 0)
    nxt = np.append(np.arange(1, len(row)), len(row) - 1) if len(row) else row
    follows = (
        (nxt != np.arange(len(row)))
        & (row[nxt] == row)
        & (seg.sample[nxt] == PAD_SAMPLE)
        & (seg.length[nxt] == want)
    )
    for k in np.flatnonzero(real & (want > 0) & ~follows):
        text = (
            f"sample {seg.sample[k]} ({seg.length[k]} tokens) is not followed by its {want[k]} "
            f"padding tokens (to a multiple of 2 x cp = {split.sample_multiple})"
        )
        yield Problem("row.split", seg.where(k), text)
    own = np.zeros(len(row), dtype=bool)  # a sample's CP padding
    own[1:] = (want[:-1] > 0) & follows[:-1]
    m = split.sample_multiple
    bad_pad = (seg.sample == PAD_SAMPLE) & ~own & (seg.length % m != 0)
    bad_pad &= ~uneven_row[row]  # a row already reported: one problem, not two
    for k in np.flatnonzero(bad_pad):
        text = (
            f"{seg.length[k]} padding tokens are not a multiple of 2 x cp = {m} (--cp "
            f"{split.cp}: not valid THD)"
        )
        yield Problem("row.split", seg.where(k), text)
