"""``--check`` for ``--cp`` / ``--sp`` packs: every GPU's attention, fed from the reader's views,
gives each token the output of its sample run alone.

A tiny causal attention model gives every token its q, k, v from its token id and its position
(a seeded table per id, rotary embedding by position), so a token moved to the wrong place, or
given the wrong position, changes the result. For a sample of group rows:

- **CP**: CP rank r's view (``ds.micro_batches(step, rank, cp_rank=r, torch=True)``) gives its
  queries; each sample's keys and values are gathered from all CP ranks' views back into the
  sample's order by ``rolltool.format.split.cp_gather``. The rank's query blocks, chunk r and chunk
  2C-1-r as the zigzag layout defines them, attend to the gathered prefix up to each chunk's
  end (``Backend.attend_blocks``, causal, bottom-right): what ring attention computes. Each real
  token's output is compared with the sample alone at the position the layout gives it
  (chunk x c + offset).
- **SP**: the S views' slices are concatenated back into the row; SP rank i runs its heads
  (`rolltool.bench.shares.sp_heads`) over the whole row; the ranks' outputs side by side by
  heads, sliced by tokens (the all-to-all back: rank i keeps the i-th 1/S of the tokens), are
  compared with each sample alone.

The reference: the sample's tokens from the group's stored row (no view), positions 0 .. L-1,
the same model, causal sdpa in fp32 (`rolltool.bench.check.reference`), on inputs rounded to
the bench dtype; the tolerance is ``TOLERANCES[dtype]``.

With ``--backward`` the gradients are compared too: every real token's output gradient is the
one its sample alone gets at that position (padding's is 0, as its loss weight is), and the
gradients of every GPU's local q, k, v (CP: a key's summed over every block of every rank that
gathered it, what ring attention sends back to its owner) must equal the sample alone's, error
relative to the sample's largest gradient, within twice the relative tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from rolltool.bench.backends import Backend
from rolltool.bench.check import _excess, reference, sample_rows
from rolltool.bench.config import TOLERANCES, BenchSetup, torch_dtype
from rolltool.bench.rows import ReplayRows, Row
from rolltool.bench.shares import sp_heads
from rolltool.format.split import cp_gather
from rolltool.packed.reader import PackedDataset, open_packed

VOCAB = 251
"""Rows of the tiny model's tables (a token id picks row id mod VOCAB)."""


@dataclass
class TinyAttention:
    """q, k, v of tokens from (id, position): seeded tables, rotary embedding on q and k."""

    torch: Any
    tables: tuple[Any, ...]
    """q [VOCAB, heads, D], k, v [VOCAB, kv_heads, D], output gradient [VOCAB, heads, D]."""
    dtype: Any
    """The bench dtype: q, k, v are rounded to it (the reference sees the same values)."""

    @classmethod
    def make(cls, torch: Any, setup: BenchSetup) -> TinyAttention:
        s = setup.shape
        gen = torch.Generator(device="cpu").manual_seed(setup.seed + 5)
        tables = tuple(
            torch.randn(VOCAB, h, s.head_dim, generator=gen)
            for h in (s.heads, s.kv_heads, s.kv_heads, s.heads)
        )
        return cls(torch, tables, torch_dtype(torch, setup.dtype))

    def __call__(self, ids: Any, pos: Any) -> tuple[Any, Any, Any]:
        """float32 q [n, heads, D], k, v [n, kv_heads, D] (values of the bench dtype)."""
        row = ids.long() % VOCAB
        q, k, v = (table[row] for table in self.tables[:3])
        q, k = self._rope(q, pos), self._rope(k, pos)
        q, k, v = (x.to(self.dtype).float() for x in (q, k, v))
        return q, k, v

    def grad_out(self, ids: Any, pos: Any) -> Any:
        """float32 [n, heads, D]: the loss gradient of a token's attention output."""
        return self._rope(self.tables[3][ids.long() % VOCAB], pos)

    def _rope(self, x: Any, pos: Any) -> Any:
        t = self.torch
        half = x.shape[-1] // 2
        freq = 10000.0 ** (-t.arange(half, dtype=t.float32) / max(half, 1))
        angle = (pos.double()[:, None] * freq.double()).float()[:, None, :]  # [n, 1, half]
        cos, sin = angle.cos(), angle.sin()
        a, b, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        return t.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


