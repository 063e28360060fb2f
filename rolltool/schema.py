"""The rollout schema: check the input and extract its light per-sample columns.

One Parquet row is one trainable sample (a branch of a rollout). `scan` streams the input once,
checks every rule below and returns a `Rollouts` holding the light columns (ids, env, reward,
lengths, finish times) as NumPy arrays. Token lists are looked at batch by batch and never kept.

Rules, all reported together (file, column, sample) before anything is written:
missing or mistyped columns; an id column (``group_id``, ``rollout_id``, ``sample_id``) that is
integer in one file and string in another (1 and "1" are not the same id, and we do not guess);
nulls in required columns; ``loss_mask``/``logprobs`` length different from ``input_ids``;
loss-mask values other than 0/1; negative token ids or ids above 2**31 - 1 (packed as int32);
null or non-finite values inside ``logprobs`` lists (a null list is fine: logprobs are optional
per sample); non-finite rewards; branches of one rollout with different rewards; duplicate
``sample_id``; a group spread over two envs; empty sequences. Samples with no trainable token are
allowed but counted and warned about.

Identity: a group is its ``group_id``; a rollout is the pair (``group_id``, ``rollout_id``), so
rollout ids may restart in every group; without ``rollout_id`` every row is its own rollout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rolltool.errors import RolltoolError
from rolltool.source import InputFile, check_mapping, file_schema, iter_row_groups

ID_COLUMNS = ("group_id", "rollout_id", "sample_id")
TOKEN_COLUMNS = ("input_ids", "loss_mask", "logprobs", "prompt_ids", "response_ids")
LIGHT_COLUMNS = ("group_id", "rollout_id", "sample_id", "env", "reward", "finished_at")
SCAN_COLUMNS = LIGHT_COLUMNS + TOKEN_COLUMNS
FORMAT_COLUMNS = {"input_ids": ("input_ids", "loss_mask"), "prompt_response": TOKEN_COLUMNS[3:]}
DEFAULT_ENV = "default"
MAX_LISTED = 8  # problems listed per kind; the rest are counted
MAX_ID = 2**31 - 1  # token ids are packed as int32


def _is_id(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list_of(t: pa.DataType, pred: Callable[[pa.DataType], bool]) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pred(t.value_type)


def _is_mask_value(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


# column -> (type check, description for the message)
COLUMN_TYPES = {
    "group_id": (_is_id, "string or integer"),
    "rollout_id": (_is_id, "string or integer"),
    "sample_id": (_is_id, "string or integer"),
    "env": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string"),
    "reward": (_is_number, "float"),
    "input_ids": (lambda t: _is_list_of(t, pa.types.is_integer), "list of int"),
    "prompt_ids": (lambda t: _is_list_of(t, pa.types.is_integer), "list of int"),
    "response_ids": (lambda t: _is_list_of(t, pa.types.is_integer), "list of int"),
    "loss_mask": (lambda t: _is_list_of(t, _is_mask_value), "list of bool/int"),
    "logprobs": (lambda t: _is_list_of(t, _is_number), "list of float"),
    "finished_at": (lambda t: pa.types.is_timestamp(t) or _is_number(t), "timestamp or float"),
}


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """Light columns of the ordered input: one entry per row (= trainable sample).

    Row i is ``sample_index`` i: the row number over the input files in sorted path order.
    """

    files: list[InputFile]
    """Input files in order, with row counts."""
    file_index: np.ndarray  # [n] int32: which file row i came from
    sample_id: pa.Array  # [n] the user's sample ids (string or int64); default: sample_index
    group: np.ndarray  # [n] int64: dense group code, numbered in order of first appearance
    group_ids: pa.Array  # [G] the original group_id of each group code
    rollout_ids: pa.Array  # [R] the original rollout_id of each rollout code (row number if none)
    rollout: np.ndarray  # [n] int64: dense rollout code over (group_id, rollout_id)
    env: np.ndarray  # [n] int32: code into env_names
    env_names: list[str]  # env names in order of first appearance
    reward: np.ndarray  # [n] float64
    length: np.ndarray  # [n] int64: tokens in the sample (prompt and all turns)
    trainable: np.ndarray  # [n] int64: tokens with loss_mask 1
    finished_at: np.ndarray | None  # [n] float64 seconds since the epoch, or None
    token_format: str  # "input_ids" (input_ids + loss_mask) or "prompt_response"
    has_logprobs: bool
    columns: list[str]  # every column of the input (schema names, after --column)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return len(self.group)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def label(self, i: int) -> str:
        """How messages name sample i: its sample_id and its file."""
        f = self.files[int(self.file_index[i])].path
        return f"sample {self.sample_id[i].as_py()!r} ({f})"


class _Problems:
    """Collects problems by kind; lists the first few of each kind, counts the rest."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[str]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        if len(self.by_kind[kind]) < MAX_LISTED:
            self.by_kind[kind].append(text)

    def raise_if_any(self) -> None:
        if not self.counts:
            return
        total = sum(self.counts.values())
        lines = [f"the input has {total} problem{'s' * (total != 1)}; nothing was written:"]
        for kind, texts in self.by_kind.items():
            lines.extend(f"  {t}" for t in texts)
            more = self.counts[kind] - len(texts)
            if more:
                lines.append(f"  ... and {more} more like the above ({kind})")
        raise RolltoolError(
            "\n".join(lines),
            hint="fix these rows or columns; map differently named columns with --column NEW=OLD",
        )


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(offsets rebased to 0, flat values) of a list array, slice-safe."""
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.values.slice(offsets[0], offsets[-1] - offsets[0])
    return offsets - offsets[0], values


def _row_sums(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of `values` (bool or int) over each row [offsets[i], offsets[i+1]); 0 for empty rows.

    One pass with np.add.reduceat over the non-empty rows: their starts increase strictly and
    each one's span ends where the next non-empty row starts (empty rows hold no values).
    """
    n = len(offsets) - 1
    sums = np.zeros(n, dtype=np.int64)
    full = np.flatnonzero(offsets[1:] > offsets[:-1])
    if len(full):
        vals = values.view(np.uint8) if values.dtype == np.bool_ else values
        sums[full] = np.add.reduceat(vals, offsets[:-1][full], dtype=np.int64)
    return sums


