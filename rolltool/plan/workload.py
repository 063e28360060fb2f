"""Cost model: how expensive is a sample of L tokens to train on?

Every workload is the same quadratic in the sequence length, only the coefficients differ::

    cost(L) = c + a·L + b·L²          (float64, one value per sample)

=============  ===================================  =================================================
kind           coefficients                         meaning
=============  ===================================  =================================================
``flops``      a = 6·N, b = 6·layers·heads·head_dim  forward+backward training FLOPs of a decoder-only
                                                     transformer with causal attention (the default)
``verl``       a = 24576, b = 1                     the peer's proxy (12h² L + 2h L² over 2h, h=4096)
``tokens``     a = 1                                tokens
``count``      c = 1                                samples
``calibrated`` a, b (c, m) from a JSON file         measured seconds, written by ``rolltool bench``
=============  ===================================  =================================================

A calibrated workload may also carry ``m``, seconds per micro-batch whatever it holds (a kernel's
launch and fixed work): a micro-batch costs ``m + Σ cost(L)`` (`Workload.micro_batch_cost`).
Every rank runs as many micro-batches in a step, so ``m`` leaves the balance alone; the sample
cost ``cost(L)`` is what the partition balances. `rolltool.plan.cost_fit` fits m, c, a and b.

N counts the parameters that take part in a matmul per token: the transformer blocks plus the
output projection (the embedding lookup is not a matmul). The attention term is the causal half
of ``12·layers·L²·heads·head_dim`` (QKᵀ and AV, forward and backward); with ``heads·head_dim ==
hidden`` it is the ``6·layers·hidden·L²`` of the usual formula. ``flops_coefficients`` is the
one place this is written: ``rolltool bench`` counts the FLOPs it times with it too.

Example, the ``dense-7b`` preset at L = 4,096 tokens::

    >>> w = make_workload("flops", model="dense-7b")
    >>> round(float(w.cost(np.array([4096]))[0]) / 1e12, 1)    # TFLOPs
    183.9

Calibration file (JSON object; extra keys such as ``"device"`` or ``"r2"`` are kept as notes):
``{"a": <seconds per token>, "b": <seconds per token²>, "c": <seconds per sample, optional>,
"m": <seconds per micro-batch, optional>}``; a missing ``c`` or ``m`` is 0 (files written before
bench fitted them give the cost they gave then).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import RecordedModel, RecordedWorkload, from_json, to_json

__all__ = [
    "MODEL_PRESETS",
    "WORKLOADS",
    "ModelShape",
    "Workload",
    "flops_coefficients",
    "load_model_config",
    "make_workload",
]

MATMUL_FLOPS = 2.0
"""Forward FLOPs per matmul weight per token: one multiply-add."""

CAUSAL_ATTENTION_FLOPS = 2.0
"""Forward FLOPs per token² per unit of ``heads·head_dim`` per layer: QKᵀ and AV are L²·head_dim
multiply-adds each per head (4·L²·head_dim FLOPs), halved by the causal mask. A FLOP counter
that counts the full square overstates causal work 2x."""

BACKWARD_FACTOR = 2.0
"""Backward FLOPs / forward FLOPs, matmuls and attention alike: the gradients of a product's
two inputs (activations and weights; for attention Q and K, then the scores and V) cost a forward
product each. These are model FLOPs: FlashAttention's backward also recomputes the scores (2.5x
forward for attention), work the kernel chooses to redo, not work the model needs."""


def flops_coefficients(
    *, matmul_params: float, attention_width: int, layers: int, backward: bool = True
) -> tuple[float, float]:
    """``(a, b)``: FLOPs per token and per token² of a dense decoder, cost(L) = a·L + b·L².

    ``matmul_params``: weights used in a matmul once per token (all layers; the output
    projection too if counted); ``attention_width``: heads·head_dim; ``layers``: attention layers.
    Forward only, or forward and backward (1 + ``BACKWARD_FACTOR`` = 3x forward).
    Example, one layer of 9,216 matmul weights, 2 heads of 16, with backward:
    ``(2 · 3 · 9216, 2 · 3 · 32) = (55296.0, 192.0)``.
    """
    passes = 1.0 + (BACKWARD_FACTOR if backward else 0.0)
    a = MATMUL_FLOPS * passes * matmul_params
    b = CAUSAL_ATTENTION_FLOPS * passes * layers * attention_width
    return a, b


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a dense decoder-only transformer (what its FLOPs depend on)."""

    hidden_size: int
    """Width of the residual stream (``hidden_size`` in a Hugging Face config)."""
    num_layers: int
    """Number of transformer blocks (``num_hidden_layers``)."""
    num_heads: int
    """Query heads per block (``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads per block (``num_key_value_heads``; fewer than ``num_heads`` with GQA)."""
    intermediate_size: int
    """Width of the gated MLP (``intermediate_size``); the MLP has three such matrices."""
    vocab_size: int
    """Vocabulary size (``vocab_size``); sets the size of the output projection."""
    head_dim: int = 0
    """Width of one attention head; 0 means ``hidden_size // num_heads``."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise RolltoolError(
                    f"model shape: {name} must be at least 1, got {getattr(self, name)}"
                )
        for name in ("intermediate_size", "vocab_size", "head_dim"):
            if getattr(self, name) < 0:
                raise RolltoolError(f"model shape: {name} must not be negative")
        if self.head_dim == 0 and self.hidden_size < self.num_heads:
            raise RolltoolError(
                f"model shape: hidden_size ({self.hidden_size}) // num_heads ({self.num_heads}) "
                f"gives a head_dim of 0",
                hint="give head_dim, or check hidden_size and num_heads",
            )
        if self.num_heads % self.num_kv_heads:
            raise RolltoolError(
                f"model shape: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def attention_width(self) -> int:
        """``num_heads · head_dim``: the width of the attention scores' contraction."""
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def matmul_params(self) -> int:
        """Parameters used in a matmul once per token: blocks plus the output projection."""
        h, d = self.hidden_size, self.head_dim or self.hidden_size // self.num_heads
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, then k, v
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp) + h * self.vocab_size


