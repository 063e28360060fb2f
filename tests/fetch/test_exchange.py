"""The exchange path (`rolltool.fetch.buckets`): buckets give exactly what the direct reader gives,
reading every row group once."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from rolltool.fetch.buckets import exchange
from rolltool.fetch.tokens import TokenReader
from rolltool.input.resolve import resolve_inputs

EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> TokenReader:
    """The example over two files in row groups of 37 rows."""
    t = pq.read_table(EXAMPLE)
    d = tmp_path_factory.mktemp("ex")
    half = t.num_rows // 2
    pq.write_table(t.slice(0, half), d / "a.parquet", row_group_size=37)
    pq.write_table(t.slice(half), d / "b.parquet", row_group_size=37)
    return TokenReader(resolve_inputs([str(d)]), {}, cache_bytes=0)


def same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(
        np.array_equal(getattr(a, k), getattr(b, k))
        for k in ("offsets", "input_ids", "loss_mask", "logprobs")
    )


@pytest.mark.parametrize("buffer", [0, 10_000, 10**9])
def test_buckets_equal_the_direct_reads(reader: TokenReader, tmp_path: Path, buffer: int) -> None:
    rng = np.random.default_rng(buffer % 7)
    n = reader.num_rows
    order = rng.permutation(n)
    steps = [(k, part) for k, part in enumerate(np.array_split(order[: n - 5], 9))]
    steps.append((9, order[:30]))  # a second epoch: samples already in step 0's bucket
    steps.append((10, np.zeros(0, np.int64)))  # a step with nothing
    reads = []
    real = reader.fetch

    def counting(idx):  # type: ignore[no-untyped-def]
        reads.append(np.asarray(idx).copy())
        return real(idx)

    reader.fetch = counting  # type: ignore[method-assign]
    try:
        buckets = exchange(reader, steps, tmp_path, buffer_bytes=buffer)
    finally:
        del reader.fetch
    # every read asks for samples of one row group, each row group's samples once per step
    starts = np.append(reader.block_starts, n)
    for idx in reads:
        assert len(np.unique(np.searchsorted(starts, idx, side="right"))) == 1
    back = pickle.loads(pickle.dumps(buckets))  # what a worker process gets
    for s, members in steps:
        ask = rng.permutation(members)
        assert same(back.fetch(s, ask), reader.fetch(ask))


def test_a_sample_not_in_the_bucket_is_refused(reader: TokenReader, tmp_path: Path) -> None:
    from rolltool.errors import RolltoolError

    buckets = exchange(reader, [(0, np.array([3, 5]))], tmp_path)
    with pytest.raises(RolltoolError, match="not in its bucket"):
        buckets.fetch(0, np.array([4]))


@pytest.mark.usefixtures("small_pools")
@pytest.mark.parametrize("workers", [1, 2])
def test_pack_through_the_exchange_writes_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Forced onto the exchange path (threshold 0), pack writes the same shards and
    samples.parquet as the direct path, records the path, and leaves no bucket behind."""
    from rolltool.engine.config import ExecutionConfig
    from rolltool.jobs import pack as pack_module
    from rolltool.jobs.pack import run_pack
    from rolltool.plan.config import PackConfig
    from rolltool.verify import run_verify

    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(EXAMPLE), src, row_group_size=40)
    config = PackConfig.from_options(dp=2, batch_size=16, order="shuffle", cache_mb=0,
                                     mini_batches=2, epochs=2)  # fmt: skip
    direct = run_pack([str(src)], tmp_path / "d", config, ExecutionConfig(workers=workers))
    monkeypatch.setattr(pack_module, "EXCHANGE_AT", 0.0)
    via = run_pack([str(src)], tmp_path / "x", config, ExecutionConfig(workers=workers))
    assert direct.reads is not None and via.reads is not None
    assert (direct.reads.path, via.reads.path) == ("direct", "exchange")
    assert {k: v for k, v in direct.files.items()} == {k: v for k, v in via.files.items()}
    assert not list((tmp_path / "x").rglob(".exchange*"))
    assert any("exchange path" in w for w in via.warnings)
    assert run_verify(tmp_path / "x").ok


