"""What `verify` reads, once: samples.parquet, the layout settings and the input.

`Context` is frozen and built once; every invariant is a function of it (see the package
docstring). Reading is separated from judging: nothing here decides that data is wrong, except
that a samples.parquet that cannot be read or an input that is not the one the pack was made
from leaves nothing to check against (those are problems the driver reports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.fetch.tokens import TokenReader
from rolltool.format import SAMPLES, STATUSES, InputRecord, Manifest
from rolltool.format.split import GroupSplit, recorded_split
from rolltool.input.parquet import InputFile, footer, invert_mapping, iter_batches
from rolltool.input.resolve import resolve_inputs
from rolltool.storage.fs import is_remote, locate_input
from rolltool.util.problems import Problem
from rolltool.verify.segments import Segments

_INT_COLUMNS = ("sample_index", "step", "rank", "micro_batch", "length", "trainable_tokens")
_FLOAT_COLUMNS = ("advantage", "token_loss_weight")
HYBRID_COLUMNS = ("cp_start", "cp_degree")
"""samples.parquet's columns of a --hybrid-cp pack only."""


@dataclass(frozen=True)
class Samples:
    """samples.parquet as NumPy columns; row i is sample i (``n`` rows)."""

    index: np.ndarray  # [n] int64, sample_index as stored (should be 0..n-1)
    step: np.ndarray  # [n] int64, -1 unless trained
    rank: np.ndarray  # [n] int64
    micro_batch: np.ndarray  # [n] int64
    length: np.ndarray  # [n] int64, tokens
    trainable: np.ndarray  # [n] int64, trainable tokens (loss-mask count)
    advantage: np.ndarray  # [n] float32
    weight: np.ndarray  # [n] float32, token_loss_weight (per trainable token)
    trained: np.ndarray  # [n] bool, status == "trained"
    env: np.ndarray  # [n] int64, index into env_names
    env_names: tuple[str, ...]
    status_counts: Mapping[str, int]
    fate: np.ndarray  # [n] int64, index into STATUSES (-1: a status rolltool does not write)
    group: np.ndarray  # [n] int64, dense code of group_id
    rollout: np.ndarray  # [n] int64, dense code of (group_id, rollout_id)
    reward: np.ndarray | None  # [n] float64; None for packs written before the column existed
    by_step: np.ndarray  # trained samples of steps 0..num_steps-1, sorted by step (stable)
    step_bounds: np.ndarray  # [num_steps + 1]: by_step[bounds[s]:bounds[s + 1]] train at step s
    cp_start: np.ndarray | None = None  # [n] int64 --hybrid-cp: its sub-group's first GPU
    cp_degree: np.ndarray | None = None  # [n] int64 --hybrid-cp: its CP degree (0: untrained)
    """(None when samples.parquet has no such column: every pack but --hybrid-cp's)"""

    @property
    def n(self) -> int:
        return len(self.index)

    def planned(self, step: int) -> np.ndarray:
        """Samples trained at `step`, in sample order."""
        return self.by_step[self.step_bounds[step] : self.step_bounds[step + 1]]

    def inside_run(self, num_steps: int, dp: int) -> np.ndarray:
        """[n] bool: step, rank and micro-batch name a place the run has (for trained samples)."""
        step_ok = (self.step >= 0) & (self.step < num_steps)
        return step_ok & (self.rank >= 0) & (self.rank < dp) & (self.micro_batch >= 0)

    def where(self, i: int | np.integer) -> str:
        """Where samples.parquet puts sample i (its planned place when trained)."""
        if not self.trained[i]:
            return f"sample {i}"
        return (
            f"step {self.step[i]} rank {self.rank[i]} micro-batch {self.micro_batch[i]} sample {i}"
        )


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    """[n] int64 dense codes of a column's values (any type; order of first appearance)."""
    encoded = pc.dictionary_encode(column.combine_chunks())
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _read(path: Path) -> pa.Table:
    """samples.parquet's columns that verify judges (``reward`` and ``epoch`` when written)."""
    names = set(pq.read_schema(path).names)
    wanted = [*_INT_COLUMNS, *_FLOAT_COLUMNS, "status", "env", "group_id", "rollout_id"]
    optional = [c for c in ("reward", "epoch", *HYBRID_COLUMNS) if c in names]
    t = pq.read_table(path, columns=wanted + optional)
    nulls = [c for c in t.column_names if t.column(c).null_count]
    if nulls:
        raise RolltoolError(f"{SAMPLES}: null values in {', '.join(nulls)}")
    return t