@dataclass
class Alone:
    """One sample run alone: its output, the output gradient its tokens get, q/k/v gradients."""

    out: Any  # [L, heads, D] float32
    go: Any  # [L, heads, D] float32
    grads: tuple[Any, Any, Any] | None  # dq, dk, dv with --backward


def alone(
    torch: Any, model: TinyAttention, whole: dict[str, Any], backward: bool
) -> dict[int, Alone]:
    """Each real sample of the group's stored row run alone, by sample index."""
    cu = whole["cu_seqlens"].tolist()
    found = {}
    for seg, s in enumerate(whole["sample_index"].tolist()):
        if s < 0:
            continue
        ids = whole["input_ids"][cu[seg] : cu[seg + 1]]
        pos = torch.arange(len(ids))
        qkv = [x.requires_grad_(backward) for x in model(ids, pos)]
        with torch.enable_grad():
            out = reference(torch, *qkv)
            go = model.grad_out(ids, pos)
            grads = torch.autograd.grad(out, qkv, go) if backward else None
        found[s] = Alone(out.detach(), go, grads)
    return found


@dataclass
class Tally:
    """The worst error seen so far over compared tokens."""

    atol: float
    rtol: float
    max_err: float = 0.0
    worst: float = 0.0
    worst_sample: int = -1
    tokens: int = 0

    worst_grad: float = 0.0

    def add(self, torch: Any, sample: int, got: Any, want: Any) -> None:
        if len(want) == 0:
            return
        err, excess = _excess(torch, got.detach().cpu(), want, self.atol, self.rtol)
        self.max_err = max(self.max_err, err)
        if excess > self.worst:
            self.worst, self.worst_sample = excess, sample
        self.tokens += len(want)

    def add_grads(self, got: Sequence[Any], want: Sequence[Any], ref: Alone) -> None:
        """q, k, v gradients of some tokens against the sample alone's at their positions."""
        assert ref.grads is not None
        for g, w, full in zip(got, want, ref.grads, strict=True):
            scale = float(full.abs().max()) or 1.0
            if len(w):
                rel = float((g.float().cpu() - w).abs().max()) / scale
                self.worst_grad = max(self.worst_grad, rel / (2 * self.rtol))


def _blocks_of_rank(
    torch: Any, local: Sequence[tuple[Any, Any, Any]], views: Sequence[dict[str, Any]], r: int
) -> tuple[list[Any], list[Any], list[Any], list[tuple[int, Any]]]:
    """CP rank r's query blocks and their gathered key/value prefixes, with (sample, positions
    of the block's queries by the zigzag layout) per block. ``local``: every rank's q, k, v."""
    cp = len(views)
    cus = [v["cu_seqlens"].numpy().astype(np.int64) for v in views]
    padded = np.diff(views[r]["cu_seqlens_padded"].numpy().astype(np.int64))
    qs, ks, vs, where = [], [], [], []
    for seg, s in enumerate(views[r]["sample_index"].tolist()):
        if s < 0:
            continue
        p = int(padded[seg])
        c = p // (2 * cp)
        # Where each of the sample's positions lies in cat(rank 0's part, rank 1's, ...):
        # rolltool.format.split's mapping, applied to the parts' row numbers.
        n = p // cp
        order = torch.from_numpy(cp_gather([np.arange(g * n, (g + 1) * n) for g in range(cp)], p))
        kv = [torch.cat([local[g][j][cus[g][seg] : cus[g][seg + 1]] for g in range(cp)])[order]
              for j in (1, 2)]  # fmt: skip
        a = int(cus[r][seg])
        for half, chunk in enumerate((r, 2 * cp - 1 - r)):
            qs.append(local[r][0][a + half * c : a + (half + 1) * c])
            ks.append(kv[0][: (chunk + 1) * c])
            vs.append(kv[1][: (chunk + 1) * c])
            where.append((s, chunk * c + torch.arange(c)))
    return qs, ks, vs, where


