"""What `rolltool bench` runs: the layer shape, what of it is timed, the backend, and how it times.

A ``BenchConfig`` is what the user asks for (``auto`` allowed: ``rolltool bench``'s options, or a
script's); ``run_bench`` resolves it on the machine that runs it into a ``BenchSetup`` (no
``auto`` left) before any row is timed, and the setup goes into the report, so every measurement
says how it was made.

``what`` chooses a row's work (see ``rolltool.bench.layer``):

=============  ==============================================================================
``layer``      a whole dense decoder layer (q/k/v projections, varlen attention, output
               projection, SiLU-gated MLP, RMSNorms, residuals): what a trainer's layer costs,
               linear term (matmuls) and quadratic term (attention) together. The default.
``attention``  the varlen attention call only (random q, k, v): the L² term alone.
=============  ==============================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rolltool.bench.backends import BACKENDS
from rolltool.errors import RolltoolError
from rolltool.plan.workload import DEFAULT_PRESET, MODEL_PRESETS, ModelShape

WHATS = ("layer", "attention")
"""Names accepted by ``--what``: a whole transformer layer per row, or its attention only."""

DTYPES = ("bf16", "fp16", "fp32")
"""Names accepted by ``--dtype`` (besides ``auto``: bf16 on CUDA, fp32 on CPU)."""
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Each of ``DTYPES`` as torch names it."""


def torch_dtype(torch: Any, name: str) -> Any:
    """The torch dtype of ``--dtype`` `name` (one of ``DTYPES``), from the `torch` module the
    bench was handed (this module never imports torch)."""
    return getattr(torch, TORCH_DTYPES[name])


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
"""Devices ``--device`` accepts: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` (checked before torch,
which would raise its own RuntimeError on e.g. ``tpu``)."""


def parse_device(text: str) -> str:
    """``text`` if it is a device ``--device`` accepts (``DEVICE_PATTERN``), else a ValueError."""
    if not DEVICE_PATTERN.fullmatch(text):
        raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def parse_steps(text: str) -> tuple[int, ...]:
    """``"0,2-4"`` -> ``(0, 2, 3, 4)`` (sorted, each once); bad syntax is a ValueError."""
    steps: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            first, last = 0, -1
        if first < 0 or last < first:
            raise ValueError(f"expected steps like 0,2-4, got {text!r}")
        steps.update(range(first, last + 1))
    return tuple(sorted(steps))


DEFAULT_CHECK_ROWS = 4
"""Rows per directory ``--check`` compares when not told how many (``--check-rows``)."""

# Tolerances of --check: |varlen - alone| <= atol + rtol * |alone|, per element. The reference
# runs in fp32 on the same (rounded) inputs; bf16/fp16 outputs are rounded once (2^-8 / 2^-11
# relative), so these bounds leave about 2x headroom over rounding and still catch a token that
# sees one foreign key (its output moves by O(1) at a segment's start).
TOLERANCES: dict[str, tuple[float, float]] = {
    "bf16": (1.5e-2, 1.5e-2),
    "fp16": (2e-3, 2e-3),
    "fp32": (1e-4, 1e-4),
}


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One decoder layer's shape, and the layer count.

    Attention: q is ``[T, heads, head_dim]``, k and v ``[T, kv_heads, head_dim]``. Layer mode
    adds the residual stream ``[T, hidden]`` and the gated MLP's ``intermediate`` width.
    """

    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (fewer than ``heads`` with grouped-query attention; must divide it)."""
    head_dim: int
    """Width of one head."""
    hidden: int = 0
    """Width of the residual stream (layer mode; 0: unknown, attention mode only)."""
    intermediate: int = 0
    """Width of the SiLU-gated MLP (layer mode; 0: unknown, attention mode only)."""
    layers: int = 1
    """Layers (or attention calls) per row, emulating depth (times and FLOPs scale with it)."""

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "layers"):
            if getattr(self, name) < 1:
                raise RolltoolError(f"bench: --{name.replace('_', '-')} must be at least 1")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) < 0:
                raise RolltoolError(f"bench: --{name} must not be negative")
        if self.heads % self.kv_heads:
            raise RolltoolError(
                f"bench: --heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})"
            )

    @property
    def matmul_params(self) -> int:
        """Weights of one layer's matmuls: q, o (hidden x heads·head_dim), k, v (hidden x
        kv_heads·head_dim), gate, up, down (hidden x intermediate). Each is used once per token.

        Example, dense-7b (hidden 3,584, 28 heads / 4 kv of 128, MLP 18,944): 233.0 M.
        """
        h = self.hidden
        return (
            2 * h * self.heads * self.head_dim
            + 2 * h * self.kv_heads * self.head_dim
            + (3 * h * self.intermediate)
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "layers": self.layers,
        }


