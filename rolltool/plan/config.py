"""The pack job's settings: one frozen record, validated once, recorded in the manifest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rolltool.errors import OptionConflict, RolltoolError
from rolltool.format import (
    MAX_TOKEN_ID,
    RecordedAdvantages,
    RecordedConfig,
    RecordedSteps,
    to_json,
)
from rolltool.format.split import GroupSplit
from rolltool.plan.advantages import AdvantageConfig
from rolltool.plan.batches import StepConfig
from rolltool.plan.hybrid import RingModel
from rolltool.plan.loss import check_loss_agg
from rolltool.plan.partition import ALIGNS
from rolltool.plan.prefix import SHARE_MIN
from rolltool.plan.workload import WORKLOADS, Workload, make_workload

"""The largest token id a shard holds (``input_ids`` are int32): 2**31 - 1, as the schema's."""

OVERLONG = ("error", "drop")
"""What to do with a sample longer than the token budget."""

DEFAULT_BATCH_SIZE = 128
"""Step size in batch units when none is given (``PackConfig.steps``, ``--batch-size``)."""

DEFAULT_CP_LINK_BANDWIDTH = 100.0
"""GB/s of one ring link with ``--hybrid-cp`` when none is given (NVLink-class; the ring model's
default, `rolltool.plan.hybrid.RingModel`)."""

DEFAULT_GPU_TFLOPS = 400.0
"""TFLOP/s one GPU sustains with ``--hybrid-cp`` when none is given (an H100 at ~40% of its
bf16 peak)."""

DEFAULT_MICRO_BATCH_TOKENS = 32_768
"""The micro-batch token budget when neither a budget, a micro-batch size nor a row length is
given (see ``PackConfig.micro_batch_tokens``)."""


def _default_steps() -> StepConfig:
    return StepConfig(batch_size=DEFAULT_BATCH_SIZE)


def _field_names(record: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(record)]