def load_samples(path: Path, num_steps: int, input_rows: int | None = None) -> Samples:
    """Read samples.parquet; a `RolltoolError` when it cannot be read or lacks a column.

    With an ``epoch`` column (format 2, --epochs) row ``e * n + i`` is sample i in epoch e:
    ``index`` is then that row number as the columns give it (``epoch * input_rows +
    sample_index``), so every check indexes (sample, epoch) pairs as it would samples."""
    try:
        t = _read(path)
        ints = {c: t.column(c).to_numpy().astype(np.int64) for c in _INT_COLUMNS}
        if "epoch" in t.column_names and input_rows is not None:
            epoch = t.column("epoch").to_numpy().astype(np.int64)
            ints["sample_index"] = ints["sample_index"] + epoch * input_rows
        adv, weight = (t.column(c).to_numpy().astype(np.float32) for c in _FLOAT_COLUMNS)
        status = pc.cast(t.column("status"), pa.string()).combine_chunks()
        env = pc.cast(t.column("env"), pa.string()).combine_chunks().dictionary_encode()
        group, rollout_id = _codes(t.column("group_id")), _codes(t.column("rollout_id"))
        reward = (
            t.column("reward").to_numpy().astype(np.float64) if "reward" in t.column_names else None
        )
        cp = {c: t.column(c).to_numpy().astype(np.int64) for c in HYBRID_COLUMNS
              if c in t.column_names}  # fmt: skip
    except (pa.ArrowException, KeyError, OSError, ValueError, TypeError) as e:
        raise RolltoolError(f"{SAMPLES}: unreadable or missing columns ({e})") from None
    trained = pc.equal(status, "trained").to_numpy(zero_copy_only=False)
    step = ints["step"]
    order = np.flatnonzero(trained & (step >= 0) & (step < num_steps))
    order = order[np.argsort(step[order], kind="stable")]
    counts = {c["values"]: c["counts"] for c in pc.value_counts(status).to_pylist()}
    pairs = group * (int(rollout_id.max()) + 1 if len(rollout_id) else 1) + rollout_id
    return Samples(
        index=ints["sample_index"],
        step=step,
        rank=ints["rank"],
        micro_batch=ints["micro_batch"],
        length=ints["length"],
        trainable=ints["trainable_tokens"],
        advantage=adv,
        weight=weight,
        trained=trained,
        env=env.indices.to_numpy(zero_copy_only=False).astype(np.int64),
        env_names=tuple(env.dictionary.to_pylist()),
        status_counts=counts,
        fate=pc.index_in(status, pa.array(STATUSES)).fill_null(-1).to_numpy().astype(np.int64),
        group=group,
        rollout=np.unique(pairs, return_inverse=True)[1].astype(np.int64).reshape(-1),
        reward=reward,
        by_step=order,
        step_bounds=np.searchsorted(step[order], np.arange(num_steps + 1), side="left"),
        **cp,
    )


@dataclass(frozen=True)
class Context:
    """Everything the invariants look at, read once."""

    root: Path
    manifest: Manifest
    samples: Samples
    segments: Segments
    row_len: int | None
    """Every (group) row's length when the pack pads rows to a fixed length: --row-len x sp
    or x cp."""
    pad_id: int
    """Token id of padding."""
    reader: TokenReader | None
    """The input's tokens by sample_index; None when the input is not compared."""
    split: GroupSplit = field(default_factory=GroupSplit)
    """How the pack splits each group's rows over its sp or cp GPUs."""
    input_rows: int = 0
    """Input samples (the manifest's inputs): with --epochs, samples.parquet row and segment
    ``sample`` ``e * input_rows + i`` are sample i in epoch e (`by_epoch`)."""

    def input_index(self, sample: np.ndarray) -> np.ndarray:
        """The input sample_index of samples.parquet rows (or segments) `sample`."""
        return sample % self.input_rows if self.input_rows else sample


