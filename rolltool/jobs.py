"""One function per subcommand, wiring readers -> pure stages -> writers.

These are the Python API behind the CLI: they take config objects and paths and return a report
dict (the same document `--json` prints). They never print.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rolltool import __version__
from rolltool.advantages import AdvantageConfig, AdvantageInput, compute_advantages, summarize
from rolltool.outputs import atomic_path, check_target, parquet_marker
from rolltool.rewrite import append_columns, output_schema
from rolltool.schema import scan
from rolltool.source import invert_mapping, resolve_inputs
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
    check_target(output, force)
    table = generate(config)
    with atomic_path(output, force=force, directory=False) as tmp:
        marked = table.replace_schema_metadata(parquet_marker("synth"))
        pq.write_table(marked, tmp, compression="zstd", row_group_size=4096)
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


ROW_GROUP = 65_536
"""Most rows in an output row group (`rolltool.rewrite.row_group_plan`)."""

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
) -> dict:
    """Compute group advantages and write the input rows plus the advantage columns.

    `columns` maps schema names to the input's names (`--column NEW=OLD`). Memory is bounded by
    the light columns (a few numbers per sample) and one output row group, not by the input:
    the input is scanned row group by row group for the light columns, the advantages are
    computed from them, then the input is copied file by file, one row group at a time, with
    the new columns appended (`rolltool.rewrite.append_columns`: at most ``ROW_GROUP`` rows
    and about ``ROW_GROUP_BYTES`` decoded bytes per output row group).
    """
    check_target(output, force, inputs=inputs)
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    rollouts = scan(files, rename, ignore=ADVANTAGE_COLUMNS)  # replaced: neither read nor checked
    light = AdvantageInput.from_rollouts(rollouts)
    adv = compute_advantages(config, light)
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
    schema = output_schema(files, rename, replaced, new, parquet_marker("advantages"))
    with atomic_path(output, force=force, directory=False) as tmp:
        append_columns(
            tmp, files, rename, schema, replaced, new, max_rows=ROW_GROUP, max_bytes=ROW_GROUP_BYTES
        )
    envs, overall = summarize(adv, light)
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
