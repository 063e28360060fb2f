"""Statistics of rollout Parquet, file by file, without materializing token lists.

Only the light columns (``group_id``, ``rollout_id``, ``env``, ``reward``, ``finished_at``) and
one token column per format are read: ``loss_mask`` (its list length is the sample length, its
ones the trainable tokens; ``input_ids`` is never read) or ``prompt_ids`` + ``response_ids``
(list lengths only). The input is trusted, not validated (``rolltool pack`` validates), except
that an id column that is integer in one file and string in another is refused, as ``pack``
refuses it, rather than merging 1 and "1" into one id.

Each piece of the input (`Piece`: a file, or a run of its row groups holding about
``PIECE_TOKENS`` tokens) gives a ``RolloutStats``; ``a + b`` is the
``RolloutStats`` of both inputs, exactly, also when a group or a rollout is split over pieces
(rollouts are kept as one small partial row each and re-aggregated by ``report``, in input row
order, so the report does not depend on where the pieces were cut). The pieces are independent:
``mapper`` (``stats --engine ray``: Ray tasks, `rolltool.engine.ray`) may compute them anywhere;
they are summed on the driver in input order.

Definitions (per env and over all envs):

- a **rollout** is (``group_id``, ``rollout_id``), or one row when there is no ``rollout_id``;
  its **samples** are its branches (rows); its reward is its first row's;
- a group's **size** is its rollout count; the env's **usual size** is the most frequent one,
  and ``odd_size_groups`` counts groups of another size;
- a **uniform** group has two or more rollouts, all with the same reward (no gradient signal):
  ``all_0`` (reward 0), ``all_1`` (reward 1) or ``other``;
- a group **completes** when its last rollout finishes (``finished_at``); groups are in input
  order by their first row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.input.parquet import (
    InputFile,
    check_mapping,
    file_schema,
    footer,
    invert_mapping,
    source_names,
)
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import DEFAULT_ENV, id_type_conflicts, token_format
from rolltool.stats.accumulate import Moments, Stats, ValueCounts, add_dicts, percentiles
from rolltool.storage.fs import is_remote, locate_input
from rolltool.util.mapping import Mapper

HINT = (
    "`rolltool stats` reads rollout Parquet (group_id, reward and input_ids/loss_mask or "
    "prompt_ids/response_ids; --column NEW=OLD maps other names) or a directory written by "
    "`rolltool pack` (with manifest.json)"
)

PIECE_TOKENS = 32_000_000
"""A file is read in pieces of whole row groups holding at least this many tokens (values of
the token column(s), from the footers; the last piece may hold fewer): each piece one polars
scan, or one Ray task."""
TOKEN_COLUMNS = ("loss_mask", "prompt_ids", "response_ids")
"""The token columns stats reads (one format or the other)."""


@dataclass(frozen=True)
class Piece:
    """Rows ``offset .. offset + rows - 1`` of `file` (``rows`` None: to its end); the file's
    first row is row ``first_row`` of the ordered input."""

    file: InputFile
    first_row: int
    offset: int = 0
    rows: int | None = None


@dataclass(frozen=True)
class EnvLengths:
    """Sample-level counts of one env: mergeable with ``+``."""

    samples: int = 0
    sampled: ValueCounts = field(default_factory=ValueCounts.empty)
    """Distribution of sample lengths (tokens: prompt and all turns)."""
    trainable: ValueCounts = field(default_factory=ValueCounts.empty)
    """Distribution of trainable tokens per sample (loss_mask ones)."""

    def __add__(self, other: EnvLengths) -> EnvLengths:
        return EnvLengths(
            self.samples + other.samples,
            self.sampled + other.sampled,
            self.trainable + other.trainable,
        )


@dataclass(frozen=True)
class RolloutStats:
    """Mergeable summary of some rollout rows: ``stats(f1) + stats(f2) == stats(f1 + f2)``."""

    rows: int = 0
    """Rows read."""
    envs: dict[str, EnvLengths] = field(default_factory=dict)
    """Length distributions per env."""
    parts: tuple[pl.DataFrame, ...] = ()
    """Per-rollout partial rows (group_id, rollout_id, env, reward, samples, row, finished)."""
    has_finished: bool = True
    """Every part has ``finished_at`` (completion order is only reported then)."""

    def __add__(self, other: RolloutStats) -> RolloutStats:
        return RolloutStats(
            self.rows + other.rows,
            add_dicts(self.envs, other.envs),
            self.parts + other.parts,
            self.has_finished and other.has_finished,
        )

    def report(self) -> dict[str, Any]:
        """The statistics as one JSON-able dict: ``{"overall": {...}, "envs": {env: {...}}}``."""
        # in input order: float sums (the reward's mean) do not depend on where pieces were cut
        rollouts = _rollouts(self.parts).sort("row")
        groups = _groups(rollouts).sort("row")
        env_order = (
            groups.group_by("env").agg(pl.col("row").min()).sort("row")["env"].to_list()
            if len(groups)
            else sorted(self.envs)
        )
        env_order += [e for e in self.envs if e not in env_order]
        finished = self.has_finished and bool(len(groups))
        envs = {
            e: _section(
                self.envs.get(e, EnvLengths()),
                rollouts.filter(pl.col("env") == e),
                groups.filter(pl.col("env") == e),
                finished,
            )
            for e in env_order
        }
        total = EnvLengths()
        for e in env_order:
            total = total + self.envs.get(e, EnvLengths())
        overall = _section(total, rollouts, groups, finished)
        # "odd size" is relative to each env's usual size: sum the envs' counts
        overall["group_size"]["odd_size_groups"] = sum(
            s["group_size"]["odd_size_groups"] for s in envs.values()
        )
        overall["group_size"]["usual"] = None if len(envs) > 1 else overall["group_size"]["usual"]
        return {"rows": self.rows, "overall": overall, "envs": envs}


def _rollouts(parts: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """One row per rollout from the per-file partial rows (a rollout may span files)."""
    if not parts:
        return pl.DataFrame(
            schema={
                "group_id": pl.String,
                "rollout_id": pl.String,
                "env": pl.String,
                "reward": pl.Float64,
                "samples": pl.Int64,
                "row": pl.Int64,
                "finished": pl.Float64,
            }
        )
    frames = list(parts)
    for col in ("group_id", "rollout_id"):
        # ints next to strings: only default rollout ids (row numbers) next to string ids, as
        # rollout_stats refuses an id column typed differently in two files
        if len({f.schema[col] for f in frames}) > 1:
            frames = [f.with_columns(pl.col(col).cast(pl.String)) for f in frames]
    df = pl.concat(frames, how="vertical_relaxed")
    if len(frames) == 1:
        return df
    return df.group_by("group_id", "rollout_id").agg(
        pl.col("env").sort_by("row").first(),
        pl.col("reward").sort_by("row").first(),
        pl.col("samples").sum(),
        pl.col("row").min(),
        pl.col("finished").max(),
    )


def _groups(rollouts: pl.DataFrame) -> pl.DataFrame:
    """One row per group: env, size (rollouts), reward min/max, first row, finish span."""
    return rollouts.group_by("group_id").agg(
        pl.col("env").sort_by("row").first(),
        pl.len().alias("size"),
        pl.col("reward").min().alias("reward_min"),
        pl.col("reward").max().alias("reward_max"),
        pl.col("row").min(),
        pl.col("finished").min().alias("started"),
        pl.col("finished").max().alias("completed"),
    )


def _section(
    lengths: EnvLengths, rollouts: pl.DataFrame, groups: pl.DataFrame, finished: bool
) -> dict[str, Any]:
    """The statistics of one env (or of all): see the module docstring for the definitions."""
    size = ValueCounts.of(groups["size"].to_numpy())
    usual = size.mode()
    branches = ValueCounts.of(rollouts["samples"].to_numpy())
    uniform = groups.filter((pl.col("size") >= 2) & (pl.col("reward_min") == pl.col("reward_max")))
    all_0 = int((uniform["reward_min"] == 0).sum())
    all_1 = int((uniform["reward_min"] == 1).sum())
    n_groups = len(groups)
    reward = Moments.of(rollouts["reward"].to_numpy())
    return {
        "groups": n_groups,
        "group_size": {
            "usual": usual,
            "odd_size_groups": int(size.counts[size.values != usual].sum()) if n_groups else 0,
            "counts": size.as_dict(),
        },
        "rollouts": len(rollouts),
        "samples": lengths.samples,
        "branches_per_rollout": {
            "mean": lengths.samples / len(rollouts) if len(rollouts) else None,
            "max": int(branches.values[-1]) if len(rollouts) else None,
            "counts": branches.as_dict(),
        },
        "sampled_tokens": lengths.sampled.summary(),
        "trainable_tokens": lengths.trainable.summary(),
        "reward": {"mean": reward.summary()["mean"], "std": reward.std},
        "uniform_groups": {
            "all_0": all_0,
            "all_1": all_1,
            "other": len(uniform) - all_0 - all_1,
            "total": len(uniform),
            "share": len(uniform) / n_groups if n_groups else None,
        },
        "completion": _completion(groups) if finished else None,
    }


def _completion(groups: pl.DataFrame) -> dict[str, Any]:
    """How out of order groups complete, relative to their input order.

    ``out_of_order_groups``: groups that complete before some group that comes earlier in the
    input (a consumer taking groups as they complete sees them early); ``displacement``: how far
    (in groups) a group's completion rank is from its input rank; ``rank_correlation``: Spearman
    correlation of the two orders (1 = in input order); ``span_s``: first to last completion;
    ``group_wait_s``: a group's first to last rollout finish (how long it waits for stragglers).
    """
    g = groups.sort("row")
    done = g["completed"].to_numpy().astype(np.float64)
    n = len(done)
    earlier_max = np.maximum.accumulate(np.concatenate([[-np.inf], done[:-1]]))
    late_rank = np.empty(n, dtype=np.int64)
    late_rank[np.argsort(done, kind="stable")] = np.arange(n)
    displacement = np.abs(late_rank - np.arange(n))
    corr = None
    if n > 1:
        corr = float(np.corrcoef(np.arange(n), late_rank)[0, 1])
    wait = (g["completed"] - g["started"]).to_numpy().astype(np.float64)
    return {
        "out_of_order_groups": int((done < earlier_max).sum()),
        "out_of_order_share": float((done < earlier_max).mean()),
        "displacement": {
            "mean": float(displacement.mean()),
            "p90": ValueCounts.of(displacement).quantile(0.9),
            "max": int(displacement.max()),
        },
        "rank_correlation": corr,
        "span_s": float(done.max() - done.min()),
        "group_wait_s": {k: v for k, v in percentiles(wait).items() if k != "min"},
    }


def _token_format(file: InputFile, schema: pa.Schema) -> str:
    """The file's token format (`rolltool.schema.token_format`: a lone ``loss_mask`` is enough
    here, as stats reads only the mask); an error naming what is missing."""
    names = set(schema.names)
    missing = [c for c in ("group_id", "reward") if c not in names]
    fmt = token_format(names)
    if fmt is None:
        missing.append("loss_mask (or prompt_ids and response_ids)")
    if missing:
        raise RolltoolError(
            f"{file.path}: not rollout Parquet: column {', '.join(missing)} missing", hint=HINT
        )
    return str(fmt)


def _ones(col: pl.Expr, dtype: pa.DataType) -> pl.Expr:
    """Elements equal to 1 (or True) per list; a null list counts 0."""
    if pa.types.is_boolean(dtype.value_type):
        return col.list.sum().fill_null(0)
    return col.list.eval(pl.element() == 1).list.sum().fill_null(0)


def _length(col: pl.Expr) -> pl.Expr:
    return col.list.len().fill_null(0)


def _as_float(col: pl.Expr, dtype: pa.DataType) -> pl.Expr:
    """float64 values; timestamps become seconds since the epoch."""
    if pa.types.is_timestamp(dtype):
        return col.dt.epoch("us").cast(pl.Float64) / 1e6
    return col.cast(pl.Float64)


def _frame(
    path: str, columns: Sequence[str], first_row: int, offset: int = 0, limit: int | None = None
) -> pl.LazyFrame:
    """Rows ``offset`` to ``offset + limit`` of the file (`columns` of it at least), with the
    ``row`` index from ``first_row``. A URI is read with pyarrow through its filesystem (the row
    groups holding those rows): polars knows neither pyarrow's filesystems nor its URI options
    (``?endpoint_override=``), and must never guess an endpoint of its own."""
    if not is_remote(path):
        lf = pl.scan_parquet(path, hive_partitioning=False).with_row_index("row", first_row)
        return lf.slice(offset, limit) if offset or limit is not None else lf
    meta = footer(path)
    end = meta.num_rows if limit is None else min(meta.num_rows, offset + limit)
    groups, start, at = [], None, 0
    for i in range(meta.num_row_groups):
        n = meta.row_group(i).num_rows
        if at + n > offset and at < end:
            groups.append(i)
            start = at if start is None else start
        at += n
    start = offset if start is None else start
    loc = locate_input(path)
    with loc.fs.open_input_file(loc.path) as f:
        table = pq.ParquetFile(f, metadata=meta).read_row_groups(groups, columns=list(columns))
    lf = pl.from_arrow(table).lazy().with_row_index("row", first_row + start)  # type: ignore[union-attr]
    return lf.slice(offset - start, max(end - offset, 0))


def _sources(file: InputFile, rename: Mapping[str, str]) -> dict[str, str]:
    """Schema column name -> the file's column holding it."""
    return source_names(footer(file.path).schema.to_arrow_schema().names, rename)


