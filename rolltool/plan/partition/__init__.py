"""Partition engine: which sample goes to which data-parallel rank and micro-batch.

* ``balance``: split weighted items into k parts with the lightest possible heaviest part
  (``kk``, ``lpt`` or ``auto``), optionally with equal item counts;
* ``plan_step``: one optimizer step's layout, ``micro_batches[rank][j]``, under a hard token cap
  or with a fixed number of samples per micro-batch, with the same micro-batch count on every rank.

Pure functions over NumPy arrays: nothing here reads files or prints.
"""

from __future__ import annotations

from rolltool.plan.partition.balance import (
    METHODS,
    balance,
    balance_labels,
    lower_bound,
    part_loads,
    split_labels,
)
from rolltool.plan.partition.plan import ALIGNS, StepPlan, plan_step, plan_units

__all__ = [
    "ALIGNS",
    "METHODS",
    "StepPlan",
    "balance",
    "balance_labels",
    "lower_bound",
    "part_loads",
    "plan_step",
    "plan_units",
    "split_labels",
]