MODEL_PRESETS: dict[str, ModelShape] = {
    "dense-0.5b": ModelShape(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, vocab_size=151_936,
    ),
    "dense-1.5b": ModelShape(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        intermediate_size=8960, vocab_size=151_936,
    ),
    "dense-7b": ModelShape(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        intermediate_size=18_944, vocab_size=152_064,
    ),
    "dense-8b": ModelShape(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        intermediate_size=14_336, vocab_size=128_256,
    ),
    "dense-32b": ModelShape(
        hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
        intermediate_size=27_648, vocab_size=152_064,
    ),
    "dense-70b": ModelShape(
        hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
        intermediate_size=28_672, vocab_size=128_256,
    ),
}  # fmt: skip
"""Built-in shapes, named by size; ``flops`` uses ``DEFAULT_PRESET`` when given no model."""

DEFAULT_PRESET = "dense-7b"


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A cost model ``cost(L) = c + a·L + b·L²`` and where its coefficients came from."""

    kind: str
    """Name in ``WORKLOADS`` (``flops``, ``verl``, ``tokens``, ``count``, ``calibrated``)."""
    a: float = 0.0
    """Cost per token (FLOPs, seconds, or 1 for ``tokens``)."""
    b: float = 0.0
    """Cost per token² (the attention term)."""
    c: float = 0.0
    """Cost per sample, whatever its length (1 for ``count``)."""
    m: float = 0.0
    """Cost per micro-batch, whatever it holds (calibrated only; 0 elsewhere). Recorded in the
    manifest as the note ``"m"`` when not 0, so records without it keep their bytes."""
    source: str | None = None
    """Preset name, model config path or calibration file path, for the manifest."""
    model: ModelShape | None = None
    """The model shape behind ``flops``; ``None`` for the other kinds."""
    notes: Mapping[str, Any] = field(default_factory=dict)
    """Extra keys of a calibration file (device, fit quality...), kept for the record."""

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise RolltoolError(
                f"unknown workload {self.kind!r}",
                hint=f"choose one of {', '.join(sorted(WORKLOADS))}",
            )
        for name in ("a", "b", "c", "m"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise RolltoolError(
                    f"workload {self.kind}: coefficient {name} must be a finite number >= 0, got {value!r}"
                )
        if self.a == 0 and self.b == 0 and self.c == 0:
            raise RolltoolError(f"workload {self.kind}: all coefficients are zero")

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Cost of each sample: ``[n]`` lengths (any integer or float dtype) -> ``[n]`` float64."""
        length = np.asarray(lengths, dtype=np.float64)
        return self.c + length * (self.a + self.b * length)

    def micro_batch_cost(self, lengths: np.ndarray) -> float:
        """Cost of one micro-batch holding samples of ``lengths``: ``m + Σ cost(L)``."""
        return self.m + float(self.cost(lengths).sum())

    def unreliable(self) -> str | None:
        """For a calibration that ``rolltool bench`` flagged (``"reliable": false``, or its
        ``warning`` in files written before that flag), a sentence saying so; else None."""
        if self.kind != "calibrated":
            return None
        flagged = self.notes.get("reliable") is False or "warning" in self.notes
        if not flagged:
            return None
        why = str(self.notes.get("warning") or "bench marked its fit unreliable")
        return (
            f"calibration file {self.source}: {why}; the balance follows those coefficients "
            "anyway (bench again on a quiet device, or use --balance flops)"
        )

    def describe(self) -> str:
        """One line for people, e.g. ``flops(dense-7b): 4.56e+10·L + 6.02e+05·L²``."""
        terms = [f"{v:.3g}{s}" for v, s in ((self.c, ""), (self.a, "·L"), (self.b, "·L²")) if v]
        src = f"({self.source})" if self.source else ""
        per_mb = f", + {self.m:.3g} per micro-batch" if self.m else ""
        return f"{self.kind}{src}: {' + '.join(terms)}{per_mb}"

    def record(self) -> RecordedWorkload:
        """The workload as the manifest records it; `from_record` reverses it. Built once per
        workload (every planned step records its own: ``asdict`` each time cost ~1% of a
        plan) and kept beside the fields, out of ``==`` and ``repr``."""
        kept = self.__dict__.get("_record")
        if kept is None:
            model = None if self.model is None else RecordedModel(**asdict(self.model))
            fields = asdict(self)
            m = fields.pop("m")
            notes = {**self.notes, MICRO_BATCH_NOTE: m} if m else dict(self.notes)
            kept = RecordedWorkload(**{**fields, "model": model, "notes": notes})
            object.__setattr__(self, "_record", kept)  # frozen: set as __init__ would
        return cast(RecordedWorkload, kept)

    @classmethod
    def from_record(cls, r: RecordedWorkload) -> Workload:
        """The workload a manifest recorded (coefficients taken as recorded)."""
        model = None if r.model is None else ModelShape(**asdict(r.model))
        notes = dict(r.notes)
        m = notes.pop(MICRO_BATCH_NOTE, 0.0) if _is_number(notes.get(MICRO_BATCH_NOTE)) else 0.0
        return cls(**{**asdict(r), "model": model, "notes": notes, "m": float(m)})

    def to_dict(self) -> dict[str, Any]:
        """`record` as JSON; ``Workload.from_dict`` reverses it."""
        return to_json(self.record())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Workload:
        """The workload of a ``to_dict`` document (`rolltool.format.CodecError` if misshapen)."""
        return cls.from_record(from_json(RecordedWorkload, d, "workload"))