def test_the_cli_forces_or_forbids_the_exchange(tmp_path: Path) -> None:
    import json

    from pack_helpers import cli

    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(EXAMPLE), src, row_group_size=40)
    base = ["pack", src, "--dp", 2, "--batch-size", 16, "--order", "shuffle", "--cache-mb", 0]
    got = {}
    for choice in ("always", "never"):
        r = cli(*base, "-o", tmp_path / choice, "--exchange", choice, "--json")
        assert r.exit_code == 0, r.stderr
        got[choice] = json.loads(r.stdout)
    assert got["always"]["reads"]["path"] == "exchange"
    assert got["never"]["reads"]["path"] == "direct"
    assert got["never"]["reads"]["cached_amplification"] > 1.5  # scattered, and read directly
    assert got["always"]["files"] == got["never"]["files"]
    assert cli(*base, "-o", tmp_path / "x", "--exchange", "sometimes").exit_code == 2


def test_packs_last_line_says_how_the_input_was_read(tmp_path: Path) -> None:
    from pack_helpers import cli

    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(EXAMPLE), src, row_group_size=40)
    base = ["pack", src, "--dp", 2, "--batch-size", 16, "--order", "shuffle", "--cache-mb", 0]
    r = cli(*base, "-o", tmp_path / "a", "--exchange", "always")
    assert "the input was read once into step buckets (the exchange path" in r.stderr
    r = cli(*base, "-o", tmp_path / "b", "--exchange", "never")
    assert "fetching the steps read the input" in r.stderr and "x over" in r.stderr
    r = cli("pack", src, "--dp", 2, "-o", tmp_path / "c")  # input order: read about once
    assert "read the input" not in r.stderr and "exchange" not in r.stderr


def _short(f: object, array: np.ndarray) -> int:
    return array.nbytes // 2  # what a full disk does to a write: part of it


def _enospc(f: object, array: np.ndarray) -> int:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("write", [_short, _enospc], ids=["short", "enospc"])
def test_a_full_disk_while_bucketing_says_so_with_the_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[..., int]
) -> None:
    """A bucket write that comes back short or fails with ENOSPC is the direct path's one line
    (the output named, "No space left on device") and its hint; nothing is left behind."""
    from pack_helpers import cli

    import rolltool.fetch.buckets

    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(EXAMPLE), src, row_group_size=40)
    monkeypatch.setattr(rolltool.fetch.buckets, "_write", write)
    out = tmp_path / "out"
    r = cli("pack", src, "-o", out, "--dp", 2, "--batch-size", 16, "--order", "shuffle",
            "--cache-mb", 0, "--exchange", "always")  # fmt: skip
    assert r.exit_code == 1
    assert r.stderr.splitlines()[0] == f"Error: {out}: No space left on device"
    assert "Hint: free some space, or write the output elsewhere with -o" in r.stderr
    assert "requested and" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


def test_bucket_writes_are_the_arrays_bytes(tmp_path: Path) -> None:
    """`_write` appends exactly what numpy's ``tofile`` did, for every dtype and for a
    non-contiguous array."""
    from rolltool.fetch.buckets import _write

    floats = np.linspace(0, 1, 9, dtype=np.float32)[::2]
    arrays: list[np.ndarray] = [np.arange(7, dtype=np.int32), np.ones(5, np.uint8), floats,
                                np.zeros(0, np.int32)]  # fmt: skip
    with open(tmp_path / "a", "ab") as f:
        for a in arrays:
            assert _write(f, np.ascontiguousarray(a)) == a.nbytes
    with open(tmp_path / "b", "ab") as f:
        for a in arrays:
            a.tofile(f)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