def _rows_of(offsets: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Rows (list indices) holding at least one flagged value; `bad` is [values] bool."""
    return np.unique(np.searchsorted(offsets, np.flatnonzero(bad), side="right") - 1)


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass
class _FileScan:
    ids: dict[str, list[pa.Array]] = field(default_factory=lambda: defaultdict(list))
    reward: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    trainable: list[np.ndarray] = field(default_factory=list)
    finished: list[np.ndarray] = field(default_factory=list)


def _check_columns(
    file: InputFile, schema: pa.Schema, problems: _Problems
) -> tuple[str | None, set[str]]:
    """Column-level checks: (token format, mistyped columns).

    The format is None when a required column is missing or mistyped and the file can't be
    scanned; a mistyped optional column is only left out of the scan, so that the file's
    row-level problems are still reported.
    """
    names = set(schema.names)
    ok = True
    for col in ("group_id", "reward"):
        if col not in names:
            problems.add("missing column", f"{file.path}: column '{col}' is missing (required)")
            ok = False
    fmt = None
    if {"input_ids", "loss_mask"} <= names:
        fmt = "input_ids"
    elif {"prompt_ids", "response_ids"} <= names:
        fmt = "prompt_response"
    else:
        have = sorted(names & set(TOKEN_COLUMNS))
        problems.add(
            "missing column",
            f"{file.path}: needs columns 'input_ids' and 'loss_mask' "
            f"(or 'prompt_ids' and 'response_ids'); found {have or 'none of them'}",
        )
        ok = False
    mistyped = set()
    for name, (check, desc) in COLUMN_TYPES.items():
        if name in names and not check(schema.field(name).type):
            problems.add(
                "mistyped column",
                f"{file.path}: column '{name}' has type {schema.field(name).type}, expected {desc}",
            )
            mistyped.add(name)
    required = {"group_id", "reward", *FORMAT_COLUMNS.get(fmt or "", ())}
    return (fmt if ok and not (mistyped & required) else None), mistyped


def _scan_batch(
    batch: pa.RecordBatch,
    fmt: str,
    file: InputFile,
    first_row: int,
    acc: _FileScan,
    problems: _Problems,
    skip: set[str],
) -> None:
    n = batch.num_rows
    cols = {k: v for k, v in zip(batch.schema.names, batch.columns, strict=True) if k not in skip}
    if "sample_id" in cols:
        sid = cols["sample_id"]
    else:
        sid = pa.array(np.arange(first_row, first_row + n, dtype=np.int64))
    acc.ids["sample_id"].append(sid)

    def name(i: int | np.integer) -> str:
        if not sid[i].is_valid:
            return f"{file.path}: row {first_row + int(i)} of the ordered input"
        return f"{file.path}: sample {sid[i].as_py()!r}"

    if "sample_id" in cols:
        for i in np.flatnonzero(sid.is_null().to_numpy(zero_copy_only=False)):
            problems.add("null sample_id", f"{name(i)}: column 'sample_id' is null")
    for col in ("group_id", "rollout_id", "env"):
        if col in cols:
            arr = cols[col]
            for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)):
                problems.add(f"null {col}", f"{name(i)}: column '{col}' is null")
            acc.ids[col].append(arr)

    reward = pc.cast(cols["reward"], pa.float64()).to_numpy(zero_copy_only=False)
    reward = np.asarray(reward, dtype=np.float64)
    for i in np.flatnonzero(~np.isfinite(reward)):
        problems.add("reward", f"{name(i)}: column 'reward' is not finite ({reward[i]})")
    acc.reward.append(reward)

    if fmt == "input_ids":
        ids, mask = cols["input_ids"], cols["loss_mask"]
        length = _lengths(ids)
        mask_len = _lengths(mask)
        for col, arr in (("input_ids", ids), ("loss_mask", mask)):
            for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)):
                problems.add(f"null {col}", f"{name(i)}: column '{col}' is null")
        for i in np.flatnonzero(mask_len != length):
            problems.add(
                "length",
                f"{name(i)}: column 'loss_mask' has {mask_len[i]} values, 'input_ids' has {length[i]}",
            )
        offsets, values = _list_parts(mask)
        if pa.types.is_boolean(values.type) and values.null_count == 0:
            # bool: always 0/1; polars counts set bits per list without unpacking them.
            counts = pl.Series(mask.cast(pa.large_list(pa.bool_()))).list.sum()
            trainable = counts.fill_null(0).to_numpy().astype(np.int64)
        else:
            mvals = pc.cast(values, pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
            bad = (mvals != 0) & (mvals != 1)
            if bad.any():
                for i in _rows_of(offsets, bad):
                    problems.add(
                        "mask", f"{name(i)}: column 'loss_mask' holds values other than 0/1"
                    )
            trainable = _row_sums(offsets, mvals == 1)
        tok_arrays = [("input_ids", ids)]
    else:
        p, r = cols["prompt_ids"], cols["response_ids"]
        for col, arr in (("prompt_ids", p), ("response_ids", r)):
            for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)):
                problems.add(f"null {col}", f"{name(i)}: column '{col}' is null")
        trainable = _lengths(r)
        length = _lengths(p) + trainable
        tok_arrays = [("prompt_ids", p), ("response_ids", r)]
    for col, arr in tok_arrays:
        offsets, values = _list_parts(arr)
        if values.null_count == 0:
            lo_hi = pc.min_max(values)
            if len(values) == 0 or (lo_hi["min"].as_py() >= 0 and lo_hi["max"].as_py() <= MAX_ID):
                continue  # the common case, checked in one pass
        flat = values.fill_null(0).to_numpy(zero_copy_only=False)
        null = values.is_null().to_numpy(zero_copy_only=False)
        for bad, what in (
            ((flat < 0) | null, "negative or null token ids"),
            (flat > MAX_ID, "token ids above 2**31 - 1 (the int32 maximum, 2,147,483,647)"),
        ):
            for i in _rows_of(offsets, bad):
                problems.add("token", f"{name(i)}: column '{col}' holds {what}")
    if "logprobs" in cols:
        lp = cols["logprobs"]
        lp_len = _lengths(lp)
        lp_null = lp.is_null().to_numpy(zero_copy_only=False)
        for i in np.flatnonzero((lp_len != length) & ~lp_null):
            problems.add(
                "length",
                f"{name(i)}: column 'logprobs' has {lp_len[i]} values, the sequence has {length[i]} tokens",
            )
        # A null list means "no logprobs for this sample" (packed as 0); a value inside a list
        # must be a finite number, or the trainer's importance ratios become nan.
        offsets, values = _list_parts(lp)
        if pa.types.is_floating(values.type):
            finite = pc.is_finite(values).fill_null(False)
        else:  # integers: only a null can be wrong
            finite = values.is_valid()
        if len(values) and not pc.all(finite).as_py():
            for i in _rows_of(offsets, ~finite.to_numpy(zero_copy_only=False)):
                problems.add(
                    "logprobs", f"{name(i)}: column 'logprobs' holds null or non-finite values"
                )
    for i in np.flatnonzero(length == 0):
        problems.add("empty", f"{name(i)}: the sequence is empty")
    acc.length.append(length)
    acc.trainable.append(trainable)

    if "finished_at" in cols:
        fin = cols["finished_at"]
        if pa.types.is_timestamp(fin.type):
            fin = pc.divide(pc.cast(pc.cast(fin, pa.timestamp("us")), pa.int64()), 1e6)
        seconds = np.asarray(
            pc.cast(fin, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64
        )
        for i in np.flatnonzero(~np.isfinite(seconds)):
            problems.add("finished_at", f"{name(i)}: column 'finished_at' is null or not finite")
        acc.finished.append(seconds)


def id_type_conflicts(schemas: Iterable[tuple[str, pa.Schema]]) -> list[str]:
    """Id columns that are integers in one file and strings in another, one message each.

    `schemas`: (path, schema after --column) per file. Reading 1 and "1" as one id (or as two)
    would be a guess either way, so the input is refused; files without the column don't count.

    >>> a = pa.schema([("group_id", pa.int64())]); b = pa.schema([("group_id", pa.string())])
    >>> id_type_conflicts([("a.parquet", a), ("b.parquet", b)])
    ["column 'group_id' is integer in a.parquet but string in b.parquet"]
    """
    first: dict[tuple[str, str], str] = {}  # (column, kind) -> first file with it
    for path, schema in schemas:
        for col in ID_COLUMNS:
            if col in schema.names and _is_id(t := schema.field(col).type):
                kind = "integer" if pa.types.is_integer(t) else "string"
                first.setdefault((col, kind), path)
    return [
        f"column '{col}' is integer in {first[(col, 'integer')]} but string in "
        f"{first[(col, 'string')]}"
        for col in ID_COLUMNS
        if (col, "integer") in first and (col, "string") in first
    ]


def _concat_ids(parts: list[pa.Array]) -> pa.Array:
    """Concatenate id arrays from several files (of one kind, see `id_type_conflicts`).

    Integer widths become int64, string kinds one string type; integers still meet strings
    where a file without ``sample_id`` (default ids: row numbers) meets one with string ids:
    those become strings (and a clash is reported as a duplicate sample_id).
    """
    types = {a.type for a in parts}
    if len(types) > 1:
        if all(_is_id(t) for t in types) and any(pa.types.is_integer(t) for t in types):
            if any(not pa.types.is_integer(t) for t in types):
                parts = [pc.cast(a, pa.string()) for a in parts]
            else:
                parts = [pc.cast(a, pa.int64()) for a in parts]
        else:
            parts = [pc.cast(a, pa.large_string()) for a in parts]
    if not parts:
        return pa.array([], pa.int64())
    return pa.concat_arrays(parts)


def _codes(df: pl.DataFrame, keys: list[str]) -> tuple[np.ndarray, pl.DataFrame]:
    """Dense codes of the key tuple per row, numbered in order of first appearance."""
    uniques = df.select(keys).unique(maintain_order=True).with_row_index("_code")
    joined = df.select(keys).join(
        uniques, on=keys, how="left", maintain_order="left", nulls_equal=True
    )
    return joined["_code"].to_numpy().astype(np.int64), uniques


def _row_group_batches(
    k: int,
    file: InputFile,
    rename: Mapping[str, str],
    on_row_group: Callable[[int, int, pa.Table], None] | None,
) -> Iterator[pa.RecordBatch]:
    for rg, table in iter_row_groups(file, rename, SCAN_COLUMNS):
        if on_row_group is not None:
            on_row_group(k, rg, table)
        yield from table.to_batches(max_chunksize=65_536)


def scan(
    files: Sequence[InputFile],
    rename: Mapping[str, str] | None = None,
    tables: Iterable[pa.Table] | None = None,
    on_row_group: Callable[[int, int, pa.Table], None] | None = None,
) -> Rollouts:
    """Check the input and return its light columns; raises RolltoolError listing every problem.

    `tables` (one per file, already read) skips reading the files again. Otherwise files are
    read row group by row group, and `on_row_group(file_index, row_group, table)` sees each one
    (the packer keeps the token columns of as many as its cache allows, to avoid a second read).
    """
    rename = dict(rename or {})
    check_mapping(files, rename)
    problems = _Problems()
    warnings: list[str] = []
    scans: list[_FileScan] = []
    file_index: list[np.ndarray] = []
    formats: set[str] = set()
    columns: list[str] = []
    has_logprobs = True
    table_iter = iter(tables) if tables is not None else None
    first_row = 0
    column_problems = False
    schemas = []
    for k, file in enumerate(files):
        schema = file_schema(file, rename)
        schemas.append((file.path, schema))
        for n in schema.names:
            if n not in columns:
                columns.append(n)
        fmt, mistyped = _check_columns(file, schema, problems)
        column_problems |= fmt is None or bool(mistyped)
        table = next(table_iter) if table_iter is not None else None
        if fmt is None:
            first_row += file.rows
            continue
        formats.add(fmt)
        has_logprobs &= "logprobs" in schema.names
        acc = _FileScan()
        batches = (
            table.to_batches(max_chunksize=65_536)
            if table is not None
            else _row_group_batches(k, file, rename, on_row_group)
        )
        row = first_row
        for batch in batches:
            _scan_batch(batch, fmt, file, row, acc, problems, mistyped)
            row += batch.num_rows
        scans.append(acc)
        file_index.append(np.full(row - first_row, k, dtype=np.int32))
        first_row = row
    if len(formats) > 1:
        problems.add(
            "format",
            "some files have 'input_ids'/'loss_mask' and others only 'prompt_ids'/'response_ids'; "
            "use one token format for the whole input",
        )
        column_problems = True
    for text in id_type_conflicts(schemas):
        problems.add("id type", text)
        column_problems = True
    if column_problems:  # with them, rows can't be compared across the input: stop here
        problems.raise_if_any()

    def cat(name: str) -> list[np.ndarray]:
        return [a for s in scans for a in getattr(s, name)]

    n = first_row
    reward = np.concatenate(cat("reward")) if n else np.zeros(0)
    length = np.concatenate(cat("length")) if n else np.zeros(0, np.int64)
    trainable = np.concatenate(cat("trainable")) if n else np.zeros(0, np.int64)
    fidx = np.concatenate(file_index) if file_index else np.zeros(0, np.int32)
    sample_id = _concat_ids([a for s in scans for a in s.ids["sample_id"]])
    group_arr = _concat_ids([a for s in scans for a in s.ids["group_id"]])
    finished = None
    fin_parts = cat("finished")
    if fin_parts and sum(len(a) for a in fin_parts) == n:
        finished = np.concatenate(fin_parts)
    elif fin_parts:
        problems.add("finished_at", "column 'finished_at' is present in some files but not all")

    frame = {"group_id": pl.Series(group_arr), "sample_id": pl.Series(sample_id)}
    env_parts = [a for s in scans for a in s.ids["env"]]
    if env_parts and sum(len(a) for a in env_parts) != n:
        problems.add("env", "column 'env' is present in some files but not all")
        env_parts = []
    frame["env"] = (
        pl.Series(_concat_ids(env_parts))
        if env_parts
        else pl.Series([DEFAULT_ENV] * n, dtype=pl.String)
    )
    ro_parts = [a for s in scans for a in s.ids["rollout_id"]]
    if ro_parts and sum(len(a) for a in ro_parts) != n:
        problems.add("rollout_id", "column 'rollout_id' is present in some files but not all")
        ro_parts = []
    frame["rollout_id"] = pl.Series(_concat_ids(ro_parts)) if ro_parts else pl.Series(np.arange(n))
    df = pl.DataFrame(frame).with_columns(
        pl.Series("reward", reward), pl.Series("row", np.arange(n, dtype=np.int64))
    )

    def where(i: int | np.integer) -> str:
        return f"{files[int(fidx[i])].path}: sample {sample_id[i].as_py()!r}"

    dup = df.filter(pl.col("sample_id").is_duplicated() & pl.col("sample_id").is_not_null())
    for first_i in dup.group_by("sample_id", maintain_order=True).agg(pl.col("row"))["row"]:
        rows = list(first_i)
        problems.add(
            "duplicate",
            f"{where(rows[1])}: column 'sample_id' repeats (also at row {rows[0]} of the ordered input)",
        )
    group, group_uniques = _codes(df, ["group_id"])
    rollout, rollout_uniques = _codes(df, ["group_id", "rollout_id"])
    env_codes, env_uniques = _codes(df, ["env"])
    df = df.with_columns(
        pl.Series("_g", group), pl.Series("_r", rollout), pl.Series("_e", env_codes)
    )
    # branches of one rollout share the reward (non-finite rewards are reported above)
    spread = (
        df.filter(pl.col("reward").is_finite())
        .group_by("_r")
        .agg(
            pl.col("reward").min().alias("lo"),
            pl.col("reward").max().alias("hi"),
            pl.col("row").first(),
        )
    )
    for rec in spread.filter(pl.col("lo") != pl.col("hi")).sort("row").iter_rows(named=True):
        problems.add(
            "branch reward",
            f"{where(rec['row'])}: column 'reward': branches of one rollout have different "
            f"rewards ({rec['lo']} vs {rec['hi']})",
        )
    envs = df.group_by("_g").agg(  # null envs are reported above
        pl.col("env").drop_nulls().n_unique().alias("k"),
        pl.col("row").first(),
        pl.col("env").drop_nulls().unique(),
    )
    for grec in envs.filter(pl.col("k") > 1).sort("row").iter_rows(named=True):
        problems.add(
            "group env",
            f"{where(grec['row'])}: column 'env': group {df['group_id'][grec['row']]!r} is spread over "
            f"envs {sorted(grec['env'])}",
        )
    problems.raise_if_any()

    no_train = int((trainable == 0).sum())
    if no_train:
        warnings.append(f"{no_train} sample(s) have no trainable token (loss_mask all 0)")
    env_names = [str(v) for v in env_uniques["env"].to_list()]
    return Rollouts(
        files=list(files),
        file_index=fidx,
        sample_id=sample_id,
        group=group,
        group_ids=group_uniques["group_id"].to_arrow(),
        rollout_ids=rollout_uniques["rollout_id"].to_arrow(),
        rollout=rollout,
        env=env_codes.astype(np.int32),
        env_names=env_names,
        reward=reward,
        length=length,
        trainable=trainable,
        finished_at=finished,
        token_format=formats.pop() if formats else "input_ids",
        has_logprobs=bool(has_logprobs and scans),
        columns=columns,
        warnings=warnings,
    )
