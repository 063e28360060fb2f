"""The benchmarks' fresh-process runner: a timed snippet in its own interpreter.

Each reader or tree measured in a process of its own starts alike (no heap, caches or imports
left by the one before); `read_cpu.py` and `first_row.py` alternate such processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_child(code: str) -> Any:
    """Run `code` with this interpreter in a fresh process; the JSON of its last stdout line."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
