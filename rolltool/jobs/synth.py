"""The synth job: realistic synthetic rollouts (`rolltool.input.synth`) written as Parquet."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from rolltool.input.synth import SynthConfig, generate
from rolltool.storage.outputs import atomic_file, check_target, output_bytes, parquet_marker


def run_synth(config: SynthConfig, output: str | os.PathLike[str], *, force: bool = False) -> dict:
    """Write `generate(config)` to `output` (Parquet, zstd) and describe what was written."""
    check_target(output, force, file=True)
    table = generate(config)
    with atomic_file(output, force=force) as tmp:
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
            "shared_prompts": config.shared_prompts,
            "group_size": config.group_size,
            "prompt_len": config.prompt_len,
        },
        "rows": table.num_rows,
        "samples_per_env": {e["values"]: e["counts"] for e in envs},
        "bytes": output_bytes(output),
    }