MICRO_BATCH_NOTE = "m"
"""The note a manifest's workload record keeps ``Workload.m`` under (only when it is not 0)."""

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
"""Config keys that mark a mixture-of-experts model, whose FLOPs the dense formula gets wrong."""


def _is_number(value: object) -> bool:
    """A JSON number: int or float, not bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _moe_key(config: Mapping[str, Any]) -> str | None:
    """The first key saying ``config`` is a mixture of experts, or None for a dense model."""
    for key in MOE_KEYS:
        value = config.get(key)
        if value is None or value is False:
            continue
        if key == "moe_intermediate_size" or not _is_number(value) or value > 1:
            return key
    return None


def _read_json(p: Path, what: str) -> Any:
    if not p.exists():
        raise RolltoolError(f"{what} {p} does not exist")
    if not p.is_file():
        raise RolltoolError(f"{what} {p} is not a file")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RolltoolError(f"cannot read {what} {p}: {e}") from None


def _pick(
    raw: Mapping[str, Any], p: Path, *names: str, default: int | None = None
) -> tuple[int, str]:
    """The first of ``names`` in the config, as a positive integer, and the name it had."""
    for name in names:
        value = raw.get(name)
        if value is None:
            continue
        if not (_is_number(value) and math.isfinite(value) and value == int(value)) or value < 1:
            raise RolltoolError(
                f"model config {p}: {name!r} must be a positive integer, got {value!r}"
            )
        return int(value), name
    if default is None:
        raise RolltoolError(
            f"model config {p} has no {names[-1]!r}",
            hint="a Hugging Face config.json of a dense decoder-only model has all needed keys",
        )
    return default, names[-1]


def load_model_config(path: str | Path) -> ModelShape:
    """Read a model shape from a JSON config; the keys of a Hugging Face ``config.json`` work.

    Accepted keys (first name is ours, second the Hugging Face one): ``hidden_size``,
    ``num_layers``/``num_hidden_layers``, ``num_heads``/``num_attention_heads``,
    ``num_kv_heads``/``num_key_value_heads`` (default: heads), ``intermediate_size``,
    ``vocab_size``, ``head_dim`` (optional; else ``hidden_size`` must divide by the heads). A
    multimodal config's ``text_config`` is used when the top level has no ``hidden_size``.
    Every value is a positive integer (``4096.0`` is fine, ``"4096"``, ``64.7`` or ``true`` are
    not). Mixture-of-experts configs (``num_experts`` > 1 and the like) are refused: the dense
    formula would count every expert on every token.
    """
    p = Path(path)
    top = _read_json(p, "model config")
    if not isinstance(top, dict):
        raise RolltoolError(f"model config {p} is not a JSON object")
    raw: dict[str, Any] = top
    if "hidden_size" not in raw and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]
    for config in (top, raw):
        moe = _moe_key(config)
        if moe is not None:
            raise RolltoolError(
                f"model config {p} is a mixture of experts ({moe}: {config[moe]!r}); the flops "
                f"workload only models dense transformers",
                hint="measure it with `rolltool bench` and use --balance calibrated, or use "
                "--balance tokens",
            )

    hidden, hidden_key = _pick(raw, p, "hidden_size")
    heads, heads_key = _pick(raw, p, "num_heads", "num_attention_heads")
    head_dim, _ = _pick(raw, p, "head_dim", default=0)
    if head_dim == 0 and hidden % heads:
        raise RolltoolError(
            f"model config {p}: {hidden_key!r} ({hidden}) is not a multiple of {heads_key!r} "
            f"({heads}), and there is no 'head_dim'",
            hint="add the model's 'head_dim', or check the two values",
        )
    return ModelShape(
        hidden_size=hidden,
        num_layers=_pick(raw, p, "num_layers", "num_hidden_layers")[0],
        num_heads=heads,
        num_kv_heads=_pick(raw, p, "num_kv_heads", "num_key_value_heads", default=heads)[0],
        intermediate_size=_pick(raw, p, "intermediate_size")[0],
        vocab_size=_pick(raw, p, "vocab_size")[0],
        head_dim=head_dim,
    )


def _flops(model: str | None = None, calibration: str | Path | None = None) -> Workload:
    if calibration is not None:
        raise RolltoolError("a calibration file goes with the 'calibrated' workload, not 'flops'")
    name = DEFAULT_PRESET if model is None else model
    presets_hint = f"give a preset ({', '.join(MODEL_PRESETS)}) or the path of a config.json"
    if name in MODEL_PRESETS:
        shape = MODEL_PRESETS[name]
    elif name.strip() and (Path(name).exists() or name.endswith(".json") or "/" in name):
        shape = load_model_config(name)
    else:
        raise RolltoolError(f"unknown model {name!r}", hint=presets_hint)
    a, b = flops_coefficients(
        matmul_params=shape.matmul_params,
        attention_width=shape.attention_width,
        layers=shape.num_layers,
    )
    return Workload(kind="flops", a=a, b=b, source=name, model=shape)


def _fixed(kind: str, a: float = 0.0, b: float = 0.0, c: float = 0.0) -> Callable[..., Workload]:
    def make(model: str | None = None, calibration: str | Path | None = None) -> Workload:
        if model is not None or calibration is not None:
            raise RolltoolError(f"the {kind!r} workload takes no model or calibration file")
        return Workload(kind=kind, a=a, b=b, c=c)

    return make


def _calibrated(model: str | None = None, calibration: str | Path | None = None) -> Workload:
    if calibration is None:
        raise RolltoolError(
            "the 'calibrated' workload needs a calibration file",
            hint='write one with `rolltool bench`; it holds {"a": ..., "b": ...}',
        )
    p = Path(calibration)
    raw = _read_json(p, "calibration file")
    if not isinstance(raw, dict) or "a" not in raw or "b" not in raw:
        raise RolltoolError(
            f"calibration file {p} must be a JSON object with keys 'a' and 'b'",
            hint='e.g. {"a": 1.2e-7, "b": 3.4e-12} (seconds per token and per token²)',
        )
    coefficients = {key: raw.get(key, 0.0) for key in ("a", "b", "c", "m")}
    for key, value in coefficients.items():
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise RolltoolError(
                f"calibration file {p}: {key!r} must be a finite number >= 0, got {value!r}",
                hint="write the file again with `rolltool bench`",
            )
    a, b, c, m = (float(coefficients[key]) for key in ("a", "b", "c", "m"))
    if a == 0 and b == 0 and c == 0:
        raise RolltoolError(f"calibration file {p}: 'a', 'b' and 'c' are all zero")
    notes = {key: v for key, v in raw.items() if key not in ("a", "b", "c", "m")}
    return Workload(kind="calibrated", a=a, b=b, c=c, m=m, source=str(p), model=None, notes=notes)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "flops": _flops,
    "verl": _fixed("verl", a=24_576.0, b=1.0),
    "tokens": _fixed("tokens", a=1.0),
    "count": _fixed("count", c=1.0),
    "calibrated": _calibrated,
}
"""Workload constructors by name, each ``(model=None, calibration=None) -> Workload``."""


def make_workload(
    kind: str = "flops", *, model: str | None = None, calibration: str | Path | None = None
) -> Workload:
    """Build a workload from CLI-style arguments.

    ``model`` is a preset name (``dense-7b``...) or a config.json path and only goes with
    ``flops``; ``calibration`` is a JSON file path and only goes with ``calibrated``.
    """
    if kind not in WORKLOADS:
        raise RolltoolError(
            f"unknown workload {kind!r}", hint=f"choose one of {', '.join(sorted(WORKLOADS))}"
        )
    return WORKLOADS[kind](model=model, calibration=calibration)
