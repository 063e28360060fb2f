"""rolltool's partitioning behind verl's ``verl.utils.seqlen_balancing`` signatures.

verl (verl-project/verl) balances a batch over data-parallel ranks with
``get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)`` (Karmarkar-Karp; sorted
index lists, one per partition, every index once, equal counts with ``equal_size``) and splits a
rank's samples into micro-batches in ``rearrange_micro_batches(batch, max_token_len, dp_group,
...)``: ``M = ceil(tokens / max_token_len)``, ``all_reduce(MAX)`` over the DP group, then
``get_seqlen_balanced_partitions(workload, M, equal_size=False)``.

Here the same calls run on `rolltool.plan.partition`:

* ``get_seqlen_balanced_partitions``: `rolltool.plan.partition.balance` on the weights as given (verl
  passes lengths or its workload proxy 24576·L + L²), same return type and assertions;
* ``num_micro_batches(seqlen_list, max_token_len)``: this rank's count before the all-reduce;
* ``get_micro_batch_partitions(seqlen_list, max_token_len, dp_group_max_count, ...)``: the list
  core of ``rearrange_micro_batches``: `rolltool.plan.partition.plan_step` under the hard token cap,
  split further until ``dp_group_max_count`` micro-batches (the DP group's MAX, so every rank steps
  the same number of times), ordered heaviest first so rank r's j-th micro-batch lines up.

In verl's ``rearrange_micro_batches`` the mapping is::

    lens = batch["attention_mask"].sum(dim=1).tolist()
    m = num_micro_batches(lens, max_token_len)            # then all_reduce(MAX) over dp_group
    idx = get_micro_batch_partitions(lens, max_token_len, dp_group_max_count=m)
    micro_batches = [batch[torch.tensor(p)] for p in idx]  # verl returns (micro_batches, idx)

``patch()`` is the one-line swap: ``import rolltool.integrations.verl as r; r.patch()``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.partition import balance, plan_step
from rolltool.plan.workload import Workload, make_workload

__all__ = [
    "get_micro_batch_partitions",
    "get_seqlen_balanced_partitions",
    "num_micro_batches",
    "patch",
]

VERL_MODULE = "verl.utils.seqlen_balancing"
"""The verl module whose ``get_seqlen_balanced_partitions`` ``patch`` replaces."""


def get_seqlen_balanced_partitions(
    seqlen_list: list[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """verl's call: split indices ``0..n-1`` into ``k_partitions`` lists balancing the weight sums.

    ``seqlen_list``: weights (lengths or a workload per sample), used as given. Returns
    ``k_partitions`` ascending lists of ints; every index appears exactly once; with
    ``equal_size`` all lists have ``n / k_partitions`` items. As in verl, an ``AssertionError``
    when ``n < k_partitions``, when ``equal_size`` and k does not divide n, or a part is empty.
    """
    n, k = len(seqlen_list), int(k_partitions)
    assert n >= k, f"number of items:[{n}] < k_partitions:[{k}]"
    assert not equal_size or n % k == 0, f"{n} items cannot split into {k} equal parts"
    w = np.asarray(seqlen_list, dtype=np.float64)
    parts = [p.tolist() for p in balance(w, k, equal_count=bool(equal_size))]
    _fill_empty(parts)
    assert all(parts), "a partition is empty"
    return parts


def _fill_empty(parts: list[list[int]]) -> None:
    """Give each empty part one item from the part with most items (zero weights only)."""
    for p in parts:
        if not p:
            donor = max(parts, key=len)
            if len(donor) > 1:
                p.append(donor.pop())
    for p in parts:
        p.sort()


def num_micro_batches(seqlen_list: Sequence[int], max_token_len: int) -> int:
    """This rank's micro-batch count under the hard cap (the value to all-reduce with MAX).

    It is what `get_micro_batch_partitions` returns without ``dp_group_max_count``: at least
    ``ceil(tokens / max_token_len)``, usually equal to it or one more.
    """
    return len(get_micro_batch_partitions(seqlen_list, max_token_len, same_micro_num_in_dp=False))


def get_micro_batch_partitions(
    seqlen_list: Sequence[int],
    max_token_len: int,
    dp_group_max_count: int | None = None,
    same_micro_num_in_dp: bool = True,
    workload: Workload | None = None,
) -> list[list[int]]:
    """The core of verl's ``rearrange_micro_batches``: this rank's micro-batch index lists.

    ``seqlen_list``: tokens per sample; ``max_token_len``: the hard cap per micro-batch (a sample
    longer than it is an error). ``dp_group_max_count``: the count to align to (the MAX of
    `num_micro_batches` over the DP group), honoured when ``same_micro_num_in_dp``; micro-batches
    are split until there are that many. ``workload``: the cost model (default verl's proxy).
    Returns ascending lists of ints, heaviest micro-batch first; every index appears once.
    """
    lengths = np.asarray(seqlen_list, dtype=np.int64)
    wl = workload if workload is not None else make_workload("verl")
    if len(lengths) == 0:
        return []
    plan = plan_step(lengths, dp=1, max_tokens=int(max_token_len), workload=wl)
    parts = [mb.tolist() for mb in plan.micro_batches[0] if len(mb)]
    if same_micro_num_in_dp and dp_group_max_count is not None:
        target = int(dp_group_max_count)
        if target > len(lengths):
            raise RolltoolError(
                f"cannot make {target} micro-batches from {len(lengths)} samples",
                hint="verl asserts num_micro_batches <= batch size too; lower the micro-batch count",
            )
        parts = _split_to(parts, target, wl.cost(lengths))
    cost = wl.cost(lengths)
    parts.sort(key=lambda p: (-float(cost[p].sum()), p[0]))
    return parts


def _split_to(parts: list[list[int]], target: int, cost: np.ndarray) -> list[list[int]]:
    """Split the heaviest splittable micro-batch in two (balanced) until there are ``target``."""
    while len(parts) < target:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        i = max(splittable, key=lambda i: (float(cost[parts[i]].sum()), -i))
        p = np.asarray(parts.pop(i), dtype=np.int64)
        parts += [p[half].tolist() for half in balance(cost[p], 2)]
    return parts


def patch() -> list[str]:
    """Swap rolltool's ``get_seqlen_balanced_partitions`` into verl; returns the patched modules.

    One line in a verl entry point: ``import rolltool.integrations.verl as r; r.patch()``. It
    replaces the function in ``verl.utils.seqlen_balancing`` (so ``rearrange_micro_batches``
    uses it) and in every loaded module that imported it by name (e.g. the PPO trainer's
    ``_balance_batch``). Call it before training starts. Without verl: a `RolltoolError`.
    """
    try:
        import importlib

        module = importlib.import_module(VERL_MODULE)
    except ImportError as exc:
        raise RolltoolError(
            f"cannot patch verl: {VERL_MODULE} is not importable ({exc})",
            hint="install verl in this environment, or call the functions here directly",
        ) from None
    original = module.get_seqlen_balanced_partitions
    patched = []
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "get_seqlen_balanced_partitions", None) is original:
            mod.get_seqlen_balanced_partitions = get_seqlen_balanced_partitions  # type: ignore[attr-defined]
            patched.append(name)
    return sorted(patched)
