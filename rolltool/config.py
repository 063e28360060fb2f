"""The pack job's settings: one frozen record, validated once, recorded in the manifest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolltool.advantages import AdvantageConfig
from rolltool.errors import RolltoolError
from rolltool.loss import check_loss_agg
from rolltool.partition import ALIGNS
from rolltool.schema import MAX_ID
from rolltool.steps import StepConfig
from rolltool.workload import WORKLOADS, Workload, make_workload

OVERLONG = ("error", "drop")
"""What to do with a sample longer than the token budget."""


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    dp: int
    """Data-parallel ranks."""
    steps: StepConfig
    """How optimizer steps are assembled (batch semantics)."""
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Estimator used when the input has no 'advantage' column."""
    micro_batch_tokens: int | None = 32_768
    """Hard token budget per micro-batch (None with micro_batch_size)."""
    micro_batch_size: int | None = None
    """Fixed number of samples per micro-batch instead of a token budget."""
    row_len: int | None = None
    """Pad every row to this many tokens (static shapes); must be >= micro_batch_tokens."""
    pad_id: int = 0
    """Token id written into padding: 0 <= pad_id <= 2**31 - 1 (packed as int32)."""
    balance: str = "flops"
    """Workload the partition balances: flops, verl, tokens, count or calibrated."""
    model: str | None = None
    """Model preset or config.json for the flops workload (default preset when None)."""
    calibration: str | None = None
    """Calibration JSON for the calibrated workload (written by rolltool bench)."""
    align: str = "lockstep"
    """lockstep: minimize sum_j max_r cost(r, j) (FSDP/ZeRO-3/TP); total: max_r sum_j (DDP)."""
    equal_count: bool = False
    """Give every rank the same number of samples."""
    overlong: str = "error"
    """A sample longer than the token budget: error, or drop it from training (counted)."""
    loss_agg: str = "token-mean"
    """Loss aggregation the per-token weights implement (see rolltool.loss)."""
    loss_scale_factor: float | None = None
    """Constant f of seq-mean-token-sum-norm."""
    shard_mb: float = 256.0
    """Largest shard file in MB; a (step, rank) above it is split by rows."""
    cache_mb: float = 1024.0
    """Decoded input row groups kept in memory (MB); input that fits is read from disk once."""

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise RolltoolError(f"--dp must be at least 1, got {self.dp}")
        if (self.micro_batch_tokens is None) == (self.micro_batch_size is None):
            raise RolltoolError("give exactly one of --micro-batch-tokens and --micro-batch-size")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise RolltoolError(
                f"--micro-batch-tokens must be positive, got {self.micro_batch_tokens}"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise RolltoolError(f"--micro-batch-size must be positive, got {self.micro_batch_size}")
        if self.row_len is not None:
            if self.row_len < 1:
                raise RolltoolError(f"--row-len must be positive, got {self.row_len}")
            if self.micro_batch_tokens is not None and self.row_len < self.micro_batch_tokens:
                raise RolltoolError(
                    f"--row-len {self.row_len} is shorter than --micro-batch-tokens {self.micro_batch_tokens}",
                    hint="a row holds one micro-batch; make the row at least as long as the budget",
                )
        if not 0 <= self.pad_id <= MAX_ID:
            raise RolltoolError(
                f"--pad-id must be between 0 and {MAX_ID:,} (2**31 - 1: token ids are int32), "
                f"got {self.pad_id}"
            )
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
        if self.shard_mb <= 0:
            raise RolltoolError(f"--shard-mb must be positive, got {self.shard_mb}")
        if self.cache_mb < 0:
            raise RolltoolError(f"--cache-mb must be >= 0, got {self.cache_mb}")

    @property
    def token_cap(self) -> int | None:
        """Most tokens one sample may have: the budget, or the row length in count mode."""
        return self.micro_batch_tokens if self.micro_batch_tokens is not None else self.row_len

    def workload(self) -> Workload:
        return make_workload(self.balance, model=self.model, calibration=self.calibration)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "steps": self.steps.to_dict(),
            "advantages": self.advantages.to_dict(),
            "micro_batch_tokens": self.micro_batch_tokens,
            "micro_batch_size": self.micro_batch_size,
            "row_len": self.row_len,
            "pad_id": self.pad_id,
            "balance": self.balance,
            "model": self.model,
            "calibration": self.calibration,
            "align": self.align,
            "equal_count": self.equal_count,
            "overlong": self.overlong,
            "loss_agg": self.loss_agg,
            "loss_scale_factor": self.loss_scale_factor,
            "shard_mb": self.shard_mb,
            "cache_mb": self.cache_mb,
        }
