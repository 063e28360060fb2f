"""The pack job: rollouts -> advantages -> steps -> partition -> packed rows -> shards.

Plans from the light columns only (ids, env, reward, lengths, finish times), then reads token
columns one step at a time, so memory stays bounded by a step. Output goes to a temporary
directory renamed into place; ``manifest.json`` is written last.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rolltool import __version__
from rolltool.advantages import ESTIMATORS
from rolltool.config import OVERLONG, PackConfig
from rolltool.errors import RolltoolError
from rolltool.format import STATUSES
from rolltool.jsonable import jsonable
from rolltool.layout import TOKEN_FIELDS, pack_rows
from rolltool.loss import LOSS_AGGS
from rolltool.outputs import atomic_path, check_target
from rolltool.schedule import Schedule, StepWork, schedule
from rolltool.schema import MAX_LISTED, Rollouts, scan
from rolltool.shards import FORMAT, FORMAT_VERSION, file_record, write_shards
from rolltool.source import invert_mapping, iter_batches, resolve_inputs
from rolltool.tokens import TokenReader

USAGE = (
    "loss = sum over this rank's rows of sum_t loss_weight[t] * token_loss[t]; the weights already "
    "divide by the step's denominators (over all ranks), so sum gradients over ranks. If your "
    "framework averages gradients over the dp ranks (DDP/FSDP do), multiply the loss by dp."
)


def _input_advantages(ro: Rollouts, rename: Mapping[str, str]) -> np.ndarray | None:
    """The input's own 'advantage' column (float32 per sample), or None if it has none."""
    if "advantage" not in ro.columns:
        return None
    parts = []
    for f in ro.files:
        got = 0
        for batch in iter_batches(f, rename, ["advantage"]):
            col = batch.column("advantage") if "advantage" in batch.schema.names else None
            if col is None or (
                not pa.types.is_floating(col.type) and not pa.types.is_integer(col.type)
            ):
                raise RolltoolError(
                    f"{f.path}: column 'advantage' must be a float column present in every file"
                )
            parts.append(
                np.asarray(
                    pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64
                )
            )
            got += batch.num_rows
        if got != f.rows:
            raise RolltoolError(
                f"{f.path}: column 'advantage' is missing", hint="give it in every file or in none"
            )
    adv = np.concatenate(parts) if parts else np.zeros(0)
    problems = [
        f"{ro.label(int(i))}: column 'advantage' is not finite ({adv[i]})"
        for i in np.flatnonzero(~np.isfinite(adv))
    ]
    # Every branch of a rollout carries the rollout's advantage, as its reward (schema.scan).
    first = np.full(int(ro.rollout.max()) + 1 if len(ro.rollout) else 0, -1, dtype=np.int64)
    first[ro.rollout[::-1]] = np.arange(len(ro.rollout))[::-1]  # first branch of each rollout
    ref = adv[first[ro.rollout]]
    differs = (adv != ref) & np.isfinite(adv) & np.isfinite(ref)
    _, at = np.unique(ro.rollout[differs], return_index=True)  # first differing branch each
    problems += [
        f"{ro.label(int(i))}: column 'advantage': branches of one rollout have different "
        f"advantages ({ref[i]} in {ro.label(int(first[ro.rollout[i]]))}, {adv[i]} here)"
        for i in np.sort(np.flatnonzero(differs)[at])
    ]
    if problems:
        listed = [f"  {p}" for p in problems[:MAX_LISTED]]
        if len(problems) > MAX_LISTED:
            listed.append(f"  ... and {len(problems) - MAX_LISTED} more")
        raise RolltoolError(
            f"the input's 'advantage' column has {len(problems)} problem(s); nothing was "
            "written:\n" + "\n".join(listed),
            hint="fix the column, or drop it to let --estimator compute advantages",
        )
    return adv.astype(np.float32)