def resolve_shape(
    *,
    model: str | None = None,
    manifest_model: ModelShape | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden: int | None = None,
    intermediate: int | None = None,
    layers: int = 1,
) -> tuple[LayerShape, str]:
    """The layer shape and where it came from.

    Base shape: the preset ``model``, else the model the packed directory was balanced for
    (``manifest_model``), else ``DEFAULT_PRESET``; explicit ``heads``/``kv_heads``/``head_dim``/
    ``hidden``/``intermediate`` override it, each on its own (``--heads 2 --head-dim 16`` keeps
    the base's hidden and MLP widths). ``kv_heads`` defaults to the base's ratio when only
    ``heads`` is given and the ratio divides it, else to ``heads``. ``layers`` never comes from
    the model: time is linear in it, so one layer (the default) measures balance at a fraction of
    the cost.
    """
    if model is not None:
        if model not in MODEL_PRESETS:
            raise RolltoolError(
                f"unknown model preset {model!r}", hint=f"choose one of {', '.join(MODEL_PRESETS)}"
            )
        base, source = MODEL_PRESETS[model], f"preset {model}"
    elif manifest_model is not None:
        base, source = manifest_model, "the packed directory's workload model"
    else:
        base, source = MODEL_PRESETS[DEFAULT_PRESET], f"preset {DEFAULT_PRESET}"
    base_dim = base.head_dim or base.hidden_size // base.num_heads
    h = heads if heads is not None else base.num_heads
    if kv_heads is not None:
        kv = kv_heads
    elif heads is None:
        kv = base.num_kv_heads
    else:
        group = base.num_heads // base.num_kv_heads
        kv = h // group if h % group == 0 else h
    if any(x is not None for x in (heads, kv_heads, head_dim, hidden, intermediate)):
        source += " with overrides"
    shape = LayerShape(
        heads=h,
        kv_heads=kv,
        head_dim=head_dim if head_dim is not None else base_dim,
        hidden=hidden if hidden is not None else base.hidden_size,
        intermediate=intermediate if intermediate is not None else base.intermediate_size,
        layers=layers,
    )
    return shape, source


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to replay and how: ``rolltool bench``'s settings (defaults here, once).

    ``auto`` and ``None`` are resolved by ``run_bench`` where it runs (see ``BenchSetup``):
    the device and dtype from the machine, the backend from what is installed, the shape from
    ``model``, else the packed directory's model, with the explicit widths overriding it.
    """

    backend: str = "auto"
    """``auto`` (flash-attn, else torch-varlen on CUDA, else sdpa) or a name in ``BACKENDS``."""
    what: str = "layer"
    """One of ``WHATS``: a whole layer per row, or attention only."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """``auto`` (bf16 on CUDA, fp32 on CPU) or one of ``DTYPES``."""
    model: str | None = None
    """Preset the layer shape is taken from (None: the packed directory's model, else
    ``DEFAULT_PRESET``)."""
    heads: int | None = None
    """Query heads, overriding the model's."""
    kv_heads: int | None = None
    """Key/value heads (GQA), overriding the model's (see ``resolve_shape``)."""
    head_dim: int | None = None
    """Width of one head, overriding the model's."""
    hidden: int | None = None
    """Residual stream width, overriding the model's."""
    intermediate: int | None = None
    """Gated MLP width, overriding the model's."""
    layers: int = 1
    """Layers (or attention calls) per row, chained, emulating depth."""
    backward: bool = False
    """Time forward + backward, not forward only."""
    repeats: int = 5
    """Timed passes over all rows (median per row; order shuffled each pass)."""
    warmup: int = 1
    """Untimed passes over all rows first."""
    flush_l2: bool = False
    """Flush the GPU's L2 cache before each timed row (CUDA only)."""
    seed: int = 0
    """Seed of the random inputs and weights, and of the row order of each pass."""
    steps: tuple[int, ...] | None = None
    """Steps to replay; None for all."""
    check_rows: int = 0
    """Rows per directory whose segments are compared with each sequence run alone (0: none)."""

    def __post_init__(self) -> None:
        try:
            parse_device(self.device)
        except ValueError as e:
            raise RolltoolError(f"bench: unknown --device {self.device!r}", hint=str(e)) from None
        for option, value, names in (
            ("--backend", self.backend, ("auto", *BACKENDS)),
            ("--what", self.what, WHATS),
            ("--dtype", self.dtype, ("auto", *DTYPES)),
        ):
            if value not in names:
                raise RolltoolError(f"bench: unknown {option} {value!r}", hint=f"one of {names}")
        if self.model is not None and self.model not in MODEL_PRESETS:
            raise RolltoolError(
                f"unknown model preset {self.model!r}",
                hint=f"choose one of {', '.join(MODEL_PRESETS)}",
            )
        _check_counts(self.repeats, self.warmup, self.check_rows)
        if self.steps is not None and any(s < 0 for s in self.steps):
            raise RolltoolError(f"bench: steps count from 0, got {list(self.steps)}")


