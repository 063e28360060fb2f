"""What a hybrid-CP split costs: the ring's exposed communication (`RingModel`), the tokens a
k-way split puts on each GPU (`gpu_tokens`, CP padding counted), each GPU's cost (`gpu_cost`) and
each sample's least degree (`cp_degrees`). The formulas are `rolltool.plan.hybrid`'s (its
docstring); the placement (`hybrid_place`) and the halving pass (`hybrid_halve`) price with
these alone, and so do ``stats`` and ``verify`` through `rolltool.plan.hybrid_step.gpu_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.workload import Workload

__all__ = ["RingModel", "cp_degrees", "gpu_cost", "gpu_tokens"]


@dataclass(frozen=True, kw_only=True)
class RingModel:
    """What ring attention over k GPUs costs beyond each GPU's 1/k of the work."""

    kv_bytes_per_token: float
    """K and V bytes of one token over all layers (2 · layers · kv_heads · head_dim · bytes of
    the dtype)."""
    bandwidth: float = 100e9
    """Bytes per second of one ring link (default 100 GB/s, NVLink-class)."""
    speed: float = 400e12
    """The workload's units one GPU does per second (default 400 TFLOP/s: an H100 at ~40% of its
    bf16 peak, for the ``flops`` workload)."""

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "bandwidth", "speed"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0) or (
                name != "kv_bytes_per_token" and value == 0
            ):
                raise RolltoolError(f"ring model: {name} must be a positive number, got {value!r}")

    @classmethod
    def for_workload(cls, workload: Workload, dtype_bytes: int = 2, **kwargs: float) -> RingModel:
        """The ring of `workload`'s model shape (``flops``); no communication for the others,
        whose units are not FLOPs."""
        m = workload.model
        if m is None:
            return cls(kv_bytes_per_token=0.0, **kwargs)
        head_dim = m.head_dim or m.hidden_size // m.num_heads
        kv = 2.0 * m.num_layers * m.num_kv_heads * head_dim * dtype_bytes
        return cls(kv_bytes_per_token=kv, **kwargs)

    def exposed(self, lengths: np.ndarray, k: np.ndarray, attention: float) -> np.ndarray:
        """[n] float64: the communication each GPU of a k-way split waits for, in the workload's
        units (0 for k = 1); `attention`: the workload's per-token² coefficient ``b``."""
        length = np.asarray(lengths, dtype=np.float64)
        k = np.asarray(k, dtype=np.float64)
        chunk = length / k
        comm = 3.0 * chunk * self.kv_bytes_per_token / self.bandwidth * self.speed
        compute = attention * chunk * chunk
        return np.where(k > 1, (k - 1) * np.maximum(0.0, comm - compute), 0.0)


def gpu_tokens(lengths: np.ndarray, k: np.ndarray) -> np.ndarray:
    """[n] int64: tokens a sample puts on each GPU of its k-way split, CP padding counted
    (padded to a multiple of 2k, then 1/k of it; k = 1: the sample itself, unpadded).

    >>> gpu_tokens(np.array([10, 10, 7]), np.array([1, 2, 4])).tolist()
    [10, 6, 2]
    """
    length = np.asarray(lengths, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    padded = -(-length // (2 * k)) * 2 * k
    return np.where(k > 1, padded // k, length)


def cp_degrees(lengths: np.ndarray, cp: int, max_tokens: int) -> np.ndarray:
    """[n] int64: each sample's least degree, the smallest power of two k <= cp whose per-GPU
    tokens fit `max_tokens`; a `RolltoolError` naming the first sample that fits none."""
    length = np.asarray(lengths, dtype=np.int64)
    k = np.ones(len(length), dtype=np.int64)
    while True:
        over = gpu_tokens(length, k) > max_tokens
        if not over.any():
            return k
        wider = over & (k * 2 <= cp)
        if not np.array_equal(wider, over):
            i = int(np.flatnonzero(over & ~wider)[0])
            raise RolltoolError(
                f"sample {i} ({int(length[i])} tokens) does not fit {cp} GPUs of {max_tokens} "
                "tokens, CP padding counted",
                hint="raise --micro-batch-tokens or --cp, or drop over-long samples "
                "(--overlong drop)",
            )
        k[wider] *= 2


def gpu_cost(length: np.ndarray, k: np.ndarray, workload: Workload, ring: RingModel) -> np.ndarray:
    """[n] float64: each sample's cost on each GPU of its k-way split: 1/k of the padded sample's
    cost plus the ring's exposed communication (k = 1: the sample's own cost)."""
    length = np.asarray(length, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    padded = np.where(k > 1, gpu_tokens(length, k) * k, length)
    return workload.cost(padded) / k + ring.exposed(length, k, workload.b)