def _columns(file: InputFile, rename: Mapping[str, str]) -> Any:
    """``col(name)``: the expression reading schema column ``name`` of ``file`` (a renamed
    column, or a hive partition value)."""
    source = _sources(file, rename)

    def col(name: str) -> pl.Expr:
        if name not in source:  # a hive partition value (file_schema added it)
            return pl.lit(file.partitions[name], pl.String)
        return pl.col(source[name])

    return col


def group_end(files: Sequence[InputFile], rename: Mapping[str, str], limit: int) -> int:
    """How many rows ``--limit limit`` reads: ``limit``, then on to the end of the group of the
    limit-th row (the rows right after it with the same ``group_id``, into later files too), so
    a group whose rows are contiguous is never cut in half. Reads only ``group_id``."""
    first = 0
    rows = limit
    group: Any = None
    for f in files:
        if first + f.rows < limit:  # before the limit-th row
            first += f.rows
            continue
        offset = max(0, limit - 1 - first)
        first += f.rows
        col = _columns(f, rename)
        try:
            wanted = [c for n, c in _sources(f, rename).items() if n == "group_id"]
            ids = (
                _frame(f.path, wanted, 0)
                .select(col("group_id").alias("g"), pl.col("row"))
                .slice(offset)
                .collect()["g"]
            )
        except (OSError, KeyError, pa.ArrowException, pl.exceptions.PolarsError):
            return rows  # not rollout Parquet: file_stats says what is wrong
        if group is None:  # the file holding the limit-th row
            group, ids = ids[0], ids[1:]
        if ids.dtype == pl.Null or not len(ids):
            continue
        other = (ids != group).fill_null(True).arg_true()
        if len(other):
            return rows + int(other[0])
        rows += len(ids)
    return rows


