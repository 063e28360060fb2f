"""Shared prefixes of a group: found from the input's tokens alone, laid out once, exactly.

Every rollout of a GRPO group starts with the same prompt, every branch of an agent rollout
with the same trajectory up to its branch point. In a causal model a prefix's hidden states do
not depend on what follows, so they can be computed once and their keys and values shared by
every continuation (issue 24; the design is docs/shared_prefix.md).

**Detection** (`detect`) is a trie over the group's samples, compressed to the branch points
that pay: two samples *agree* at token t when they have the same token there and, unless t is
their first token (never a target), the same loss mask and, where it is 1, the same behaviour
log-prob and advantage. A set of samples that agree on their first b tokens (and no other sample
of the group does) is a trie node; it becomes a *prefix* when it has at least two samples and
shares at least ``share_min`` tokens more than its nearest ancestor prefix (0 for a root). A
per-sample ``limit`` (e.g. the prompt's length) caps what sample i can share.

**Layout** (`lay_out`): with P the length a prefix's samples share and a its parent's (0 for a
root), the prefix stores positions [a - 1, P - 1) of one *representative* sample (its lowest
index; [0, P - 1) for a root) and every child (a nested prefix or a sample's own continuation)
starts at P - 1: the *branch token* P - 1 is re-fed once per child. Why re-feed it rather than
store it once: the logits at the branch token predict a different token in every child, and
re-fed each stored token has exactly one target, so the per-token target arrays stay aligned
with the stored tokens and a trainer's loss code does not change (the prefix's last stored
token predicts the branch token, which every child has, see
`rolltool.format.prefix.shared_next_token_targets`). It costs one token per child. For the same
reason a sample keeps at least one token of its own: identical samples share everything but
their last token, re-fed once each and with no target (no segment is ever empty, so no kernel
sees a zero-length sequence).

**Weights**: a stored token carries the sum of the loss weights of every sample through its
segment. Where the samples agree at a token, its loss is the same function of the same logits
(same context, same target, same log-prob and advantage), so ``sum_i w_i * loss = (sum_i w_i) *
loss``: the step's loss and gradient are unchanged.

Worked example, ``share_min = 2``: samples ``a b c d`` and ``a b c e f`` (untrained prompt
``a b c``) agree on 3 tokens: the prefix stores ``a b`` (positions 0-1), the continuations
``c d`` and ``c e f`` (from position 2); 7 stored tokens instead of 9.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format.prefix import NO_PARENT, KernelIndex, kernel_index

SHARE_MIN = 64
"""Default ``share_min``: a prefix must save at least this many tokens per extra copy."""


@dataclass(frozen=True)
class GroupTokens:
    """One group's samples: the per-token arrays detection compares (n samples, L_i tokens).

    ``advantages`` and ``logprobs`` may be None (not compared: e.g. an input without behaviour
    log-probs). ``advantages`` may also be one value per sample ([n]), broadcast over its tokens.
    """

    input_ids: Sequence[np.ndarray]
    """n x [L_i] int: the tokens."""
    loss_mask: Sequence[np.ndarray]
    """n x [L_i] 0/1: trained tokens (token 0 is never a target and never compared)."""
    logprobs: Sequence[np.ndarray] | None = None
    """n x [L_i] float: behaviour log-prob of each token, compared where trained."""
    advantages: Sequence[np.ndarray] | np.ndarray | None = None
    """n x [L_i] or [n] float: each token's advantage, compared where trained."""
    limit: np.ndarray | None = None
    """[n] int or None: sample i shares at most its first ``limit[i]`` tokens (its prompt)."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n:
            raise RolltoolError(f"{n} samples' input_ids but {len(self.loss_mask)} loss masks")
        for i, ids in enumerate(self.input_ids):
            if len(ids) == 0:
                raise RolltoolError(f"sample {i} has no tokens")
            if len(self.loss_mask[i]) != len(ids) or (
                self.logprobs is not None and len(self.logprobs[i]) != len(ids)
            ):
                raise RolltoolError(f"sample {i}'s per-token arrays differ in length")
        if self.limit is not None and len(self.limit) != n:
            raise RolltoolError(f"{len(self.limit)} limits for {n} samples")

    @property
    def lengths(self) -> np.ndarray:
        """[n] int64: each sample's tokens."""
        return np.array([len(a) for a in self.input_ids], dtype=np.int64)


