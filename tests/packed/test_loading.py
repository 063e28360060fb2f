"""Loading packed rows into a trainer: worker sharding, batching, resume, copies, prefetch.

The reference order is the obvious one: for every step, for every micro-batch, as
`ds.micro_batches(step, rank)` lists them (the manifest's counts say how many). Worker sharding
is checked through real DataLoaders for a few cases and, for every start position and worker
count, by playing the DataLoader's round robin over the workers' iterators by hand.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack

import rolltool
from rolltool.errors import RolltoolError

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

import rolltool.packed.torch_data as torch_data  # noqa: E402

STORED = ("input_ids", "loss_mask", "logprobs", "sample_index")  # views of the shard file


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> Path:
    """3 ranks, several steps, uneven micro-batch counts per step, shards split by rows."""
    tmp = tmp_path_factory.mktemp("loading")
    pq.write_table(synth_table, tmp / "in.parquet")
    pack(tmp / "in.parquet", tmp / "out", "--dp", 3, "--batch-size", 24, "--keep-last",
         "--micro-batch-tokens", 4096, "--shard-mb", 0.05)  # fmt: skip
    return tmp / "out"


def _stream(ds: Any, rank: int) -> list[tuple[int, int]]:
    """(step, micro_batch) of every row of the rank, from the manifest's counts."""
    return [
        (s, j)
        for s in range(ds.num_steps)
        for j in range(ds.manifest.steps[s].ranks[rank].micro_batches)
    ]


def _keys(items: Any) -> list[tuple[int, int]]:
    return [(int(x["step"]), int(x["micro_batch"])) for x in items]


def test_fixture_has_what_the_tests_need(out: Path) -> None:
    ds = rolltool.open_packed(out)
    counts = {len(ds.micro_batches(s, 1)) for s in range(ds.num_steps)}
    assert ds.num_steps >= 3 and len(counts) >= 2  # steps of different micro-batch counts
    parts = {ref.file.path for ref in ds.rank_rows(1)}
    assert len(parts) > ds.num_steps  # some (step, rank) split over several shard files


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_dataloader_workers_give_the_single_process_rows(out: Path, workers: int) -> None:
    ds = rolltool.open_packed(out)
    rank = 1
    loader = DataLoader(ds.torch_dataset(rank), batch_size=None, num_workers=workers)
    items = list(loader)
    assert _keys(items) == _stream(ds, rank)  # every row once, in order (not W times)
    assert len(loader.dataset) == len(items)
    expected = [row for s in range(ds.num_steps) for row in ds.micro_batches(s, rank)]
    for item, row in zip(items, expected, strict=True):
        assert isinstance(item, torch_data.MicroBatch)
        assert set(item) == {*row, "step", "micro_batch"}
        for key, a in row.items():
            t = item[key]
            assert isinstance(t, torch.Tensor) and t.numpy().dtype == a.dtype
            assert np.array_equal(t.numpy(), a)


class _FakeWorkers:
    """Plays W DataLoader workers: one dataset copy per worker (as a worker process gets) with
    get_worker_info answering for it, merged in the loader's round robin."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, num_workers: int) -> None:
        self.monkeypatch, self.w = monkeypatch, num_workers

    def iterators(self, datasets: list[Any]) -> list[Any]:
        its = []
        for wid, d in enumerate(datasets):
            info = SimpleNamespace(id=wid, num_workers=self.w)
            self.monkeypatch.setattr(torch_data, "get_worker_info", lambda info=info: info)
            its.append(iter(d))  # __iter__ reads the worker info
        self.monkeypatch.setattr(torch_data, "get_worker_info", lambda: None)
        return its

    @staticmethod
    def round_robin(its: list[Any], first: int = 0, limit: int | None = None) -> list[Any]:
        """Items in the loader's order, starting at worker `first`; stop after `limit`."""
        out, active, w = [], [True] * len(its), first
        while any(active) and (limit is None or len(out) < limit):
            if active[w]:
                try:
                    out.append(next(its[w]))
                except StopIteration:
                    active[w] = False
            w = (w + 1) % len(its)
        return out


