"""One function per subcommand, wiring readers -> pure stages -> writers.

These are the Python API behind the CLI: they take config objects and paths and return a report
dict (the same document `--json` prints). They never print.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rolltool import __version__
from rolltool.advantages import AdvantageConfig, compute_advantages, summarize
from rolltool.errors import RolltoolError
from rolltool.outputs import atomic_path, check_target
from rolltool.schema import scan
from rolltool.source import InputFile, file_schema, invert_mapping, iter_batches, resolve_inputs
from rolltool.synth import SynthConfig, generate

ADVANTAGE_COLUMNS = (
    "advantage",
    "group_size",
    "group_reward_mean",
    "group_reward_std",
    "group_uniform",
)


def run_synth(config: SynthConfig, output: str | os.PathLike[str], *, force: bool = False) -> dict:
    """Write `generate(config)` to `output` (Parquet, zstd) and describe what was written."""
    check_target(Path(output), force)
    table = generate(config)
    with atomic_path(output, force=force, directory=False) as tmp:
        pq.write_table(table, tmp, compression="zstd", row_group_size=4096)
    envs = table.column("env").value_counts().to_pylist()
    return {
        "output": str(output),
        "config": {
            "groups": config.groups,
            "seed": config.seed,
            "envs": list(config.envs),
            "max_len": config.max_len,
        },
        "rows": table.num_rows,
        "samples_per_env": {e["values"]: e["counts"] for e in envs},
        "bytes": os.path.getsize(output),
    }


def _read_file(file: InputFile, rename: Mapping[str, str]) -> pa.Table:
    batches = list(iter_batches(file, rename, batch_rows=1 << 20))
    if not batches:
        return file_schema(file, rename).empty_table()
    return pa.Table.from_batches(batches)


def run_advantages(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    config: AdvantageConfig,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
) -> dict:
    """Compute group advantages and write the input rows plus the advantage columns.

    `columns` maps schema names to the input's names (`--column NEW=OLD`).
    """
    check_target(Path(output), force)
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    tables = [_read_file(f, rename) for f in files]
    rollouts = scan(files, rename, tables=tables)
    adv = compute_advantages(
        config,
        group=rollouts.group,
        rollout=rollouts.rollout,
        env=rollouts.env,
        env_names=rollouts.env_names,
        reward=rollouts.reward,
        trainable=rollouts.trainable,
    )
    new = {
        "advantage": pa.array(adv.advantage, pa.float32()),
        "group_size": pa.array(adv.group_size, pa.int64()),
        "group_reward_mean": pa.array(adv.group_reward_mean, pa.float64()),
        "group_reward_std": pa.array(adv.group_reward_std, pa.float64()),
        "group_uniform": pa.array(adv.group_uniform, pa.bool_()),
    }
    replaced = sorted(set(ADVANTAGE_COLUMNS) & set(rollouts.columns))
    warnings = list(rollouts.warnings)
    if replaced:
        warnings.append(f"input columns {', '.join(replaced)} were replaced by the computed ones")
    try:
        schema = pa.unify_schemas(
            [t.drop_columns([c for c in replaced if c in t.column_names]).schema for t in tables],
            promote_options="permissive",
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise RolltoolError(f"the input files have incompatible column types ({e})") from None
    for name, arr in new.items():
        schema = schema.append(pa.field(name, arr.type))
    with atomic_path(output, force=force, directory=False) as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            start = 0
            for file, table in zip(files, tables, strict=True):
                n = table.num_rows
                table = table.drop_columns([c for c in replaced if c in table.column_names])
                for name, arr in new.items():
                    table = table.append_column(name, arr.slice(start, n))
                for field in schema:
                    if field.name not in table.column_names:
                        table = table.append_column(field.name, pa.nulls(n, field.type))
                try:
                    table = table.select(schema.names).cast(schema)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    raise RolltoolError(
                        f"{file.path}: columns do not match the other input files ({e})"
                    ) from None
                writer.write_table(table, row_group_size=65_536)
                start += n
    envs, overall = summarize(
        adv,
        group=rollouts.group,
        rollout=rollouts.rollout,
        env=rollouts.env,
        env_names=rollouts.env_names,
        reward=rollouts.reward,
    )
    return {
        "rolltool": __version__,
        "output": str(output),
        "inputs": [{"path": f.path, "rows": f.rows} for f in files],
        "config": config.to_dict(),
        "samples": rollouts.num_samples,
        "groups": rollouts.num_groups,
        "samples_without_trainable_tokens": int(np.sum(rollouts.trainable == 0)),
        "warnings": warnings,
        "envs": envs,
        "overall": overall,
    }