def by_epoch(manifest: Manifest, segments: Segments, input_rows: int) -> Segments:
    """Segments whose ``sample`` is their samples.parquet row: ``epoch * input_rows + i`` for
    sample i in a step of that epoch (unchanged without --epochs; padding stays -1)."""
    epoch = np.array([st.epoch for st in manifest.steps], dtype=np.int64)
    if not epoch.any() or not len(segments.sample):
        return segments
    at = np.where(segments.sample >= 0, epoch[segments.step] * input_rows, 0)
    return replace(segments, sample=segments.sample + at)


def layout_settings(manifest: Manifest) -> tuple[int | None, int, GroupSplit]:
    """(group row_len, pad_id, split) of the recorded pack config."""
    row_len, split = manifest.config.row_len, recorded_split(manifest.config)
    return None if row_len is None else row_len * split.size, manifest.config.pad_id, split


# -- the input ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputState:
    """The input's token reader, or why there is none (``status``, shown in the report)."""

    reader: TokenReader | None
    status: str
    """"compared", "skipped", "not found: <paths>" or "not compared: <why>"."""


def candidates(record: InputRecord, root: Path) -> list[Path]:
    """Where a recorded input file may be: its path when absolute; a relative path (manifests
    written before paths were resolved) or the path as given, against the packed directory's
    parent, then the current directory."""
    found: list[Path] = []
    for text in (record.path, record.given):
        if text is None:
            continue
        p = Path(text)
        tries = [p] if p.is_absolute() else [root.absolute().parent / p, Path.cwd() / p]
        found.extend(t for t in tries if t not in found)
    return found


def _remote_file(uri: str) -> bool:
    try:
        return locate_input(uri).is_file()
    except RolltoolError:
        return False


def locate_recorded(manifest: Manifest, root: Path) -> tuple[list[Path | str], list[str]]:
    """(the recorded input files where they are found, the recorded paths that are not);
    an input recorded by URI (`rolltool.storage.fs`) is looked for there only."""
    found: list[Path | str] = []
    missing: list[str] = []
    for record in manifest.inputs:
        if is_remote(record.path):
            (found if _remote_file(record.path) else missing).append(record.path)
            continue
        hit = next((p for p in candidates(record, root) if p.is_file()), None)
        if hit is None:
            missing.append(record.path)
        else:
            found.append(hit)
    return found, missing


def open_input(
    manifest: Manifest,
    root: Path,
    inputs: Sequence[str | os.PathLike[str]] | None,
    recorded: bool,
) -> tuple[InputState, list[Problem]]:
    """The token reader over `inputs`, else over the recorded input files when `recorded` and
    all of them are found; a problem when they are not the input the pack was made from."""
    if inputs is not None:
        files = resolve_inputs(inputs)
    elif not recorded or not manifest.inputs:
        return InputState(None, "skipped"), []
    else:
        paths, missing = locate_recorded(manifest, root)
        if missing:
            return InputState(None, "not found: " + ", ".join(missing)), []
        try:
            files = [InputFile(str(p), footer(p).num_rows) for p in paths]
        except (pa.ArrowException, OSError) as e:
            return _failed("input.unreadable", f"not readable ({e})")
    have, want = [f.rows for f in files], [r.rows for r in manifest.inputs]
    if have != want:
        return _failed(
            "input.mismatch",
            f"{len(files)} file(s) with {have} rows, the pack was made from {len(want)} file(s) "
            f"with {want} rows",
        )
    try:
        reader = TokenReader(files, invert_mapping(manifest.columns), cache_bytes=int(1e9))
    except (RolltoolError, pa.ArrowException, OSError) as e:
        return _failed("input.unreadable", e.message if isinstance(e, RolltoolError) else str(e))
    return InputState(reader, "compared"), []


def input_rewards(reader: TokenReader | None, n: int) -> np.ndarray | None:
    """[n] float64 rewards of the input the reader reads (for packs whose samples.parquet has
    no reward column); None without an input, or when it cannot be read or has not n rows."""
    if reader is None:
        return None
    parts = []
    try:
        for file in reader.files:
            for batch in iter_batches(file, reader.rename, ["reward"]):
                parts.append(batch.column("reward").to_numpy(zero_copy_only=False))
    except (RolltoolError, pa.ArrowException, KeyError, OSError) as e:
        del e  # the content invariant reports an unreadable input
        return None
    rewards = np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)
    return rewards if len(rewards) == n else None


def _failed(kind: str, text: str) -> tuple[InputState, list[Problem]]:
    return InputState(None, "not compared: see problems"), [Problem(kind, "input", text)]
