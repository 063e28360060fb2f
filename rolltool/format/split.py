"""A data-parallel group's row split over its sequence- or context-parallel GPUs.

With ``--sp S`` (Ulysses sequence parallelism) or ``--cp C`` (context parallelism, ring
attention) each data-parallel rank is a *group* of k = S or C GPUs that share every micro-batch.
The shards hold the group's row (what the partition planned, what ``ds.micro_batches(step,
rank)`` returns); each GPU's view of it is derived here, exactly, so no token is stored twice.

**SP (``sp_view``).** The group's row is padded to a multiple of S; SP rank i takes the i-th
contiguous 1/S of every per-token array. ``cu_seqlens`` and ``sample_index`` stay the whole
row's (after the all-to-all each SP rank attends over the whole row with 1/S of the heads).

**CP (``cp_view``), load-balanced causal split.** Every sample is padded to a multiple of 2C (a
padding segment right after it in the stored row) and cut into 2C equal chunks; CP rank r holds
chunks r and 2C-1-r (the "zigzag": the early, cheap chunk with the late, dear one, so causal
attention work is even). Per-token arrays follow their tokens; ``position_ids`` are the sample's
own positions (its padding continues them). Padding at the end of the row (``--row-len``, or an
empty micro-batch) is a multiple of 2C too, split into C contiguous parts: so every boundary of
``cu_seqlens_padded`` is a multiple of 2C, as the THD layout of TransformerEngine
(``thd_get_partitioned_indices`` refuses any other) and ring-flash-attn's zigzag varlen ring
attention (wrong outputs on real tokens otherwise) require: a ``--cp C`` row is a multiple of 2C
tokens (an empty micro-batch's row is 2C padding tokens; ``--row-len`` must be even). The
view's boundaries:

- ``cu_seqlens``: this rank's local segments (a sample's two chunks, its padding included), so
  they index the view's arrays like any row's;
- ``cu_seqlens_padded``: the group's padded boundaries (= C x ``cu_seqlens``), and
  ``cu_seqlens_unpadded``: the group's real sample lengths, the THD convention's
  ``cu_seqlens_q_padded`` / ``cu_seqlens_q`` (TransformerEngine, Megatron) for a ring-attention
  kernel;
- ``sample_index``: one per local segment, -1 for row-end padding.

Worked example: a 10-token sample over cp 2 is padded to 12 (2C = 4 chunks of 3):
chunks ``[0 1 2] [3 4 5] [6 7 8] [9 p p]``; CP rank 0 holds chunks 0 and 3, tokens
``0 1 2 9 p p`` (positions 0 1 2 9 10 11); CP rank 1 holds chunks 1 and 2, tokens ``3 4 5 6 7 8``.
``cp_token_map(10, 2)`` gives each token's (rank, local offset) and ``cp_positions(12, 2, r)``
each local offset's position: the mapping both ways, to gather per-sample results (log-probs,
entropies) from the CP ranks (``cp_gather``).

Next-token targets (`rolltool.format.targets`) are derived on the group row, before the split,
so each view holds the targets of its own logits. In the example (``x`` = -100, no target):
the row's ``target_ids`` are ``1 2 3 4 5 6 7 8 9 x x x``; CP rank 0 gets ``1 2 3 x x x`` (token
2's target, 3, lives on rank 1), CP rank 1 gets ``4 5 6 7 8 9`` (token 8's target, 9, lives on
rank 0). ``target_loss_weight`` and the other target arrays follow the same tokens, so a loss
over a view's logits uses that view's arrays only. An SP slice ends the same way: its last
token's target is the next slice's first token, already in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import PAD_SAMPLE
from rolltool.format.records import RecordedConfig
from rolltool.format.targets import TARGET_FIELDS, next_token_targets

PER_TOKEN = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "advantages",
    "logprobs",
    "loss_weight",
    *TARGET_FIELDS,
)
"""The reader row's per-token arrays: what a view slices. The next-token targets
(`rolltool.format.targets`) are among them: derived on the whole row, so a view's
``target_ids`` at a chunk's or a slice's last token is the token held by the next GPU."""


@dataclass(frozen=True)
class GroupSplit:
    """How a data-parallel rank's micro-batch is shared by its GPUs: ``sp`` or ``cp`` of them
    (at most one above 1).

    >>> g = GroupSplit(cp=2)
    >>> g.size, g.padded(np.array([10, 12, 1])).tolist()
    (2, [12, 12, 4])
    """

    sp: int = 1
    cp: int = 1
    hybrid: bool = False
    """``--hybrid-cp``: each row's cp GPUs are cut into sub-groups, a degree per sample
    (`rolltool.format.hybrid`); ``sample_multiple``, ``row_multiple`` and ``padded`` are then
    the widest sub-group's (k = cp), a sample's own degree is in the rows."""

    def __post_init__(self) -> None:
        for name in ("sp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RolltoolError(f"--{name} must be a positive integer, got {value!r}")
        if self.sp > 1 and self.cp > 1:
            raise RolltoolError("give --sp or --cp, not both")
        if self.hybrid and (self.cp < 2 or self.cp & (self.cp - 1)):
            raise RolltoolError(f"--hybrid-cp needs --cp a power of two >= 2, got {self.cp}")

    @property
    def size(self) -> int:
        """GPUs per data-parallel group: k = S or C (1 without either)."""
        return self.sp * self.cp

    @property
    def kind(self) -> str | None:
        """``"sp"``, ``"cp"`` or None."""
        return "sp" if self.sp > 1 else "cp" if self.cp > 1 else None

    @property
    def sample_multiple(self) -> int:
        """Every sample is padded to a multiple of this (2C with CP, else 1)."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def row_multiple(self) -> int:
        """Every row's length is a multiple of this: S with SP (each GPU an equal slice), 2C with
        CP (every ``cu_seqlens_padded`` boundary a multiple of 2C, row-end padding included:
        valid THD for TransformerEngine and ring-flash-attn), else 1. An empty micro-batch's row
        is this many padding tokens.

        >>> GroupSplit(sp=4).row_multiple, GroupSplit(cp=4).row_multiple, GroupSplit().row_multiple
        (4, 8, 1)
        """
        return 2 * self.cp if self.cp > 1 else self.sp

    def padded(self, lengths: np.ndarray) -> np.ndarray:
        """[n] int64 tokens each sample occupies in the group's row (its length with CP padding)."""
        m = self.sample_multiple
        return -(-np.asarray(lengths, dtype=np.int64) // m) * m


# -- CP: the zigzag mapping, both ways --------------------------------------------------------


def cp_positions(padded_len: int, cp: int, rank: int) -> np.ndarray:
    """[padded_len / cp] int64: the sample positions CP rank `rank` holds, in its local order
    (chunk ``rank`` then chunk ``2cp-1-rank``). Local offset j holds position ``out[j]``.

    >>> cp_positions(12, 2, 0).tolist(), cp_positions(12, 2, 1).tolist()
    ([0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8])
    """
    if padded_len % (2 * cp) or not 0 <= rank < cp:
        raise ValueError(f"padded length {padded_len} over cp {cp}, rank {rank}")
    c = padded_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return np.concatenate([np.arange(rank * c, rank * c + c), np.arange(late * c, late * c + c)])


def cp_token_map(length: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each of a sample's `length` tokens lies: ([length] CP rank, [length] local offset
    in that rank's part of the sample). The inverse of `cp_positions`.

    >>> rank, offset = cp_token_map(10, 2)
    >>> rank.tolist(), offset.tolist()
    ([0, 0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 1, 2, 0, 1, 2, 3, 4, 5, 3])
    """
    t = np.arange(length, dtype=np.int64)
    if cp == 1:
        return np.zeros(length, np.int64), t
    c = max(-(-length // (2 * cp)), 1)  # chunk length: the padded length / 2cp
    chunk = t // c
    early = chunk < cp
    rank = np.where(early, chunk, 2 * cp - 1 - chunk)
    offset = t % c + np.where(early, 0, c)
    return rank, offset


def cp_gather(parts: Sequence[np.ndarray], length: int) -> np.ndarray:
    """A sample's per-token values from its C local parts (CP rank r's values of the sample's
    local segment, ``padded / C`` each, in rank order), back in token order, padding dropped.

    >>> a = np.arange(10)
    >>> parts = [np.append(a, [-1, -1])[cp_positions(12, 2, r)] for r in range(2)]
    >>> cp_gather(parts, 10).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    cp = len(parts)
    padded = sum(len(p) for p in parts)
    out = np.empty(padded, dtype=np.result_type(*[p.dtype for p in parts]))
    for r, p in enumerate(parts):
        out[cp_positions(padded, cp, r)] = p
    return out[:length]


# -- views of a group row ---------------------------------------------------------------------


def sp_view(row: dict[str, np.ndarray], sp: int, rank: int) -> dict[str, np.ndarray]:
    """SP rank `rank`'s view of a group row (a reader dict): the rank-th contiguous 1/sp of
    every per-token array (the next-token targets derived on the whole row first, so a slice's
    last target is the next slice's first token); ``cu_seqlens`` and ``sample_index`` are the
    whole row's, and ``sp_offset`` ([1] int64) is where the slice starts in the row."""
    _check_rank("sp_rank", rank, sp)
    n = len(row["input_ids"])
    if n % sp:
        raise RolltoolError(
            f"a row of {n} tokens does not split over --sp {sp} (packed without it?)"
        )
    part = n // sp
    sl = slice(rank * part, (rank + 1) * part)
    row = _with_targets(row)
    out = {k: row[k][sl] for k in PER_TOKEN}
    out["cu_seqlens"] = row["cu_seqlens"]
    out["sample_index"] = row["sample_index"]
    out["sp_offset"] = np.array([rank * part], dtype=np.int64)
    return out


@dataclass(frozen=True)
class CpSpans:
    """A group row's samples as the CP split sees them: per span, where it starts in the row,
    its padded length, its real length and its sample (-1 for row-end padding)."""

    start: np.ndarray  # [P] int64
    padded: np.ndarray  # [P] int64
    real: np.ndarray  # [P] int64
    sample: np.ndarray  # [P] int64


def cp_spans(cu_seqlens: np.ndarray, sample_index: np.ndarray, cp: int) -> CpSpans:
    """Group a CP row's segments into spans: a sample with the padding segment after it that
    brings it to a multiple of 2cp (`GroupSplit.padded`), or a segment of row-end padding (a
    multiple of 2cp too: every span, so every ``cu_seqlens_padded`` boundary, is one, as THD
    needs). Raises RolltoolError when the segments are not laid out that way (the row was not
    packed for this cp, or was packed before row-end padding was a multiple of 2cp)."""
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    sample = np.asarray(sample_index, dtype=np.int64)
    m = 2 * cp
    spans: list[tuple[int, int, int, int]] = []  # (start, padded, real, sample)
    k, pos = 0, 0
    while k < len(lens):
        n = int(lens[k])
        if sample[k] == PAD_SAMPLE:
            if n % m:
                raise RolltoolError(
                    f"row-end padding of {n} tokens is not a multiple of 2 x cp = {m} "
                    f"(--cp {cp}: not valid THD; packed for another --cp, or by an older rolltool?)"
                )
            spans.append((pos, n, 0, PAD_SAMPLE))
            k, pos = k + 1, pos + n
            continue
        want = -(-n // m) * m - n
        got = int(lens[k + 1]) if want and k + 1 < len(lens) and sample[k + 1] == PAD_SAMPLE else 0
        if got != want:
            raise RolltoolError(
                f"sample {int(sample[k])} ({n} tokens) is not followed by the {want} padding "
                f"tokens that bring it to a multiple of 2 x cp = {m} (packed for another --cp?)"
            )
        spans.append((pos, n + want, n, int(sample[k])))
        k, pos = k + (2 if want else 1), pos + n + want
    cols = np.array(spans, dtype=np.int64).reshape(-1, 4).T
    return CpSpans(*cols)


def cp_view(row: dict[str, np.ndarray], cp: int, rank: int) -> dict[str, np.ndarray]:
    """CP rank `rank`'s view of a group row (a reader dict): see the module docstring."""
    _check_rank("cp_rank", rank, cp)
    spans = cp_spans(row["cu_seqlens"], row["sample_index"], cp)
    index = _cp_index(spans, cp, rank)
    row = _with_targets(row)
    out = {k: row[k][index] for k in PER_TOKEN if k != "position_ids"}
    local = spans.padded // cp
    positions = np.concatenate(
        [
            cp_positions(int(p), cp, rank) if s != PAD_SAMPLE else np.arange(int(n))
            for p, s, n in zip(spans.padded, spans.sample, local, strict=True)
        ]
        or [np.zeros(0, np.int64)]
    )
    out["position_ids"] = positions.astype(np.int32)
    out["cu_seqlens"] = _cumsum(local)
    out["cu_seqlens_padded"] = _cumsum(spans.padded)
    out["cu_seqlens_unpadded"] = _cumsum(spans.real)
    out["sample_index"] = spans.sample
    return {k: out[k] for k in (*PER_TOKEN, *CP_BOUNDARIES)}


CP_BOUNDARIES = ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_unpadded", "sample_index")
"""Per-segment keys of a CP view (see the module docstring)."""


def _cp_index(spans: CpSpans, cp: int, rank: int) -> np.ndarray:
    """[row / cp] int64: the row positions CP rank `rank` holds, in its local order."""
    parts = []
    for start, padded, sample in zip(spans.start, spans.padded, spans.sample, strict=True):
        if sample == PAD_SAMPLE:
            part = int(padded) // cp
            parts.append(np.arange(start + rank * part, start + (rank + 1) * part))
        else:
            parts.append(start + cp_positions(int(padded), cp, rank))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _with_targets(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The group row with its next-token targets: the reader's rows have them; a row built
    elsewhere gets them derived here, on the whole row, before it is split."""
    if all(k in row for k in TARGET_FIELDS):
        return row
    return row | next_token_targets(row)


def _cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int32)
    np.cumsum(x, out=out[1:])
    return out


def _check_rank(name: str, rank: int, size: int) -> None:
    if not isinstance(rank, int | np.integer) or not 0 <= rank < size:
        raise RolltoolError(f"{name} {rank} out of range (the pack's group has {size} GPUs)")


def recorded_split(config: RecordedConfig, where: str = "manifest.json") -> GroupSplit:
    """The `GroupSplit` a pack config records (``sp``/``cp``; 1 in packs written before them;
    ``hybrid_cp``);
    a bad value is a RolltoolError naming the key."""
    for key, value in (("sp", config.sp), ("cp", config.cp)):
        if value < 1:
            raise RolltoolError(
                f"{where}: 'config.{key}' must be a positive integer, got {value!r}"
            )
    try:
        return GroupSplit(sp=config.sp, cp=config.cp, hybrid=config.hybrid_cp)
    except RolltoolError as e:
        raise RolltoolError(f"{where}: {e.message}") from None