def test_every_start_position_with_any_worker_count(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = rolltool.open_packed(out)
    rank = 2
    stream = _stream(ds, rank)
    starts = [*stream, (ds.num_steps, 0)]
    starts += [(s, ds.manifest.steps[s].ranks[rank].micro_batches) for s in range(ds.num_steps)]
    checked = 0
    for workers in (1, 2, 3, 5):
        fake = _FakeWorkers(monkeypatch, workers)
        for step, mb in starts:
            data = ds.torch_dataset(rank, start_step=step, start_micro_batch=mb)
            its = fake.iterators([copy.copy(data) for _ in range(workers)])
            first = ds.stream_position(rank, step, mb)
            assert _keys(fake.round_robin(its)) == stream[first:]
            checked += 1
    assert checked == 4 * len(starts) > 40


def test_start_and_state_errors(out: Path) -> None:
    ds = rolltool.open_packed(out)
    n = ds.manifest.steps[0].ranks[0].micro_batches
    with pytest.raises(RolltoolError, match="out of range"):
        ds.torch_dataset(0, start_step=ds.num_steps + 1)
    with pytest.raises(RolltoolError, match="micro-batch"):
        ds.torch_dataset(0, start_step=0, start_micro_batch=n + 1)
    with pytest.raises(RolltoolError, match="rank 0's, this dataset is rank 1's"):
        ds.torch_dataset(1).load_state_dict(ds.torch_dataset(0).state_dict())
    state = ds.torch_dataset(0).state_dict() | {"num_workers": 2}
    data = ds.torch_dataset(0)
    data.load_state_dict(state)
    with pytest.raises(RolltoolError, match="same num_workers"):
        iter(data)


def _checkpoint_after(ds: Any, k: int) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """The keys of rank 0's first k items and the state saved after them, as a checkpoint
    holds it (plain JSON)."""
    data = ds.torch_dataset(0)
    it = iter(data)
    seen = _keys(next(it) for _ in range(k))
    return seen, json.loads(json.dumps(data.state_dict()))


def test_resume_from_state_dict_single_process(out: Path) -> None:
    ds = rolltool.open_packed(out)
    stream = _stream(ds, 0)
    for k in range(len(stream) + 1):
        seen, state = _checkpoint_after(ds, k)
        fresh = ds.torch_dataset(0)
        fresh.load_state_dict(state)
        assert seen + _keys(fresh) == stream
        assert _keys(fresh) == stream  # the loaded state applies to one pass only


def test_state_dict_right_after_load_state_dict_is_the_state_loaded(out: Path) -> None:
    """A checkpoint saved after restoring and before the next pass starts (a trainer that
    saves on resume, or is stopped again before its first step) resumes where the loaded
    state does: state_dict() between load_state_dict() and iter() named the dataset's start
    (found in review: rows 0..k-1 served again after such a second resume)."""
    ds = rolltool.open_packed(out)
    stream = _stream(ds, 0)
    for k in range(len(stream) + 1):
        seen, state = _checkpoint_after(ds, k)
        restored = ds.torch_dataset(0)
        restored.load_state_dict(state)
        saved_again = json.loads(json.dumps(restored.state_dict()))  # before any iter()
        fresh = ds.torch_dataset(0)
        fresh.load_state_dict(saved_again)
        assert seen + _keys(fresh) == stream
        assert seen + _keys(restored) == stream  # the restored one itself resumes there too


def test_resume_from_worker_states(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What StatefulDataLoader does: each worker's state_dict() after its last delivered item,
    loaded into that worker's copy of a fresh dataset; the round robin goes on at the next
    worker."""
    ds = rolltool.open_packed(out)
    stream = _stream(ds, 1)
    workers = 3
    fake = _FakeWorkers(monkeypatch, workers)
    for k in range(0, len(stream) + 1, 2):
        copies = [copy.copy(ds.torch_dataset(1, start_step=1)) for _ in range(workers)]
        seen = _keys(fake.round_robin(fake.iterators(copies), limit=k))
        states = [c.state_dict() for c in copies]
        resumed = [copy.copy(ds.torch_dataset(1, start_step=1)) for _ in range(workers)]
        for c, state in zip(resumed, states, strict=True):
            c.load_state_dict(state)
        rest = _keys(fake.round_robin(fake.iterators(resumed), first=k % workers))
        assert seen + rest == stream[ds.stream_position(1, 1) :]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader(out: Path, workers: int) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = rolltool.open_packed(out)
    stream = _stream(ds, 0)
    for k in (1, len(stream) // 2, len(stream)):
        loader = sdl.StatefulDataLoader(ds.torch_dataset(0), batch_size=None, num_workers=workers)
        it = iter(loader)
        seen = _keys(next(it) for _ in range(k))
        state = loader.state_dict()
        del it, loader
        again = sdl.StatefulDataLoader(ds.torch_dataset(0), batch_size=None, num_workers=workers)
        again.load_state_dict(state)
        assert seen + _keys(again) == stream


@pytest.mark.parametrize("collate", ["default", "as_is"])
@pytest.mark.parametrize("batch_size", [1, 2])  # 1: DataLoader's default
def test_a_batch_size_is_refused_with_a_sentence(out: Path, batch_size: int, collate: str) -> None:
    # (in a worker the same collate raises; torch re-raises it naming the worker, but a loader
    # whose worker failed takes ~5 s to shut down, too slow for this suite)
    ds = rolltool.open_packed(out)
    kw = {"collate_fn": torch_data.as_is} if collate == "as_is" else {}
    with pytest.raises(ValueError, match=r"use DataLoader\(\.\.\., batch_size=None\)"):
        next(iter(DataLoader(ds.torch_dataset(0), batch_size=batch_size, **kw)))


@pytest.mark.parametrize("workers", [0, 2])
def test_as_is_hands_on_the_items_the_default_would(out: Path, workers: int) -> None:
    """``collate_fn=as_is`` (the recipe) gives the items of the default ``default_convert``:
    the same MicroBatch keys, ints and tensors, in the same order."""
    ds = rolltool.open_packed(out)
    plain = list(DataLoader(ds.torch_dataset(1), batch_size=None))
    kept = list(
        DataLoader(ds.torch_dataset(1), batch_size=None, num_workers=workers,
                   collate_fn=torch_data.as_is)
    )  # fmt: skip
    assert len(kept) == len(plain) == len(_stream(ds, 1)) > 0
    for a, b in zip(kept, plain, strict=True):
        assert type(a) is torch_data.MicroBatch and list(a) == list(b)
        assert all(
            torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k] for k, x in a.items()
        )


def test_a_rank_reads_only_its_own_files(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rolltool.packed.core as reader

    opened: list[Path] = []
    real = reader._open_local  # where the reader opens (reads or maps) a local shard

    def spy(path: str | Path) -> Any:
        opened.append(Path(path))
        return real(path)

    monkeypatch.setattr(reader, "_open_local", spy)
    ds = rolltool.open_packed(out)
    rows = sum(1 for _ in ds.torch_dataset(2))
    assert rows == len(_stream(ds, 2)) > len(set(opened))  # a shard is mapped once, not per row
    assert opened and {p.parent.name for p in opened} == {"rank-0002"}
    assert len(opened) == len({ref.file.path for ref in ds.rank_rows(2)})


def test_tensors_wrap_every_array_and_a_write_never_reaches_the_file(out: Path) -> None:
    """Plain tensors copy nothing: stored arrays are wrapped in the shard's private
    (copy-on-write) map, derived ones in their fresh memory. A write to a stored tensor changes
    neither the file nor another read of it; an array that cannot be wrapped safely (a
    read-only map, bytes) is copied."""
    ds = rolltool.open_packed(out)
    row = ds.micro_batches(1, 0)[0]
    assert not row["input_ids"].flags.writeable  # the reader's arrays map the file
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only array
        tensors = torch_data.to_tensors(row)
    kept = {k: np.array(a) for k, a in row.items()}
    for key, a in row.items():
        t = tensors[key]
        assert np.array_equal(t.numpy(), a)
        assert np.shares_memory(t.numpy(), a), key  # no copy, stored arrays included
    shard = out / ds.step_rows(1, 0)[0].file.path
    before = shard.read_bytes()
    for key in STORED:
        tensors[key].fill_(7)
    assert shard.read_bytes() == before  # the file never sees a write
    again = rolltool.open_packed(out).micro_batches(1, 0)[0]
    assert all(np.array_equal(again[k], kept[k]) for k in kept)  # nor does another read
    frozen = np.frombuffer(row["logprobs"].tobytes(), np.float32)  # read-only, over bytes
    assert not np.shares_memory(torch_data.to_tensors({"x": frozen})["x"].numpy(), frozen)
    shared = torch_data.to_tensors(again, shared=True)  # what a DataLoader worker makes
    assert all(t.is_shared() and np.array_equal(t.numpy(), again[k]) for k, t in shared.items())


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only error")
def test_pin_memory_without_an_accelerator_is_a_clear_error(out: Path) -> None:
    with pytest.raises(RolltoolError, match="needs an accelerator"):
        rolltool.open_packed(out).torch_dataset(0, pin_memory=True)


def test_prefetch_keeps_order_and_stays_one_ahead(out: Path) -> None:
    ds = rolltool.open_packed(out)
    pulled = []

    def source() -> Any:
        for item in ds.torch_dataset(0):
            pulled.append(item["micro_batch"])
            yield item

    seen = 0
    for item in torch_data.prefetch(source(), "cpu"):
        seen += 1
        assert len(pulled) == min(seen + 1, len(_stream(ds, 0)))  # exactly one in flight
        assert isinstance(item["input_ids"], torch.Tensor)
    assert seen == len(_stream(ds, 0))


def test_manifest_rows_that_do_not_add_up_are_an_error(out: Path) -> None:
    import dataclasses

    ds = rolltool.open_packed(out)
    st = ds.manifest.steps[0]
    rank = dataclasses.replace(st.ranks[0], micro_batches=st.ranks[0].micro_batches + 1)
    bad = dataclasses.replace(st, ranks=(rank, *st.ranks[1:]))
    ds.manifest = dataclasses.replace(ds.manifest, steps=(bad, *ds.manifest.steps[1:]))
    with pytest.raises(RolltoolError, match="do not hold rows"):
        ds.micro_batches(0, 0)


def test_reading_numpy_rows_does_not_import_torch_or_pandas(out: Path) -> None:
    code = (
        "import sys, rolltool; ds = rolltool.open_packed(sys.argv[1]); "
        "n = sum(1 for _ in ds.rank_iter(0, start_step=1)); "
        "print(n, 'torch' in sys.modules, 'pandas' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    n, torch_imported, pandas_imported = done.stdout.split()
    ds = rolltool.open_packed(out)
    assert int(n) == len(_stream(ds, 0)) - ds.stream_position(0, 1) > 0
    assert torch_imported == "False"
    assert pandas_imported == "False"  # pyarrow's to_numpy imports it: ~0.2 s at start