def check_cp(torch: Any, backend: Backend, ds: PackedDataset, row: Row, setup: BenchSetup,
             model: TinyAttention, tally: Tally) -> int:  # fmt: skip
    """Every CP rank of one group row against the samples alone; returns samples compared."""
    cp = ds.split.cp
    views = [ds.micro_batches(row.step, row.rank, cp_rank=r, torch=True)[row.micro_batch]
             for r in range(cp)]  # fmt: skip
    whole = ds.micro_batches(row.step, row.rank, torch=True)[row.micro_batch]
    refs = alone(torch, model, whole, setup.backward)
    local = [tuple(x.requires_grad_(setup.backward) for x in model(v["input_ids"], v["position_ids"]))
             for v in views]  # fmt: skip
    loss = 0.0
    with torch.enable_grad():
        for r in range(cp):
            qs, ks, vs, where = _blocks_of_rank(torch, local, views, r)
            if not qs:
                continue
            out = _attend_blocks(torch, backend, setup, qs, ks, vs)
            loss = loss + _compared(torch, out, qs, where, refs, tally)
        if setup.backward and torch.is_tensor(loss):
            flat = [x for qkv in local for x in qkv]
            grads = _grads(torch, loss, flat)
            _cp_grads(torch, views, grads, refs, tally)
    return len(refs)


def check_hybrid(torch: Any, backend: Backend, ds: PackedDataset, row: Row, setup: BenchSetup,
                 model: TinyAttention, tally: Tally) -> int:  # fmt: skip
    """Every GPU of one ``--hybrid-cp`` group row against the samples alone: each sub-group of
    k > 1 GPUs as a ``--cp k`` group (its views' chunks against keys gathered from the
    sub-group), each plain GPU's segments each attending to itself; every sample of the row
    must be met exactly once over the GPUs, or the row fails. Returns samples compared."""
    views = [ds.micro_batches(row.step, row.rank, cp_rank=g, torch=True)[row.micro_batch]
             for g in range(ds.split.cp)]  # fmt: skip
    whole = ds.micro_batches(row.step, row.rank, torch=True)[row.micro_batch]
    refs = alone(torch, model, whole, setup.backward)
    local = [tuple(x.requires_grad_(setup.backward) for x in model(v["input_ids"], v["position_ids"]))
             for v in views]  # fmt: skip
    blocks: dict[int, list[int]] = {}
    for g, v in enumerate(views):
        blocks.setdefault(int(v["cp_group_start"][0]), []).append(g)
    met: list[int] = []
    loss = 0.0
    with torch.enable_grad():
        for members in blocks.values():
            sub, sub_local = [views[g] for g in members], [local[g] for g in members]
            for r in range(len(members)):
                if len(members) > 1:
                    qs, ks, vs, where = _blocks_of_rank(torch, sub_local, sub, r)
                    if r == 0:  # every rank of the sub-group holds two chunks of each sample
                        met += [s for s, _ in where[::2]]
                else:
                    qs, ks, vs, where = _plain_blocks(torch, sub_local[0], sub[0])
                    met += [s for s, _ in where]
                if not qs:
                    continue
                out = _attend_blocks(torch, backend, setup, qs, ks, vs)
                loss = loss + _compared(torch, out, qs, where, refs, tally)
        if setup.backward and torch.is_tensor(loss):
            grads = _grads(torch, loss, [x for qkv in local for x in qkv])
            for members in blocks.values():
                sub = [views[g] for g in members]
                mine = [x for g in members for x in grads[3 * g : 3 * g + 3]]
                if len(members) > 1:
                    _cp_grads(torch, sub, mine, refs, tally)
                else:
                    _plain_grads(sub[0], mine, refs, tally)
    if sorted(met) != sorted(refs):  # a sample missing from every GPU, or on two
        tally.worst = float("inf")
    return len(refs)


def _compared(
    torch: Any, out: Any, qs: list[Any], where: list[tuple[int, Any]], refs: Any, tally: Tally
) -> Any:
    """Each query block's rows of `out` (the blocks' outputs, concatenated) against its sample
    alone at its positions (`where`), into `tally`; the loss whose gradient the backward check
    compares: each output times the sample's upstream gradient there (padding: none)."""
    loss: Any = 0.0
    start = 0
    for q, (s, pos) in zip(qs, where, strict=True):
        got, start = out[start : start + len(q)], start + len(q)
        real = pos < len(refs[s].out)
        tally.add(torch, s, got[real], refs[s].out[pos[real]])
        loss = loss + (got[real] * refs[s].go[pos[real]]).sum()
    return loss


