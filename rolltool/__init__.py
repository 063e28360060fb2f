"""rolltool: prepare RL rollout datasets for LLM training.

Groups (comparison sets for advantages), batches (optimizer steps) and packing (the physical
layout of ragged sequences in dense rows) are kept apart; docs/architecture.md maps the tree.

The public API, importable from here (each loaded on first use, so ``import rolltool`` stays
light: no polars, pyarrow or torch until a name needs them):

- `open_packed` / `PackedDataset`: read a packed directory (`rolltool.packed.reader`);
- `run_pack`, `run_advantages`, `run_synth`: the commands as functions (`rolltool.jobs`),
  with their settings `PackConfig` (`rolltool.plan.config`), `AdvantageConfig`
  (`rolltool.plan.advantages`) and `SynthConfig` (`rolltool.input.synth`);
- `Manifest`: a packed directory's typed record of itself (`rolltool.format`);
- `RolltoolError`: every error meant for people.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rolltool import _deprecated
from rolltool._version import __version__
from rolltool.errors import RolltoolError

if TYPE_CHECKING:
    from rolltool.format import Manifest
    from rolltool.input.synth import SynthConfig
    from rolltool.jobs.advantages import run_advantages
    from rolltool.jobs.pack import run_pack
    from rolltool.jobs.synth import run_synth
    from rolltool.packed.reader import PackedDataset, open_packed
    from rolltool.plan.advantages import AdvantageConfig
    from rolltool.plan.config import PackConfig

_deprecated.install()  # old import paths (rolltool.reader, ...) for one release

_LAZY = {
    "open_packed": "rolltool.packed.reader",
    "PackedDataset": "rolltool.packed.reader",
    "run_pack": "rolltool.jobs.pack",
    "run_advantages": "rolltool.jobs.advantages",
    "run_synth": "rolltool.jobs.synth",
    "PackConfig": "rolltool.plan.config",
    "AdvantageConfig": "rolltool.plan.advantages",
    "SynthConfig": "rolltool.input.synth",
    "Manifest": "rolltool.format",
}

__all__ = [
    "AdvantageConfig",
    "Manifest",
    "PackConfig",
    "PackedDataset",
    "RolltoolError",
    "SynthConfig",
    "__version__",
    "open_packed",
    "run_advantages",
    "run_pack",
    "run_synth",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rolltool' has no attribute {name!r}")
