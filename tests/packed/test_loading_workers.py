"""DataLoader workers hand their items to the main process by reference (issue 25).

A worker's item of a local shard pickles as where its row lies (`torch_data.WorkerItem`); the
main process maps the shard itself and makes the row again (`torch_data._rebuild`). The user
gets exactly the tensors of a 0-worker loader: same keys in the same order, dtypes, shapes and
values, rows in the same order, for every layout (plain, --sp, --cp, --hybrid-cp,
--share-prefix) and GPU view. A shard replaced between the worker's checks and the main
process's map is refused; an item changed in the worker, or one of a remote shard, crosses as
before (its tensors through shared memory).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fs_helpers import Folder, register
from pack_helpers import G, pack, rollouts
from shared_helpers import shared_rollouts

import rolltool
from rolltool.errors import RolltoolError

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

import rolltool.packed.torch_data as torch_data  # noqa: E402

LENGTHS = [[9, 23, 4, 17], [40, 6, 31, 12], [3, 58, 21, 8], [14, 27, 5, 44], [61, 19, 7, 33]]
STEPS = ("--batch-size", 8, "--keep-last")
LAYOUTS: dict[str, tuple[str, tuple[Any, ...], list[dict[str, int]]]] = {
    # name: (input, pack flags, the GPU views read)
    "plain": ("synth", ("--dp", 2, "--batch-size", 24, "--keep-last", "--micro-batch-tokens",
                        4096, "--shard-mb", 0.05), [{}]),
    "sp2": ("groups", ("--dp", 2, *STEPS, "--sp", 2, "--micro-batch-tokens", 32),
            [{"sp_rank": 0}, {"sp_rank": 1}]),
    "cp2": ("groups", ("--dp", 2, *STEPS, "--cp", 2, "--micro-batch-tokens", 36),
            [{"cp_rank": 0}, {"cp_rank": 1}, {}]),
    "hybrid": ("groups", ("--dp", 2, *STEPS, "--cp", 4, "--hybrid-cp", "--micro-batch-tokens",
                          16), [{"cp_rank": r} for r in range(4)]),
    "shared": ("shared", ("--dp", 2, "--micro-batch-tokens", 400, "--batch-size", 6,
                          "--share-prefix", "--share-min", 4), [{}]),
}  # fmt: skip


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory, synth_table: pa.Table) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("workers")
    rng = np.random.default_rng(3)
    groups = [G("math", rng.random(4).round(2).tolist(), lens) for lens in LENGTHS]
    inputs = {"synth": synth_table, "groups": rollouts(groups, seed=5)}
    inputs["shared"] = shared_rollouts(groups=3, rollouts=2, branches=2, identical=1,
                                       prompt=(10, 20), response=(3, 12), trajectory=(6, 10),
                                       vocab=40, seed=4)  # fmt: skip
    for name, table in inputs.items():
        pq.write_table(table, tmp / f"{name}.parquet")
    out = {}
    for name, (source, flags, _) in LAYOUTS.items():
        pack(tmp / f"{source}.parquet", tmp / name, *flags)
        out[name] = tmp / name
    return out


@pytest.fixture
def rebuilt(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the rows the main process made for items that came by reference."""
    calls: list[int] = []
    real = torch_data.rebuild_row

    def spy(source: Any) -> Any:
        calls.append(1)
        return real(source)

    monkeypatch.setattr(torch_data, "rebuild_row", spy)
    return calls


def _load(data: Any, workers: int) -> list[dict[str, Any]]:
    return list(DataLoader(data, batch_size=None, num_workers=workers))