def _check_counts(repeats: int, warmup: int, check_rows: int) -> None:
    if repeats < 1:
        raise RolltoolError("bench: --repeats must be at least 1")
    if warmup < 0:
        raise RolltoolError("bench: --warmup must not be negative")
    if check_rows < 0:
        raise RolltoolError("bench: the number of rows to check must not be negative")


@dataclass(frozen=True, kw_only=True)
class BenchSetup:
    """How a packed directory is replayed: a ``BenchConfig`` resolved (no ``auto`` values)."""

    backend: str
    """Name in ``rolltool.bench.backends.BACKENDS``."""
    shape: LayerShape
    """Layer shape, and the layer count."""
    what: str = "layer"
    """One of ``WHATS``: a whole layer per row, or attention only."""
    dtype: str = "fp32"
    """One of ``DTYPES``."""
    device: str = "cpu"
    """A torch device string: ``cpu``, ``cuda``, ``cuda:1``."""
    backward: bool = False
    """Time forward and backward instead of forward only (layer: gradients of the input and of
    every weight; attention: gradients of q, k, v)."""
    repeats: int = 5
    """Timed passes over all rows; each row's time is the median over them."""
    warmup: int = 1
    """Untimed passes over all rows before the first timed one."""
    flush_l2: bool = False
    """Overwrite a buffer larger than the L2 cache before each timed row (CUDA only)."""
    seed: int = 0
    """Seed of the random inputs and weights, and of the row order of each pass."""
    steps: tuple[int, ...] | None = None
    """Steps to replay; ``None`` for all."""
    check_rows: int = 0
    """Rows whose segments ``--check`` compares with each sequence run alone (0: no check)."""
    shape_source: str = field(default="", compare=False)
    """Where the shape came from, for the report."""

    def __post_init__(self) -> None:
        if self.what not in WHATS:
            raise RolltoolError(f"bench: unknown --what {self.what!r}", hint=f"one of {WHATS}")
        if self.what == "layer" and (self.shape.hidden < 1 or self.shape.intermediate < 1):
            raise RolltoolError(
                "bench: layer mode needs the hidden and MLP widths "
                f"(got hidden {self.shape.hidden}, intermediate {self.shape.intermediate})",
                hint="give --hidden and --intermediate, or --what attention",
            )
        if self.dtype not in DTYPES:
            raise RolltoolError(f"bench: unknown dtype {self.dtype!r}", hint=f"one of {DTYPES}")
        _check_counts(self.repeats, self.warmup, self.check_rows)
        if self.flush_l2 and not self.device.startswith("cuda"):
            raise RolltoolError("bench: --flush-l2 needs a CUDA device")
