"""The manifest's typed records: what a packed directory says about itself.

A packed directory (see `rolltool.packed.writer` for how it is written, `rolltool.packed.reader` for how a
trainer reads it)::

    packed/
      manifest.json                         `Manifest`, written last: the commit mark
      samples.parquet                       one row per input sample: where it went, or why not
      rank-0003/step-000012-00.safetensors  rank 3's rows of step 12, part 00 (`shard_name`)

A shard holds one (step, rank)'s rows flat: the ``TOKEN_ARRAYS`` concatenated over rows with
``row_offsets`` into them, the ``SEGMENT_ARRAYS`` (one entry per sample or padding segment)
with ``row_segments``. The reader derives the per-token ``READER_FIELDS`` from them exactly.

Every consumer reads the manifest through `Manifest.from_json`, the one place that checks its
format, version, shape and types; a manifest of another shape is a `RolltoolError`, never a
KeyError or AttributeError further down.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format.codec import OMIT_DEFAULT, CodecError, from_json, kind, to_json
from rolltool.format.spec import (
    FORMAT,
    FORMAT_VERSION,
    HYBRID_VERSION,
    MANIFEST,
    READER_FIELDS,
    SHARED_VERSION,
    SUPPORTED_VERSIONS,
    USAGE,
)

_HINT = "the manifest was changed or written by another tool; pack again"


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    """A file of the directory as written."""

    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class ShardRef:
    """One shard file of a (step, rank): rows [first_row, first_row + rows) of that rank."""

    path: str
    first_row: int
    rows: int


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """One rank's share of a step."""

    micro_batches: int
    samples: int
    tokens: int
    """Tokens in its rows, padding included."""
    real_tokens: int
    """Tokens of samples."""
    files: tuple[ShardRef, ...]


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    """Counts that explain a step's cost and gradient scale (overall, or one env's)."""

    groups: int
    rollouts: int
    samples: int
    sampled_tokens: int
    trainable_tokens: int
    uniform_groups_kept: int
    uniform_groups_dropped: int
    overlong_dropped: int
    over_gpu_budget: int = 0
    """Trained samples longer than the per-GPU budget: trained because --sp or --cp split them."""
    reward_mean: float | None
    advantage_mean: float | None
    advantage_std: float | None
    """Unbiased; None with fewer than two samples (missing is null, never 0)."""
    loss_weight_sum: float


@dataclass(frozen=True, kw_only=True)
class Denominators:
    """The step's loss denominators over all ranks (see `rolltool.plan.loss`)."""

    trainable_tokens: int
    trained_samples: int
    scale_factor: float | None
    weight_sum: float


@dataclass(frozen=True, kw_only=True)
class RecordedSteps:
    """How optimizer steps were assembled: `rolltool.plan.batches.StepConfig` as recorded."""

    batch_size: int
    """Nominal step size in ``batch_unit``s (``--batch-size``)."""
    batch_unit: str
    """What ``batch_size`` counts: rollouts, samples (trainable branches) or (sampled) tokens."""
    exact: bool
    """A step that closes short of ``batch_size`` is an error (``--exact``)."""
    uniform: str
    """keep: uniform groups were trained; drop: skipped (``--uniform``)."""
    order: str
    """Group order: input, completion or shuffle (``--order``)."""
    seed: int
    """Seed of the shuffled orders (``--seed``)."""
    env_weights: Mapping[str, float]
    """Each env's share of every step, in batch units; empty: envs pooled in one queue."""
    keep_last: bool
    """A final step the input could not fill was kept (``--keep-last``)."""
    mini_batches: int = 1
    """Optimizer steps per batch and epoch (``--mini-batches``); 1 in packs written before it."""
    epochs: int = 1
    """Passes over each batch (``--epochs``); 1 in packs written before it."""


