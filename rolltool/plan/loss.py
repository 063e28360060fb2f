"""Layout-invariant loss weights: per-token weights fixed by the step, not by the row.

A trainer computes ``loss = sum_t loss_weight[t] * token_loss[t]`` over every row it holds and
sums gradients over ranks (or multiplies by dp when its framework averages). The weights are set
so that this sum, over all ranks and micro-batches of the step, equals the step's loss under the
chosen aggregation, computed over the whole step. With T the step's trainable tokens, S the
step's samples that have at least one trainable token, t_i the trainable tokens of sample i and
f the scale factor, a trainable token of sample i weighs:

==========================  ===================  ====================
aggregation                 weight               sum over the step
==========================  ===================  ====================
token-mean                  1 / T                1
seq-mean-token-mean         1 / (S * t_i)        1
seq-mean-token-sum          1 / S                T / S
seq-mean-token-sum-norm     1 / (S * f)          T / (S * f)
==========================  ===================  ====================

Non-trainable tokens and padding weigh 0. Nothing here depends on dp, the token budget, the row
length or the balance method, so a token's weight is a property of the data and the step.
"""

from __future__ import annotations

import numpy as np

from rolltool.errors import RolltoolError

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def check_loss_agg(agg: str, scale_factor: float | None) -> None:
    if agg not in LOSS_AGGS:
        raise RolltoolError(
            f"unknown loss aggregation {agg!r}", hint=f"choose from {', '.join(LOSS_AGGS)}"
        )
    if agg == "seq-mean-token-sum-norm":
        if scale_factor is None:
            raise RolltoolError(
                "--loss-agg seq-mean-token-sum-norm needs --loss-scale-factor",
                hint="use a constant such as the maximum response length; it must not depend on the layout",
            )
        if not (np.isfinite(scale_factor) and scale_factor > 0):
            raise RolltoolError(
                f"--loss-scale-factor must be a positive number, got {scale_factor}"
            )


def step_denominators(agg: str, trainable: np.ndarray, scale_factor: float | None = None) -> dict:
    """The step's denominators (recorded in the manifest) for the samples trained in it."""
    t = np.asarray(trainable, dtype=np.int64)
    T = int(t.sum())
    S = int((t > 0).sum())
    expected = {
        "token-mean": 1.0 if T else 0.0,
        "seq-mean-token-mean": 1.0 if S else 0.0,
        "seq-mean-token-sum": T / S if S else 0.0,
        "seq-mean-token-sum-norm": T / (S * scale_factor) if S and scale_factor else 0.0,
    }[agg]
    return {
        "trainable_tokens": T,
        "trained_samples": S,
        "scale_factor": scale_factor,
        "weight_sum": expected,
    }


def sample_weights(
    agg: str, trainable: np.ndarray, scale_factor: float | None = None
) -> np.ndarray:
    """Weight of each trainable token of each sample ([n] float64; 0 for samples without any)."""
    t = np.asarray(trainable, dtype=np.float64)
    T = t.sum()
    S = float((t > 0).sum())
    if agg == "token-mean":
        w = np.full_like(t, 1.0 / T if T else 0.0)
    elif agg == "seq-mean-token-mean":
        w = np.divide(1.0, S * t, out=np.zeros_like(t), where=t > 0)
    elif agg == "seq-mean-token-sum":
        w = np.full_like(t, 1.0 / S if S else 0.0)
    elif agg == "seq-mean-token-sum-norm":
        assert scale_factor is not None
        w = np.full_like(t, 1.0 / (S * scale_factor) if S else 0.0)
    else:
        raise RolltoolError(f"unknown loss aggregation {agg!r}")
    return np.where(t > 0, w, 0.0)
