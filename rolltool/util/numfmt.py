"""How numbers read in every table rolltool prints: one function per kind of figure.

Every renderer (``rolltool.stats.render`` for stats, pack and advantages, ``rolltool.bench.render``
for bench) formats through these, so the same figure reads the same everywhere. A missing value
(None, or NaN) is ``-``.

>>> count(1234567.4), num(0.12345, ".3f"), pct(0.4567), over(1.0123), ms(0.0123), big(233_016_320)
('1,234,567', '0.123', '45.7%', '+1.23%', '12.3', '233.0 M')
"""

from __future__ import annotations

import math
from typing import Any

MISSING = "-"
"""What a missing figure (None, NaN) reads as."""


def missing(x: Any) -> bool:
    """None, or a float NaN (a figure that could not be computed)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def count(x: Any) -> str:
    """A count, rounded to a whole number, with thousands separators: ``1,234``."""
    return MISSING if missing(x) else f"{round(x):,}"


def num(x: Any, spec: str = ",.1f") -> str:
    """A number in a format ``spec`` (``format(x, spec)``): ``num(0.5, "+.3f")`` -> ``+0.500``."""
    return MISSING if missing(x) else format(x, spec)


def pct(x: Any, spec: str = ".1%") -> str:
    """A fraction as a percentage: ``0.457`` -> ``45.7%``."""
    return num(x, spec)


def over(x: Any) -> str:
    """A ratio to the ideal (1.0 = perfect) as the percentage above it: ``1.0123`` -> ``+1.23%``.

    Rank imbalance, lockstep overhead and step time vs another split all read this way.
    """
    return MISSING if missing(x) else f"{x - 1:+.2%}"


def ms(seconds: Any) -> str:
    """Seconds as milliseconds: ``0.0123`` -> ``12.3``."""
    return MISSING if missing(seconds) else f"{seconds * 1e3:,.1f}"


def big(n: Any) -> str:
    """A large count in millions from one million on: ``233016320`` -> ``233.0 M``."""
    if missing(n):
        return MISSING
    return f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,}"