@dataclass(frozen=True, kw_only=True)
class RecordedAdvantages:
    """The advantage settings (`rolltool.plan.advantages.AdvantageConfig`) as recorded; what was
    used per env is the manifest's `AdvantagesRecord`."""

    estimator: str
    """Estimator of every env without an override (``--estimator``)."""
    env_estimators: Mapping[str, str]
    """Per-env overrides (``--env-estimator``)."""
    std_eps: float
    """Epsilon added to the group std by grpo (``--std-eps``)."""


@dataclass(frozen=True, kw_only=True)
class RecordedConfig:
    """The resolved `rolltool.plan.config.PackConfig` as the manifest records it (``config``):
    the same fields in the same order (``PackConfig.record``). Fields with a default are
    missing from packs written before their option; the default is what those packs did."""

    dp: int
    """Data-parallel ranks (groups of sp or cp GPUs)."""
    sp: int = 1
    """Sequence-parallel GPUs per group (``--sp``); 1 in packs written before it."""
    cp: int = 1
    """Context-parallel GPUs per group (``--cp``); 1 in packs written before it."""
    hybrid_cp: bool = field(default=False, metadata=OMIT_DEFAULT)
    """Each slot's cp GPUs cut into aligned sub-groups, a CP degree per sample
    (``--hybrid-cp``, format version 3); written only when true."""
    cp_link_bandwidth: float | None = field(default=None, metadata=OMIT_DEFAULT)
    """GB/s of one ring link the hybrid plan priced CP communication with
    (``--cp-link-bandwidth``); written only with ``hybrid_cp``."""
    gpu_tflops: float | None = field(default=None, metadata=OMIT_DEFAULT)
    """TFLOP/s (the workload's units per second, 1e12) of one GPU the hybrid plan weighed
    exposed communication against (``--gpu-tflops``); written only with ``hybrid_cp``."""
    share_prefix: bool = field(default=False, metadata=OMIT_DEFAULT)
    """Each group's shared prefixes stored once (``--share-prefix``, format version 4,
    `rolltool.format.prefix`); written only when true."""
    share_min: int | None = field(default=None, metadata=OMIT_DEFAULT)
    """Tokens a prefix must share beyond its parent's to be stored once (``--share-min``);
    written only with ``share_prefix``."""
    steps: RecordedSteps
    """How optimizer steps were assembled."""
    advantages: RecordedAdvantages
    """The estimator settings."""
    micro_batch_tokens: int | None
    """Token budget per micro-batch and GPU (resolved); None in fixed mode."""
    micro_batch_size: int | None
    """Samples per micro-batch (fixed mode), else None."""
    row_len: int | None
    """Tokens per row and GPU (``--row-len``; the stored group row is this x sp or cp), or None."""
    pad_id: int
    """Token id written into padding."""
    balance: str
    """Workload the partition balanced (flops, verl, tokens, count or calibrated)."""
    model: str | None
    """Model preset or config.json of the flops workload (``--model``), or None."""
    calibration: str | None
    """Calibration JSON of the calibrated workload, or None."""
    align: str
    """lockstep or total (``--align``)."""
    equal_count: bool
    """Every rank was given the same number of samples (``--equal-count``)."""
    equal_count_trim: bool = False
    """Equal counts by leaving samples out of a step (``--equal-count-trim``); False in packs
    written before it."""
    overlong: str
    """What was done with a sample over the token budget: error or drop."""
    loss_agg: str
    """Loss aggregation the per-token weights implement (``--loss-agg``)."""
    loss_scale_factor: float | None
    """Constant of seq-mean-token-sum-norm, else None."""
    shard_mb: float
    """Largest shard file, in MB (``--shard-mb``)."""
    cache_mb: float
    """Decoded input kept in memory, in MB (``--cache-mb``)."""


@dataclass(frozen=True, kw_only=True)
class RecordedModel:
    """The model shape behind a flops workload (`rolltool.plan.workload.ModelShape`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0
    """0: ``hidden_size // num_heads``."""


