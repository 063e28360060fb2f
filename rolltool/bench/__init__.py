"""``rolltool bench``: replay packed rows through transformer layers and measure balance.

A row's timed work is a whole decoder layer (``--what layer``, the default: projections,
variable-length attention, MLP, so the linear and quadratic cost terms are both real) or its
attention alone (``--what attention``).

Data flow, one module per stage::

    config.py    BenchConfig (what the user asks, ``auto`` allowed) -> BenchSetup (resolved)
    rows.py      packed directory -> Row (step, rank, micro-batch, cu_seqlens)
    backends.py  flash-attn / torch-varlen / sdpa, chosen by name (``auto``: best available)
    layer.py     one decoder layer around a backend's attention; weights made once per shape
    timing.py    staged inputs, warm-up, shuffled repeats, CUDA events or perf_counter, median
    check.py     --check: every segment equals its sequence run alone
    report.py    pure arithmetic: dp / lockstep / ideal step times, TFLOP/s, a·L + b·L² fit
    compare.py   several directories side by side, the best marked
    run.py       the job wiring them (``run_bench(paths, config)``); torch imported here, on call
    render.py    the report as rich tables and lines (the CLI prints them)

Nothing in this package imports torch at import time.
"""

from rolltool.bench.config import BenchConfig
from rolltool.bench.run import run_bench

__all__ = ["BenchConfig", "run_bench"]
