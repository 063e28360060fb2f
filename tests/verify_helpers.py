"""Tampering helpers shared by the `rolltool verify` tests (test_verify*.py); not a test module.

Each helper edits shard tensors, samples.parquet or the manifest and then rewrites the
manifest's sha256 and size for the edited file, so hashes cannot tell: only the invariants can.

- ``kinds(out, ...)``: `verify`'s problem counts by kind (the stable codes of ``--json``).
- ``edit_manifest(out, edit)``: edit the manifest JSON in place.
- ``edit_shard(out, name, edit)`` / ``edit_segment(out, i, edit)``: edit a shard's arrays (the
  whole shard, or around sample i's segment k and its first token).
- ``edit_samples(out, column, edit)``: edit one samples.parquet column.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import rolltool.verify
from rolltool.format.shards import file_record, read_shard, save_safetensors
from rolltool.verify import verify

ARGS = ("--dp", 2, "--batch-size", 16, "--micro-batch-tokens", 8192)
"""The base pack of the verify tests (16 synthetic groups, several steps, some leftover)."""

Arrays = dict[str, np.ndarray]


def pack_layouts(
    tmp: Path, layouts: dict[str, tuple], *, groups: int, seed: int
) -> dict[str, Path]:
    """One synth input in `tmp` packed once per layout: {"input": path, layout name: pack}."""
    from pack_helpers import pack

    from rolltool.input.synth import SynthConfig, generate

    inp = tmp / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=groups, seed=seed, max_len=4096)), inp)
    made = {"input": inp}
    for name, args in layouts.items():
        pack(inp, tmp / name, *args)
        made[name] = tmp / name
    return made


def copier(packs: dict[str, Path], tmp: Path, default: str | None = None) -> Callable[..., Path]:
    """copy(layout) -> a fresh copy of that pack in `tmp` to tamper with."""

    def copy(layout: str | None = default) -> Path:
        assert layout is not None
        dst = tmp / f"{layout}-{len(list(tmp.iterdir()))}"
        shutil.copytree(packs[layout], dst)
        return dst

    return copy


def kinds(out: Path, **kwargs: Any) -> dict[str, int]:
    """Problem counts by kind; the report's listed problems and counts agree."""
    report = verify(out, **kwargs)
    listed: dict[str, int] = {}
    for p in report["problems"]:
        listed[p["kind"]] = listed.get(p["kind"], 0) + 1
    assert set(listed) == set(report["counts"]), report
    assert all(listed[k] == min(n, 8) for k, n in report["counts"].items()), report
    assert report["ok"] == (not report["counts"])
    assert all(f" {kind}" in rolltool.verify.__doc__ for kind in report["counts"]), "undocumented"
    return report["counts"]


def rehash(out: Path, name: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][name] = vars(file_record(out / name))
    (out / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest(out: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


def shards(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.glob("rank-*/step-*.safetensors"))


def edit_shard(out: Path, name: str, edit: Callable[[Arrays], Any]) -> None:
    """edit(arrays) on a shard (writable copies), then write it back and rehash it."""
    arrays = {key: np.array(v) for key, v in read_shard(out / name).items()}
    edit(arrays)
    save_safetensors(out / name, arrays, {})
    rehash(out, name)


def find(out: Path, i: int) -> tuple[str, int]:
    """(shard name, segment position in it) of sample i."""
    for name in shards(out):
        hit = np.flatnonzero(read_shard(out / name)["sample_index"] == i)
        if len(hit):
            return name, int(hit[0])
    raise AssertionError(f"sample {i} not found")


def edit_segment(out: Path, i: int, edit: Callable[[Arrays, int, int], Any]) -> None:
    """edit(arrays, segment k, first token of k) on sample i's shard, then rehash it."""
    name, k = find(out, i)

    def at(a: Arrays) -> None:
        edit(a, k, int(a["seq_lens"][:k].astype(np.int64).sum()))

    edit_shard(out, name, at)


def edit_samples(out: Path, column: str, edit: Callable[[np.ndarray], Any]) -> None:
    t = pq.read_table(out / "samples.parquet")
    values = np.array(t.column(column).to_pylist(), dtype=object if column == "status" else None)
    edit(values)
    field = t.schema.field(column)
    t = t.set_column(t.schema.get_field_index(column), field, pa.array(values, field.type))
    pq.write_table(t, out / "samples.parquet")
    rehash(out, "samples.parquet")


def samples(out: Path) -> dict[str, np.ndarray]:
    t = pq.read_table(out / "samples.parquet")
    return {c: np.asarray(t.column(c).to_pylist()) for c in t.column_names}


def trained_with_prompt(out: Path) -> int:
    """A trained sample with an untrained (prompt) token."""
    s = samples(out)
    ok = np.flatnonzero((s["status"] == "trained") & (s["trainable_tokens"] < s["length"]))
    return int(ok[0])


def flip_a_prompt_token(out: Path, i: int) -> None:
    def edit(a: Arrays, k: int, start: int) -> None:
        t = start + int(np.flatnonzero(a["loss_mask"][start:] == 0)[0])
        a["loss_mask"][t] = 1

    edit_segment(out, i, edit)
