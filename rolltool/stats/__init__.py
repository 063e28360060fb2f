"""`rolltool stats`: what a rollout dataset or a packed run contains, at a glance.

::

    accumulate.py   mergeable statistics (exact value counts, moments) combined with ``+``
    rollouts.py     rollout Parquet, file by file, reading only the columns it needs
    packed.py       a packed directory: per-step counts, packing, balance vs tokens/count splits
    render.py       rich tables of either report
    plot.py         a one-page matplotlib figure (optional extra ``plot``, imported lazily)

The per-piece work (a row-group run of the input, a packed step) is pure; ``mapper`` (``stats
--engine ray``) may compute it in Ray tasks, and the driver merges the results in order, so the
report is the same. ``compute_stats(paths)`` picks the reader: one directory written by ``rolltool pack``
(`rolltool.format.is_packed_dir`) is a packed run; anything else (Parquet files, directories,
globs) is rollout Parquet. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rolltool.errors import RolltoolError
from rolltool.format import MANIFEST, Manifest, is_packed_dir, packed_doc
from rolltool.stats.accumulate import Moments, Stats, ValueCounts
from rolltool.stats.packed import packed_stats
from rolltool.storage import remote
from rolltool.storage.fs import is_remote, locate
from rolltool.util.mapping import Mapper

__all__ = [
    "Moments",
    "Stats",
    "ValueCounts",
    "compute_stats",
    "packed_stats",
    "rollout_stats",
]


def __getattr__(name: str) -> Any:
    """`rollout_stats`, imported on first use: the rollout reader brings polars and the schema
    rules, which the statistics of a packed directory never need (``stats`` of a pack starts
    faster without them)."""
    if name == "rollout_stats":
        from rolltool.stats.rollouts import rollout_stats

        return rollout_stats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_packed(path: str) -> bool:
    """A directory written by ``rolltool pack``; one holding another ``manifest.json`` is an
    error saying why it is not (never read as rollout Parquet)."""
    if is_remote(path):  # format/ knows local paths only
        loc = locate(path)
        if not loc.is_file(MANIFEST):
            if loc.is_dir() and (killed := remote.unfinished(loc, loc.files())) is not None:
                raise killed  # a pack's shards and claim: never read as rollout Parquet
            return False
        raw = loc.read_bytes(MANIFEST)
        if packed_doc(raw) is None:
            Manifest.loads(raw, loc.show(MANIFEST))  # raises, saying why
        return True
    if is_packed_dir(path):
        return True
    if (Path(path) / MANIFEST).is_file():
        Manifest.load(path)  # raises: not rolltool's format, or not a version it reads
    return False


def compute_stats(
    paths: Sequence[str],
    *,
    columns: Mapping[str, str] | None = None,
    step: int | None = None,
    limit: int | None = None,
    progress: Any = None,
    mapper: Mapper | None = None,
) -> Stats:
    """Statistics of one packed directory or of rollout Parquet ``paths``.

    ``limit``: the first N rows of rollout Parquet, or the first N steps of a packed run;
    ``step``: one step of a packed run; ``columns``: ``--column NEW=OLD`` pairs (rollouts);
    ``mapper(fn, items)``: computes the per-piece work (a piece of the input, a step) elsewhere,
    in order (``--engine ray``: `rolltool.engine.ray.RayEngine.map_in_order`), the same result.
    """
    packed = [p for p in paths if _is_packed(p)]
    if packed:
        if len(paths) > 1:
            raise RolltoolError(
                f"{packed[0]} is a packed directory: give it alone",
                hint="`rolltool stats` reads one packed directory, or rollout Parquet inputs",
            )
        if columns:
            raise RolltoolError("--column applies to rollout Parquet, not to a packed directory")
        return packed_stats(paths[0], step=step, limit=limit, mapper=mapper)
    from rolltool.stats.rollouts import HINT, rollout_stats

    if step is not None:
        raise RolltoolError(
            "--step applies to a packed directory", hint="rollout Parquet has no steps yet"
        )
    for p in paths:
        d = Path(p)
        if d.is_dir() and not any(d.rglob("*.parquet")):
            raise RolltoolError(
                f"{p}: not a rolltool directory (no manifest.json, no *.parquet files)", hint=HINT
            )
    return rollout_stats(paths, columns=columns, limit=limit, progress=progress, mapper=mapper)