@dataclass(frozen=True, kw_only=True)
class RecordedWorkload:
    """A cost model ``cost(L) = c + a·L + b·L²`` as recorded (`rolltool.plan.workload.Workload`):
    the run's in ``Manifest.workload``, a step's per-GPU one in its `PlanRecord`."""

    kind: str
    """flops, verl, tokens, count or calibrated."""
    a: float = 0.0
    """Cost per token."""
    b: float = 0.0
    """Cost per token²."""
    c: float = 0.0
    """Cost per sample."""
    source: str | None = None
    """Preset name, model config path or calibration file path."""
    model: RecordedModel | None = None
    """The model shape of a flops workload, else None."""
    notes: Mapping[str, Any] = field(default_factory=dict)
    """Extra keys of a calibration file (device, fit quality...)."""


@dataclass(frozen=True, kw_only=True)
class HybridRecord:
    """A ``--hybrid-cp`` step's layout over every GPU of the world
    (`rolltool.plan.hybrid_step`): the `PlanRecord` beside it judges each data-parallel
    group as one (its slowest GPU per slot), this one each GPU."""

    gpus: int
    """dp x cp."""
    lockstep_overhead: float
    """Σ_j max_g cost(g, j) / (Σ cost / gpus) over all GPUs g of the world, CP padding and
    exposed ring communication counted (1.0 when perfect)."""
    imbalance: float
    """max_g Σ_j cost(g, j) / mean_g (1.0 when even)."""
    split_samples: Mapping[str, int]
    """Samples per CP degree k (``"1"``: whole on one GPU)."""
    split_tokens: Mapping[str, int]
    """Their tokens per k (real tokens, CP padding not counted)."""


@dataclass(frozen=True, kw_only=True)
class SharedTokens:
    """Tokens of one env's samples in a ``--share-prefix`` step, unshared and as stored."""

    tokens: int
    """Σ of the samples' lengths: what an unshared pack stores and computes."""
    stored: int
    """Stored (and fed forward once each): every prefix once, re-fed branch tokens included."""


@dataclass(frozen=True, kw_only=True)
class SharedRecord:
    """A ``--share-prefix`` step's sharing (`rolltool.plan.prefix.SharingStats`, summed over
    its micro-batches as laid out; a prefix cut over several micro-batches counts each copy)."""

    prefixes: int
    """Prefix segments stored."""
    tokens: int
    """Σ of the trained samples' lengths (the unshared pack's tokens)."""
    stored: int
    """Tokens stored: the plan's ``tokens`` (padding not counted)."""
    attention_pairs: int
    """Causal query-key pairs unshared (Σ L (L + 1) / 2)."""
    attention_pairs_shared: int
    """Causal query-key pairs as laid out (each continuation over its full context)."""
    kv_tokens: int
    """Keys and values gathered per layer (Σ ``cu_seqlens_k[-1]`` over its rows)."""
    envs: Mapping[str, SharedTokens]
    """Per env: its samples' tokens, unshared and stored."""


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    """The partition plan's settings and report (`rolltool.plan.partition.StepPlan.report`)."""

    align: str
    equal_count: bool
    max_tokens: int | None
    micro_batch_size: int | None
    workload: RecordedWorkload | None
    """The cost model the step was planned with (per GPU: the run's over sp or cp), or None."""
    short: tuple[tuple[int, int], ...]
    dp: int
    micro_batches_per_rank: int
    ffd_micro_batches: int | None
    min_micro_batches: int | None
    samples: int
    samples_per_rank: tuple[int, ...]
    tokens: int
    empty_micro_batches: int
    short_micro_batches: int
    token_fill: float | None
    imbalance_tokens: float
    lockstep_overhead_tokens: float
    imbalance_cost: float
    lockstep_overhead_cost: float
    hybrid: HybridRecord | None = field(default=None, metadata=OMIT_DEFAULT)
    """``--hybrid-cp``: the layout per GPU (then ``tokens`` count each sample padded for its
    own degree, and the ``*_cost`` figures take each group's slowest GPU per slot); written
    only then."""
    shared: SharedRecord | None = field(default=None, metadata=OMIT_DEFAULT)
    """``--share-prefix``: tokens stored against unshared (then ``tokens`` and the ``*_cost``
    figures count what is stored and computed); written only then."""