def _plain_blocks(
    torch: Any, local: tuple[Any, Any, Any], view: dict[str, Any]
) -> tuple[list[Any], list[Any], list[Any], list[tuple[int, Any]]]:
    """A plain GPU's segments, each its own query, key and value block (a whole sample attends
    to itself), with (sample, its positions) per block."""
    cu = view["cu_seqlens"].tolist()
    qs, ks, vs, where = [], [], [], []
    for seg, s in enumerate(view["sample_index"].tolist()):
        if s < 0:
            continue
        a, b = cu[seg], cu[seg + 1]
        qs.append(local[0][a:b])
        ks.append(local[1][a:b])
        vs.append(local[2][a:b])
        where.append((s, view["position_ids"][a:b].long()))
    return qs, ks, vs, where


def _plain_grads(
    view: dict[str, Any], grads: Sequence[Any], refs: dict[int, Alone], tally: Tally
) -> None:
    """A plain GPU's q, k, v gradients against the samples alone, at each token's position."""
    cu = view["cu_seqlens"].tolist()
    for seg, s in enumerate(view["sample_index"].tolist()):
        if s < 0:
            continue
        a, b = cu[seg], cu[seg + 1]
        pos = view["position_ids"][a:b].long()
        ref_grads = refs[s].grads
        assert ref_grads is not None
        tally.add_grads([x[a:b] for x in grads], [x[pos] for x in ref_grads], refs[s])


def _grads(torch: Any, loss: Any, leaves: Sequence[Any]) -> list[Any]:
    """d loss / d leaves, zeros for a leaf the kernel did not differentiate (a broken one)."""
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


def _cp_grads(torch: Any, views: Sequence[dict[str, Any]], grads: Sequence[Any],
              refs: dict[int, Alone], tally: Tally) -> None:  # fmt: skip
    """Each CP rank's local q, k, v gradients against the samples alone, at the positions the
    zigzag layout gives its local tokens (chunk r, then chunk 2C-1-r)."""
    cp = len(views)
    for g, view in enumerate(views):
        dq, dk, dv = grads[3 * g : 3 * g + 3]
        cu = view["cu_seqlens"].tolist()
        padded = view["cu_seqlens_padded"].diff().tolist()
        for seg, s in enumerate(view["sample_index"].tolist()):
            if s < 0:
                continue
            c = padded[seg] // (2 * cp)
            pos = torch.cat([g * c + torch.arange(c), (2 * cp - 1 - g) * c + torch.arange(c)])
            real = pos < len(refs[s].out)
            local = cu[seg] + torch.arange(2 * c)[real]
            ref_grads = refs[s].grads
            assert ref_grads is not None
            want = [x[pos[real]] for x in ref_grads]
            tally.add_grads([x[local] for x in (dq, dk, dv)], want, refs[s])


def _attend_blocks(torch: Any, backend: Backend, setup: BenchSetup, qs: list[Any],
                   ks: list[Any], vs: list[Any]) -> Any:  # fmt: skip
    """One block attention call over the blocks (in the bench dtype, on the bench device)."""
    assert backend.attend_blocks is not None
    device, dtype = torch.device(setup.device), torch_dtype(torch, setup.dtype)
    q, k, v = (torch.cat(x).to(device=device, dtype=dtype) for x in (qs, ks, vs))
    k, v = _repeat_kv(backend, q, k, v)
    q_len, k_len = [len(x) for x in qs], [len(x) for x in ks]
    q_b, k_b = [0, *np.cumsum(q_len).tolist()], [0, *np.cumsum(k_len).tolist()]
    q_cu, k_cu = (torch.tensor(b, dtype=torch.int32, device=device) for b in (q_b, k_b))
    return backend.attend_blocks(q, k, v, q_cu, k_cu, max(q_len), max(k_len), q_b, k_b).float()


