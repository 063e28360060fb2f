"""Column encodings that must read like the plain ones (issue 13, "Inputs refused or broken").

``finished_at`` as ``timestamp[ns]`` with sub-microsecond values, ids and env as dictionary
(pandas categoricals) or ``string_view``: each packs to the same shards and the same
samples.parquet as the plain input, and verifies; the advantages job reads them too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts

from rolltool.schema.columns import id_type_conflicts, is_id_type, plain_type
from rolltool.verify import verify

IDS = ("group_id", "rollout_id", "sample_id", "env")
ARGS = ("--dp", 2, "--batch-size", 8, "--order", "completion", "--keep-last")


def _plain() -> pa.Table:
    groups = [
        G("math", [1.0, 0.0, 1.0], [8, 9, 10], finished=[3.0, 1.0, 2.0]),
        G("code", [0.5, 0.25], [12, 11], finished=[0.5, 4.0]),
        G("math", [0.0, 1.0, 1.0, 0.0], [9, 9, 13, 14], finished=[2.5, 0.75, 1.25, 5.0]),
    ]
    t = rollouts(groups)
    seconds = t.column("finished_at").to_numpy()
    us = pa.array((seconds * 1e6).astype("int64"), pa.timestamp("us"))
    return t.set_column(t.schema.get_field_index("finished_at"), "finished_at", us)


def _each(
    t: pa.Table, cols: tuple[str, ...], fn: Callable[[pa.ChunkedArray], pa.Array]
) -> pa.Table:
    for c in cols:
        t = t.set_column(t.schema.get_field_index(c), c, fn(t.column(c)))
    return t


def _ns(t: pa.Table) -> pa.Table:
    """The same instants plus 789 ns each: a cast to microseconds would refuse to lose them."""
    us = pc.cast(t.column("finished_at"), pa.int64()).to_numpy()
    ns = pa.array(us * 1000 + 789, pa.timestamp("ns"))
    return t.set_column(t.schema.get_field_index("finished_at"), "finished_at", ns)


VARIANTS: dict[str, Callable[[pa.Table], pa.Table]] = {
    "timestamp_ns": _ns,
    "dictionary": lambda t: _each(t, IDS, lambda c: pc.dictionary_encode(c)),
    "string_view": lambda t: _each(t, IDS, lambda c: c.cast(pa.string_view())),
}


def _hashes(out: Path) -> dict[str, str]:
    files = json.loads((out / "manifest.json").read_text())["files"]
    return {k: v["sha256"] for k, v in files.items() if k != "samples.parquet"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_encoding_packs_like_the_plain_input(tmp_path: Path, variant: str) -> None:
    plain = _plain()
    table = VARIANTS[variant](plain)
    assert table.schema != plain.schema  # the variant really is another encoding
    pq.write_table(plain, tmp_path / "plain.parquet")
    pq.write_table(table, tmp_path / "in.parquet")
    assert pq.read_schema(tmp_path / "in.parquet") != pq.read_schema(tmp_path / "plain.parquet")
    pack(tmp_path / "plain.parquet", tmp_path / "a", *ARGS)
    pack(tmp_path / "in.parquet", tmp_path / "b", *ARGS)
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
    assert pq.read_table(tmp_path / "a" / "samples.parquet").equals(
        pq.read_table(tmp_path / "b" / "samples.parquet")
    )
    assert verify(tmp_path / "b")["ok"]
    result = cli("advantages", tmp_path / "in.parquet", "-o", tmp_path / "adv.parquet")
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "adv.parquet").num_rows == plain.num_rows


def test_plain_types() -> None:
    dict_str = pa.dictionary(pa.int32(), pa.string())
    assert plain_type(dict_str) == pa.string() and is_id_type(dict_str)
    assert plain_type(pa.string_view()) == pa.string() and is_id_type(pa.string_view())
    assert plain_type(pa.dictionary(pa.int8(), pa.int64())) == pa.int64()
    assert not is_id_type(pa.dictionary(pa.int8(), pa.float64()))
    a = pa.schema([("group_id", dict_str)])
    b = pa.schema([("group_id", pa.string_view())])
    c = pa.schema([("group_id", pa.int64())])
    assert id_type_conflicts([("a", a), ("b", b)]) == []
    assert id_type_conflicts([("a", a), ("c", c)]) == [
        "column 'group_id' is integer in c but string in a"
    ]
