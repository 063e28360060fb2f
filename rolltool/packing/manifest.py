"""The pack job's records: the manifest of a planned, written run and samples.parquet's table.

The one place that assembles a `rolltool.format.Manifest` from a run (the writer adds the file
list and writes it last): every engine's run gets the same document from the same plan.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from rolltool._version import __version__
from rolltool.errors import RolltoolError
from rolltool.format import (
    HYBRID_VERSION,
    SHARED_VERSION,
    STATUSES,
    AdvantagesRecord,
    InputRecord,
    LossRecord,
    Manifest,
    PartialStep,
    SampleCounts,
    StepRecord,
)
from rolltool.plan.config import PackConfig
from rolltool.plan.schedule import Schedule
from rolltool.plan.workload import Workload
from rolltool.schema import Rollouts


def _version(config: PackConfig, epochs: int) -> int:
    """The format version a pack is written in (`rolltool.format.spec.SUPPORTED_VERSIONS`)."""
    if config.hybrid_cp:
        return HYBRID_VERSION
    if config.share_prefix:
        return SHARED_VERSION
    return 2 if epochs > 1 else 1


def manifest_record(
    ro: Rollouts,
    plan: Schedule,
    config: PackConfig,
    workload: Workload,
    steps: list[StepRecord],
    warnings: list[str],
    columns: Mapping[str, str] | None,
    command: Sequence[str] | None,
) -> Manifest:
    """The manifest (without its file list, which the writer adds) of a planned, written run;
    `command` is recorded as the caller gives it (the CLI: its command line)."""
    counts = {s: int((plan.status == s).sum()) for s in STATUSES}  # samples.parquet's rows
    once = {s: int((plan.status[: ro.num_samples] == s).sum()) for s in STATUSES}  # epoch 0
    notes = list(warnings)  # the caller's list stays as it was
    if once["leftover"]:
        notes.append(f"{once['leftover']} sample(s) left over: not enough to fill another step")
    if once["env_unweighted"]:
        notes.append(
            f"{once['env_unweighted']} sample(s) of envs without --env-weight were not used"
        )
    a = config.advantages
    partial = plan.assembly.partial_dropped
    return Manifest(
        format_version=_version(config, plan.epochs),
        rolltool_version=__version__,
        created_at=created_at(),
        command=tuple(command or ()),
        config=config.record(),
        workload=workload.record(),
        advantages=AdvantagesRecord(
            source=plan.advantages.source,
            whitening="per step" if plan.advantages.per_step_whitening else None,
            estimators={e: a.env_estimators.get(e, a.estimator) for e in ro.env_names},
        ),
        loss=LossRecord(agg=config.loss_agg, scale_factor=config.loss_scale_factor),
        inputs=tuple(InputRecord(path=f.resolved, rows=f.rows, given=f.path) for f in ro.files),
        columns=dict(columns or {}),
        dp=config.dp,
        samples=SampleCounts(total=len(plan.status), **counts),
        leftover_groups=len(plan.assembly.leftover),
        partial_step_dropped=None
        if partial is None
        else PartialStep(groups=len(partial.groups), actual=partial.actual),
        warnings=tuple(notes),
        steps=tuple(steps),
    )


def created_at() -> str:
    """The manifest's creation time, UTC to the second: ``SOURCE_DATE_EPOCH`` when set (the
    reproducible-builds convention: the same command then writes the same manifest bytes),
    else now. A value that is not a whole number of seconds is an error naming it."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        when = dt.datetime.now(dt.timezone.utc)
    else:
        try:
            when = dt.datetime.fromtimestamp(int(epoch), dt.timezone.utc)
        except (ValueError, OverflowError, OSError):
            raise RolltoolError(
                f"SOURCE_DATE_EPOCH={epoch!r} is not a time (whole seconds since 1970-01-01 UTC)",
                hint="unset it, or give e.g. SOURCE_DATE_EPOCH=$(date +%s)",
            ) from None
    return when.isoformat(timespec="seconds")


def samples_table(ro: Rollouts, plan: Schedule) -> pa.Table:
    """One row per input sample: where it went, or why it was not trained; with --epochs E > 1
    one row per (epoch, sample), epoch by epoch, with an ``epoch`` column (format version 2);
    with --hybrid-cp each sample's CP sub-group (`_hybrid_columns`)."""
    n, e = ro.num_samples, plan.epochs
    index = np.arange(n, dtype=np.int64)

    def tiled(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        return values if e == 1 else values.take(pa.array(np.tile(index, e)))

    epoch = {} if e == 1 else {"epoch": pa.array(np.repeat(np.arange(e, dtype=np.int64), n))}
    return pa.table(
        {
            **epoch,
            "sample_index": pa.array(np.tile(index, e)),
            "sample_id": tiled(ro.sample_id),
            "group_id": tiled(ro.group_ids.take(pa.array(ro.group))),
            "rollout_id": tiled(ro.rollout_ids.take(pa.array(ro.rollout))),
            "env": pa.array([ro.env_names[k] for k in ro.env] * e, pa.string()),
            "length": pa.array(np.tile(ro.length, e), pa.int64()),  # int32 in Rollouts
            "trainable_tokens": pa.array(np.tile(ro.trainable, e), pa.int64()),
            "reward": pa.array(np.tile(ro.reward, e), pa.float64()),
            "advantage": pa.array(plan.advantage.astype(np.float32)),
            "token_loss_weight": pa.array(plan.weight.astype(np.float32)),
            "step": pa.array(plan.step),
            "rank": pa.array(plan.rank),
            "micro_batch": pa.array(plan.micro_batch),
            "status": pa.array(plan.status.tolist(), pa.string()),
            **_hybrid_columns(plan),
        }
    )


def _hybrid_columns(plan: Schedule) -> dict[str, pa.Array]:
    """A --hybrid-cp pack's two extra samples.parquet columns (none in any other pack):
    ``cp_start`` (the first GPU of the sample's sub-group in its data-parallel group) and
    ``cp_degree`` (its CP degree k: 1 whole on GPU ``cp_start``, 0 when not trained)."""
    if plan.cp_start is None or plan.cp_degree is None:
        return {}
    return {"cp_start": pa.array(plan.cp_start), "cp_degree": pa.array(plan.cp_degree)}