@dataclass(frozen=True, kw_only=True)
class StepRecord(StepCounts):
    """One optimizer step: its counts (inherited, overall), per env, denominators, plan, ranks."""

    step: int
    status: str
    nominal: int | None
    actual: int
    """The batch's status, nominal and actual size (in its batch unit; with --mini-batches the
    whole batch's, not this step's)."""
    batch: int | None = None
    """The batch (generation batch, `rolltool.plan.batches`) this optimizer step is cut from; None in
    manifests written before mini-batches (then the step is its own batch)."""
    epoch: int = 0
    """Pass over the batch (--epochs)."""
    mini_batch: int = 0
    """Mini-batch of the batch in this epoch (--mini-batches)."""
    envs: Mapping[str, StepCounts]
    denominators: Denominators
    plan: PlanRecord
    ranks: tuple[RankRecord, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ReadRecord:
    """The plan's reads of the input's token columns (`rolltool.fetch.readplan.read_plan`), and the
    path the run took: ``direct`` (fetch step by step) or ``exchange`` (the input read once into
    step buckets, `rolltool.fetch.buckets`)."""

    path: str = "direct"
    needed_bytes: int
    """The trained samples' share of their row groups' compressed token-column bytes."""
    read_bytes: int
    """What fetching step by step reads without a cache (the last decoded row group kept)."""
    cached_read_bytes: int
    """The same with the ``--cache-mb`` cache (an LRU model of it, filled by the scan first)."""
    amplification: float
    """read_bytes / needed_bytes (1.0 with nothing needed)."""
    cached_amplification: float
    """cached_read_bytes / needed_bytes."""
    row_group_reads: int
    row_groups: int


@dataclass(frozen=True, kw_only=True)
class InputRecord:
    """An input file: its resolved path, as given, and its rows."""

    path: str
    rows: int
    given: str | None = None


@dataclass(frozen=True, kw_only=True)
class SampleCounts:
    """samples.parquet's rows by status (`STATUSES`): one per input sample, or with --epochs
    one per (sample, epoch)."""

    total: int
    trained: int
    uniform_dropped: int
    overlong_dropped: int
    leftover: int
    env_unweighted: int
    count_trimmed: int = 0


@dataclass(frozen=True, kw_only=True)
class AdvantagesRecord:
    source: str
    """The estimator, or "input column 'advantage'"."""
    whitening: str | None
    estimators: Mapping[str, str]
    """Estimator per env."""


@dataclass(frozen=True, kw_only=True)
class LossRecord:
    agg: str
    scale_factor: float | None
    usage: str = USAGE


@dataclass(frozen=True, kw_only=True)
class PartialStep:
    """The final partial step, dropped without --keep-last."""

    groups: int
    actual: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json``: how the directory was made and everything in it."""

    rolltool_version: str
    created_at: str
    command: tuple[str, ...]
    config: RecordedConfig
    """The resolved `rolltool.plan.config.PackConfig` (``PackConfig.record``)."""
    workload: RecordedWorkload
    """The cost model the plan balanced (``Workload.record``)."""
    advantages: AdvantagesRecord
    loss: LossRecord
    inputs: tuple[InputRecord, ...]
    columns: Mapping[str, str]
    """The --column mapping NEW -> OLD the input was read with."""
    dp: int
    samples: SampleCounts
    leftover_groups: int
    partial_step_dropped: PartialStep | None
    warnings: tuple[str, ...]
    steps: tuple[StepRecord, ...]
    reads: ReadRecord | None = None
    """What fetching the steps read of the input (`rolltool.fetch.readplan`); None before it was
    recorded."""
    files: Mapping[str, FileRecord] = field(default_factory=dict)
    token_fields: Mapping[str, str] = field(
        default_factory=lambda: {k: np.dtype(v).name for k, v in READER_FIELDS.items()}
    )
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict[str, Any]:
        """The JSON document (``num_steps`` included for readers that do not parse records)."""
        doc = to_json(self)
        doc["num_steps"] = self.num_steps
        return doc

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, doc: Any, where: str = MANIFEST) -> Manifest:
        """Check format, version, shape and types; a `RolltoolError` naming the key otherwise."""
        if not isinstance(doc, dict):
            raise RolltoolError(
                f"{where}: not a rolltool packed manifest (a JSON {kind(doc)}, not an object)"
            )
        if doc.get("format") != FORMAT:
            raise RolltoolError(
                f"{where}: not a rolltool packed manifest (format {doc.get('format')!r})"
            )
        if doc.get("format_version") not in SUPPORTED_VERSIONS:
            raise RolltoolError(
                f"{where}: format version {doc.get('format_version')!r} is not supported "
                f"(this rolltool reads {', '.join(map(str, SUPPORTED_VERSIONS))})",
                hint="read it with the rolltool version that wrote it",
            )
        try:
            m = from_json(cls, doc, "")
        except CodecError as e:
            raise RolltoolError(f"{where}: {e}", hint=_HINT) from None
        if "num_steps" in doc and doc["num_steps"] != m.num_steps:
            raise RolltoolError(
                f"{where}: num_steps is {doc['num_steps']!r} but {m.num_steps} steps are listed"
            )
        if m.config.hybrid_cp != (m.format_version == HYBRID_VERSION):
            raise RolltoolError(
                f"{where}: format version {m.format_version} with config.hybrid_cp "
                f"{str(m.config.hybrid_cp).lower()} (a --hybrid-cp pack is version "
                f"{HYBRID_VERSION}, and only it)",
                hint=_HINT,
            )
        if m.config.share_prefix != (m.format_version == SHARED_VERSION):
            raise RolltoolError(
                f"{where}: format version {m.format_version} with config.share_prefix "
                f"{str(m.config.share_prefix).lower()} (a --share-prefix pack is version "
                f"{SHARED_VERSION}, and only it)",
                hint=_HINT,
            )
        for s, st in enumerate(m.steps):
            if st.step != s or len(st.ranks) != m.dp:
                raise RolltoolError(
                    f"{where}: steps[{s}] is step {st.step} with {len(st.ranks)} ranks "
                    f"(expected step {s} with dp = {m.dp})"
                )
        return m

    @classmethod
    def loads(cls, text: str | bytes, where: str = MANIFEST) -> Manifest:
        """Parse a manifest's JSON text (read by the caller, e.g. from object storage); `where`
        names it in errors."""
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RolltoolError(f"{where}: unreadable manifest ({e})") from None
        return cls.from_json(doc, where)

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        """Read ``root/manifest.json``."""
        path = Path(root) / MANIFEST
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RolltoolError(f"{path}: unreadable manifest ({e})") from None
        return cls.from_json(doc, str(path))


def packed_doc(raw: str | bytes) -> dict[str, Any] | None:
    """`raw` as the JSON object of a rolltool manifest (its ``format`` is rolltool's), else None.
    Cheap, no full parse (`Manifest.from_json`): enough to tell a packed output from others."""
    try:
        doc = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def listed_files(raw: str | bytes) -> set[str] | None:
    """The files a manifest document lists, itself included; None when it is not a rolltool
    manifest or has no file list. No full parse: a manifest this version cannot read (another
    format version) still keeps its files from being taken for a dead run's."""
    doc = packed_doc(raw)
    files = None if doc is None else doc.get("files")
    return {MANIFEST, *files} if isinstance(files, dict) else None


def is_packed_dir(path: str | Path) -> bool:
    """A directory holding a manifest.json whose format is rolltool's (cheap: no full parse)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return packed_doc(manifest.read_text()) is not None
    except OSError:
        return False
