"""`rolltool verify`: check a packed directory against its own records, independently and exactly.

A pack has three records that must agree: the shards (what a trainer reads), ``samples.parquet``
(where every sample went, its length, trainable tokens, advantage and weight) and
``manifest.json`` (config, per-step metadata and denominators, file hashes). Hashes only show that
files were not changed after the manifest was written; the checks below also catch files edited
with the manifest's hashes updated, because each value is recomputed from another record.
Problems name the step, rank, micro-batch and sample they concern.

Files and structure:

- every file listed in the manifest exists with its recorded size and sha256;
- shards are readable and self-consistent; a (step, rank)'s files hold its micro-batches in order
  and every rank has the number of micro-batches the manifest says, the same on every rank;
- no micro-batch holds more real tokens than ``micro_batch_tokens``; rows have ``row_len``
  tokens when it is set; ``cu_seqlens`` and ``position_ids`` (as the reader derives them) start
  at 0 at every segment; padding carries no loss mask, weight or advantage.

Every real segment (a sample), against ``samples.parquet``:

- the sample is planned (status ``trained``) at this step, rank and micro-batch, appears exactly
  once in the run, and every planned sample appears;
- its length and loss-mask count equal ``length`` and ``trainable_tokens``; its advantage equals
  ``advantage`` exactly (float32);
- its per-token loss weight equals ``token_loss_weight`` exactly, and equals the weight recomputed
  from the aggregation formula (manifest ``loss.agg``/``loss.scale_factor``, the step's trained
  samples' ``trainable_tokens``) up to float32 rounding.

Every step, against the manifest:

- T (trainable tokens) and S (samples with a trainable token), recomputed from
  ``samples.parquet``, equal the recorded ``denominators``, and so does the weight sum the
  aggregation implies; the loss weights in the shards sum to it (relative error <= 1e-6);
- samples, sampled tokens and trainable tokens counted from the rows equal the step's metadata
  (overall, per env and per rank), and so do the loss-weight sum and the advantage mean/std.

With the input (``inputs`` given, or the manifest's recorded input files when they all exist):
every packed sample's ``input_ids``, ``loss_mask`` and ``logprobs`` equal the input's, and the
input's row counts equal the manifest's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.layout import check_rows, unpack_row
from rolltool.reader import PackedDataset, open_packed
from rolltool.shards import file_record, read_shard
from rolltool.source import InputFile, invert_mapping, resolve_inputs
from rolltool.tokens import TokenReader

MAX_LISTED = 20
STATUSES = ("trained", "uniform_dropped", "overlong_dropped", "leftover", "env_unweighted")
# Weights are float32 roundings of exact values: at most half an ulp (2^-24 relative) off.
WEIGHT_RTOL = 2.0**-23
SUM_RTOL = 1e-6


class _Problems:
    """Problem texts (the first MAX_LISTED) and the total count; texts are built lazily."""

    def __init__(self) -> None:
        self.listed: list[str] = []
        self.count = 0

    def __call__(self, text: str) -> None:
        self.many([0], lambda _: text)

    def many(self, items: Sequence[Any] | np.ndarray, text: Callable[[Any], str]) -> None:
        """One problem per item; only as many texts are built as can still be listed."""
        room = MAX_LISTED - len(self.listed)
        for item in list(items[:room]) if room > 0 else []:
            self.listed.append(text(item))
        self.count += len(items)


def verify(
    path: str | os.PathLike[str],
    *,
    hashes: bool = True,
    inputs: Sequence[str | os.PathLike[str]] | None = None,
    recorded_inputs: bool = True,
) -> dict[str, Any]:
    """Check a packed directory; returns {"ok", "problems", "checked"} (never raises on data).

    Token content is compared with `inputs` when given, else with the input files the manifest
    records when `recorded_inputs` and they all exist; ``checked["input_samples"]`` counts the
    samples compared (absent when the input was not read).
    """
    ds = open_packed(path)
    problems = _Problems()
    checked: dict[str, int] = {}
    _check_files(ds, hashes, problems, checked)
    if not problems.count:
        _Run(ds, problems, checked, inputs, recorded_inputs).check()
    if problems.count:
        checked["problems"] = problems.count
    return {"ok": not problems.count, "problems": problems.listed, "checked": checked}


def _check_files(
    ds: PackedDataset, hashes: bool, problem: _Problems, checked: dict[str, int]
) -> None:
    for name, rec in ds.raw["files"].items():
        f = ds.path / name
        if not f.is_file():
            problem(f"{name}: listed in the manifest but missing")
            continue
        if f.stat().st_size != rec["bytes"]:
            problem(f"{name}: {f.stat().st_size} bytes, the manifest says {rec['bytes']}")
        elif hashes and file_record(f)["sha256"] != rec["sha256"]:
            problem(f"{name}: sha256 differs from the manifest (file changed or corrupt)")
        checked["files"] = checked.get("files", 0) + 1


def expected_weights(
    agg: str, trainable: np.ndarray, scale_factor: float | None
) -> tuple[np.ndarray, float]:
    """Per-trainable-token weight of each sample of a step (float64) and the step's weight sum,
    straight from the aggregation formulas (see rolltool.loss; recomputed here on purpose)."""
    t = np.asarray(trainable, dtype=np.int64)
    T, S = int(t.sum()), int((t > 0).sum())
    if agg == "token-mean":
        per = np.full(len(t), 1.0 / T if T else 0.0)
    elif agg == "seq-mean-token-mean":
        per = np.divide(1.0, S * t.astype(np.float64), out=np.zeros(len(t)), where=t > 0)
    elif agg == "seq-mean-token-sum":
        per = np.full(len(t), 1.0 / S if S else 0.0)
    elif agg == "seq-mean-token-sum-norm":
        if not scale_factor or not np.isfinite(scale_factor) or scale_factor <= 0:
            raise ValueError(f"scale factor {scale_factor!r}")
        per = np.full(len(t), 1.0 / (S * scale_factor) if S else 0.0)
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    weight_sum = {
        "token-mean": 1.0 if T else 0.0,
        "seq-mean-token-mean": 1.0 if S else 0.0,
        "seq-mean-token-sum": T / S if S else 0.0,
        "seq-mean-token-sum-norm": T / (S * scale_factor) if S and scale_factor else 0.0,
    }[agg]
    return np.where(t > 0, per, 0.0), weight_sum


def _close(a: float, b: float, rtol: float, atol: float = 1e-12) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


class _Run:
    """The checks after the files: samples.parquet, every step's shards, the input."""

    def __init__(
        self,
        ds: PackedDataset,
        problem: _Problems,
        checked: dict[str, int],
        inputs: Sequence[str | os.PathLike[str]] | None,
        recorded_inputs: bool,
    ) -> None:
        self.ds, self.m, self.problem, self.checked = ds, ds.raw, problem, checked
        self.inputs, self.recorded_inputs = inputs, recorded_inputs
        cfg = self.m.get("config", {})
        self.cap = cfg.get("micro_batch_tokens")
        self.row_len = cfg.get("row_len")
        self.pad_id = cfg.get("pad_id", 0)
        loss = self.m.get("loss", {})
        self.agg, self.factor = loss.get("agg"), loss.get("scale_factor")

    def count(self, key: str, n: int = 1) -> None:
        self.checked[key] = self.checked.get(key, 0) + n

    # -- samples.parquet -------------------------------------------------------------------

    def _load_samples(self) -> bool:
        try:
            t = pq.read_table(self.ds.path / "samples.parquet")
            col = {
                c: t.column(c).to_numpy()
                for c in (
                    "sample_index",
                    "step",
                    "rank",
                    "micro_batch",
                    "length",
                    "trainable_tokens",
                )
            }
            self.adv = np.asarray(t.column("advantage").to_numpy(), dtype=np.float32)
            self.w = np.asarray(t.column("token_loss_weight").to_numpy(), dtype=np.float32)
            status = pc.cast(t.column("status"), pa.string()).combine_chunks()
            env = pc.cast(t.column("env"), pa.string()).combine_chunks().dictionary_encode()
        except (pa.ArrowException, KeyError, OSError, ValueError, TypeError) as e:
            self.problem(f"samples.parquet: unreadable or missing columns ({e})")
            return False
        n = t.num_rows
        self.n = n
        self.s_step = col["step"].astype(np.int64)
        self.s_rank = col["rank"].astype(np.int64)
        self.s_mb = col["micro_batch"].astype(np.int64)
        self.s_len = col["length"].astype(np.int64)
        self.s_train = col["trainable_tokens"].astype(np.int64)
        self.trained = pc.equal(status, "trained").fill_null(False).to_numpy(zero_copy_only=False)
        self.env_names = env.dictionary.to_pylist()
        self.env = env.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        if not np.array_equal(col["sample_index"], np.arange(n)):
            self.problem("samples.parquet: sample_index is not 0, 1, 2, ... in row order")
        bad = np.flatnonzero((self.s_train < 0) | (self.s_train > self.s_len) | (self.s_len <= 0))
        self.problem.many(
            bad,
            lambda i: (
                f"samples.parquet: sample {i} has {self.s_train[i]} trainable of "
                f"{self.s_len[i]} tokens"
            ),
        )
        counts = pc.value_counts(status).to_pylist()
        got = {c["values"]: c["counts"] for c in counts}
        recorded = self.m.get("samples", {})
        if recorded.get("total") != n:
            self.problem(f"samples.parquet: {n} rows, the manifest says {recorded.get('total')}")
        for s in sorted(set(got) | set(STATUSES)):
            if s not in STATUSES:
                self.problem(f"samples.parquet: {got[s]} sample(s) with unknown status {s!r}")
            elif got.get(s, 0) != recorded.get(s):
                self.problem(
                    f"samples.parquet: {got.get(s, 0)} sample(s) {s}, the manifest says "
                    f"{recorded.get(s)}"
                )
        rows_in = sum(int(f.get("rows", 0)) for f in self.m.get("inputs", []))
        if rows_in != n:
            self.problem(f"samples.parquet: {n} rows, the manifest's input files have {rows_in}")
        outside = np.flatnonzero(
            self.trained & ((self.s_step < 0) | (self.s_step >= self.ds.num_steps))
        )
        self.problem.many(
            outside,
            lambda i: (
                f"samples.parquet: sample {i} is trained at step {self.s_step[i]}, the run "
                f"has {self.ds.num_steps} steps"
            ),
        )
        # Trained samples grouped by step (one sort instead of a scan per step).
        tr = np.flatnonzero(self.trained)
        order = tr[np.argsort(self.s_step[tr], kind="stable")]
        self.by_step = order
        self.step_bounds = np.searchsorted(
            self.s_step[order], np.arange(self.ds.num_steps + 1), side="left"
        )
        return True

    # -- the input ---------------------------------------------------------------------------

    def _token_reader(self) -> TokenReader | None:
        recorded = self.m.get("inputs", [])
        if self.inputs is not None:
            files = resolve_inputs(self.inputs)
        elif self.recorded_inputs and recorded and all(Path(f["path"]).is_file() for f in recorded):
            try:
                files = [
                    InputFile(path=f["path"], rows=pq.ParquetFile(f["path"]).metadata.num_rows)
                    for f in recorded
                ]
            except (pa.ArrowException, OSError) as e:
                self.problem(f"input: not readable ({e})")
                return None
        else:
            return None
        have = [f.rows for f in files]
        want = [int(f["rows"]) for f in recorded]
        if have != want:
            self.problem(
                f"input: {len(files)} file(s) with {have} rows, the pack was made from "
                f"{len(want)} file(s) with {want} rows"
            )
            return None
        rename = invert_mapping(self.m.get("columns") or {})
        try:
            reader = TokenReader(files, rename, cache_bytes=int(1e9))
        except (RolltoolError, pa.ArrowException, OSError) as e:
            self.problem(f"input: {e.message if isinstance(e, RolltoolError) else e}")
            return None
        self.checked["input_samples"] = 0
        return reader

    # -- the run ------------------------------------------------------------------------------

    def check(self) -> None:
        ds, problem = self.ds, self.problem
        if self.m.get("config", {}).get("loss_agg", self.agg) != self.agg:
            problem(
                f"manifest: loss.agg {self.agg!r} differs from config loss_agg "
                f"{self.m['config'].get('loss_agg')!r}"
            )
        try:
            expected_weights(self.agg, np.zeros(0, np.int64), self.factor)
            self.formula_ok = True
        except ValueError as e:
            problem(f"manifest: loss weights cannot be recomputed ({e})")
            self.formula_ok = False
        if len(self.m.get("steps", [])) != ds.num_steps:
            problem(
                f"manifest: {len(self.m.get('steps', []))} step entries for {ds.num_steps} steps"
            )
            return
        if not self._load_samples():
            return
        try:
            self.reader = self._token_reader()
        except RolltoolError as e:
            problem(f"input: {e.message}")
            self.reader = None
        self.seen = np.zeros(self.n, dtype=np.int64)
        self.w_exp = np.full(self.n, np.nan)  # the current step's planned samples only
        for step in range(ds.num_steps):
            self._step(step)
        repeated = np.flatnonzero(self.seen > 1)
        problem.many(
            repeated, lambda i: f"sample {i} appears {self.seen[i]} times in the packed rows"
        )
        missing = np.flatnonzero(self.trained & (self.seen == 0))
        problem.many(
            missing,
            lambda i: (
                f"step {self.s_step[i]} rank {self.s_rank[i]} micro-batch {self.s_mb[i]} "
                f"sample {i}: planned but missing from the packed rows"
            ),
        )

    def _step(self, step: int) -> None:
        meta = self.m["steps"][step]
        planned = self.by_step[self.step_bounds[step] : self.step_bounds[step + 1]]
        t = self.s_train[planned]
        # Per trainable token of each planned sample, from the formula (NaN elsewhere).
        weight_sum = None
        if self.formula_ok:
            per, weight_sum = expected_weights(self.agg, t, self.factor)
            self.w_exp[planned] = per
        try:
            self._step_rows(step, meta, weight_sum)
        finally:
            self.w_exp[planned] = np.nan
        self.count("steps")

    def _step_rows(self, step: int, meta: dict[str, Any], weight_sum: float | None) -> None:
        problem = self.problem
        planned = self.by_step[self.step_bounds[step] : self.step_bounds[step + 1]]
        t = self.s_train[planned]
        T, S = int(t.sum()), int((t > 0).sum())
        den = meta.get("denominators", {})
        for key, value in (("trainable_tokens", T), ("trained_samples", S)):
            if den.get(key) != value:
                problem(
                    f"step {step}: denominators {key} is {den.get(key)}, samples.parquet gives "
                    f"{value}"
                )
        if den.get("scale_factor") != self.factor:
            problem(
                f"step {step}: denominators scale_factor {den.get('scale_factor')}, the manifest's "
                f"loss has {self.factor}"
            )
        if weight_sum is not None and not _close(
            float(den.get("weight_sum", np.nan)), weight_sum, 1e-12
        ):
            problem(
                f"step {step}: denominators weight_sum is {den.get('weight_sum')}, the "
                f"aggregation gives {weight_sum:.12g}"
            )
        ranks = meta.get("ranks", [])
        if len(ranks) != self.ds.dp:
            problem(f"step {step}: {len(ranks)} rank entries, dp is {self.ds.dp}")
            return
        counts = [int(r.get("micro_batches", -1)) for r in ranks]
        if len(set(counts)) != 1:
            problem(f"step {step}: ranks have different micro-batch counts {counts}")
        acc = _StepSums(len(self.env_names))
        for rank, rmeta in enumerate(ranks):
            self._rank(step, rank, rmeta, acc)
        self._compare_meta(step, meta, acc, weight_sum)

    def _rank(self, step: int, rank: int, rmeta: dict[str, Any], acc: _StepSums) -> None:
        where = f"step {step} rank {rank}"
        rows = 0
        got = {"samples": 0, "tokens": 0, "real_tokens": 0}
        for f in rmeta.get("files", []):
            path = self.ds.path / f["path"]
            try:
                arrays = read_shard(path)
            except RolltoolError as e:
                self.problem(f"{where}: {e.message}")
                return
            broken = check_rows(arrays)
            if broken is None and len(arrays["row_offsets"]) - 1 != int(f["rows"]):
                broken = f"{len(arrays['row_offsets']) - 1} rows, the manifest says {f['rows']}"
            if broken is None and int(f.get("first_row", -1)) != rows:
                broken = f"first row {f.get('first_row')}, the files before it hold {rows}"
            if broken is not None:
                self.problem(f"{where}: {f['path']}: corrupt shard ({broken})")
                return
            self._shard(step, rank, rows, arrays, acc, got)
            rows += int(f["rows"])
        if rows != rmeta.get("micro_batches"):
            self.problem(
                f"{where}: {rows} rows in files, manifest says {rmeta.get('micro_batches')}"
            )
        for key, value in got.items():
            if rmeta.get(key) != value:
                self.problem(
                    f"{where}: {value} {key.replace('_', ' ')}, the manifest says {rmeta.get(key)}"
                )

    def _shard(
        self,
        step: int,
        rank: int,
        first: int,
        a: dict[str, np.ndarray],
        acc: _StepSums,
        got: dict[str, int],
    ) -> None:
        problem = self.problem
        ro, rs = a["row_offsets"].astype(np.int64), a["row_segments"].astype(np.int64)
        R = len(ro) - 1
        lens = a["seq_lens"].astype(np.int64)
        seg_row = np.repeat(np.arange(R), np.diff(rs))
        bounds = np.concatenate([[0], np.cumsum(lens)])
        starts, ends = bounds[:-1], bounds[1:]
        idx = a["sample_index"].astype(np.int64)
        mask = a["loss_mask"]
        seg_w = a["seg_weight"].astype(np.float32)
        seg_adv = a["seg_advantage"].astype(np.float32)

        def at(k: int) -> str:
            return f"step {step} rank {rank} micro-batch {first + int(seg_row[k])}"

        def sample(k: int) -> str:
            return f"{at(k)} sample {idx[k]}"

        # Rows as the reader gives them: positions, cu_seqlens, budget, fixed length, padding.
        for r in range(R):
            self.count("rows")
            _check_row(unpack_row(a, r), f"step {step} rank {rank} micro-batch {first + r}",
                       self.cap, self.row_len, problem)  # fmt: skip

        bad = np.flatnonzero(mask > 1)
        if len(bad):
            k = int(np.searchsorted(ends, bad[0], side="right"))
            problem(f"{at(k)}: {len(bad)} loss_mask value(s) other than 0 and 1")
        cs = np.concatenate([[0], np.cumsum(mask != 0, dtype=np.int64)])
        cnt = cs[ends] - cs[starts]

        pad = idx < 0
        problem.many(
            np.flatnonzero(idx < -1), lambda k: f"{at(k)}: sample_index {idx[k]} is not valid"
        )
        pad_tok = np.repeat(pad, lens)
        padbad = pad & ((cnt != 0) | (seg_w != 0) | (seg_adv != 0))
        problem.many(
            np.flatnonzero(padbad),
            lambda k: f"{at(k)}: padding carries loss mask, weight or advantage",
        )
        if np.any(a["input_ids"][pad_tok] != self.pad_id) or np.any(a["logprobs"][pad_tok] != 0):
            k = int(np.flatnonzero(pad)[0])
            problem(f"{at(k)}: padding tokens are not pad_id {self.pad_id} with logprobs 0")

        real = (idx >= 0) & (idx < self.n)
        problem.many(np.flatnonzero(idx >= self.n), lambda k: f"{sample(k)}: not an input sample")
        ks = np.flatnonzero(real)
        i = idx[ks]
        np.add.at(self.seen, i, 1)
        placed = (
            self.trained[i]
            & (self.s_step[i] == step)
            & (self.s_rank[i] == rank)
            & (self.s_mb[i] == first + seg_row[ks])
        )
        problem.many(
            ks[~placed],
            lambda k: (
                f"{sample(k)}: samples.parquet has it "
                + (
                    f"at step {self.s_step[idx[k]]} rank {self.s_rank[idx[k]]} micro-batch "
                    f"{self.s_mb[idx[k]]}"
                    if self.trained[idx[k]]
                    else "not trained"
                )
            ),
        )
        j = np.flatnonzero(lens[ks] != self.s_len[i])
        problem.many(
            ks[j],
            lambda k: f"{sample(k)}: {lens[k]} tokens, samples.parquet says {self.s_len[idx[k]]}",
        )
        j = np.flatnonzero(cnt[ks] != self.s_train[i])
        problem.many(
            ks[j],
            lambda k: (
                f"{sample(k)}: {cnt[k]} trainable tokens (loss_mask), samples.parquet "
                f"trainable_tokens says {self.s_train[idx[k]]}"
            ),
        )
        j = np.flatnonzero(seg_adv[ks].view(np.uint32) != self.adv[i].view(np.uint32))
        problem.many(
            ks[j],
            lambda k: (
                f"{sample(k)}: advantage {seg_adv[k]:.9g}, samples.parquet says "
                f"{self.adv[idx[k]]:.9g}"
            ),
        )
        j = np.flatnonzero(seg_w[ks] != self.w[i])
        problem.many(
            ks[j],
            lambda k: (
                f"{sample(k)}: loss weights {seg_w[k]:.9g} per trainable token, samples.parquet "
                f"token_loss_weight says {self.w[idx[k]]:.9g}"
            ),
        )
        if self.formula_ok:
            exp = self.w_exp[i]
            off = placed & ~(np.abs(seg_w[ks].astype(np.float64) - exp) <= WEIGHT_RTOL * exp)
            problem.many(
                ks[off],
                lambda k: (
                    f"{sample(k)}: loss weights {seg_w[k]:.9g} per trainable token, the "
                    f"{self.agg} formula gives {self.w_exp[idx[k]]:.9g}"
                ),
            )
        self.count("segments", len(ks))

        # Sums for the step's metadata.
        env = self.env[i]
        acc.add(env, lens[ks], cnt[ks], seg_w[ks].astype(np.float64) * cnt[ks], seg_adv[ks])
        got["samples"] += len(ks)
        got["tokens"] += int(ro[-1])
        got["real_tokens"] += int(lens[ks].sum())

        if self.reader is not None and len(ks):
            self._content(a, ks, idx, starts, lens, sample)

    def _content(
        self,
        a: dict[str, np.ndarray],
        ks: np.ndarray,
        idx: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
        sample: Callable[[int], str],
    ) -> None:
        assert self.reader is not None
        try:
            src = self.reader.fetch(idx[ks])
        except (RolltoolError, pa.ArrowException, OSError, IndexError, KeyError) as e:
            self.problem(f"{sample(int(ks[0]))}: the input could not be read ({e})")
            self.reader = None
            return
        in_len = np.diff(src.offsets)
        j = np.flatnonzero(in_len != lens[ks])
        self.problem.many(
            ks[j],
            lambda k: (
                f"{sample(k)}: {lens[k]} tokens, the input has {in_len[np.searchsorted(ks, k)]}"
            ),
        )
        same = in_len == lens[ks]
        ks, in_off = ks[same], src.offsets[:-1][same]
        n_tok = lens[ks]
        total = int(n_tok.sum())
        seg_of = np.repeat(np.arange(len(ks)), n_tok)
        within = np.arange(total) - np.repeat(np.cumsum(n_tok) - n_tok, n_tok)
        packed_at = np.repeat(starts[ks], n_tok) + within
        input_at = np.repeat(in_off, n_tok) + within
        fields = {
            "input_ids": (a["input_ids"][packed_at], src.input_ids[input_at]),
            "loss_mask": (a["loss_mask"][packed_at], src.loss_mask[input_at]),
            "logprobs": (  # bitwise: NaN and -0.0 compare as stored
                a["logprobs"][packed_at].view(np.uint32),
                src.logprobs[input_at].view(np.uint32),
            ),
        }
        for name, (packed, given) in fields.items():
            diff = np.bincount(seg_of[packed != given], minlength=len(ks))

            def text(s: int, name: str = name, diff: np.ndarray = diff) -> str:
                k = int(ks[s])
                return f"{sample(k)}: {name} differ from the input at {diff[s]} of {lens[k]} tokens"

            self.problem.many(np.flatnonzero(diff), text)
        self.count("input_samples", len(ks))

    def _compare_meta(
        self, step: int, meta: dict[str, Any], acc: _StepSums, weight_sum: float | None
    ) -> None:
        problem = self.problem
        if meta.get("step", step) != step:
            problem(f"step {step}: the manifest's entry says step {meta.get('step')}")
        scopes: list[tuple[str, dict[str, Any], np.ndarray]] = [
            ("", meta, np.ones(len(self.env_names), dtype=bool))
        ]
        envs = meta.get("envs", {})
        for e, name in enumerate(self.env_names):
            sel = np.arange(len(self.env_names)) == e
            if acc.samples[e] or name in envs:
                scopes.append((f" env {name}", envs.get(name, {}), sel))
        for label, rec, sel in scopes:
            for key, value in (
                ("samples", int(acc.samples[sel].sum())),
                ("sampled_tokens", int(acc.sampled[sel].sum())),
                ("trainable_tokens", int(acc.trainable[sel].sum())),
            ):
                if rec.get(key) != value:
                    problem(
                        f"step {step}{label}: {value} {key.replace('_', ' ')} in the rows, the "
                        f"manifest says {rec.get(key)}"
                    )
        total = float(acc.weight.sum())
        if weight_sum is not None and not _close(total, weight_sum, SUM_RTOL):
            problem(
                f"step {step}: loss weights sum to {total:.9g}, the {self.agg} aggregation needs "
                f"{weight_sum:.9g}"
            )
        rec_sum = meta.get("loss_weight_sum")
        if rec_sum is not None and not _close(total, float(rec_sum), SUM_RTOL):
            problem(f"step {step}: loss weights sum to {total:.9g}, the manifest says {rec_sum}")
        adv = np.concatenate(acc.adv).astype(np.float64) if acc.adv else np.zeros(0)
        mean = float(adv.mean()) if len(adv) else None
        std = (float(adv.std(ddof=1)) if len(adv) > 1 else 0.0) if len(adv) else None
        for name, moment in (("advantage_mean", mean), ("advantage_std", std)):
            recorded = meta.get(name)
            if (moment is None or recorded is None) and moment != recorded:
                problem(
                    f"step {step}: {name} of the rows is {moment}, the manifest says {recorded}"
                )
            elif moment is not None and not _close(moment, float(recorded), 1e-9, 1e-9):
                problem(
                    f"step {step}: {name} of the rows is {moment:.9g}, the manifest says {recorded}"
                )