@dataclass(frozen=True)
class PrefixForest:
    """What `detect` found in one group: m prefixes (trie nodes) and each sample's chain.

    Prefixes are numbered so that a parent comes before its children. Sample i's chain is
    its deepest prefix ``sample_node[i]`` and that prefix's ancestors; its own continuation
    starts where the deepest ends (``continuation_start``).
    """

    lengths: np.ndarray
    """[n] int64: each sample's tokens."""
    node_sample: np.ndarray
    """[m] int64: the representative sample (lowest index) whose tokens a prefix stores."""
    node_start: np.ndarray
    """[m] int64: a prefix's first stored position (its parent's end; 0 for a root)."""
    node_end: np.ndarray
    """[m] int64: one past its last stored position (= shared length - 1: the branch token)."""
    node_parent: np.ndarray
    """[m] int64: the enclosing prefix, or -1."""
    sample_node: np.ndarray
    """[n] int64: each sample's deepest prefix, or -1 (nothing shared)."""

    @property
    def continuation_start(self) -> np.ndarray:
        """[n] int64: where each sample's own tokens start (0 when it shares nothing)."""
        out = np.zeros(len(self.lengths), dtype=np.int64)
        has = self.sample_node >= 0
        out[has] = self.node_end[self.sample_node[has]]
        return out

    def chain(self, i: int) -> list[int]:
        """Sample i's prefixes, root first."""
        out = []
        node = int(self.sample_node[i])
        while node >= 0:
            out.append(node)
            node = int(self.node_parent[node])
        return out[::-1]

    def members(self, node: int) -> list[int]:
        """The samples whose chain holds prefix ``node``, ascending."""
        return [i for i in range(len(self.lengths)) if node in self.chain(i)]


def _keys(group: GroupTokens) -> tuple[np.ndarray, ...]:
    """Padded [n, Lmax] arrays whose column-wise equality is `detect`'s *agree*."""
    lengths = group.lengths
    n, width = len(lengths), int(lengths.max(initial=0))
    ids = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width), dtype=bool)
    lp = np.zeros((n, width), dtype=np.float64)
    adv = np.zeros((n, width), dtype=np.float64)
    for i, L in enumerate(lengths):
        ids[i, :L] = group.input_ids[i]
        mask[i, :L] = np.asarray(group.loss_mask[i]) != 0
        if group.logprobs is not None:
            lp[i, :L] = group.logprobs[i]
        if group.advantages is not None:
            adv[i, :L] = np.broadcast_to(np.asarray(group.advantages[i], dtype=np.float64), L)
    mask[:, 0] = False  # token 0 is never a target: only its id matters
    lp[~mask] = 0.0
    adv[~mask] = 0.0
    return ids, mask, lp, adv


def pairwise_agreement(group: GroupTokens) -> np.ndarray:
    """[n, n] int64: how many leading tokens each pair of samples agree on (``limit``-capped;
    the diagonal is a sample's own cap). NaN log-probs or advantages never agree."""
    keys = _keys(group)
    lengths = group.lengths
    cap = lengths if group.limit is None else np.minimum(lengths, np.asarray(group.limit))
    cap = np.maximum(cap, 0)
    n, width = keys[0].shape
    out = np.empty((n, n), dtype=np.int64)
    differ = np.zeros((n, width + 1), dtype=bool)
    differ[:, width] = True  # a sentinel: agreeing to the end stops at the padded width
    for i in range(n):
        d = differ[:, :width]
        d[:] = False
        for k in keys:
            d |= k != k[i]
        out[i] = np.minimum(differ.argmax(axis=1), np.minimum(cap, cap[i]))
    return out


@dataclass
class _Builder:
    lcp: np.ndarray
    share_min: int
    sample: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)

    def grow(self, members: np.ndarray, node: int, shared: int, sample_node: np.ndarray) -> None:
        """Place ``members`` (>= 2 samples agreeing beyond ``shared``, under prefix ``node``
        that shares ``shared`` tokens): a new prefix if theirs pays, then each branch."""
        b = int(self.lcp[members[0], members].min())
        if b - shared >= self.share_min:
            self.sample.append(int(members[0]))
            self.start.append(shared - 1 if node >= 0 else 0)
            self.end.append(b - 1)
            self.parent.append(node)
            node, shared = len(self.end) - 1, b
            sample_node[members] = node
        rest = members
        while len(rest):  # branches: the members that still agree at token b
            same = self.lcp[rest[0], rest] > b
            same[0] = True  # a sample that ends (or is capped) at b is a branch of its own
            if same.sum() >= 2:
                self.grow(rest[same], node, shared, sample_node)
            rest = rest[~same]