READ = ("group_id", "rollout_id", "env", "reward", "finished_at", "loss_mask", "prompt_ids",
        "response_ids")  # fmt: skip
"""The schema columns `file_stats` reads (of a remote file, only those are fetched)."""


def file_stats(
    file: InputFile,
    rename: Mapping[str, str],
    first_row: int,
    limit: int | None = None,
    offset: int = 0,
) -> RolloutStats:
    """Statistics of one file; ``first_row`` is its first row's index in the ordered input.

    ``offset``, ``limit``: read at most ``limit`` rows of the file, from row ``offset`` of it
    (polars skips the row groups before). One lazy polars scan reads the light
    columns and the token column(s), reduced at once to list lengths (streaming engine: memory
    stays bounded by a morsel of rows, not by the file's tokens).
    """
    schema = file_schema(file, rename)
    fmt = _token_format(file, schema)
    types = {f.name: f.type for f in schema}
    col = _columns(file, rename)

    # trainable: the targets, as pack counts them (the first token is never one: rolltool.schema)
    if fmt == "input_ids":
        length = _length(col("loss_mask"))
        first = col("loss_mask").list.first().cast(pl.Int64).fill_null(0) == 1
        trainable = _ones(col("loss_mask"), types["loss_mask"]) - first.cast(pl.Int64)
    else:
        response, prompt = _length(col("response_ids")), _length(col("prompt_ids"))
        trainable = response - ((prompt == 0) & (response > 0)).cast(pl.Int64)
        length = prompt + response
    has = set(types)
    exprs = [
        col("group_id").alias("group_id"),
        (col("rollout_id") if "rollout_id" in has else pl.col("row")).alias("rollout_id"),
        (col("env").cast(pl.String) if "env" in has else pl.lit(DEFAULT_ENV)).alias("env"),
        _as_float(col("reward"), types["reward"]).alias("reward"),
        length.cast(pl.Int64).alias("length"),
        trainable.cast(pl.Int64).alias("trainable"),
        pl.col("row"),
        (
            _as_float(col("finished_at"), types["finished_at"])
            if "finished_at" in has
            else pl.lit(None, pl.Float64)
        ).alias("finished"),
    ]
    wanted = [c for n, c in _sources(file, rename).items() if n in READ]
    try:
        lf = _frame(file.path, wanted, first_row, offset, limit)
        df = lf.select(exprs).collect(engine="streaming")
    except (OSError, pa.ArrowException, pl.exceptions.PolarsError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None
    df = df.with_columns(pl.col("row").cast(pl.Int64))
    if "rollout_id" not in has:
        df = df.with_columns(pl.col("rollout_id").cast(pl.Int64))
    envs = {}
    for (env,), part in df.group_by("env"):
        envs[str(env)] = EnvLengths(
            len(part),
            ValueCounts.of(part["length"].to_numpy()),
            ValueCounts.of(part["trainable"].to_numpy()),
        )
    rollouts = df.group_by("group_id", "rollout_id").agg(
        pl.col("env").first(),
        pl.col("reward").first(),
        pl.len().cast(pl.Int64).alias("samples"),
        pl.col("row").min(),
        pl.col("finished").max(),
    )
    return RolloutStats(len(df), envs, (rollouts,) if len(df) else (), "finished_at" in has)


def pieces(files: Sequence[InputFile], rename: Mapping[str, str], read: int | None) -> list[Piece]:
    """The input cut into `Piece` s, in order: each file in runs of whole row groups of at least
    ``PIECE_TOKENS`` tokens (footers only); only the first `read` rows (None: all).
    A file with no row is a piece too (its schema is checked)."""
    out: list[Piece] = []
    first = 0
    for f in files:
        if read is not None and read - first <= 0:
            break
        end = f.rows if read is None else min(f.rows, read - first)
        offset = 0
        held = at = 0
        for n, b in _row_groups(f, rename):
            at, held = at + n, held + b
            if held >= PIECE_TOKENS and offset < at < end:
                out.append(Piece(f, first, offset, at - offset))
                offset, held = at, 0
        out.append(Piece(f, first, offset, None if read is None else end - offset))
        first += f.rows
    return out


def _row_groups(file: InputFile, rename: Mapping[str, str]) -> list[tuple[int, int]]:
    """(rows, values of the token columns) of each row group, from the footer."""
    meta = footer(file.path)
    names = source_names(meta.schema.to_arrow_schema().names, rename)
    wanted = {names[c] for c in TOKEN_COLUMNS if c in names}
    out = []
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        chunks = (group.column(j) for j in range(group.num_columns))
        size = sum(c.num_values for c in chunks if c.path_in_schema.split(".")[0] in wanted)
        out.append((group.num_rows, size))
    return out


def piece_stats(piece: Piece, *, rename: Mapping[str, str]) -> RolloutStats:
    """Statistics of one `Piece` (`file_stats`): pure, it may run in any process."""
    return file_stats(piece.file, rename, piece.first_row, piece.rows, piece.offset)


def rollout_stats(
    inputs: Sequence[str],
    *,
    columns: Mapping[str, str] | None = None,
    limit: int | None = None,
    progress: Any = None,
    mapper: Mapper | None = None,
) -> Stats:
    """Statistics of rollout Parquet ``inputs`` (files, directories, globs).

    ``columns``: ``--column NEW=OLD`` pairs; ``limit``: read the first N rows of the ordered
    input and on to the end of the last group started (``group_end``); ``progress(iterable,
    total, description)`` may wrap the loop over pieces; ``mapper``: computes the pieces
    elsewhere (Ray tasks), the same report.
    """
    if limit is not None and limit < 1:
        raise RolltoolError(f"--limit must be at least 1, got {limit}")
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    check_mapping(files, rename)
    # From the schemas alone, before reading a row: also the files --limit will not reach.
    conflicts = id_type_conflicts((f.path, file_schema(f, rename)) for f in files)
    if conflicts:  # as `rolltool pack` and `advantages` refuse it (rolltool.schema.scan)
        raise RolltoolError(
            "; ".join(conflicts),
            hint='use one type per id column in every file (1 and "1" are not the same id)',
        )
    read = None if limit is None else group_end(files, rename, limit)
    todo = pieces(files, rename, read)
    fn = functools.partial(piece_stats, rename=rename)
    if mapper is None:
        wrap = progress or (lambda it, total, desc: it)
        parts = [fn(p) for p in wrap(todo, len(todo), "reading rollouts")]
    else:
        parts = list(mapper(fn, todo))
    acc = RolloutStats()
    for part in parts:  # in input order
        acc = acc + part
    report = {
        "kind": "rollouts",
        "inputs": [{"path": f.path, "rows": f.rows} for f in files],
        "limit": limit,
        **acc.report(),
    }
    return Stats(
        report=report, lengths={e: acc.envs[e].sampled for e in report["envs"] if e in acc.envs}
    )