class _StepSums:
    """Per-env sums over a step's real segments."""

    def __init__(self, n_env: int) -> None:
        self.samples = np.zeros(n_env, dtype=np.int64)
        self.sampled = np.zeros(n_env, dtype=np.int64)
        self.trainable = np.zeros(n_env, dtype=np.int64)
        self.weight = np.zeros(n_env, dtype=np.float64)
        self.adv: list[np.ndarray] = []

    def add(
        self, env: np.ndarray, lens: np.ndarray, cnt: np.ndarray, w: np.ndarray, adv: np.ndarray
    ) -> None:
        n = len(self.samples)
        self.samples += np.bincount(env, minlength=n)
        self.sampled += np.bincount(env, weights=lens, minlength=n).astype(np.int64)
        self.trainable += np.bincount(env, weights=cnt, minlength=n).astype(np.int64)
        self.weight += np.bincount(env, weights=w, minlength=n)
        self.adv.append(adv)


def _check_row(
    row: dict[str, np.ndarray], where: str, cap: int | None, row_len: int | None, problem: Any
) -> None:
    cu = row["cu_seqlens"].astype(np.int64)
    n = len(row["input_ids"])
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
        problem(f"{where}: cu_seqlens {cu.tolist()[:8]}... inconsistent with a row of {n} tokens")
        return
    if len(row["sample_index"]) != len(cu) - 1:
        problem(
            f"{where}: {len(row['sample_index'])} sample_index entries for {len(cu) - 1} segments"
        )
        return
    for k in ("position_ids", "loss_mask", "advantages", "logprobs", "loss_weight"):
        if len(row[k]) != n:
            problem(f"{where}: {k} has {len(row[k])} values for {n} tokens")
            return
    starts = np.repeat(cu[:-1], np.diff(cu))
    if not np.array_equal(row["position_ids"].astype(np.int64), np.arange(n) - starts):
        problem(f"{where}: position_ids do not restart at 0 at every segment")
    pad = row["sample_index"] < 0
    seg_len = np.diff(cu)
    real_tokens = int(seg_len[~pad].sum())
    if cap is not None and real_tokens > cap:
        problem(f"{where}: {real_tokens} tokens, over the {cap}-token budget")
    if row_len is not None and n != row_len:
        problem(f"{where}: row of {n} tokens, --row-len is {row_len}")
    pad_tok = np.repeat(pad, seg_len)
    if np.any(row["loss_mask"][pad_tok] != 0) or np.any(row["loss_weight"][pad_tok] != 0):
        problem(f"{where}: padding carries loss mask or loss weight")
    if np.any(row["loss_weight"][row["loss_mask"] == 0] != 0):
        problem(f"{where}: untrained tokens carry loss weight")