def detect(group: GroupTokens, share_min: int = SHARE_MIN) -> PrefixForest:
    """The prefixes of one group and each sample's chain (see the module docstring).

    >>> g = GroupTokens([np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5, 6])],
    ...                 [np.array([0, 0, 0, 1]), np.array([0, 0, 0, 1, 1])])
    >>> f = detect(g, share_min=2)
    >>> f.node_start.tolist(), f.node_end.tolist(), f.continuation_start.tolist()
    ([0], [2], [2, 2])
    """
    if share_min < 2:
        raise RolltoolError(
            f"share_min must be at least 2, got {share_min}",
            hint="a prefix of one token stores nothing once: its branch token is re-fed",
        )
    n = len(group.input_ids)
    lcp = pairwise_agreement(group)
    builder = _Builder(lcp, share_min)
    sample_node = np.full(n, NO_PARENT, dtype=np.int64)
    rest = np.arange(n)
    while len(rest):  # roots: the samples that agree at token 0
        same = lcp[rest[0], rest] > 0
        same[0] = True
        if same.sum() >= 2:
            builder.grow(rest[same], NO_PARENT, 0, sample_node)
        rest = rest[~same]
    return PrefixForest(
        lengths=group.lengths,
        node_sample=np.array(builder.sample, dtype=np.int64),
        node_start=np.array(builder.start, dtype=np.int64),
        node_end=np.array(builder.end, dtype=np.int64),
        node_parent=np.array(builder.parent, dtype=np.int64),
        sample_node=sample_node,
    )


@dataclass(frozen=True)
class SharingStats:
    """What sharing saves, in tokens and attention pairs; merge groups with ``+``.

    Attention pairs are the query-key pairs under the causal mask (sum over tokens of its
    position + 1): the unshared layout's ``sum L (L + 1) / 2``; the shared one's counts every
    continuation's queries over its full context (prefix keys included).
    """

    samples: int = 0
    prefixes: int = 0
    tokens: int = 0
    """Stored and computed without sharing (sum of the samples' lengths)."""
    tokens_shared: int = 0
    """Stored and computed with sharing (each stored token is fed forward once)."""
    attention_pairs: int = 0
    attention_pairs_shared: int = 0
    kv_tokens_shared: int = 0
    """Keys/values the shared layout gathers (``cu_seqlens_k[-1]``)."""

    def __add__(self, other: SharingStats) -> SharingStats:
        return SharingStats(*(a + b for a, b in zip(_fields(self), _fields(other), strict=True)))

    @property
    def token_ratio(self) -> float:
        """Unshared over shared computed tokens (1.0 when nothing is shared)."""
        return self.tokens / self.tokens_shared if self.tokens_shared else 1.0


def _fields(s: SharingStats) -> tuple[int, ...]:
    return (s.samples, s.prefixes, s.tokens, s.tokens_shared, s.attention_pairs,
            s.attention_pairs_shared, s.kv_tokens_shared)  # fmt: skip


