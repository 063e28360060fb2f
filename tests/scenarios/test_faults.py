"""Fault injection, end to end through the CLI: kills at random points of pack and advantages
(nothing complete-looking is left, and a rerun is byte-identical), SIGTERM and SIGINT, runs at
the same time, an input changed during a run, a full disk and a file-size limit, and what
--force refuses. Child processes cost ~0.5 s each: the sweep samples kill points (seeded)
rather than trying them all; tests/storage/test_outputs.py tries every point of the swap itself."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fault_hooks import Injector, child_command
from pack_helpers import cli

from rolltool.input.synth import SynthConfig, generate
from rolltool.storage.outputs import LOCK

PACK = ("--dp", 2, "--batch-size", 16, "--keep-last")
ADV_ROW_GROUP = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """96 samples of synthetic rollouts, in row groups of 16."""
    path = tmp_path_factory.mktemp("data") / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=8, max_len=2048)), path, row_group_size=16)
    return path


def _digest(path: Path) -> dict[str, str] | None:
    """What an output holds, byte for byte (a manifest's creation time aside); None if missing."""
    if not path.exists():
        return None
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if f.name == "manifest.json":
            data = json.dumps(json.loads(data)["files"], sort_keys=True).encode()
        out[str(f.relative_to(path))] = hashlib.sha256(data).hexdigest()
    return out


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _run(command: str, data: Path, out: Path, *extra: Any) -> Any:
    if command == "pack":
        return cli("pack", data, "-o", out, *PACK, *extra)
    return cli("advantages", data, "-o", out, *extra)


def _child(
    injector: Injector, *args: Any, hangup: Any = signal.SIG_DFL
) -> subprocess.CompletedProcess[str]:
    """Run ``rolltool ARGS`` in a child under `injector`, with SIGHUP's disposition `hangup`
    (default: as a login shell starts a job, whatever this process inherited, e.g. from
    ``nohup``, which ignores it)."""
    return subprocess.run(
        child_command(*args),
        env=injector.env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup),
    )


def _reference(
    command: str, data: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, dict[str, str] | None, dict[str, str] | None]:
    """(operations a run over an existing output makes, its output, that older output) for
    `command`, run in-process with the operations counted."""
    extra = ("--dp", 1) if command == "pack" else ("--estimator", "rloo")
    assert _run(command, data, folder / "ref", *extra).exit_code == 0
    older = _digest(folder / "ref")
    counter = Injector(row_group=ADV_ROW_GROUP)
    with monkeypatch.context() as m:
        counter.install(m.setattr)
        result = _run(command, data, folder / "ref", "--force")  # over an older output
    assert result.exit_code == 0, result.output
    return counter.count, _digest(folder / "ref"), older