def _assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The same items: keys in order, ints, and tensors of the same dtype, shape and values."""
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert type(a) is torch_data.MicroBatch and type(b) is torch_data.MicroBatch
        assert list(a) == list(b)
        for key, x in b.items():
            y = a[key]
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor), key
                assert (y.dtype, y.shape) == (x.dtype, x.shape), key
                assert torch.equal(y, x), key
            else:
                assert type(y) is type(x) and y == x, key


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_workers_give_the_tensors_of_none(
    packs: dict[str, Path], layout: str, rebuilt: list[int]
) -> None:
    ds = rolltool.open_packed(packs[layout])
    ranks = range(ds.dp) if layout == "plain" else [0]
    served = 0
    for rank in ranks:
        for view in LAYOUTS[layout][2]:
            want = _load(ds.torch_dataset(rank, **view), 0)
            got = _load(ds.torch_dataset(rank, **view), 2)
            _assert_same(got, want)
            assert not any(t.is_shared() for x in got for t in x.values() if torch.is_tensor(t))
            served += len(got)
    assert len(rebuilt) == served > 0  # every item came by reference, none through shared memory


@pytest.mark.parametrize("through", ["views", "tensors_in"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rows_made_for_tensors_are_writable_throughout(
    packs: dict[str, Path], layout: str, through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``to_tensors(row, writable=True)`` relies on when it wraps a row without looking:
    every array of every row (each GPU view) made for tensors from a local shard is writable,
    in the process that checked it and as the main process rebuilds it; torch never warns.
    ``tensors_in``: every shard read by `tensors_in` (as `_views` leaves a header it does not
    take as it is), whose views `_views` makes writable too."""
    import rolltool.packed.core as core
    from rolltool.packed.core import rebuild_row

    if through == "tensors_in":
        monkeypatch.setattr(core, "_VIEW_DTYPES", {})
        core.release_rebuilt_maps()

    ds = rolltool.open_packed(packs[layout])
    rows = 0
    for view in LAYOUTS[layout][2]:
        refs = ds.rank_rows(0)
        for row, source in ds.sourced_rows(refs, for_tensors=True, **view):
            assert source is not None
            again = rebuild_row(source)
            assert list(again) == list(row)
            for made in (row, again):
                assert [k for k, a in made.items() if not a.flags.writeable] == []
            rows += 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when it wraps a read-only array
            assert len(list(ds.torch_dataset(0, **view))) == len(refs)
    assert rows > 0


class _ReplaceShard(IterableDataset[Any]):
    """Runs in the worker: after the first item is made (its shard checked), replaces that
    shard by a copy of itself (the same bytes, another inode), then hands the item over."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        for item in self.data:
            shard = Path(item.source.path)
            shutil.copyfile(shard, shard.with_suffix(".tmp"))
            os.replace(shard.with_suffix(".tmp"), shard)
            yield item
            return


def test_a_shard_replaced_after_the_worker_read_it_is_refused(
    packs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "p"
    shutil.copytree(packs["plain"], out)
    loader = DataLoader(
        _ReplaceShard(rolltool.open_packed(out).torch_dataset(1)), batch_size=None, num_workers=1
    )
    with pytest.raises(RolltoolError, match="changed on disk after a DataLoader worker read"):
        next(iter(loader))


def _worker_item(ds: Any, monkeypatch: pytest.MonkeyPatch, **view: int) -> Any:
    """The first item rank 0's dataset makes in a (played) DataLoader worker."""
    info = SimpleNamespace(id=0, num_workers=1)
    monkeypatch.setattr(torch_data, "get_worker_info", lambda: info)
    item = next(iter(ds.torch_dataset(0, **view)))
    monkeypatch.setattr(torch_data, "get_worker_info", lambda: None)
    assert type(item) is torch_data.WorkerItem
    return item


