"""rolltool: prepare RL rollout datasets for LLM training.

Groups (comparison sets for advantages), batches (optimizer steps) and packing (the physical
layout of ragged sequences in dense rows) are kept apart; see README.md for the data flow.
"""

from __future__ import annotations

from typing import Any

from rolltool.errors import RolltoolError

__version__ = "0.1.0"

__all__ = ["RolltoolError", "__version__", "open_packed"]


def open_packed(path: Any, **kwargs: Any) -> Any:
    """Open a packed directory written by `rolltool pack` (see rolltool.packed.reader)."""
    from rolltool.packed.reader import open_packed as _open

    return _open(path, **kwargs)
