"""samples.parquet's column types do not follow the driver's in-memory dtypes: the scan keeps
lengths and codes in int32 (`rolltool.schema.rollouts.narrow`), the file stays int64."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from pack_helpers import G, cli, rollouts


def test_samples_parquet_counts_stay_int64(tmp_path) -> None:
    groups = [G("math", [1.0, 0.0, 1.0], [30, 50, 70]) for _ in range(4)]
    pq.write_table(rollouts(groups), tmp_path / "in.parquet")
    done = cli("pack", tmp_path / "in.parquet", "-o", tmp_path / "out", "--dp", 2,
               "--batch-size", 4)  # fmt: skip
    assert done.exit_code == 0, done.stderr
    schema = pq.read_schema(tmp_path / "out" / "samples.parquet")
    for name in ("sample_index", "length", "trainable_tokens", "step", "rank", "micro_batch"):
        assert schema.field(name).type == pa.int64(), name
    table = pq.read_table(tmp_path / "out" / "samples.parquet")
    assert sorted(table.column("length").to_pylist()) == sorted([30, 50, 70] * 4)