def run_pack(
    inputs: Sequence[str],
    output: str | Path,
    config: PackConfig,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
    command: Sequence[str] | None = None,
    progress: Any = None,
    estimator_chosen: bool = False,
) -> dict[str, Any]:
    """Pack rollout Parquet `inputs` into `output` (a directory); returns the report.

    `progress(iterable, total, description)` may wrap the step loop (the CLI passes a progress
    bar on stderr). `estimator_chosen`: the caller chose the estimator (the CLI: --estimator or
    --env-estimator given); an input with its own 'advantage' column then gets a warning that
    the estimator is not used.
    """
    check_target(Path(output), force)
    workload = config.workload()
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    reader = TokenReader(files, rename, cache_bytes=int(config.cache_mb * 1e6))
    ro = scan(files, rename, on_row_group=reader.offer)
    n = ro.num_samples
    warnings = list(ro.warnings)
    given = _input_advantages(ro, rename)
    if given is not None and estimator_chosen:
        warnings.append(
            "the input has an 'advantage' column, used as is: --estimator/--env-estimator "
            "are ignored (drop the column to compute advantages)"
        )
    plan = schedule(ro, config, workload, given)
    warnings.extend(plan.warnings)
    works, status = plan.works, plan.status
    max_bytes = int(config.shard_mb * 1e6)
    steps_meta: list[dict[str, Any]] = []
    file_records: dict[str, dict] = {}
    wrap = progress or (lambda it, total, desc: it)

    # Pass 2 (I/O): fetch a step's tokens, pack its rows, write its shards. The next step's
    # tokens are read, and the previous rows written and hashed, on worker threads meanwhile.
    with atomic_path(output, force=force, directory=True) as root:
        root.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=3) as pool:
            fetch = pool.submit(reader.fetch, works[0].members[works[0].order])
            writes: list[tuple[StepWork, list[Future[list[dict]]]]] = []
            for i, work in enumerate(wrap(works, len(works), "packing steps")):
                tokens = fetch.result()
                if i + 1 < len(works):
                    nxt = works[i + 1]
                    fetch = pool.submit(reader.fetch, nxt.members[nxt.order])
                futures = []
                ranks = []
                # Tokens come in row order (rank by rank, micro-batch by micro-batch), so each
                # row is one run of consecutive positions in `tokens`.
                order = work.order
                start = 0
                for r, mbs in enumerate(work.plan.micro_batches):
                    spans = []
                    for m in mbs:
                        spans.append(np.arange(start, start + len(m)))
                        start += len(m)
                    rows = pack_rows(
                        tokens,
                        spans,
                        sample_index=work.members[order],
                        advantage=work.advantage[order],
                        weight=work.weights[order],
                        row_len=config.row_len,
                        pad_id=config.pad_id,
                    )
                    ranks.append(
                        {
                            "micro_batches": len(mbs),
                            "samples": int(sum(len(m) for m in mbs)),
                            "tokens": int(rows.row_offsets[-1]),
                            "real_tokens": int(
                                sum(int(ro.length[work.members[m]].sum()) for m in mbs)
                            ),
                        }
                    )
                    futures.append(pool.submit(write_shards, root, work.index, r, rows, max_bytes))
                work.meta["ranks"] = ranks
                # Keep at most one step of rows in flight: memory stays bounded by a step.
                for done, fs in writes:
                    _collect(done, fs, file_records)
                writes = [(work, futures)]
                steps_meta.append(work.meta)
            for done, fs in writes:
                _collect(done, fs, file_records)

        samples = _samples_table(ro, plan)
        pq.write_table(samples, root / "samples.parquet", compression="zstd")
        (root / "samples.parquet").chmod(0o644)
        file_records["samples.parquet"] = file_record(root / "samples.parquet")
        counts = {s: int((status == s).sum()) for s in STATUSES}
        if counts["leftover"]:
            warnings.append(
                f"{counts['leftover']} sample(s) left over: not enough to fill another step"
            )
        if counts["env_unweighted"]:
            warnings.append(
                f"{counts['env_unweighted']} sample(s) of envs without --env-weight were not used"
            )
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rolltool_version": __version__,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": list(command) if command is not None else list(sys.argv),
            "config": config.to_dict(),
            "workload": workload.to_dict(),
            "advantages": {
                "source": plan.advantage_source,
                "whitening": "per step" if plan.per_step_whitening else None,
                "estimators": {
                    e: config.advantages.env_estimators.get(e, config.advantages.estimator)
                    for e in ro.env_names
                },
            },
            "loss": {
                "agg": config.loss_agg,
                "scale_factor": config.loss_scale_factor,
                "usage": USAGE,
            },
            "inputs": [{"path": f.path, "rows": f.rows} for f in files],
            "columns": dict(columns or {}),
            "dp": config.dp,
            "num_steps": len(steps_meta),
            "token_fields": {k: np.dtype(v).name for k, v in TOKEN_FIELDS.items()},
            "samples": {"total": n, **counts},
            "leftover_groups": len(plan.assembly.leftover),
            "partial_step_dropped": None
            if plan.assembly.partial_dropped is None
            else {
                "groups": len(plan.assembly.partial_dropped.groups),
                "actual": plan.assembly.partial_dropped.actual,
            },
            "warnings": warnings,
            "steps": steps_meta,
            "files": file_records,
        }
        (root / "manifest.json").write_text(json.dumps(jsonable(manifest), separators=(",", ":")))
        (root / "manifest.json").chmod(0o644)
    return manifest


def _collect(
    work: StepWork, futures: list[Future[list[dict]]], file_records: dict[str, dict]
) -> None:
    """Wait for a step's shard writes; record files in the manifest and in the step's ranks."""
    for rank, fut in zip(work.meta["ranks"], futures, strict=True):
        recs = fut.result()
        rank["files"] = [
            {"path": x["path"], "first_row": x["first_row"], "rows": x["rows"]} for x in recs
        ]
        for x in recs:
            file_records[x["path"]] = {"bytes": x["bytes"], "sha256": x["sha256"]}


def _samples_table(ro: Rollouts, plan: Schedule) -> pa.Table:
    """One row per input sample: where it went, or why it was not trained."""
    n = ro.num_samples
    return pa.table(
        {
            "sample_index": pa.array(np.arange(n, dtype=np.int64)),
            "sample_id": ro.sample_id,
            "group_id": ro.group_ids.take(pa.array(ro.group)),
            "rollout_id": ro.rollout_ids.take(pa.array(ro.rollout)),
            "env": pa.array([ro.env_names[e] for e in ro.env], pa.string()),
            "length": pa.array(ro.length),
            "trainable_tokens": pa.array(ro.trainable),
            "advantage": pa.array(plan.advantage.astype(np.float32)),
            "token_loss_weight": pa.array(plan.weight.astype(np.float32)),
            "step": pa.array(plan.step),
            "rank": pa.array(plan.rank),
            "micro_batch": pa.array(plan.micro_batch),
            "status": pa.array(plan.status.tolist(), pa.string()),
        }
    )


__all__ = ["ESTIMATORS", "LOSS_AGGS", "OVERLONG", "STATUSES", "PackConfig", "run_pack"]
