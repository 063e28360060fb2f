"""Fault injection for test_faults: count the operations a run makes that read, write or move
data, and send a signal at the `at`-th one (before it, or just after it).

In a child process: ``python -c CHILD`` (`child_command`) installs an `Injector` from the
``FAULT`` environment variable and runs the CLI; in-process, `Injector.install` takes a
pytest ``monkeypatch``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = f"""
import sys
sys.path.insert(0, {HERE!r})
import fault_hooks
fault_hooks.Injector.from_env().install_global()
from rolltool.cli import main
main(sys.argv[1:])
"""


def child_command(*args: Any) -> list[str]:
    """argv running ``rolltool ARGS`` under the `Injector` that ``FAULT`` describes."""
    return [sys.executable, "-c", CHILD, *map(str, args)]


def _targets() -> list[tuple[Any, str]]:
    import pyarrow.parquet as pq

    import rolltool.packed.writer
    import rolltool.storage.outputs
    from rolltool.fetch.tokens import TokenReader

    return [
        (os, "rename"),
        (os, "replace"),
        (rolltool.packed.writer, "write_shard"),
        (rolltool.packed.writer.PackedWriter, "write_samples"),
        (rolltool.packed.writer.PackedWriter, "finish"),
        (pq.ParquetWriter, "write_table"),
        (TokenReader, "fetch"),
        (rolltool.storage.outputs, "_commit"),
    ]


@dataclass
class Injector:
    """Send `sig` at the `at`-th call (1-based; -1: never) of the counted operations, or of
    the one named `only`; `after`: once that call has returned. `row_group` overrides the
    advantages job's output row group (more row groups: more places to be killed at)."""

    at: int = -1
    sig: int = signal.SIGKILL
    after: bool = False
    only: str | None = None
    row_group: int | None = None
    count: int = 0
    names: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_env(cls) -> Injector:
        return cls(**json.loads(os.environ.get("FAULT", "{}")))

    def env(self) -> dict[str, str]:
        doc = {"at": self.at, "sig": int(self.sig), "after": self.after, "only": self.only}
        return {**os.environ, "FAULT": json.dumps({**doc, "row_group": self.row_group})}

    def _hit(self, name: str) -> bool:
        if self.only is not None and name != self.only:
            return False
        with self._lock:
            self.count += 1
            self.names.append(name)
            return self.count == self.at

    def _wrap(self, name: str, real: Any) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            hit = self._hit(name)
            if hit and not self.after:
                os.kill(os.getpid(), self.sig)
            result = real(*args, **kwargs)
            if hit and self.after:
                os.kill(os.getpid(), self.sig)
            return result

        return op

    def install(self, setattr_: Any) -> None:
        """Wrap every counted operation with ``setattr_(owner, name, wrapper)``."""
        import rolltool.jobs.advantages

        for owner, name in _targets():
            setattr_(owner, name, self._wrap(name, getattr(owner, name)))
        if self.row_group is not None:
            setattr_(rolltool.jobs.advantages, "ROW_GROUP", self.row_group)

    def install_global(self) -> None:
        self.install(setattr)
