"""Pack's deferred scan: the token columns decoded once, where they are fetched, every row still
checked, and the same messages as a scan that reads every column first.

The scan reads the light columns and ``loss_mask`` (`rolltool.schema.scan_deferred`); the
reader that fetches a row group's token columns runs the rules the scan left on it
(`rolltool.fetch.tokens.TokenReader.check`), in the driver, its preload thread, a pool worker
or the exchange path; row groups no step trains are checked at the end. Wherever a problem is
found, the error is the full scan's listing (`rolltool.schema.scan`), exit 1, nothing written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, rollouts

import rolltool.fetch.tokens
import rolltool.schema.pieces
import rolltool.schema.rollouts
from rolltool.engine.local import LocalEngine
from rolltool.errors import RolltoolError
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import scan

BASE = ("--dp", 2, "--batch-size", 8, "--micro-batch-tokens", 256)
GROUPS = 9
"""Nine groups of four, one row group each: four steps of two groups, the last group left
over (its row group is read by no step)."""
LEFT_OVER = 8 * 4 + 1
"""A row of the left-over group."""


def _table() -> pa.Table:
    return rollouts([G("math", [0.0, 1.0, 0.5, 0.25], [20, 30, 40, 50]) for _ in range(GROUPS)])


def _write(t: pa.Table, path: Path) -> Path:
    pq.write_table(t, path, row_group_size=4)
    assert pq.ParquetFile(path).metadata.num_row_groups == GROUPS
    return path


def _bad_token(t: pa.Table, row: int) -> pa.Table:
    ids = t.column("input_ids").to_pylist()
    ids[row][-1] = -5
    col = pa.array(ids, t.schema.field("input_ids").type)
    return t.set_column(t.column_names.index("input_ids"), "input_ids", col)


def _bad_logprob(t: pa.Table, row: int) -> pa.Table:
    lp = t.column("logprobs").to_pylist()
    lp[row][3] = float("nan")
    col = pa.array(lp, t.schema.field("logprobs").type)
    return t.set_column(t.column_names.index("logprobs"), "logprobs", col)


def _bad_reward(t: pa.Table, row: int) -> pa.Table:
    reward = t.column("reward").to_pylist()
    reward[row] = float("inf")
    return t.set_column(t.column_names.index("reward"), "reward", pa.array(reward))


def _full_scan_error(path: Path) -> RolltoolError:
    with pytest.raises(RolltoolError) as info:
        scan(resolve_inputs([path]))
    return info.value


MODES = {
    "preload": ("--workers", 1),
    "fetch": ("--workers", 1, "--cache-mb", 0),
    "exchange": ("--workers", 1, "--cache-mb", 0, "--order", "shuffle", "--exchange", "always"),
    "pool": ("--workers", 2, "--cache-mb", 0),
}
"""Where a trained row group is first decoded (and checked): the driver's preload thread while
it plans (the default cache), its fetch (no cache: nothing preloaded), the exchange path's read
into buckets, a pool worker."""


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize(
    ("edit", "row"),
    [(_bad_token, 5), (_bad_token, LEFT_OVER), (_bad_logprob, 14), (_bad_logprob, LEFT_OVER)],
)
def test_a_bad_token_row_fails_with_the_full_scans_message(
    tmp_path: Path,
    small_pools: None,
    mode: str,
    edit: Callable[[pa.Table, int], pa.Table],
    row: int,
) -> None:
    """In a trained row (found where its row group is fetched: the driver's preload, a pool
    worker, the exchange's read) or in the left-over group (found by the last check)."""
    path = _write(edit(_table(), row), tmp_path / "in.parquet")
    want = _full_scan_error(path)
    assert "'input_ids'" in want.message or "'logprobs'" in want.message
    result = cli("pack", path, "-o", tmp_path / "out", *BASE, *MODES[mode])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and "Traceback" not in result.output
    assert str(want) in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_the_scan_as_tasks_gives_the_same_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 workers and at least MIN_ROW_GROUPS row groups, the row groups are checked by
    the workers (a mapper that counts its items shows it ran), and a problem the deferred scan
    sees (a reward) is listed as the full scan lists it, as with one worker."""
    assert GROUPS >= rolltool.schema.pieces.MIN_ROW_GROUPS
    path = _write(_bad_reward(_table(), 6), tmp_path / "in.parquet")
    mapped: list[int] = []
    real = LocalEngine.scan_mapper

    def counting(self: LocalEngine) -> Any:
        mapper = real(self)
        if mapper is None:
            return None

        def run(fn: Any, items: Any) -> Any:
            mapped.append(len(items))
            return mapper(fn, items)

        return run

    monkeypatch.setattr(LocalEngine, "scan_mapper", counting)
    outs = []
    for workers in (1, 2):
        result = cli("pack", path, "-o", tmp_path / "out", *BASE, "--workers", workers)
        assert result.exit_code == 1 and "Traceback" not in result.output
        outs.append(result.stderr)
    assert outs[0] == outs[1] and str(_full_scan_error(path)) in outs[0]
    assert mapped and mapped[0] == GROUPS  # the deferred scan's row groups, as tasks


def test_the_token_columns_are_decoded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process, the default cache: the scan reads no input_ids or logprobs, the reader
    reads each row group's token columns once (and checks each once), and the bytes are those
    of a run that decodes them again for every step (no cache)."""
    path = _write(_table(), tmp_path / "in.parquet")
    scanned: list[list[str]] = []
    fetched: list[int] = []
    scan_read, fetch_read = (
        rolltool.schema.rollouts.iter_row_groups,
        rolltool.fetch.tokens.read_row_group,
    )

    def scan_spy(file: Any, rename: Any, columns: list[str]) -> Any:
        scanned.append(list(columns))
        return scan_read(file, rename, columns)

    def fetch_spy(file: Any, rename: Any, columns: list[str], rg: int) -> pa.Table:
        fetched.append(rg)
        return fetch_read(file, rename, columns, rg)

    monkeypatch.setattr(rolltool.schema.rollouts, "iter_row_groups", scan_spy)
    monkeypatch.setattr(rolltool.fetch.tokens, "read_row_group", fetch_spy)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    result = cli("pack", path, "-o", tmp_path / "a", *BASE, "--workers", 1, "--json")
    assert result.exit_code == 0, result.output
    assert sorted(fetched) == list(range(GROUPS))  # every row group once, the left-over one too
    assert scanned and all("input_ids" not in c and "logprobs" not in c for c in scanned)
    fetched.clear()
    result = cli("pack", path, "-o", tmp_path / "b", *BASE, "--workers", 1, "--cache-mb", 0)
    assert result.exit_code == 0, result.output
    assert len(fetched) >= GROUPS
    for f in (tmp_path / "a").rglob("*"):
        if f.is_file() and f.name != "manifest.json":
            assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()