@pytest.mark.parametrize("command", ["pack", "advantages"])
def test_killed_anywhere_leaves_nothing_complete_looking_and_reruns_identically(
    command: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops, ref, older = _reference(command, data, tmp_path, monkeypatch)
    assert ops >= 8 and ref != older  # the run really passes through many points
    rng = random.Random(13)
    points = sorted({*rng.sample(range(1, ops - 2), 3), ops - 1, ops})  # the swap's included
    states = set()
    for i, at in enumerate(points):
        folder = tmp_path / f"kill-{at}"
        folder.mkdir()
        out = folder / "out"
        if i % 2 == 1 or at >= ops - 1:  # the counts are a run's over an existing output
            extra = ("--dp", 1) if command == "pack" else ("--estimator", "rloo")
            assert _run(command, data, out, *extra).exit_code == 0
        before = _digest(out)
        args = [command, data, "-o", out, *(PACK if command == "pack" else ()), "--force"]
        last = at == ops  # killed just after the last operation rather than before it
        killed = _child(Injector(at=at, after=last, row_group=ADV_ROW_GROUP), *args)
        assert killed.returncode == -signal.SIGKILL, (at, killed.stderr)
        now = _digest(out)
        aside = list(folder.glob(".out.old-*"))
        states.add((now == ref, now == before, bool(aside)))
        # A complete output (the old or the new one), or the old one aside; nothing else but
        # the killed run's temporary directory.
        assert now in (before, ref) or (now is None and [_digest(a) for a in aside] == [before])
        rest = [n for n in _visible(folder) if not n.startswith(".out.tmp-")]
        assert rest == sorted([a.name for a in aside] + (["out"] if now is not None else []))
        # The rerun repairs, replaces and leaves nothing beside it.
        with monkeypatch.context() as m:
            Injector(row_group=ADV_ROW_GROUP).install(m.setattr)
            again = _run(command, data, out, "--force")
        assert again.exit_code == 0, (at, again.output)
        assert _digest(out) == ref and _visible(folder) == ["out"], at
    assert (False, True, False) in states  # killed before the commit: the old output stays
    assert (True, False, False) in states  # killed after it: the new one
    if command == "pack":  # mid-swap: no output and the old one aside (the rerun restores it)
        assert (False, False, True) in states


def test_sigterm_sigint_and_sighup_clean_up_and_exit_143_130_and_129(
    data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert cli("pack", data, "-o", out, *PACK, "--dp", 1).exit_code == 0
    before = _digest(out)
    args = ["pack", data, "-o", out, *PACK, "--force"]
    signals = ((signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT"), (signal.SIGHUP, 129, "SIGHUP"))  # fmt: skip
    for sig, code, name in signals:
        run = _child(Injector(at=3, sig=sig, only="write_shard"), *args)
        assert run.returncode == code, run.stderr
        assert f"Interrupted by {name}: no output was written" in run.stderr
        assert "Traceback" not in run.stderr and "Aborted" not in run.stderr
        assert _digest(out) == before and _visible(tmp_path) == ["out"]  # temp removed


def test_sighup_ignored_under_nohup_stays_ignored(data: Path, tmp_path: Path) -> None:
    """``nohup rolltool pack ...``: the hangup the job was started to survive does not stop it."""
    out = tmp_path / "out"
    run = _child(
        Injector(at=3, sig=signal.SIGHUP, only="write_shard"),
        "pack", data, "-o", out, *PACK, hangup=signal.SIG_IGN,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Interrupted" not in run.stderr
    assert cli("verify", out).exit_code == 0


def test_sigint_after_the_commit_says_the_output_is_complete(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _child(
        Injector(at=1, sig=signal.SIGINT, after=True, only="_commit"),
        "pack", data, "-o", out, *PACK,
    )  # fmt: skip
    assert run.returncode == 130, run.stderr
    assert "Aborted" not in run.stderr and f"after {out} was written (complete)" in run.stderr
    assert cli("verify", out).exit_code == 0
    assert _visible(tmp_path) == ["out"]


def test_runs_at_the_same_time(data: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    assert cli("pack", data, "-o", ref, *PACK).exit_code == 0
    out = tmp_path / "out"
    assert cli("pack", data, "-o", out, *PACK, "--dp", 1).exit_code == 0
    # A run in another container, live: its lock is held, its pid means nothing here.
    live = tmp_path / ".out.tmp-elsewhere"
    (live / "out").mkdir(parents=True)
    (live / LOCK).write_text("otherhost 1\n")
    fd = os.open(live / LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                child_command("pack", data, "-o", out, *PACK, "--force"),
                env=Injector().env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
        assert all(code == 0 for code, _ in results), results
        assert live.is_dir()  # never taken for stale
    finally:
        os.close(fd)
    assert _digest(out) == _digest(ref)
    assert _visible(tmp_path) == [".out.tmp-elsewhere", "out", "ref"]
    assert cli("pack", data, "-o", out, *PACK, "--force").exit_code == 0
    assert _visible(tmp_path) == ["out", "ref"]  # dead now: cleaned by the next run


def _longer(table: pa.Table) -> pa.Table:
    """Every sample one token longer: the same rows and row groups, other lengths."""
    cols = {}
    for name in ("input_ids", "loss_mask", "logprobs"):
        values = table.column(name).to_pylist()
        cols[name] = pa.array([v + v[-1:] for v in values], table.schema.field(name).type)
    for name, arr in cols.items():
        table = table.set_column(table.schema.get_field_index(name), name, arr)
    return table


@pytest.mark.parametrize("change", ["longer samples", "fewer rows"])
def test_an_input_changed_during_a_pack_is_an_error_naming_it(
    change: str, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "in.parquet"
    src.write_bytes(data.read_bytes())
    table = pq.read_table(src)
    new = _longer(table) if change == "longer samples" else table.slice(0, 80)
    from rolltool.fetch.tokens import TokenReader

    real, calls = TokenReader.fetch, [0]

    def fetch(self: TokenReader, idx: np.ndarray) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # after the scan, between two steps
            pq.write_table(new, src, row_group_size=16)
        return real(self, idx)

    monkeypatch.setattr(TokenReader, "fetch", fetch)
    result = cli("pack", src, "-o", tmp_path / "out", *PACK, "--cache-mb", 0)
    assert result.exit_code == 1 and calls[0] >= 2
    assert result.stderr.startswith(f"Error: {src}: changed while rolltool was reading it")
    assert "Traceback" not in result.stderr and _visible(tmp_path) == ["in.parquet"]


def test_lengths_unlike_the_scans_are_an_error_even_when_the_file_looks_unchanged(
    data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rolltool.fetch.tokens
    from rolltool.errors import RolltoolError
    from rolltool.input.resolve import resolve_inputs

    files = resolve_inputs([data])
    reader = rolltool.fetch.tokens.TokenReader(files, {}, cache_bytes=0)
    for rg in range(6):
        reader.offer(0, rg, pq.ParquetFile(data).read_row_group(rg))
    assert len(reader.fetch(np.arange(96)).offsets) == 97  # as scanned: fine
    real = rolltool.fetch.tokens.read_row_group
    monkeypatch.setattr(
        rolltool.fetch.tokens, "read_row_group", lambda *a: _longer(real(*a).combine_chunks())
    )
    with pytest.raises(RolltoolError, match=r"in.parquet: row group 0 changed since the scan"):
        reader.fetch(np.arange(3))


def test_a_full_disk_is_one_line_naming_the_output(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rolltool.packed.writer

    out = tmp_path / "out"
    assert cli("pack", data, "-o", out, *PACK, "--dp", 1).exit_code == 0
    before = _digest(out)

    def full(*args: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rolltool.packed.writer, "write_shard", full)
    result = cli("pack", data, "-o", out, *PACK, "--force")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"Error: {out}: No space left on device"
    assert _digest(out) == before and _visible(tmp_path) == ["out"]


def test_a_file_size_limit_is_one_line_and_keeps_the_old_output(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("pack", data, "-o", out, *PACK, "--dp", 1).exit_code == 0
    before = _digest(out)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))

    run = subprocess.run(
        child_command("pack", data, "-o", out, *PACK, "--force"),
        env=Injector().env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    assert run.returncode == 1, run.stderr
    assert "File too large" in run.stderr.splitlines()[0] and "Traceback" not in run.stderr
    assert "ulimit" in run.stderr
    assert _digest(out) == before and _visible(tmp_path) == ["out"]


def test_an_unreadable_path_is_one_line_naming_it(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rolltool.input.resolve

    def denied(text: str) -> Any:
        raise PermissionError(13, "Permission denied", str(tmp_path / "data" / "locked"))

    monkeypatch.setattr(rolltool.input.resolve, "_expand", denied)
    result = cli("pack", tmp_path / "data", "-o", tmp_path / "out", *PACK)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == f"Error: {tmp_path}/data/locked: Permission denied"


def test_force_refusals_through_the_cli(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "in.parquet"
    src.write_bytes(data.read_bytes())
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    packed = tmp_path / "packed"
    assert cli("pack", src, "-o", packed, *PACK).exit_code == 0
    (tmp_path / "link").symlink_to(packed)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    plain = tmp_path / "plain.parquet"
    plain.write_bytes(data.read_bytes())  # rollouts, but not written by rolltool
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(data.read_bytes())
    cases = [
        (["pack", src, "-o", notes, *PACK], "not an output rolltool wrote"),
        (["pack", src, "-o", tmp_path / "link", *PACK], "is a symbolic link"),
        (["pack", src, "-o", tmp_path / "dangling", *PACK], "is a symbolic link"),
        (["pack", src, "-o", ".", *PACK], "current directory"),
        (["advantages", src, "-o", src], "is one of the inputs"),
        (["advantages", folder, "-o", folder / "adv.parquet"], "lies inside the input"),
        (["advantages", src, "-o", plain], "not an output rolltool wrote"),
        (["synth", "-o", notes / "todo.txt", "--groups", 2], "not an output rolltool wrote"),
    ]
    before = {p: _digest(p) for p in (src, notes, packed, plain, folder)}
    monkeypatch.chdir(packed)  # `-o .`: the current directory, and a packed one at that
    for args, words in cases:
        result = cli(*args, "--force")
        assert result.exit_code == 1, (args, result.output)
        lines = result.stderr.splitlines()
        assert lines[0].startswith("Error: ") and words in lines[0], (args, lines)
        assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert {p: _digest(p) for p in before} == before
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()
    assert not list(tmp_path.glob(".*"))


def test_a_shard_deleted_from_the_temp_before_the_commit_is_an_error(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a cleaner that took a live run for dead did: the run must not commit the rest."""
    import rolltool.packed.writer

    real = rolltool.packed.writer.write_shard

    def write_then_lose(root: Path, *args: Any) -> Any:
        name, record = real(root, *args)
        if name.endswith("step-000002-00.safetensors"):
            (root / name).unlink()
        return name, record

    monkeypatch.setattr(rolltool.packed.writer, "write_shard", write_then_lose)
    result = cli("pack", data, "-o", tmp_path / "out", *PACK)
    assert result.exit_code == 1
    assert "vanished or changed before the commit" in result.stderr.splitlines()[0]
    assert _visible(tmp_path) == []
