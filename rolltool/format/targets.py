"""Next-token targets: what the logits at each token are trained to predict, and with what.

A causal LM's logits at token t of a sample predict token t+1 of the same sample. The stored
per-token arrays are aligned with the *predicted* token (``loss_weight[t]``, ``advantages[t]``,
``logprobs[t]`` belong to ``input_ids[t]``), so a trainer shifts them by one. Shifting inside
a GPU's view is wrong under ``--cp``: a CP view holds two chunks of each sample, and the target
of a chunk's last token is on another CP rank (under ``--sp`` the same holds at the slice's
end). So the reader derives the shift over the whole group row, before any split, as Megatron
shifts labels before it splits a batch, and the views slice the result like every other
per-token array (`rolltool.format.split.PER_TOKEN`).

Per sample of length n, for t < n - 1 (`next_token_targets`):

- ``target_ids[t] = input_ids[t+1]`` (int32), the token the logits at t predict;
- ``target_loss_weight[t] = loss_weight[t+1]``, ``target_advantages[t] = advantages[t+1]``,
  ``target_logprobs[t] = logprobs[t+1]`` (float32): that target token's weight, advantage and
  behaviour log-prob.

A sample's last token and every padding token have no target: ``target_ids`` is `IGNORE_INDEX`
(-100, what Hugging Face's and Megatron's cross-entropy skip) and the three others are 0. So a
loss over any view's logits needs only that view's arrays::

    loss = sum_t target_loss_weight[t] * f(logits[t], target_ids[t], target_logprobs[t],
                                            target_advantages[t])

summed over every GPU of every group is the step's loss ``sum_t loss_weight[t] * f(token t)``
(with logits of token t-1) exactly: every weighted token but a sample's first is some token's
target, and a first token has no prediction inside its sample (its weight is 0).

Worked example, one sample of 4 tokens ``a b c d`` with weights ``0 w1 w2 w3`` then 2 padding
tokens: ``target_ids = b c d -100 -100 -100``, ``target_loss_weight = w1 w2 w3 0 0 0``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rolltool.format.spec import PAD_SAMPLE

IGNORE_INDEX = -100
"""``target_ids`` of a token with no target (a sample's last token, padding)."""

TARGET_FIELDS = {
    "target_ids": np.int32,
    "target_loss_weight": np.float32,
    "target_advantages": np.float32,
    "target_logprobs": np.float32,
}
"""The derived per-token target arrays of every reader row and view, and their dtypes."""

SHIFTED_FROM = {
    "target_ids": "input_ids",
    "target_loss_weight": "loss_weight",
    "target_advantages": "advantages",
    "target_logprobs": "logprobs",
}
"""Each target array is this reader array shifted left by one within its sample."""

NO_TARGET = {
    "target_ids": IGNORE_INDEX,
    "target_loss_weight": 0,
    "target_advantages": 0,
    "target_logprobs": 0,
}
"""The value of each target array where a token has no target."""


def next_token_targets(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The `TARGET_FIELDS` of a whole (group) row: each array of `SHIFTED_FROM` shifted left
    by one inside every segment, `NO_TARGET` at each segment's last token and on padding
    segments (``sample_index`` -1). A sample is one segment of the row (under ``--cp`` its CP
    padding is the next segment), so a segment's last token is its sample's last.

    `row` needs the `SHIFTED_FROM` arrays [T], ``cu_seqlens`` [n+1] and ``sample_index`` [n]
    (a row as `rolltool.format.layout.unpack_row` makes it, before any split). Fresh arrays,
    each one slice copy plus a scatter over the segment ends.

    >>> row = {"input_ids": np.array([5, 6, 7, 8, 0]), "loss_weight": np.ones(5),
    ...        "advantages": np.ones(5), "logprobs": np.ones(5),
    ...        "cu_seqlens": np.array([0, 3, 4, 5]), "sample_index": np.array([0, 1, -1])}
    >>> next_token_targets(row)["target_ids"].tolist()
    [6, 7, -100, -100, -100]
    """
    return next_token_targets_of(row, row["cu_seqlens"], row["sample_index"])


_FEW_PADS = 8
"""Up to this many padding segments in a row, each is filled as one slice (a row-end padding,
an empty micro-batch); more (``--cp``: one after every sample) go through `no_target`."""


def next_token_targets_of(
    row: Mapping[str, np.ndarray], cu_seqlens: np.ndarray, sample_index: np.ndarray
) -> dict[str, np.ndarray]:
    """`next_token_targets` of `row`'s `SHIFTED_FROM` arrays, given its segments apart (what
    `rolltool.format.layout.unpack_row` has at hand): the same arrays, the segment ends
    scattered and a few padding segments filled as slices instead of a gathered index."""
    cu = np.asarray(cu_seqlens)
    index = np.asarray(sample_index).tolist()  # a row's few segments: Python finds the padding
    pad = [k for k, i in enumerate(index) if i == PAD_SAMPLE] if PAD_SAMPLE in index else []
    if len(pad) > _FEW_PADS:
        ends, spans = no_target(cu, sample_index), []
    else:
        ends = cu[1:].astype(np.int64) - 1
        bounds = cu.tolist() if pad else []
        spans = [(bounds[p], bounds[p + 1]) for p in pad]
    out = {}
    for key, source in SHIFTED_FROM.items():
        a = row[source]
        shifted = np.empty(len(a), dtype=TARGET_FIELDS[key])
        shifted[:-1] = a[1:]
        fill = NO_TARGET[key]
        shifted[ends] = fill
        for x, y in spans:
            shifted[x:y] = fill
        out[key] = shifted
    return out


def no_target(cu_seqlens: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """[m] int64: the row positions with no next-token target, each segment's last token
    then every token of a padding segment (a position may appear twice).

    >>> no_target(np.array([0, 3, 5, 8]), np.array([0, -1, 1])).tolist()
    [2, 4, 7, 3, 4]
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    pad = np.flatnonzero(np.asarray(sample_index) == PAD_SAMPLE)
    if not len(pad):
        return cu[1:] - 1
    lens = cu[pad + 1] - cu[pad]
    first = np.cumsum(lens) - lens  # where each padding segment starts among the padding tokens
    tokens = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(cu[pad] - first, lens)
    return np.concatenate([cu[1:] - 1, tokens])