def _values(record: Any) -> dict[str, Any]:
    """A record's fields by name, values as they are (no copy, no conversion)."""
    return {name: getattr(record, name) for name in _field_names(record)}


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """What ``rolltool pack`` does; the one place of its defaults and of its cross-setting rules.

    ``PackConfig(...)`` and the CLI build the same record from the same settings: every default
    that depends on another setting is resolved here (``micro_batch_tokens``), and every
    combination the CLI refuses is refused here (``OptionConflict``). The resolved record goes
    into the manifest (``record``).

    >>> PackConfig(dp=2, row_len=8192).micro_batch_tokens  # a row holds one micro-batch
    8192
    >>> PackConfig(dp=2).micro_batch_tokens, PackConfig(dp=2, micro_batch_size=4).micro_batch_tokens
    (32768, None)
    """

    dp: int
    """Data-parallel ranks (groups of GPUs with ``sp`` or ``cp``: what the partition balances)."""
    sp: int = 1
    """Sequence-parallel (Ulysses) GPUs per data-parallel group: each micro-batch's row is
    split into ``sp`` contiguous parts (`rolltool.format.split`)."""
    cp: int = 1
    """Context-parallel GPUs per data-parallel group: every sample is split into 2 x ``cp``
    chunks, zigzag (`rolltool.format.split`). Not with ``sp``."""
    hybrid_cp: bool = False
    """Hybrid context parallelism (`rolltool.plan.hybrid`): in each micro-batch slot the cp GPUs
    of a group are cut into aligned power-of-two sub-groups; a sample is whole on one GPU or
    zigzag-split over one sub-group, its degree chosen by the plan. ``cp`` must be a power of
    two >= 2; not with ``micro_batch_size``, ``align="total"`` or ``equal_count``."""
    cp_link_bandwidth: float | None = None
    """GB/s of one ring link (``hybrid_cp`` only; None resolves to
    ``DEFAULT_CP_LINK_BANDWIDTH`` with it): what the plan prices CP communication with."""
    gpu_tflops: float | None = None
    """TFLOP/s of one GPU (``hybrid_cp`` only; None resolves to ``DEFAULT_GPU_TFLOPS`` with
    it): what exposed ring communication is weighed against, in the workload's units."""
    share_prefix: bool = False
    """Store each group's shared prefixes once (`rolltool.plan.prefix_step`, issue 24): a
    prefix tree is placed whole on one micro-batch of one rank, its cost what is computed.
    Not with ``sp``, ``cp``, ``hybrid_cp``, ``micro_batch_size``, ``align="total"`` or
    ``equal_count`` (yet)."""
    share_min: int | None = None
    """Tokens a prefix must share beyond its parent's to be stored once (``share_prefix``
    only; None resolves to `rolltool.plan.prefix.SHARE_MIN` with it)."""
    steps: StepConfig = field(default_factory=_default_steps)
    """How optimizer steps are assembled (batch semantics); default: ``DEFAULT_BATCH_SIZE``
    rollouts per step."""
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Estimator used when the input has no 'advantage' column."""
    micro_batch_tokens: int | None = None
    """Hard token budget per micro-batch and GPU (a group's micro-batch holds up to this x sp,
    or x cp, tokens: ``group_tokens``). None resolves to: no budget with ``micro_batch_size``
    (fixed mode); else ``row_len`` when given (a row holds one micro-batch: fill it); else
    ``DEFAULT_MICRO_BATCH_TOKENS``. ``dataclasses.replace`` keeps the resolved value: pass
    ``micro_batch_tokens=None`` to resolve it again."""
    micro_batch_size: int | None = None
    """Fixed number of samples per micro-batch instead of a token budget."""
    row_len: int | None = None
    """Pad every row to this many tokens per GPU (static shapes; the group's row holds this x
    sp, or x cp); must be >= micro_batch_tokens, and even with cp (a CP row is a multiple of
    2 x cp tokens: `_check_thd_rows`)."""
    pad_id: int = 0
    """Token id written into padding: 0 <= pad_id <= 2**31 - 1 (packed as int32)."""
    balance: str = "flops"
    """Workload the partition balances: flops, verl, tokens, count or calibrated."""
    model: str | None = None
    """Model preset or config.json for the flops workload (default preset when None)."""
    calibration: str | None = None
    """Calibration JSON for the calibrated workload (written by rolltool bench)."""
    align: str = "lockstep"
    """lockstep: minimize sum_j max_r cost(r, j) (FSDP/ZeRO-3/TP); total: max_r sum_j (DDP).
    Token-budget mode only: fixed mode (``micro_batch_size``) lays out the same rows either way,
    so ``total`` with it is an ``OptionConflict``."""
    equal_count: bool = False
    """Give every rank the same number of samples: a step whose trained samples --dp does not
    divide is an error, unless ``equal_count_trim``."""
    equal_count_trim: bool = False
    """Equal counts (implies ``equal_count``), leaving out of each step the last ``n % dp`` of
    its ``n`` trained samples (status ``count_trimmed`` in samples.parquet, counted in the
    manifest, a warning) instead of stopping."""
    overlong: str = "error"
    """A sample longer than the token budget: error, or drop it from training (counted)."""
    loss_agg: str = "token-mean"
    """Loss aggregation the per-token weights implement (see rolltool.plan.loss)."""
    loss_scale_factor: float | None = None
    """Constant f of seq-mean-token-sum-norm (required by it, refused with any other)."""
    shard_mb: float = 256.0
    """Largest shard file in MB; a (step, rank) above it is split by rows."""
    cache_mb: float = 1024.0
    """Decoded input row groups kept in memory (MB); input that fits is read from disk once."""

    def __post_init__(self) -> None:
        if self.equal_count_trim:
            object.__setattr__(self, "equal_count", True)  # trimming is a way to equal counts
        self._check_choices()
        self._check_conflicts()
        self._check_hybrid()
        self._check_shared()
        if self.micro_batch_tokens is None and self.micro_batch_size is None:
            budget = self.row_len if self.row_len is not None else DEFAULT_MICRO_BATCH_TOKENS
            object.__setattr__(self, "micro_batch_tokens", budget)  # resolved once, recorded
        self._check_sizes()
        if self.shard_mb <= 0:
            raise RolltoolError(f"--shard-mb must be positive, got {self.shard_mb}")
        if self.cache_mb < 0:
            raise RolltoolError(f"--cache-mb must be >= 0, got {self.cache_mb}")

    def _check_conflicts(self) -> None:
        """The combinations the CLI refuses as usage errors (exit 2)."""
        if self.micro_batch_tokens is not None and self.micro_batch_size is not None:
            raise OptionConflict("give --micro-batch-tokens or --micro-batch-size, not both")
        if self.micro_batch_size is not None and self.align != "lockstep":
            raise OptionConflict(
                f"--align {self.align} has no effect with --micro-batch-size: fixed-size "
                "micro-batches are laid out the same way whatever the alignment",
                hint="drop --align total, or balance with a token budget (--micro-batch-tokens)",
            )
        if self.sp > 1 and self.cp > 1:
            raise OptionConflict(
                "give --sp or --cp, not both",
                hint="a data-parallel group splits its micro-batches one way: Ulysses (--sp) "
                "or ring attention (--cp)",
            )
        if self.loss_scale_factor is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise OptionConflict(
                f"--loss-scale-factor applies to --loss-agg seq-mean-token-sum-norm only, "
                f"not to {self.loss_agg}"
            )

    def _check_hybrid(self) -> None:
        """``hybrid_cp``'s rules (usage errors) and its ring settings resolved."""
        ring = (("--cp-link-bandwidth", "cp_link_bandwidth", DEFAULT_CP_LINK_BANDWIDTH),
                ("--gpu-tflops", "gpu_tflops", DEFAULT_GPU_TFLOPS))  # fmt: skip
        if not self.hybrid_cp:
            for flag, name, _ in ring:
                if getattr(self, name) is not None:
                    raise OptionConflict(f"{flag} applies to --hybrid-cp only")
            return
        cp = self.cp
        if cp < 2 or cp & (cp - 1):
            raise OptionConflict(
                f"--hybrid-cp needs --cp a power of two, 2 or more, got --cp {cp}",
                hint="sub-groups are aligned powers of two (1, 2, 4, ... cp GPUs of a group)",
            )
        for given, flag, why in (
            (self.micro_batch_size is not None, "--micro-batch-size",
             "it plans with a token budget per GPU (--micro-batch-tokens)"),
            (self.align != "lockstep", f"--align {self.align}",
             "it balances every GPU in every slot (lockstep)"),
            (self.equal_count, "--equal-count",
             "its plan does not give every rank the same number of samples"),
        ):  # fmt: skip
            if given:
                raise OptionConflict(f"--hybrid-cp is not available with {flag}: {why}")
        for flag, name, default in ring:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, default)
            elif not (value > 0 and value < float("inf")):
                raise RolltoolError(f"{flag} must be a positive number, got {value}")

    def _check_shared(self) -> None:
        """``share_prefix``'s rules (usage errors) and ``share_min`` resolved."""
        if not self.share_prefix:
            if self.share_min is not None:
                raise OptionConflict("--share-min applies to --share-prefix only")
            return
        for given, flag, why in (
            (self.hybrid_cp, "--hybrid-cp", "a prefix tree is planned whole on one GPU"),
            (self.cp > 1, f"--cp {self.cp}",
             "a continuation's queries would need the prefix's keys from every CP rank"),
            (self.sp > 1, f"--sp {self.sp}", "its views are not cut along prefix trees yet"),
            (self.micro_batch_size is not None, "--micro-batch-size",
             "it plans prefix trees under a token budget (--micro-batch-tokens)"),
            (self.align != "lockstep", f"--align {self.align}",
             "it balances prefix trees in lockstep"),
            (self.equal_count, "--equal-count", "a prefix tree's samples stay on one rank"),
        ):  # fmt: skip
            if given:
                raise OptionConflict(
                    f"--share-prefix is not available with {flag} yet: {why}",
                    hint=f"drop {flag.split()[0]} or --share-prefix (docs/shared_prefix.md)",
                )
        if self.share_min is None:
            object.__setattr__(self, "share_min", SHARE_MIN)
        elif self.share_min < 2:
            raise RolltoolError(
                f"--share-min must be at least 2, got {self.share_min}",
                hint="a prefix of one token stores nothing once: its branch token is re-fed",
            )

    def ring(self, workload: Workload) -> RingModel:
        """The ring model ``hybrid_cp`` plans with: `workload`'s model shape (K/V bytes per
        token), ``cp_link_bandwidth`` and ``gpu_tflops``."""
        assert self.cp_link_bandwidth is not None and self.gpu_tflops is not None
        return RingModel.for_workload(
            workload, bandwidth=self.cp_link_bandwidth * 1e9, speed=self.gpu_tflops * 1e12
        )

    def _check_sizes(self) -> None:
        for name, value in (
            ("--micro-batch-tokens", self.micro_batch_tokens),
            ("--micro-batch-size", self.micro_batch_size),
            ("--row-len", self.row_len),
        ):
            if value is not None and value < 1:
                raise RolltoolError(f"{name} must be positive, got {value}")
        for name, value in (("--dp", self.dp), ("--sp", self.sp), ("--cp", self.cp)):
            if value < 1:
                raise RolltoolError(f"{name} must be at least 1, got {value}")
        self._check_thd_rows()
        budget = self.micro_batch_tokens
        if self.row_len is not None and budget is not None and self.row_len < budget:
            raise RolltoolError(
                f"--row-len {self.row_len} is shorter than --micro-batch-tokens {budget}",
                hint="a row holds one micro-batch; make the row at least as long as the budget",
            )
        if not 0 <= self.pad_id <= MAX_TOKEN_ID:
            raise RolltoolError(
                f"--pad-id must be between 0 and {MAX_TOKEN_ID:,} (2**31 - 1: token ids are int32), "
                f"got {self.pad_id}"
            )

    def _check_thd_rows(self) -> None:
        """With ``--cp C`` every row must be valid THD: a multiple of 2C tokens (each
        ``cu_seqlens_padded`` boundary, row-end padding included; `GroupSplit.row_multiple`),
        what TransformerEngine's partitioner and ring-flash-attn's zigzag ring attention need.
        A ``--row-len R`` row holds R x C tokens, so R must be even; an empty micro-batch's row
        is 2C padding tokens, so the group's budget (``micro_batch_tokens`` x C) must hold 2C."""
        if self.cp == 1:
            return
        m = 2 * self.cp
        if self.row_len is not None and self.row_len % 2:
            raise RolltoolError(
                f"--row-len {self.row_len} with --cp {self.cp}: every CP row must be a multiple "
                f"of 2 x cp = {m} tokens (TransformerEngine's and ring-flash-attn's THD layout), "
                f"and a row holds --row-len x cp = {self.row_len * self.cp:,}",
                hint=f"use an even --row-len, e.g. {self.row_len + 1}",
            )
        budget = self.micro_batch_tokens
        if budget is not None and budget * self.cp < m:
            raise RolltoolError(
                f"--micro-batch-tokens {budget} with --cp {self.cp}: a CP row holds at least "
                f"2 x cp = {m} tokens (THD), more than the group's {budget * self.cp}-token budget",
                hint="give --micro-batch-tokens 2 or more",
            )

    def _check_choices(self) -> None:
        if self.balance not in WORKLOADS:
            raise RolltoolError(
                f"unknown --balance {self.balance!r}",
                hint=f"choose from {', '.join(sorted(WORKLOADS))}",
            )
        if self.align not in ALIGNS:
            raise RolltoolError(f"--align must be one of {', '.join(ALIGNS)}")
        if self.overlong not in OVERLONG:
            raise RolltoolError(f"--overlong must be one of {', '.join(OVERLONG)}")
        check_loss_agg(self.loss_agg, self.loss_scale_factor)

    @classmethod
    def from_options(cls, **options: Any) -> PackConfig:
        """A PackConfig from one flat set of settings (how the CLI and a script both name them):
        `StepConfig`'s fields go to ``steps``, `AdvantageConfig`'s to ``advantages``, the rest to
        the PackConfig; anything not given (or None for ``batch_size``) takes its default.
        ``batch_unit="tokens"`` needs an explicit ``batch_size`` (`OptionConflict`): the
        default counts rollouts. ``model_config`` (a config.json path) is another way to give
        ``model``, not both.

        >>> c = PackConfig.from_options(dp=8, batch_size=64, estimator="rloo", row_len=8192)
        >>> c.steps.batch_size, c.advantages.estimator, c.micro_batch_tokens
        (64, 'rloo', 8192)
        """
        if options.get("batch_unit") == "tokens" and options.get("batch_size") is None:
            raise OptionConflict(
                "--batch-unit tokens needs --batch-size in tokens (the default "
                f"{DEFAULT_BATCH_SIZE} counts rollouts or samples: {DEFAULT_BATCH_SIZE} tokens "
                "would make every group a step of its own)",
                hint="give the sampled tokens per step, e.g. --batch-size 1000000",
            )
        if options.get("batch_size", 0) is None:  # not given: the default
            del options["batch_size"]
        model_config = options.pop("model_config", None)
        if model_config is not None:
            if options.get("model") is not None:
                raise OptionConflict("give --model or --model-config, not both")
            options["model"] = model_config
        parts: dict[str, Any] = {}
        for name, record in (("steps", _default_steps()), ("advantages", AdvantageConfig())):
            given = {k: options.pop(k) for k in _field_names(record) if k in options}
            parts[name] = dataclasses.replace(record, **given)
        return cls(**parts, **options)

    @property
    def split(self) -> GroupSplit:
        """How each data-parallel group's micro-batches are shared by its sp or cp GPUs."""
        return GroupSplit(sp=self.sp, cp=self.cp, hybrid=self.hybrid_cp)

    @property
    def group_tokens(self) -> int | None:
        """A group's micro-batch budget: ``micro_batch_tokens`` x sp (or x cp), None in fixed
        mode. With cp it counts padded tokens (`GroupSplit.padded`)."""
        return (
            None if self.micro_batch_tokens is None else self.micro_batch_tokens * self.split.size
        )

    @property
    def group_row_len(self) -> int | None:
        """The stored (group) row length: ``row_len`` x sp (or x cp), None without --row-len."""
        return None if self.row_len is None else self.row_len * self.split.size

    @property
    def token_cap(self) -> int | None:
        """Most tokens one sample may occupy in a group's row (padded with cp): the group's
        budget, or its row length in count mode."""
        return self.group_tokens if self.group_tokens is not None else self.group_row_len

    def workload(self) -> Workload:
        return make_workload(self.balance, model=self.model, calibration=self.calibration)

    def record(self) -> RecordedConfig:
        """The settings as the manifest records them (``config``): every field, as set."""
        nested = {
            "steps": RecordedSteps(**_values(self.steps)),
            "advantages": RecordedAdvantages(**_values(self.advantages)),
        }
        return RecordedConfig(**{**_values(self), **nested})

    def to_dict(self) -> dict[str, Any]:
        """`record` as JSON: the manifest's ``config``."""
        return to_json(self.record())
