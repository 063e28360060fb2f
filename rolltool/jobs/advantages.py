"""The advantages job: rollout Parquet in, the same rows out with group advantage columns.

Like every job (one module per command in `rolltool.jobs`), it takes config objects and paths and
returns a report dict (the same document `--json` prints); it never prints.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from rolltool._version import __version__
from rolltool.errors import RolltoolError
from rolltool.input.parquet import InputFile, invert_mapping
from rolltool.input.resolve import resolve_inputs
from rolltool.jobs.rewrite import append_columns, output_schema
from rolltool.plan.advantages import (
    AdvantageConfig,
    AdvantageInput,
    Advantages,
    compute_advantages,
    summarize,
)
from rolltool.schema import scan, scan_deferred
from rolltool.schema.pieces import DeferredProblem, Mapper
from rolltool.storage.outputs import atomic_file, check_target, parquet_marker

ADVANTAGE_COLUMNS = (
    "advantage",
    "group_size",
    "group_reward_mean",
    "group_reward_std",
    "group_uniform",
)


ROW_GROUP = 65_536
"""Most rows in an output row group (`rolltool.jobs.rewrite.row_group_plan`)."""

ROW_GROUP_BYTES = 128 << 20
"""Most decoded bytes in an output row group (estimated from the input footers), unless one
input row group alone is larger. The copy holds one output row group and one input row group
(and the light columns); an input whose every ``ROW_GROUP``-row stretch fits in this is cut
every ``ROW_GROUP`` rows, as writing it whole would cut it."""


def run_advantages(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    config: AdvantageConfig,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
    mapper: Mapper | None = None,
) -> dict:
    """Compute group advantages and write the input rows plus the advantage columns.

    `columns` maps schema names to the input's names (`--column NEW=OLD`). Memory is bounded by
    the light columns (a few numbers per sample) and one output row group, not by the input:
    the input is scanned row group by row group for the light columns, the advantages are
    computed from them, then the input is copied file by file, one row group at a time, with
    the new columns appended (`rolltool.jobs.rewrite.append_columns`: at most ``ROW_GROUP`` rows
    and about ``ROW_GROUP_BYTES`` decoded bytes per output row group).

    The scan is deferred (`rolltool.schema.scan_deferred`): it reads neither ``input_ids`` nor
    ``logprobs``, which the copy decodes anyway and checks row group by row group. Where a row
    breaks a rule, or anything stops the job before the copy, the input is scanned in full and
    its problems are raised as `scan` lists them (as they were before the scan was deferred);
    an input without problems raises the error that stopped the job. Nothing is written either
    way. `mapper` scans the row groups (``--workers``: `rolltool.engine.local.local_mapper`;
    ``--engine ray``: Ray tasks; the CLI's is `rolltool.engine.config.open_mapper`).
    """
    check_target(output, force, inputs=inputs, file=True)
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    with _problems_first(files, rename, mapper, RolltoolError):
        ro, check = scan_deferred(files, rename, ignore=ADVANTAGE_COLUMNS, mapper=mapper)
        light = AdvantageInput.from_rollouts(ro)
        adv = compute_advantages(config, light)
        new = _new_columns(adv)
        replaced = sorted(set(ADVANTAGE_COLUMNS) & set(ro.columns))
        schema = output_schema(files, rename, replaced, new, parquet_marker("advantages"))
    with _problems_first(
        files, rename, mapper, DeferredProblem
    ):  # the copy's own errors as they come
        with atomic_file(output, force=force) as tmp:
            append_columns(
                tmp, files, rename, schema, replaced, new,
                max_rows=ROW_GROUP, max_bytes=ROW_GROUP_BYTES, check=check,
            )  # fmt: skip
    warnings = list(ro.warnings)
    if replaced:
        warnings.append(f"input columns {', '.join(replaced)} were replaced by the computed ones")
    envs, overall = summarize(adv, light)
    return {
        "rolltool": __version__,
        "output": str(output),
        "inputs": [{"path": f.path, "rows": f.rows} for f in files],
        "config": config.to_dict(),
        "samples": ro.num_samples,
        "groups": ro.num_groups,
        "samples_without_trainable_tokens": int(np.sum(ro.trainable == 0)),
        "warnings": warnings,
        "envs": envs,
        "overall": overall,
    }


def _new_columns(adv: Advantages) -> dict[str, pa.Array]:
    """The columns `run_advantages` appends, one entry per input row (``ADVANTAGE_COLUMNS``)."""
    return {
        "advantage": pa.array(adv.advantage, pa.float32()),
        "group_size": pa.array(adv.group_size, pa.int64()),
        "group_reward_mean": pa.array(adv.group_reward_mean, pa.float64()),
        "group_reward_std": pa.array(adv.group_reward_std, pa.float64()),
        "group_uniform": pa.array(adv.group_uniform, pa.bool_()),
    }


@contextmanager
def _problems_first(
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    mapper: Mapper | None,
    errors: type[Exception],
) -> Iterator[None]:
    """Where `errors` stops the job, raise the input's problems instead, as the full scan
    lists them, when it has any."""
    try:
        yield
    except errors:
        scan(files, rename, ignore=ADVANTAGE_COLUMNS, mapper=mapper)
        raise
