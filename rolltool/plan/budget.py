"""Over-budget samples: those longer than the most tokens one sample may occupy.

The cap is `PackConfig.token_cap`: the group's micro-batch budget (--micro-batch-tokens x sp or
cp), or its row length (--row-len x sp or cp) when micro-batches are counted in samples; in
tokens as the sample occupies them (with --cp padding, `GroupSplit.padded`). A sample over it can
never train: an error naming the sample, or with --overlong drop it is left out of training and
counted (``overlong_dropped``). Decided once over the whole input, before steps are assembled, so step
sizes count only samples that train. `budget_terms` spells how the cap came about, for this
error and for the step planner's (`rolltool.plan.step_plan`).

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports none of
groups, group_advantages, step_records, step_plan, placement, step_warnings, schedule.
"""

from __future__ import annotations

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.config import PackConfig
from rolltool.schema import Rollouts


def over_budget(ro: Rollouts, config: PackConfig) -> np.ndarray:
    """[n] bool: samples longer than the token cap; an error unless --overlong drop."""
    cap = config.token_cap
    occupied = config.split.padded(ro.length)
    too_long = occupied > cap if cap is not None else np.zeros(ro.num_samples, dtype=bool)
    if too_long.any() and config.overlong == "error":
        i = int(np.flatnonzero(too_long)[0])
        raise RolltoolError(
            f"{ro.label(i)} has {int(ro.length[i]):,} tokens"
            + (
                f" ({int(occupied[i]):,} padded for --cp {config.cp})"
                if occupied[i] > ro.length[i]
                else ""
            )
            + f", over the {cap:,}-token budget{budget_terms(config)} "
            f"({int(too_long.sum())} sample(s) are)",
            hint=f"raise {'--micro-batch-tokens' if config.micro_batch_tokens else '--row-len'}"
            + (
                ", or split long samples over more GPUs (--cp, --sp)"
                if cap == config.group_tokens
                else ""
            )
            + ", or pass --overlong drop to leave such samples out",
        )
    return too_long


def budget_terms(config: PackConfig) -> str:
    """How the group's cap came about, e.g. `` (--micro-batch-tokens 8,192 x --cp 4)``."""
    kind = config.split.kind
    if kind is None:
        return ""
    what = "--micro-batch-tokens" if config.micro_batch_tokens is not None else "--row-len"
    per_gpu = config.micro_batch_tokens if config.micro_batch_tokens is not None else config.row_len
    return f" ({what} {per_gpu:,} x --{kind} {config.split.size})"
