"""The run plan's warnings: sentences for people about what the plan had to do to its steps.

Each is about the kept steps as a whole (counted over steps, naming the first few): steps with
fewer samples than --dp (ranks with only padding), samples left out by --equal-count-trim,
batches whose mini-batches are cut inside groups, and step sizes that whole groups cannot fit
(`step_size_warning`, in --batch-unit units). None stops the run; pack prints them and records
nothing else of them.

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports placement;
schedule imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from rolltool.format import StepRecord
from rolltool.plan.config import PackConfig
from rolltool.plan.placement import StepOutline


def step_warnings(steps: list[StepOutline], config: PackConfig) -> list[str]:
    """Every warning on the kept steps, in the order pack prints them."""
    return [
        *_thin_steps(steps, config.dp),
        *_trim_warning(steps, config.dp),
        *_cut_warning(steps, config.steps.mini_batches),
        *filter(None, [step_size_warning([s.record for s in steps], config.steps.batch_unit)]),
    ]


def _cut_warning(steps: list[StepOutline], mini_batches: int) -> list[str]:
    """Batches with fewer groups than --mini-batches: their groups span mini-batches."""
    split = sorted({st.record.batch or 0 for st in steps if st.cut != "groups"})
    if not split:
        return []
    shown = ", ".join(map(str, split[:8])) + (", ..." if len(split) > 8 else "")
    empty = sorted({st.record.batch or 0 for st in steps if st.cut == "empty"})
    return [
        f"{len(split)} batch(es) ({shown}) have fewer groups than --mini-batches {mini_batches}: "
        "their mini-batches are cut inside groups (at rollout boundaries where there are enough)"
        + (
            f"; {len(empty)} of them have fewer samples than that, and leave their last "
            "mini-batches empty (steps that train nothing)"
            if empty
            else ""
        )
    ]


def _thin_steps(steps: list[StepOutline], dp: int) -> list[str]:
    thin = [st.index for st in steps if int(st.sizes.sum()) < dp]
    if not thin:
        return []
    return [
        f"{len(thin)} step(s) (first: step {thin[0]}) have fewer samples than --dp {dp}: "
        "some ranks get only all-padding micro-batches"
    ]


def _trim_warning(steps: list[StepOutline], dp: int) -> list[str]:
    trimmed = [st for st in steps if len(st.count_trimmed)]
    if not trimmed:
        return []
    n = sum(len(st.count_trimmed) for st in trimmed)
    return [
        f"--equal-count-trim: {n} sample(s) in {len(trimmed)} step(s) (first: step "
        f"{trimmed[0].index}) left out so that --dp {dp} divides each step's samples "
        "(status count_trimmed in samples.parquet)"
    ]


def step_size_warning(steps: Sequence[StepRecord], unit: str) -> str | None:
    """A sentence when most steps (final partial step aside) hold less than half or more than
    twice their nominal size: whole groups do not fit that step size (e.g. ``--batch-unit
    tokens --batch-size 128``, every group a step of its own). None when the sizes are fine.

    >>> from types import SimpleNamespace as S
    >>> step_size_warning([S(status="oversize", actual=900, nominal=128)] * 3, "tokens")[:31]
    '3 of 3 steps hold more than twi'
    """
    sized = [(s.actual, s.nominal) for s in steps if s.status != "partial" and s.nominal]
    off = [a for a, n in sized if not 0.5 * n <= a <= 2 * n]
    if not sized or 2 * len(off) <= len(sized):
        return None
    nominal = sized[0][1]
    median = sorted(a for a, _ in sized)[len(sized) // 2]
    side = "more than twice" if median > nominal else "less than half"
    return (
        f"{len(off):,} of {len(sized):,} steps hold {side} --batch-size {nominal:,} {unit} "
        f"(median {median:,}): whole groups do not fit this step size; choose a --batch-size "
        "of several groups"
    )