@dataclass(frozen=True)
class SharedLayout:
    """One group's segments, in the order they are stored: depth first, parents before
    children, siblings by their lowest sample. A segment is a prefix (``node`` >= 0) or one
    sample's continuation; it stores positions [start, end) of sample ``sample``.
    """

    lengths: np.ndarray
    """[n] int64: each sample's tokens."""
    sample: np.ndarray
    """[s] int64: whose tokens a segment stores (a prefix's representative)."""
    start: np.ndarray
    """[s] int64: its first position in that sample (= its tokens' position ids' start)."""
    end: np.ndarray
    """[s] int64: one past its last position."""
    parent: np.ndarray
    """[s] int64: the segment before it in every sample through it, or -1."""
    node: np.ndarray
    """[s] int64: the `PrefixForest` prefix a segment is, or -1 for a continuation."""
    sample_segment: np.ndarray
    """[n] int64: each sample's continuation segment."""

    @property
    def cu_seqlens(self) -> np.ndarray:
        """[s+1] int64: segment boundaries over the stored tokens."""
        return np.concatenate([[0], np.cumsum(self.end - self.start)]).astype(np.int64)

    def kernel_index(self) -> KernelIndex:
        """`rolltool.format.prefix.kernel_index` of this layout (what attention needs)."""
        return kernel_index(self.cu_seqlens, self.parent)

    def chain(self, i: int) -> list[int]:
        """Sample i's segments, root first, its continuation last."""
        out = []
        seg = int(self.sample_segment[i])
        while seg >= 0:
            out.append(seg)
            seg = int(self.parent[seg])
        return out[::-1]

    def sample_rows(self, i: int) -> np.ndarray:
        """[L_i] int64: the stored token holding each of sample i's tokens."""
        cu = self.cu_seqlens
        return np.concatenate([np.arange(cu[s], cu[s + 1]) for s in self.chain(i)])

    def gather(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """[N]: a per-token array of every sample (n x [L_i]) read at the stored tokens
        (a prefix's from its representative)."""
        parts = [
            np.asarray(arrays[s])[a:b]
            for s, a, b in zip(self.sample, self.start, self.end, strict=True)
        ]
        return np.concatenate(parts) if parts else np.zeros(0)

    def summed(self, weights: Sequence[np.ndarray]) -> np.ndarray:
        """[N] float64: per stored token, the sum of ``weights[i][t]`` over the samples i
        through its segment (the loss weights a shared row stores)."""
        cu = self.cu_seqlens
        out = np.zeros(int(cu[-1]), dtype=np.float64)
        for i in range(len(self.lengths)):
            for s in self.chain(i):
                a, b = int(self.start[s]), int(self.end[s])
                out[cu[s] : cu[s + 1]] += np.asarray(weights[i], dtype=np.float64)[a:b]
        return out

    def stats(self) -> SharingStats:
        """Tokens and attention pairs, shared against unshared."""
        L = self.lengths
        index = self.kernel_index()
        return SharingStats(
            samples=len(L),
            prefixes=int((self.node >= 0).sum()),
            tokens=int(L.sum()),
            tokens_shared=int(self.cu_seqlens[-1]),
            attention_pairs=int((L * (L + 1) // 2).sum()),
            attention_pairs_shared=int((index.position_ids + 1).sum()),
            kv_tokens_shared=int(index.cu_seqlens_k[-1]),
        )


def lay_out(forest: PrefixForest) -> SharedLayout:
    """The stored segments of a `PrefixForest` (see `SharedLayout`).

    >>> g = GroupTokens([np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5, 6])],
    ...                 [np.zeros(4), np.zeros(5)])
    >>> lay = lay_out(detect(g, share_min=2))
    >>> lay.cu_seqlens.tolist(), lay.parent.tolist(), lay.start.tolist()
    ([0, 2, 4, 7], [-1, 0, 0], [0, 2, 2])
    """
    n, m = len(forest.lengths), len(forest.node_end)
    cont = forest.continuation_start
    # children of each prefix (index m: the roots): ("node", j) or ("sample", i), by lowest sample
    kids: list[list[tuple[int, bool, int]]] = [[] for _ in range(m + 1)]
    for j in range(m):
        kids[forest.node_parent[j] if forest.node_parent[j] >= 0 else m].append(
            (int(forest.node_sample[j]), True, j)
        )
    for i in range(n):
        kids[forest.sample_node[i] if forest.sample_node[i] >= 0 else m].append((i, False, i))
    rows: list[tuple[int, int, int, int, int]] = []  # sample, start, end, parent segment, node
    sample_segment = np.full(n, -1, dtype=np.int64)
    stack = [(k, -1) for k in sorted(kids[m], reverse=True)]
    while stack:
        (low, is_node, what), parent = stack.pop()
        seg = len(rows)
        if is_node:
            rows.append(
                (low, int(forest.node_start[what]), int(forest.node_end[what]), parent, what)
            )
            stack.extend((k, seg) for k in sorted(kids[what], reverse=True))
        else:
            rows.append((what, int(cont[what]), int(forest.lengths[what]), parent, -1))
            sample_segment[what] = seg
    table = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return SharedLayout(
        lengths=forest.lengths,
        sample=table[:, 0],
        start=table[:, 1],
        end=table[:, 2],
        parent=table[:, 3],
        node=table[:, 4],
        sample_segment=sample_segment,
    )