def _repeat_kv(backend: Backend, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    if backend.gqa or k.shape[1] == q.shape[1]:
        return k, v
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def check_sp(torch: Any, backend: Backend, ds: PackedDataset, row: Row, setup: BenchSetup,
             model: TinyAttention, tally: Tally) -> int:  # fmt: skip
    """The SP ranks of one group row against the samples alone; returns samples compared."""
    sp, s = ds.split.sp, setup.shape
    views = [ds.micro_batches(row.step, row.rank, sp_rank=i, torch=True)[row.micro_batch]
             for i in range(sp)]  # fmt: skip
    whole = ds.micro_batches(row.step, row.rank, torch=True)[row.micro_batch]
    refs = alone(torch, model, whole, setup.backward)
    ids, pos = (torch.cat([v[key] for v in views]) for key in ("input_ids", "position_ids"))
    device, dtype = torch.device(setup.device), torch_dtype(torch, setup.dtype)
    leaves = [x.requires_grad_(setup.backward) for x in model(ids, pos)]
    bounds = views[0]["cu_seqlens"].tolist()
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in pairwise(bounds))
    with torch.enable_grad():
        q, k, v = (x.to(device=device, dtype=dtype) for x in leaves)
        outs = []
        for i in range(sp):
            qh, kvh = sp_heads(s.heads, s.kv_heads, sp, i)
            qi, ki, vi = (x.contiguous() for x in (q[:, qh], k[:, kvh], v[:, kvh]))
            ki, vi = _repeat_kv(backend, qi, ki, vi)
            outs.append(backend.attend(qi, ki, vi, cu, max_len, bounds).float())
        full = torch.cat(outs, dim=1)  # [T, heads]: SP rank i keeps tokens [i T/S, (i+1) T/S)
        loss, segments = 0.0, []
        for seg, sample in enumerate(views[0]["sample_index"].tolist()):
            if sample >= 0:
                a, b = bounds[seg], bounds[seg + 1]
                tally.add(torch, sample, full[a:b], refs[sample].out)
                loss = loss + (full[a:b] * refs[sample].go).sum()
                segments.append((sample, a, b))
        if setup.backward and torch.is_tensor(loss):
            grads = _grads(torch, loss, leaves)
            for sample, a, b in segments:
                ref_grads = refs[sample].grads
                assert ref_grads is not None
                tally.add_grads([x[a:b] for x in grads], ref_grads, refs[sample])
    return len(refs)


def check_split_rows(
    torch: Any, backend: Backend, packed: ReplayRows, setup: BenchSetup
) -> dict[str, Any]:
    """``setup.check_rows`` sampled group rows of a split pack (module docstring); the same
    document as `rolltool.bench.check.check_rows`, with ``what`` saying what was compared."""
    ds = open_packed(packed.path)
    split = packed.split
    groups = [r for r in packed.rows if r.gpu == 0]
    model = TinyAttention.make(torch, setup)
    atol, rtol = TOLERANCES[setup.dtype]
    check = check_hybrid if split.hybrid else check_cp if split.kind == "cp" else check_sp
    results = []
    for i in sample_rows(groups, setup.check_rows):
        row, tally = groups[i], Tally(atol, rtol)
        samples = check(torch, backend, ds, row, setup, model, tally)
        results.append({"step": row.step, "rank": row.rank, "micro_batch": row.micro_batch,
                        "segments": samples, "tokens": tally.tokens,
                        "max_abs_error": tally.max_err, "worst_output_ratio": tally.worst,
                        "worst_grad_ratio": tally.worst_grad if setup.backward else None,
                        "worst_sample": tally.worst_sample,
                        "ok": tally.worst <= 1.0 and tally.worst_grad <= 1.0})  # fmt: skip
    what = (f"hybrid cp {split.cp}: each sub-group's CP ranks against keys gathered from the "
            "sub-group, each plain GPU's segments alone" if split.hybrid
            else f"cp {split.cp}: each CP rank's chunks against keys gathered from the group"
            if split.kind == "cp" else f"sp {split.sp}: the row gathered, heads split, sliced")  # fmt: skip
    return {
        "ok": all(r["ok"] for r in results),
        "what": what,
        "rows_checked": len(results),
        "segments_checked": sum(r["segments"] for r in results),
        "tolerance": {"atol": atol, "rtol": rtol, "dtype": setup.dtype},
        "rows": results,
    }
