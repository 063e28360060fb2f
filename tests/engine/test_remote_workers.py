"""Worker processes on a remote output upload their own shards (a Ray task on another node needs
no filesystem shared with the driver), and a run that fails removes shards its workers uploaded
but never reported: the ``norename://`` filesystem of tests/fs_helpers.py (no network) and a real
S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py), through the ``far`` fixture."""

from __future__ import annotations

from pathlib import Path

import fs_helpers
import numpy as np
import pyarrow.parquet as pq
import pytest
from s3_server import S3Store

from rolltool.format.layout import PackedRows
from rolltool.input.synth import SynthConfig, generate
from rolltool.packed import writer
from rolltool.packing.step import Job
from rolltool.storage.fs import locate
from rolltool.storage.remote import RemoteRun

Far = fs_helpers.Folder | S3Store


@pytest.fixture(autouse=True)
def _norename(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fs_helpers.rfs.SCHEMES, fs_helpers.SCHEME, fs_helpers._open)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_workers_upload_their_shards_and_the_driver_stages_none(
    tmp_path: Path, run_cli, small_pools: None, monkeypatch: pytest.MonkeyPatch, far: Far
) -> None:
    """With --workers 2 on a remote output every shard is uploaded by a worker process: the
    driver's own upload (`PackedWriter._put`) sees only samples.parquet, and the bytes equal a
    local pack's."""
    data = tmp_path / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=8, max_len=2048)), data, row_group_size=16)
    put: list[str] = []
    original = writer.PackedWriter._put

    def spy(self: writer.PackedWriter, root: Path, name: str, record):  # type: ignore[no-untyped-def]
        put.append(name)
        return original(self, root, name, record)

    monkeypatch.setattr(writer.PackedWriter, "_put", spy)
    args = ("--dp", 2, "--batch-size", 16, "--keep-last", "--workers", 2)
    assert run_cli("pack", data, "-o", tmp_path / "local", *args).exit_code == 0
    put.clear()
    done = run_cli("pack", data, "-o", far.uri(), *args)
    assert done.exit_code == 0, done.output
    assert put == ["samples.parquet"]  # every shard came from a worker
    ours, theirs = _files(tmp_path / "local"), far.files()
    assert ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours)


def _rows(n: int) -> PackedRows:
    """One row of `n` tokens of one sample (what `DirectWriter.write_rank` takes)."""
    return PackedRows(
        input_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.ones(n, np.uint8),
        logprobs=np.zeros(n, np.float32),
        row_offsets=np.array([0, n], np.int64),
        seq_lens=np.array([n], np.int32),
        sample_index=np.array([0], np.int64),
        seg_advantage=np.ones(1, np.float32),
        seg_weight=np.full(1, 1.0 / n, np.float32),
        row_segments=np.array([0, 1], np.int64),
    )


def test_direct_writer_uploads_under_final_names_without_the_driver_folder(
    tmp_path: Path, far: Far
) -> None:
    """A worker given `upload` writes nothing under the driver's folder (which need not exist
    on its node) and leaves no local file; the remote file is the local writer's bytes."""
    store = far
    loc = locate(store.uri())
    far = writer.DirectWriter(tmp_path / "not-on-this-node", 1 << 20, upload=loc)
    near = writer.DirectWriter(tmp_path / "near", 1 << 20)
    (tmp_path / "near").mkdir()
    assert far.write_rank(3, 1, _rows(40)) == near.write_rank(3, 1, _rows(40))
    assert far.files == near.files and len(far.files) == 1
    assert not (tmp_path / "not-on-this-node").exists()
    assert store.files() == _files(tmp_path / "near")


def test_a_failed_run_removes_shards_its_workers_uploaded_but_never_reported(
    tmp_path: Path, far: Far
) -> None:
    loc = locate(far.uri())
    run = RemoteRun(loc, force=False)
    run.start()
    w = writer.DirectWriter(tmp_path / "unused", 1 << 20, upload=loc)
    w.write_rank(0, 0, _rows(8))  # uploaded by a "worker"; its record never reaches the driver
    reported = writer.DirectWriter(tmp_path / "unused", 1 << 20, upload=loc)
    reported.write_rank(1, 0, _rows(8))
    run.adopt(reported.files)  # a reported one, for contrast
    far.put("notes.txt", b"not rolltool's")
    assert len([n for n in loc.files() if n.endswith(".safetensors")]) == 2
    run.abort()
    assert loc.files() == ["notes.txt"]  # shards and the claim gone; a foreign file kept


def test_the_job_tells_workers_where_to_upload(tmp_path: Path) -> None:
    job = Job(
        reader=None,  # type: ignore[arg-type]
        cache_bytes=0,
        root=tmp_path,
        shard_bytes=1,
        config=None,  # type: ignore[arg-type]
        upload=locate(fs_helpers.uri(tmp_path / "far")),
    )
    assert job.writer().upload is job.upload and job.writer().root == tmp_path