def test_the_main_process_checks_the_file_it_maps(
    packs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the main process maps must be the file the worker checked: a shard rewritten
    (another size and mtime) or gone is refused, naming the file and what changed; a shard it
    mapped already serves on from that map."""
    out = tmp_path / "p"
    shutil.copytree(packs["hybrid"], out)
    item = _worker_item(rolltool.open_packed(out), monkeypatch, cp_rank=1)
    sent = ForkingPickler.dumps(item)
    assert len(sent) < 2000  # where the row lies, not its tensors
    shard = Path(item.source.path)
    kept = shard.read_bytes()
    shard.write_bytes(kept + b"\0")
    failed = pickle.loads(sent)
    assert isinstance(failed, torch_data.ExceptionWrapper)  # the DataLoader re-raises it
    with pytest.raises(RolltoolError, match=re.escape(f"{shard}: the shard changed on disk")):
        failed.reraise()
    shard.unlink()
    with pytest.raises(RolltoolError, match="it is gone or unreadable"):
        pickle.loads(sent).reraise()
    shard.write_bytes(kept)
    item = _worker_item(rolltool.open_packed(out), monkeypatch, cp_rank=1)
    sent = ForkingPickler.dumps(item)
    first = pickle.loads(sent)
    _assert_same([first], [torch_data.MicroBatch(item)])
    os.replace(shard, shard.with_suffix(".gone"))  # the map made for `first` is kept
    _assert_same([pickle.loads(sent)], [first])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_write_to_a_rebuilt_item_never_reaches_a_later_rebuild(
    packs: dict[str, Path], layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process keeps the shards it rebuilt rows from (the next epoch reads them
    again): a consumer's in-place step on an item (``mul_``, ``add_``) must change that item
    only, never the same row rebuilt later, as with no workers."""
    ds = rolltool.open_packed(packs[layout])
    for view in LAYOUTS[layout][2]:
        item = _worker_item(ds, monkeypatch, **view)
        want = torch_data.MicroBatch(
            {k: v.clone() if torch.is_tensor(v) else v for k, v in item.items()}
        )
        sent = ForkingPickler.dumps(item)
        first = pickle.loads(sent)
        for value in first.values():
            if torch.is_tensor(value) and value.numel():
                value.add_(1) if value.dtype != torch.bool else value.logical_not_()
        assert not torch.equal(first["input_ids"], want["input_ids"])
        _assert_same([pickle.loads(sent)], [want])


def test_an_item_changed_in_the_worker_crosses_with_its_changes(
    packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, rebuilt: list[int]
) -> None:
    ds = rolltool.open_packed(packs["cp2"])
    changes = {
        "written": lambda x: x["loss_weight"].mul_(2),
        # writes that torch's _version does not see (review of bb03e25): the crc32 does
        "written through numpy": lambda x: x["loss_weight"].numpy().__imul__(2),
        "written through .data": lambda x: x["advantages"].data.add_(1),
        "a stored array written": lambda x: x["input_ids"].numpy().__setitem__(0, 7),
        # changes that leave every byte as it was, or a crc32 of them (the bytes compared are
        # a copy with its dtype and shape: session 13, instead of each tensor's crc32)
        "given another dtype": lambda x: setattr(
            x["loss_weight"], "data", x["loss_weight"].view(torch.int32)
        ),
        "shortened": lambda x: x["advantages"].resize_(len(x["advantages"]) - 1),
        "two values swapped": lambda x: (
            x["input_ids"]
            .numpy()[:2]
            .__setitem__(slice(None), x["input_ids"].numpy()[1::-1].copy())
        ),
        "given another storage": lambda x: x["target_ids"].set_(x["target_ids"].flip(0)),
        "the last byte written": lambda x: (
            x["target_logprobs"]
            .numpy()
            .view(np.uint8)
            .__setitem__(-1, x["target_logprobs"].numpy().view(np.uint8)[-1] ^ 1)
        ),
        # the same bytes in another shape; a value's bytes changed, not its value (0.0 -> -0.0):
        # the compare is of dtype, shape and bytes, not of values
        "given another shape": lambda x: x["input_ids"].unsqueeze_(0),
        "a zero negated": lambda x: (
            x["target_loss_weight"]
            .numpy()
            .__setitem__(np.flatnonzero(x["target_loss_weight"].numpy() == 0)[0], -0.0)
        ),
        # a dtype NumPy cannot read: before, its bytes raised in the queue's feeder thread and a
        # DataLoader hung
        "given a dtype NumPy lacks": lambda x: setattr(
            x["logprobs"], "data", x["logprobs"].data.bfloat16()
        ),
        "replaced": lambda x: x.update(input_ids=x["input_ids"] + 1),
        "added": lambda x: x.update(extra=torch.ones(3)),
    }
    for name, change in changes.items():
        item = _worker_item(ds, monkeypatch, cp_rank=0)
        assert item.unchanged(), name
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in item.items()}
        change(item)
        assert not item.unchanged(), name
        assert any(  # the change is one (the swap: the row's first two ids differ)
            not torch.is_tensor(v)
            or (v.dtype, v.shape) != (item[k].dtype, item[k].shape)
            or v.numpy().tobytes() != item[k].numpy().tobytes()
            for k, v in before.items()
        ) or name in ("replaced", "added"), name
        want = torch_data.MicroBatch({k: v.clone() if torch.is_tensor(v) else v
                                      for k, v in item.items()})  # fmt: skip
        _assert_same([pickle.loads(ForkingPickler.dumps(item))], [want])
    assert not rebuilt  # each went the plain way


def test_an_item_made_to_require_grad_in_the_worker_keeps_it(
    packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, rebuilt: list[int]
) -> None:
    """``requires_grad_()`` in the worker changes no byte: the item compared unchanged, went by
    reference and the main process rebuilt it without the flag, unlike a 0-worker item (found
    in review: a transform's ``mb["advantages"].requires_grad_()``, 0 workers True, 2 False)."""
    ds = rolltool.open_packed(packs["cp2"])
    item = _worker_item(ds, monkeypatch, cp_rank=0)
    item["advantages"].requires_grad_()
    assert not item.unchanged()
    got = pickle.loads(ForkingPickler.dumps(item))
    assert got["advantages"].requires_grad
    assert torch.equal(got["advantages"].detach(), item["advantages"].detach())
    assert not rebuilt  # it went the plain way


