"""The benchmarks' shared input: a synth dataset of a given size, generated once and cached."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from rolltool.input.synth import SynthConfig
from rolltool.jobs.synth import run_synth


def synth_dataset(groups: int) -> Path:
    """`rolltool synth --groups N --seed 1` under the temp folder, generated on first use."""
    path = Path(tempfile.gettempdir()) / f"rolltool-bench-synth-{groups}.parquet"
    if not path.exists():
        print(f"generating {path} ...", file=sys.stderr)
        run_synth(SynthConfig(groups=groups, seed=1), path, force=True)
    return path
