"""Old import paths, kept for one release: ``import rolltool.reader`` still works, with a warning.

Before the tree was cut into layers (0.2), rolltool's modules sat flat under the package
(`rolltool.reader`, `rolltool.partition`, `rolltool.pool`, ...). `install` puts a finder first on
``sys.meta_path`` that answers each old name in `MOVED` with the module that holds it now
(the same module object, so a patched attribute is patched everywhere) and a
`DeprecationWarning` naming the new path, attributed to the line that imported it. An old
module whose contents went to several new ones (`rolltool.pool`, `rolltool.pack`) is a proxy that
looks names up in each, in order. No file sits at the old paths, so the tree shows only the
layers. Remove this module, and its two lines in ``rolltool/__init__.py``, in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

MOVED: dict[str, tuple[str, ...]] = {
    "rolltool.layout": ("rolltool.format.layout",),
    "rolltool.split": ("rolltool.format.split",),
    "rolltool.shards": ("rolltool.format.shards",),
    "rolltool.jsonable": ("rolltool.util.jsonable",),
    "rolltool.numfmt": ("rolltool.util.numfmt",),
    "rolltool.problems": ("rolltool.util.problems",),
    "rolltool.fs": ("rolltool.storage.fs",),
    "rolltool.remote": ("rolltool.storage.remote",),
    "rolltool.outputs": ("rolltool.storage.outputs",),
    "rolltool.source": ("rolltool.input.resolve", "rolltool.input.parquet", "rolltool.input.hints"),
    "rolltool.synth": ("rolltool.input.synth",),
    "rolltool.writer": ("rolltool.packed.writer",),
    "rolltool.reader": ("rolltool.packed.reader",),
    "rolltool.torch_data": ("rolltool.packed.torch_data",),
    "rolltool.advantages": ("rolltool.plan.advantages",),
    "rolltool.minibatches": ("rolltool.plan.minibatches",),
    "rolltool.loss": ("rolltool.plan.loss",),
    "rolltool.workload": ("rolltool.plan.workload",),
    "rolltool.steps": ("rolltool.plan.batches",),
    "rolltool.schedule": (
        "rolltool.plan.schedule",
        "rolltool.plan.step_plan",
        "rolltool.plan.placement",
        "rolltool.plan.step_records",
        "rolltool.plan.step_warnings",
        "rolltool.plan.group_advantages",
        "rolltool.plan.budget",
        "rolltool.plan.groups",
    ),
    "rolltool.config": ("rolltool.plan.config",),
    "rolltool.partition": ("rolltool.plan.partition",),
    "rolltool.tokens": ("rolltool.fetch.tokens",),
    "rolltool.exchange": ("rolltool.fetch.buckets",),
    "rolltool.readplan": ("rolltool.fetch.readplan",),
    "rolltool.workers": ("rolltool.engine.local", "rolltool.engine.base"),
    "rolltool.ray_engine": ("rolltool.engine.ray", "rolltool.engine.base"),
    "rolltool.ray_exchange": ("rolltool.engine.ray_exchange",),
    "rolltool.rewrite": ("rolltool.jobs.rewrite",),
    "rolltool.pool": ("rolltool.engine.local", "rolltool.packing.step", "rolltool.engine.base"),
    "rolltool.pack": ("rolltool.jobs.pack", "rolltool.packing.step", "rolltool.packing.manifest"),
}
"""Old module -> the modules that hold its names now (first: where most of it went). A package
moves with its submodules: ``rolltool.partition.kk`` is ``rolltool.plan.partition.kk``."""

RENAMED: dict[str, dict[str, str]] = {
    "rolltool.pool": {"worth_it": "pack_worth_it"},
    "rolltool.ray_engine": {"CHUNKS_PER_CPU": "CHUNKS_PER_WORKER"},
}
"""Names that changed as they moved, per old module: the old name reads the new one."""


def targets(name: str) -> tuple[str, ...] | None:
    """The new modules of old module `name` (a submodule of a moved package too), or None."""
    if name in MOVED:
        return MOVED[name]
    parent, _, leaf = name.rpartition(".")
    moved = targets(parent) if parent.startswith("rolltool.") else None
    return None if moved is None or len(moved) != 1 else (f"{moved[0]}.{leaf}",)


class _Proxy(types.ModuleType):
    """An old module split over several new ones: each name looked up in them, in order (its
    old name first, `RENAMED`); setting a name sets it where it lives, so a patch through the
    old path reaches the code that reads it."""

    def __init__(self, name: str, modules: Sequence[types.ModuleType]) -> None:
        super().__init__(name, f"Moved: {', '.join(m.__name__ for m in modules)}.")
        renamed = RENAMED.get(name, {})
        names = {n for m in modules for n in getattr(m, "__all__", dir(m)) if not n.startswith("_")}
        object.__setattr__(self, "_modules", tuple(modules))
        object.__setattr__(self, "_renamed", renamed)
        object.__setattr__(self, "__all__", sorted(names | set(renamed)))

    def _holder(self, attr: str) -> tuple[types.ModuleType, str] | None:
        attr = self._renamed.get(attr, attr)
        for m in self._modules:
            if hasattr(m, attr):
                return m, attr
        return None

    def __getattr__(self, attr: str) -> Any:
        found = self._holder(attr)
        if found is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        return getattr(*found)

    def __setattr__(self, attr: str, value: Any) -> None:
        found = None if attr.startswith("__") else self._holder(attr)
        if found is None:
            object.__setattr__(self, attr, value)
        else:
            setattr(found[0], found[1], value)

    def __dir__(self) -> list[str]:
        return list(self.__all__)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the old names (see the module docstring)."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = targets(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = targets(spec.name)
        assert new is not None
        warnings.warn(
            f"{spec.name} has moved to {' and '.join(new)}: import it from there "
            "(the old path goes in rolltool 0.3)",
            DeprecationWarning,
            stacklevel=2,  # the importing line: warnings skips the import machinery's frames
        )
        modules = [importlib.import_module(n) for n in new]
        if len(modules) > 1:
            return _Proxy(spec.name, modules)
        self._specs[spec.name] = modules[0].__spec__  # the import system overwrites it
        return modules[0]

    def exec_module(self, module: types.ModuleType) -> None:
        spec = self._specs.pop(getattr(module.__spec__, "name", ""), None)
        if spec is not None:
            module.__spec__ = spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): before the path finder, which would
    load a moved package's submodule a second time under its old name."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