def test_stateful_dataloader_resumes_two_workers_with_the_same_tensors(
    packs: dict[str, Path],
) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    ds = rolltool.open_packed(packs["hybrid"])
    want = _load(ds.torch_dataset(1, cp_rank=2), 0)
    k = len(want) // 2
    loader = sdl.StatefulDataLoader(ds.torch_dataset(1, cp_rank=2), batch_size=None, num_workers=2)
    it = iter(loader)
    seen = [next(it) for _ in range(k)]
    state = loader.state_dict()
    del it, loader
    again = sdl.StatefulDataLoader(ds.torch_dataset(1, cp_rank=2), batch_size=None, num_workers=2)
    again.load_state_dict(state)
    _assert_same(seen + list(again), want)


def test_a_remote_shard_crosses_through_shared_memory(
    packs: dict[str, Path], tmp_path: Path, rebuilt: list[int]
) -> None:
    """A shard read whole from object storage (here the ``norename://`` folder) lies in no
    map: its items cross as before, their tensors in shared memory."""
    register()
    far = Folder(tmp_path / "far")
    source = packs["cp2"].parent / "groups.parquet"
    pack(source, far.uri(), *LAYOUTS["cp2"][1])  # type: ignore[arg-type]
    remote, local = rolltool.open_packed(far.uri()), rolltool.open_packed(packs["cp2"])
    got = _load(remote.torch_dataset(1, cp_rank=1), 2)
    _assert_same(got, _load(local.torch_dataset(1, cp_rank=1), 0))
    assert not rebuilt and all(x["input_ids"].is_shared() for x in got)


def test_other_picklers_get_the_tensors_not_a_reference(
    packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, rebuilt: list[int], tmp_path: Path
) -> None:
    """``torch.save`` or ``copy.deepcopy`` of a worker's item keeps its data: only the
    DataLoader queue's ForkingPickler sends a reference (review of bb03e25: a saved item was a
    pointer to a shard, and loaded after the pack was gone it was an ExceptionWrapper)."""
    import copy

    shutil.copytree(packs["cp2"], tmp_path / "cp2")
    ds = rolltool.open_packed(tmp_path / "cp2")
    item = _worker_item(ds, monkeypatch, cp_rank=0)
    want = torch_data.MicroBatch({k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in item.items()})  # fmt: skip
    torch.save(item, tmp_path / "item.pt")
    _assert_same([copy.deepcopy(item)], [want])
    del ds, item
    shutil.rmtree(tmp_path / "cp2")  # the saved item needs no shard
    _assert_same([torch.load(tmp_path / "item.pt", weights_only=False)], [want])
    assert not rebuilt


def test_an_error_making_the_row_comes_back_to_be_raised(
    packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error while the main process makes a row (not only a changed shard) is handed back
    as torch's ExceptionWrapper, for the DataLoader to raise: raised inside the queue's
    unpickling it would kill a pin-memory thread."""
    ds = rolltool.open_packed(packs["cp2"])
    item = _worker_item(ds, monkeypatch, cp_rank=0)
    sent = ForkingPickler.dumps(item)

    def broken(source: Any) -> Any:
        raise MemoryError("no room for the row")

    monkeypatch.setattr(torch_data, "rebuild_row", broken)
    got = pickle.loads(sent)
    assert type(got).__name__ == "ExceptionWrapper"
    with pytest.raises(MemoryError, match="no room for the row"):
        got.reraise()


def _held_deleted(folder: Path) -> list[str]:
    """This process's maps of files under `folder` that are deleted."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return [m for m in maps if str(folder) in m and m.endswith("(deleted)")]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux /proc")
def test_maps_of_deleted_shards_are_let_go(
    packs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main process's kept maps (review of bb03e25: a trainer that deletes each pack it
    read kept up to 8 deleted shards on disk): dropped when the next shard is mapped, all at
    once by release_rebuilt_maps."""
    from rolltool.packed import core

    monkeypatch.setattr(core, "READ_WHOLE_BYTES", 0)  # mapped, not read: a map holds the file
    core.release_rebuilt_maps()
    for name in ("a", "b"):
        shutil.copytree(packs["plain"], tmp_path / name)
    items = _load(rolltool.open_packed(tmp_path / "a").torch_dataset(0), 2)
    assert items and core._REBUILT
    del items
    shutil.rmtree(tmp_path / "a")
    assert _held_deleted(tmp_path / "a")  # still mapped, the files gone
    item = _worker_item(rolltool.open_packed(tmp_path / "b"), monkeypatch)
    pickle.loads(ForkingPickler.dumps(item))  # the main process maps one shard of b
    assert not _held_deleted(tmp_path / "a")
    assert [str(tmp_path / "b") in path for path in core._REBUILT] == [True]
    core.release_rebuilt_maps()
    assert not core._REBUILT
