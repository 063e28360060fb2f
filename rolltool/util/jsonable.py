"""Turn reports (dicts of NumPy scalars and arrays) into plain JSON values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def jsonable(x: Any) -> Any:
    """Recursively convert NumPy values to Python ones; NaN and infinities become None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
