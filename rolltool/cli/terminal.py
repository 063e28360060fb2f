"""The width tables are fitted to: ``COLUMNS`` when set (a user's explicit choice, honoured
when the output is piped too), else the console's (the terminal's; 160 when piped)."""

from __future__ import annotations

import os

from rolltool.cli._common import out


def table_width() -> int:
    """``COLUMNS`` (read at call time, so a test or a wrapper can set it) when it is a whole
    number >= 20, else ``out.width``."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) >= 20:
        return int(columns)
    return out.width
