"""`rolltool verify` of a ``--share-prefix`` pack (format version 4, `rolltool.format.prefix`).

A shared row stores a prefix once; every other invariant judges *samples*. So the one pass over
the shards (`rolltool.verify.segments`) reads a shared shard through `expand`: each sample
reassembled from its chain (the chain's stored tokens, root first, then its continuation,
with its continuation's weight and advantage), padding as it is, prefix segments left out.
Then every sample-level invariant holds as for any pack: ``sample.length`` (the chain's length
is the sample's), ``placement`` (every sample once), ``sample.weight`` / ``sample.advantage``
(its continuation's against samples.parquet) and ``content`` (the reassembled tokens, loss mask
and log-probs against the input, bitwise: a prefix's stored tokens are every sample's through
it). What is left for `shared_layout` (kind ``row.shared``) is the shared structure itself:
`rolltool.format.prefix.shared_problem` (parents earlier and real, a prefix names its first
child's sample, its children start with one token and weigh its weight, so by induction a
prefix weighs the sum over its samples; a leaf ends at its sample's end) and the advantage
rule: a prefix holding a trained token has the advantage of every sample through it.

Rows are judged on what they store (``row.budget``, ``rank.counts``: the writer's record counts
stored segments and tokens, prefixes included); a step's plan figures on its stored tokens
(``step.plan``: ``tokens`` = the rows' real tokens = ``plan.shared.stored``, ``plan.shared.tokens``
= its samples' lengths).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE
from rolltool.format.prefix import NO_PARENT, shared_problem
from rolltool.format.shards import read_shard
from rolltool.util.problems import Problem

if TYPE_CHECKING:  # the context imports the pass over the shards, which imports this
    from rolltool.verify.context import Context


def parents_problem(a: dict[str, np.ndarray]) -> str | None:
    """Why a shared shard's ``seg_parent`` cannot be followed (missing, of the wrong shape, a
    parent not earlier in its row, padding in a chain), or None."""
    par = a.get("seg_parent")
    if par is None:
        return "missing array seg_parent (a --share-prefix pack's)"
    if par.ndim != 1 or par.dtype.kind not in "iu" or len(par) != len(a["seq_lens"]):
        return "seg_parent is not one integer per segment"
    rs = a["row_segments"].astype(np.int64)
    local = np.arange(len(par)) - np.repeat(rs[:-1], np.diff(rs))
    p = par.astype(np.int64)
    bad = (p < NO_PARENT) | (p >= local)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        return f"segment {j}'s parent {int(p[j])} is not -1 or an earlier segment of its row"
    glob = np.where(p >= 0, p + (np.arange(len(p)) - local), -1)
    pad = a["sample_index"] == PAD_SAMPLE
    if np.any(pad[glob[p >= 0]]) or np.any(pad & (p >= 0)):
        return "a padding segment continues or is continued by another"
    return None


def expand(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A shared shard's arrays as an unshared one's: each row's samples reassembled from their
    chains, in the order of their continuations, padding kept, prefixes left out (the module
    docstring). Expects arrays that passed `check_rows` and `parents_problem`."""
    par = a["seg_parent"].astype(np.int64)
    lens = a["seq_lens"].astype(np.int64)
    rs = a["row_segments"].astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)])
    base = np.repeat(rs[:-1], np.diff(rs))
    parent = np.where(par >= 0, par + base, -1)
    has_kids = np.zeros(len(par), dtype=bool)
    has_kids[parent[parent >= 0]] = True
    keep = np.flatnonzero(~has_kids)  # leaves and padding, in row order
    tokens: list[np.ndarray] = []
    out_lens = np.zeros(len(keep), dtype=np.int64)
    for n, j in enumerate(keep.tolist()):
        chain, seg = [], j
        while seg >= 0:
            chain.append(seg)
            seg = int(parent[seg])
        parts = [np.arange(cu[s], cu[s + 1]) for s in chain[::-1]]
        tokens.extend(parts)
        out_lens[n] = sum(len(x) for x in parts)
    take = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    row_of = np.repeat(np.arange(len(rs) - 1), np.diff(rs))[keep]
    row_segments = np.zeros(len(rs), dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=len(rs) - 1), out=row_segments[1:])
    row_offsets = np.zeros(len(rs), dtype=np.int64)
    np.cumsum(np.bincount(row_of, weights=out_lens, minlength=len(rs) - 1).astype(np.int64),
              out=row_offsets[1:])  # fmt: skip
    out = {k: a[k][take] for k in ("input_ids", "loss_mask", "logprobs")}
    for k in ("sample_index", "seg_weight", "seg_advantage"):
        out[k] = a[k][keep]
    out["seq_lens"] = out_lens.astype(np.int32)
    out["row_offsets"], out["row_segments"] = row_offsets, row_segments
    return out


