"""``rolltool bench``: replay packed rows through transformer layers and measure balance.

A row's timed work is a whole decoder layer (``--what layer``, the default: projections,
variable-length attention, MLP, so the linear and quadratic cost terms are both real) or its
attention alone (``--what attention``). A pack made with ``--cp C`` or ``--sp S`` (read from its
manifest) is replayed per GPU: each group row once for each of its k GPUs, each timed on its
share from the reader's view of it (CP: its two zigzag chunks of every sample against the keys
they see causally, gathered from the group; SP: the whole row with heads / S; both: the linear
part on its T / k tokens). A micro-batch then takes its slowest GPU's time, and the report gives
the group's balance (max / mean over its GPUs) beside the data-parallel figures.

Data flow, one module per stage::

    config.py       BenchConfig (what the user asks, ``auto`` allowed) -> BenchSetup (resolved)
    rows.py         packed directory -> Row (step, rank, micro-batch[, gpu], cu_seqlens)
    shares.py       --cp/--sp: a GPU's view -> GpuShare (local tokens, attention blocks)
    backends.py     flash-attn / torch-varlen / sdpa, chosen by name (``auto``: best available);
                    varlen attention per segment, and block attention (bottom-right causal)
    layer.py        one decoder layer around a backend's attention; weights made once per shape
    timing.py       staged inputs, warm-up, shuffled repeats, CUDA events or perf_counter, median
    split_work.py   staging and timed work of a GPU's share (called by timing.py)
    check.py        --check: every segment equals its sequence run alone
    split_check.py  --check of --cp/--sp packs: each GPU, fed from its view, equals the samples
                    alone (CP: keys gathered from the group; SP: the row regathered, heads split)
    report.py       pure arithmetic: dp / lockstep / ideal step times, group balance, TFLOP/s,
                    the m + Σ (c + a·L + b·L²) fit (``rolltool.plan.cost_fit``)
    profile.py      --from-profile: the same calibration fitted to a per-document latency CSV
    compare.py      several directories side by side, the best marked
    run.py          the job wiring them (``run_bench(paths, config)``); torch imported here, on call
    render.py       the report as rich tables and lines (the CLI prints them)

Nothing in this package imports torch at import time.
"""

from rolltool.bench.config import BenchConfig
from rolltool.bench.run import run_bench

__all__ = ["BenchConfig", "run_bench"]
