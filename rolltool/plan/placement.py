"""Where every sample went: the flat per-sample arrays of the run plan, filled step by step.

Every samples.parquet row (E x n: each sample once per epoch) gets a status (``STATUSES``:
trained, or why not; stored as one int8 code, `STATUS_CODE`), the step it went to or was dropped
in (int32, -1 if none), its advantage and loss weight (float32, the bytes the shards store), and
each kept step's trained samples in row order (with --hybrid-cp also each trained sample's
CP sub-group: its first GPU and its degree). `placement` gives every sample's fate outside the
kept steps (leftover, env_unweighted, or why it could never train); `Placement.add` then folds
each planned step in as it arrives, in step order, keeping only a `StepOutline` of it, so the
driver never holds every step's arrays.

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports groups and
step_plan; step_warnings and schedule import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolltool.format import STATUSES, StepRecord
from rolltool.plan.batches import Assembly
from rolltool.plan.groups import GroupIndex, index_dtype
from rolltool.plan.hybrid_step import HybridLayout
from rolltool.plan.partition import StepPlan
from rolltool.plan.prefix_step import SharedPlan
from rolltool.plan.step_plan import PlannedStep
from rolltool.schema import Rollouts

STATUS_CODE = {name: np.int8(i) for i, name in enumerate(STATUSES)}
"""A sample's status as the driver stores it: its index in ``STATUSES`` (one byte)."""


@dataclass(frozen=True)
class StepOutline:
    """What the driver keeps of a planned step beside `Schedule`'s flat arrays: its record,
    plan summary and micro-batch sizes; its samples are `Schedule.rows`' run for the step."""

    index: int
    record: StepRecord
    plan: StepPlan  # ``micro_batches`` empty: rebuilt from ``sizes`` by `Schedule.steps`
    sizes: np.ndarray  # [dp, M] int32 samples in each micro-batch
    uniform_dropped: np.ndarray  # as `PlannedStep`'s
    overlong_dropped: np.ndarray
    count_trimmed: np.ndarray
    cut: str
    hybrid: HybridLayout | None = None  # as `PlannedStep`'s (row order)
    shared: SharedPlan | None = None  # as `PlannedStep`'s

    @staticmethod
    def of(st: PlannedStep) -> StepOutline:
        sizes = np.array([[len(m) for m in mbs] for mbs in st.plan.micro_batches], np.int32)
        return StepOutline(
            index=st.index,
            record=st.record,
            plan=dataclasses.replace(st.plan, micro_batches=[]),
            sizes=sizes.reshape(st.plan.dp, st.plan.num_micro_batches),
            uniform_dropped=st.uniform_dropped,
            overlong_dropped=st.overlong_dropped,
            count_trimmed=st.count_trimmed,
            cut=st.cut,
            hybrid=st.hybrid,
            shared=st.shared,
        )


@dataclass(frozen=True)
class Placement:
    """`Schedule`'s flat arrays while the steps arrive (`placement`, then `add` per step in
    order, then `arrays`)."""

    n: int  # input samples
    status_code: np.ndarray
    step_code: np.ndarray
    advantage: np.ndarray
    weight: np.ndarray
    rows: np.ndarray  # [E*n] buffer; the first ``row_starts[-1]`` entries are filled
    row_starts: list[int]
    cp_start: np.ndarray | None = None  # [E*n] int16 --hybrid-cp: first GPU of its sub-group
    cp_degree: np.ndarray | None = None  # [E*n] int16 --hybrid-cp: its CP degree k (0: untrained)

    def add(self, st: PlannedStep) -> StepOutline:
        """Where `st`'s samples went (a later step's fate overrides an earlier one's, as they
        are added in step order); the outline the schedule keeps of it."""
        at = st.epoch * self.n  # this epoch's rows
        for fate, idx in (
            ("uniform_dropped", st.uniform_dropped),
            ("overlong_dropped", st.overlong_dropped),
            ("count_trimmed", st.count_trimmed),
        ):
            self.status_code[at + idx] = STATUS_CODE[fate]
            self.step_code[at + idx] = st.index
        order = st.order
        members = st.members[order]
        self.status_code[at + members] = STATUS_CODE["trained"]
        self.step_code[at + members] = st.index
        self.weight[at + members] = st.weight[order]
        self.advantage[at + members] = st.advantage[order]
        start = self.row_starts[-1]
        self.rows[start : start + len(members)] = members
        self.row_starts.append(start + len(members))
        if st.hybrid is not None and self.cp_start is not None and self.cp_degree is not None:
            sizes = np.array([[len(m) for m in mbs] for mbs in st.plan.micro_batches], np.int64)
            dp, m = st.plan.dp, st.plan.num_micro_batches
            rank = np.repeat(np.arange(dp).repeat(m), sizes.ravel())
            slot = np.repeat(np.tile(np.arange(m), dp), sizes.ravel())
            self.cp_start[at + members] = st.hybrid.cp_start
            self.cp_degree[at + members] = st.hybrid.degree(rank, slot)
        return StepOutline.of(st)

    def arrays(self) -> dict[str, Any]:
        """`Schedule`'s array fields."""
        return {
            "status_code": self.status_code,
            "step_code": self.step_code,
            "advantage": self.advantage,
            "weight": self.weight,
            "rows": self.rows[: self.row_starts[-1]],
            "row_starts": np.array(self.row_starts, dtype=np.int64),
            "cp_start": self.cp_start,
            "cp_degree": self.cp_degree,
        }


def placement(
    ro: Rollouts,
    assembly: Assembly,
    in_group: GroupIndex,
    too_long: np.ndarray,
    advantage: np.ndarray,
    epochs: int = 1,
    hybrid: bool = False,
) -> Placement:
    """The flat arrays before any step is added: every sample's fate outside the kept steps
    (leftover, env_unweighted, or why it could never train), arrays of length epochs x n;
    with `hybrid` (--hybrid-cp) each trained sample's sub-group too."""
    n = ro.num_samples
    code = np.full(n, STATUS_CODE["leftover"], dtype=np.int8)
    code[in_group.samples(assembly.unweighted)] = STATUS_CODE["env_unweighted"]
    # Outside kept steps, a sample that could never train says why rather than "leftover":
    # over-long anywhere, or in a uniform group the dropped partial step skipped.
    if assembly.partial_dropped is not None:
        code[in_group.samples(assembly.partial_dropped.dropped)] = STATUS_CODE["uniform_dropped"]
    code[too_long & (code == STATUS_CODE["leftover"])] = STATUS_CODE["overlong_dropped"]
    return Placement(
        n=n,
        status_code=np.tile(code, epochs),
        step_code=np.full(epochs * n, -1, dtype=np.int32),
        advantage=np.tile(advantage.astype(np.float32, copy=False), epochs),
        weight=np.zeros(epochs * n, dtype=np.float32),
        rows=np.empty(epochs * n, dtype=index_dtype(n)),
        row_starts=[0],
        cp_start=np.zeros(epochs * n, dtype=np.int16) if hybrid else None,
        cp_degree=np.zeros(epochs * n, dtype=np.int16) if hybrid else None,
    )