def shared_layout(ctx: Context) -> Iterator[Problem]:
    """``row.shared`` (see the module docstring), shard by shard."""
    if not ctx.manifest.config.share_prefix:
        return
    lengths = ctx.samples.length[: ctx.input_rows]
    seen: set[str] = set()
    for part in ctx.segments.parts:
        if part.path in seen:
            continue
        seen.add(part.path)
        try:
            a = read_shard(ctx.root / part.path)
        except RolltoolError:
            continue  # shards_readable says so
        where = f"step {part.step} rank {part.rank}"
        wrong = shared_problem(a, lengths) or _advantage_problem(a)
        if wrong is not None:
            yield Problem("row.shared", where, f"{part.path}: {wrong}")


def _advantage_problem(a: dict[str, np.ndarray]) -> str | None:
    """A prefix holding a trained token whose advantage is not that of every sample through it."""
    par = a["seg_parent"].astype(np.int64)
    lens = a["seq_lens"].astype(np.int64)
    rs = a["row_segments"].astype(np.int64)
    base = np.repeat(rs[:-1], np.diff(rs))
    parent = np.where(par >= 0, par + base, -1)
    cu = np.concatenate([[0], np.cumsum(lens)])
    adv = a["seg_advantage"]
    trained = np.add.reduceat(a["loss_mask"] != 0, cu[:-1], dtype=np.int64) if len(lens) else lens
    for j in np.flatnonzero(parent >= 0).tolist():  # every segment against each ancestor
        up = int(parent[j])
        while up >= 0:
            if trained[up] and adv[up] != adv[j]:
                return (
                    f"prefix segment {up - int(base[up])} holds trained tokens with advantage "
                    f"{adv[up]:.9g}, a sample through it has {adv[j]:.9g}"
                )
            up = int(parent[up])
    return None


def shared_plans(ctx: Context) -> Iterator[Problem]:
    """``step.plan`` of a shared pack: per step, the plan's samples and samples per rank are
    samples.parquet's, its ``tokens`` and ``shared.stored`` the rows' real tokens,
    ``shared.tokens`` (and per env) its samples' lengths."""
    m, s, seg = ctx.manifest, ctx.samples, ctx.segments
    stored = np.zeros(m.num_steps, dtype=np.int64)
    np.add.at(stored, seg.row_step, seg.row_real_tokens)
    broken = {b.step for b in seg.broken}
    inside = s.inside_run(m.num_steps, m.dp)
    for step, rec in enumerate(m.steps):
        planned = s.planned(step)
        if not inside[planned].all():
            continue  # samples.place says so
        sh = rec.plan.shared
        if sh is None:
            yield Problem("step.plan", f"step {step}", "no plan.shared in a --share-prefix pack")
            continue
        per_rank = tuple(np.bincount(s.rank[planned], minlength=m.dp).tolist())
        envs: dict[str, int] = {}
        for e, n in zip(s.env[planned].tolist(), s.length[planned].tolist(), strict=True):
            envs[s.env_names[e]] = envs.get(s.env_names[e], 0) + n
        found = [
            ("samples", rec.plan.samples, len(planned)),
            ("samples_per_rank", rec.plan.samples_per_rank, per_rank),
            ("shared.tokens", sh.tokens, int(s.length[planned].sum())),
            ("shared.envs tokens", {e: t.tokens for e, t in sh.envs.items()}, envs),
            ("shared.envs stored", sum(t.stored for t in sh.envs.values()), sh.stored),
        ]
        if step not in broken:
            found += [("tokens", rec.plan.tokens, int(stored[step])),
                      ("shared.stored", sh.stored, int(stored[step]))]  # fmt: skip
        for key, recorded, value in found:
            if recorded != value:
                text = f"plan {key} is {recorded}, the pack gives {value}"
                yield Problem("step.plan", f"step {step}", text)
