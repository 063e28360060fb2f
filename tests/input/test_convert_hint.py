"""JSON Lines, JSON, Arrow files and Hugging Face ``datasets`` directories as input (issue 13).

rolltool reads Parquet only; for these it says so and gives the exact command that converts
them. The test runs that command, as printed, and packs what it wrote: the hint is not advice
that might not work, it is checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts


def _table() -> pa.Table:
    return rollouts([G("math", [1.0, 0.0], [8, 9]), G("code", [0.5, 0.25], [10, 11])])


def _write_jsonl(table: pa.Table, path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))


def _write_json(table: pa.Table, path: Path) -> None:
    path.write_text(json.dumps(table.to_pylist()))


def _write_stream(table: pa.Table, path: Path) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _write_hf(table: pa.Table, path: Path) -> None:
    """What datasets' save_to_disk writes: IPC stream shards and two JSON files."""
    path.mkdir()
    _write_stream(table.slice(0, 2), path / "data-00000-of-00002.arrow")
    _write_stream(table.slice(2), path / "data-00001-of-00002.arrow")
    (path / "state.json").write_text("{}")
    (path / "dataset_info.json").write_text("{}")


CASES = {
    "rollouts.jsonl": _write_jsonl,
    "rollouts.json": _write_json,
    "rollouts.arrow": _write_stream,
    "hf_dataset": _write_hf,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_hint_converts_the_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    CASES[name](_table(), tmp_path / name)
    result = cli("pack", name, "-o", "out", "--dp", 1, "--batch-size", 4)
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr
    assert "not a readable Parquet file" not in result.stderr
    command = re.search(r'python -c "([^"]+)"', result.stderr)
    assert command, result.stderr
    run = subprocess.run([sys.executable, "-c", command.group(1)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    given = name if name == "hf_dataset" else name.split(".")[0] + ".parquet"
    pack(Path(given), tmp_path / "out", "--dp", 1, "--batch-size", 4)
    packed = pq.read_table(tmp_path / "out" / "samples.parquet")
    assert packed.num_rows == 4 and set(packed.column("status").to_pylist()) == {"trained"}


def test_a_corrupt_parquet_file_keeps_the_plain_message(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    result = cli("pack", tmp_path / "bad.parquet", "-o", tmp_path / "out", "--dp", 1)
    assert result.exit_code == 1
    assert "not a readable Parquet file" in result.stderr and "convert" not in result.stderr
