"""Statistics of a packed directory: what each step holds, how well it packs and balances.

Everything comes from ``manifest.json`` (per-step counts, per-env counts, the plan report, per-rank
row tokens) and ``samples.parquet`` (which rank and micro-batch each trained sample went to, and
its length); the safetensors shards are never opened.

The world (``world``): R = ``dp`` data-parallel ranks, each a group of k = ``sp`` or ``cp``
GPUs (k = 1 without either; ``gpus`` = R·k); ``gpu_budget`` is ``--micro-batch-tokens`` (per GPU),
``group_budget`` = k · gpu_budget what a group's micro-batch (a stored row) may hold, counting the
CP padding. With cp every sample occupies its length padded to a multiple of 2·cp
(`rolltool.format.split.GroupSplit.padded`): the plan balanced those occupied tokens, and so does every
figure below; costs are per GPU (the plan's recorded workload: the run's divided by k).

Per step, with R ranks, M micro-batches per rank and x(r, j) the occupied tokens (or the per-GPU
cost) of rank r's micro-batch j:

- ``rows`` = R·M packed rows; ``row_tokens`` their tokens with padding, ``real_tokens`` without;
- ``row_capacity`` = rows · (the group's row: ``--row-len`` · k, else the group's budget, else
  the step's longest row): what the rows could hold; ``packing_efficiency`` = real_tokens /
  row_capacity; ``padding_fraction`` = (row_tokens - real_tokens) / row_tokens, of which
  ``cp_padding_tokens`` (``cp_padding_fraction`` of row_tokens) are the samples' CP padding;
- ``over_gpu_budget`` (overall and per env): trained samples longer than ``gpu_budget``, trained
  only because sp or cp split them (0 without either);
- ``fill_histogram``: micro-batches by occupied tokens / per-row capacity, in ten bins of 10%;
- ``rank_imbalance`` = max_r Σ_j x(r, j) / (Σ x / R) and ``lockstep_overhead`` =
  Σ_j max_r x(r, j) / (Σ x / R), each ``{"tokens": ..., "cost": ...}``, 1.0 when perfect;
- ``step_cost``: the step's time in workload units: Σ_j max_r cost(r, j) with ``--align
  lockstep`` (ranks meet at every micro-batch), max_r Σ_j cost(r, j) with ``total``;
- ``alternatives``: the same step re-planned with the ``tokens`` and ``count`` workloads (same
  dp, budget, alignment), priced with the run's workload; ``step_cost_vs_chosen`` > 1 means the
  alternative would have been that much slower.

A ``--hybrid-cp`` pack (samples.parquet's ``cp_degree`` and ``cp_start``): each sample occupies
its length padded for its own degree k (whole: unpadded), a group's cost per slot is its slowest
GPU's (the plan's formula, `rolltool.plan.hybrid_step.gpu_costs`, ring included), and each step
adds ``hybrid``: samples and tokens at each k (``split_samples``, ``split_tokens``) and the
balance over every GPU (``gpu_imbalance``, ``gpu_lockstep_overhead`` = Σ_j max_g / Σ_j mean_g,
``gpu_step_cost``); ``totals.hybrid`` sums them over the run. No alternatives are planned.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import Manifest, StepRecord
from rolltool.format.split import GroupSplit, recorded_split
from rolltool.packed.reader import open_packed
from rolltool.plan.hybrid import RingModel
from rolltool.plan.hybrid_step import gpu_costs, occupied_tokens
from rolltool.plan.minibatches import recorded_structure
from rolltool.plan.partition import metrics, plan_step
from rolltool.plan.workload import Workload, make_workload
from rolltool.stats.accumulate import Stats, ValueCounts, percentiles
from rolltool.stats.shared import shared_figures, shared_grid, shared_totals
from rolltool.storage.fs import Location
from rolltool.util.arrow import int_column, string_codes
from rolltool.util.mapping import Mapper

Columns = Mapping[str, np.ndarray]
"""Trained samples as columns, each [n]: ``step``, ``rank``, ``micro_batch``, ``length`` (int64),
``env`` (int64 codes into the env names), and a --hybrid-cp pack's ``cp_degree``, ``cp_start``."""

ALTERNATIVES = ("tokens", "count")
"""Workloads the chosen split is compared with."""

FILL_BINS = np.linspace(0.0, 1.0, 11)
"""Edges of the token fill histogram (the last bin includes 1.0)."""

COUNTS = (
    "groups",
    "rollouts",
    "samples",
    "sampled_tokens",
    "trainable_tokens",
    "uniform_groups_kept",
    "uniform_groups_dropped",
    "overlong_dropped",
    "over_gpu_budget",
)
"""Per-step counts copied from the manifest (overall and per env)."""

ACROSS = (
    "samples",
    "over_gpu_budget",
    "sampled_tokens",
    "trainable_tokens",
    "micro_batches_per_rank",
    "packing_efficiency",
    "padding_fraction",
    "cp_padding_fraction",
    "rank_imbalance.cost",
    "rank_imbalance.tokens",
    "lockstep_overhead.cost",
    "lockstep_overhead.tokens",
)
"""Per-step figures summarized across steps (mean, min, p50, p90, max)."""


def balance_figures(tokens: np.ndarray, costs: np.ndarray, align: str) -> dict[str, Any]:
    """Imbalance, lockstep overhead and step cost of a ``[R, M]`` grid (`partition.metrics`)."""
    grids = {"tokens": tokens.astype(np.float64), "cost": costs}
    return {
        "rank_imbalance": {k: metrics.imbalance(x) for k, x in grids.items()},
        "lockstep_overhead": {k: metrics.lockstep_overhead(x) for k, x in grids.items()},
        "step_cost": metrics.step_cost(costs, align),
    }


def _grid(
    frame: Columns, dp: int, m: int, workload: Workload, split: GroupSplit
) -> tuple[np.ndarray, ...]:
    """``[dp, m]`` occupied tokens (padded for cp) and cost per micro-batch from a step's trained
    samples."""
    tokens = np.zeros((dp, m), dtype=np.int64)
    costs = np.zeros((dp, m))
    if len(frame["length"]) and m:
        r = frame["rank"]
        j = frame["micro_batch"]
        occupied = split.padded(frame["length"])
        np.add.at(tokens, (r, j), occupied)
        np.add.at(costs, (r, j), workload.cost(occupied))
    return tokens, costs


def _hybrid_grid(
    frame: Columns, dp: int, m: int, workload: Workload, ring: RingModel, cp: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A --hybrid-cp step from its trained samples (their ``cp_degree``, ``cp_start``): the
    ``[dp, m]`` occupied tokens (each sample padded for its own degree) and group cost (its
    slowest GPU), and the ``[dp, m, cp]`` cost of every GPU (`gpu_costs`)."""
    length = frame["length"]
    k, a = frame["cp_degree"], frame["cp_start"]
    r, j = frame["rank"], frame["micro_batch"]
    tokens = np.zeros((dp, m), dtype=np.int64)
    np.add.at(tokens, (r, j), occupied_tokens(length, k))
    per_gpu = gpu_costs(length, k, a, r, j, shape=(dp, m, cp), workload=workload, ring=ring)
    return tokens, per_gpu.max(axis=2) if cp else per_gpu.sum(axis=2), per_gpu


def _hybrid_figures(frame: Columns, per_gpu: np.ndarray) -> dict[str, Any]:
    """A --hybrid-cp step's samples and tokens at each CP degree and its balance over every
    GPU (``per_gpu`` [dp, m, cp]: slowest GPU over the mean per slot, Σ_j max_g / Σ_j mean_g)."""
    k, length = frame["cp_degree"], frame["length"]
    dp, m, cp = per_gpu.shape
    grid = per_gpu.transpose(0, 2, 1).reshape(dp * cp, m)
    ks = sorted(set(k.tolist()))
    return {
        "split_samples": {str(x): int((k == x).sum()) for x in ks},
        "split_tokens": {str(x): int(length[k == x].sum()) for x in ks},
        "gpu_imbalance": metrics.imbalance(grid),
        "gpu_lockstep_overhead": metrics.lockstep_overhead(grid),
        "gpu_step_cost": metrics.lockstep_cost(grid),
    }


def _alternative(
    lengths: np.ndarray, kind: str, step: StepRecord, workload: Workload, chosen: float
) -> dict[str, Any] | None:
    """The step re-planned balancing ``kind`` (tokens or count) with the step's own plan
    settings (dp, budget, alignment), priced with ``workload``."""
    plan = step.plan
    try:
        alt = plan_step(
            lengths,
            dp=len(step.ranks),
            max_tokens=plan.max_tokens,
            micro_batch_size=plan.micro_batch_size,
            workload=make_workload(kind),
            equal_count=plan.equal_count,
            align=plan.align,
        )
    except RolltoolError:
        return None
    costs = metrics.grid_costs(alt.micro_batches, workload.cost(lengths))
    fig = balance_figures(alt.tokens, costs, plan.align)
    fig["step_cost_vs_chosen"] = fig["step_cost"] / chosen if chosen > 0 else None
    return {"micro_batches_per_rank": alt.num_micro_batches, **fig}


def _counts(step: StepRecord) -> dict[str, Any]:
    """The step's counts and each env's, with its shares of tokens and of the loss weight."""
    out: dict[str, Any] = {
        "step": step.step,
        "batch": step.batch,
        "epoch": step.epoch,
        "mini_batch": step.mini_batch,
        "status": step.status,
        "nominal": step.nominal,
        "actual": step.actual,
        **{k: getattr(step, k) for k in (*COUNTS, "reward_mean")},
        "advantage_mean": step.advantage_mean,
        "advantage_std": step.advantage_std,
    }
    weight = step.loss_weight_sum
    out["envs"] = {
        env: {
            **{k: getattr(e, k) for k in (*COUNTS, "reward_mean")},
            "token_share": e.sampled_tokens / step.sampled_tokens if step.sampled_tokens else None,
            "loss_weight_sum": e.loss_weight_sum,
            "loss_weight_share": e.loss_weight_sum / weight if weight else None,
        }
        for env, e in step.envs.items()
    }
    return out


def _rows(step: StepRecord, tokens: np.ndarray, per_row: int, cp_padding: int) -> dict[str, Any]:
    """Rows, their tokens with and without padding, capacity and fill (see the module doc)."""
    rows = sum(f.rows for r in step.ranks for f in r.files)
    row_tokens = sum(r.tokens for r in step.ranks)
    real_tokens = sum(r.real_tokens for r in step.ranks)
    capacity = rows * per_row
    fill = tokens.ravel() / per_row if per_row else np.zeros(tokens.size)
    return {
        "micro_batches_per_rank": step.plan.micro_batches_per_rank,
        "ffd_micro_batches": step.plan.ffd_micro_batches,
        "empty_micro_batches": int((tokens == 0).sum()),
        "rows": rows,
        "row_tokens": row_tokens,
        "real_tokens": real_tokens,
        "padding_tokens": row_tokens - real_tokens,
        "padding_fraction": (row_tokens - real_tokens) / row_tokens if row_tokens else 0.0,
        "cp_padding_tokens": cp_padding,
        "cp_padding_fraction": cp_padding / row_tokens if row_tokens else 0.0,
        "row_capacity": capacity,
        "packing_efficiency": real_tokens / capacity if capacity else None,
        "fill_histogram": np.histogram(np.clip(fill, 0.0, 1.0), bins=FILL_BINS)[0].tolist(),
    }


def step_stats(
    step: StepRecord,
    frame: Columns,
    *,
    row_len: int | None,
    workload: Workload,
    alternatives: bool = True,
    split: GroupSplit | None = None,
    ring: RingModel | None = None,
    grid: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """One step's figures from its manifest record and its trained samples (``frame``).

    ``row_len``: the group's row length (``--row-len`` x sp or cp; None without); a row's
    capacity is that, else the group's micro-batch budget, else the step's longest micro-batch.
    ``workload``: the per-GPU cost the plan balanced; ``split``: the pack's sp or cp; ``ring``:
    a --hybrid-cp pack's ring model (then ``frame`` has ``cp_degree`` and ``cp_start``, the
    grids count each sample for its own degree, costs are each group's slowest GPU, ``hybrid``
    adds the per-degree counts and the per-GPU balance, and no alternative is planned);
    ``grid``: a --share-prefix step's stored tokens and computed cost per micro-batch
    (`rolltool.stats.shared.shared_grid`; then ``shared`` is its sharing, and no alternative is
    planned: the partition's plans would not share).
    """
    split = split or GroupSplit()
    dp, m = len(step.ranks), step.plan.micro_batches_per_rank
    lengths = frame["length"]
    hybrid: dict[str, Any] | None = None
    if ring is not None:  # --hybrid-cp: a degree per sample
        tokens, costs, per_gpu = _hybrid_grid(frame, dp, m, workload, ring, split.cp)
        occupied = occupied_tokens(lengths, frame["cp_degree"])
        hybrid = _hybrid_figures(frame, per_gpu)
        alternatives = False  # the partition's plans are not the hybrid plan's alternatives
    elif grid is not None:  # --share-prefix: what the rows store and compute
        tokens, costs = grid
        occupied = lengths
        alternatives = False
    else:
        tokens, costs = _grid(frame, dp, m, workload, split)
        occupied = split.padded(lengths)
    per_row = row_len or step.plan.max_tokens or int(tokens.max(initial=0))
    cp_padding = int((occupied - lengths).sum())
    fig = balance_figures(tokens, costs, step.plan.align)
    out = {**_counts(step), **_rows(step, tokens, per_row, cp_padding), **fig}
    if hybrid is not None:
        out["hybrid"] = hybrid
    shared = shared_figures(step)
    if shared is not None:
        out["shared"] = shared
    if alternatives:
        out["alternatives"] = {
            kind: _alternative(occupied, kind, step, workload, fig["step_cost"])
            for kind in ALTERNATIVES
        }
    out["ranks"] = [
        {
            "rank": i,
            "micro_batches": r.micro_batches,
            "samples": r.samples,
            "row_tokens": r.tokens,
            "real_tokens": r.real_tokens,
            "cost": float(costs[i].sum()),
            "micro_batch_tokens": tokens[i].tolist(),
            "micro_batch_cost": costs[i].tolist(),
        }
        for i, r in enumerate(step.ranks)
    ]
    return out


def env_totals(steps: Sequence[StepRecord]) -> dict[str, dict[str, Any]]:
    """Per env, in order of first appearance: the counts and loss-weight sum summed over
    ``steps``, with the env's share of the sampled tokens and of the loss weight.

    The one implementation of per-env run totals (the pack report and ``stats`` both use it).
    """
    keys = (*COUNTS, "loss_weight_sum")
    sampled = sum(s.sampled_tokens for s in steps)
    envs: dict[str, dict[str, Any]] = {}
    for s in steps:
        for env, e in s.envs.items():
            acc = envs.setdefault(env, dict.fromkeys(keys, 0))
            for k in keys:
                acc[k] += getattr(e, k)
    weight = sum(sum(e.loss_weight_sum for e in s.envs.values()) for s in steps)
    for t in envs.values():
        t["token_share"] = t["sampled_tokens"] / sampled if sampled else None
        t["loss_weight_share"] = t["loss_weight_sum"] / weight if weight else None
    return envs


def _get(d: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        d = d.get(key) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d


def _totals(steps: list[dict[str, Any]], records: Sequence[StepRecord]) -> dict[str, Any]:
    """Sums over steps (``steps``: their figures, ``records``: the same steps' manifest
    records), overall and per env, with run-wide ratios."""
    t: dict[str, Any] = {k: sum(int(s[k] or 0) for s in steps) for k in COUNTS}
    for k in ("rows", "row_tokens", "real_tokens", "padding_tokens", "cp_padding_tokens",
              "row_capacity"):  # fmt: skip
        t[k] = sum(int(s[k]) for s in steps)
    t["packing_efficiency"] = t["real_tokens"] / t["row_capacity"] if t["row_capacity"] else None
    row_tokens = t["row_tokens"]
    t["padding_fraction"] = t["padding_tokens"] / row_tokens if row_tokens else 0.0
    t["cp_padding_fraction"] = t["cp_padding_tokens"] / row_tokens if row_tokens else 0.0
    t["step_cost"] = sum(s["step_cost"] for s in steps)
    t["fill_histogram"] = np.sum([s["fill_histogram"] for s in steps], axis=0).tolist()
    t["balance"] = {"chosen": _balance_totals(steps, t["step_cost"])}
    for kind in ALTERNATIVES:
        got = [(s.get("alternatives") or {}).get(kind) for s in steps]
        if got and all(g is not None for g in got):
            t["balance"][kind] = _balance_totals(got, t["step_cost"])  # type: ignore[arg-type]
    t["envs"] = env_totals(records)
    hybrid = [s["hybrid"] for s in steps if "hybrid" in s]
    if hybrid:
        t["hybrid"] = _hybrid_totals(hybrid)
    shared = [s["shared"] for s in steps if "shared" in s]
    if shared:
        t["shared"] = shared_totals(shared)
    return t


def _hybrid_totals(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A --hybrid-cp run's samples and tokens per CP degree, and its per-GPU balance (the
    slowest GPU's time over the mean GPU's, Σ over steps)."""
    out: dict[str, Any] = {}
    for key in ("split_samples", "split_tokens"):
        acc: dict[str, int] = {}
        for s in steps:
            for k, v in s[key].items():
                acc[k] = acc.get(k, 0) + v
        out[key] = dict(sorted(acc.items(), key=lambda kv: int(kv[0])))
    cost = sum(s["gpu_step_cost"] for s in steps)
    mean = sum(
        s["gpu_step_cost"] / s["gpu_lockstep_overhead"] for s in steps if s["gpu_lockstep_overhead"]
    )
    out["gpu_step_cost"] = cost
    out["gpu_lockstep_overhead"] = cost / mean if mean else 1.0
    return out


def _balance_totals(steps: list[dict[str, Any]], chosen_cost: float) -> dict[str, Any]:
    """Run-level balance of a split: means over steps, summed step cost, ratio to the chosen."""
    cost = sum(s["step_cost"] for s in steps)
    return {
        "micro_batches_per_rank": float(np.mean([s["micro_batches_per_rank"] for s in steps])),
        "rank_imbalance": {
            k: float(np.mean([s["rank_imbalance"][k] for s in steps])) for k in ("tokens", "cost")
        },
        "lockstep_overhead": {
            k: float(np.mean([s["lockstep_overhead"][k] for s in steps]))
            for k in ("tokens", "cost")
        },
        "step_cost": cost,
        "step_cost_vs_chosen": cost / chosen_cost if chosen_cost else None,
    }


_READ = ("step", "rank", "micro_batch", "length", "sample_index")
_HYBRID = ("cp_start", "cp_degree")


def read_samples(location: Location) -> tuple[Columns, list[str]]:
    """The trained samples of the packed directory at `location` (`Columns`, in
    samples.parquet's row order) and the env names their ``env`` codes stand for. pyarrow's
    Parquet reader (`Location.parquet`), the columns from their buffers: no pandas, no polars
    (``stats`` of a pack starts faster)."""
    where = location.shown
    try:
        # the two string columns as dictionaries: codes without pyarrow.compute
        with location.parquet("samples.parquet", read_dictionary=["env", "status"]) as pf:
            extra = [c for c in _HYBRID if c in pf.schema_arrow.names]
            table = pf.read(columns=[*_READ, "env", "status", *extra], use_threads=False)
        status, statuses = string_codes(table.column("status"))
        env, envs = string_codes(table.column("env"))
        cols = {c: int_column(table.column(c)) for c in (*_READ, *extra)}
    except (OSError, ValueError, KeyError) as e:  # pyarrow's errors are OSError/ValueError
        raise RolltoolError(
            f"{where}: samples.parquet is missing or unreadable ({e})",
            hint="check the directory with `rolltool verify`",
        ) from None
    trained = status == statuses.index("trained") if "trained" in statuses else status < 0
    return {**{c: v[trained] for c, v in cols.items()}, "env": env[trained]}, envs


def placement_problem(samples: Columns, manifest: Manifest) -> str | None:
    """What places a trained sample outside the manifest's steps, ranks and micro-batches (or
    a --hybrid-cp sample outside its group's cp GPUs), naming the first such sample; None when
    every sample has its place."""
    step, rank, mb = samples["step"], samples["rank"], samples["micro_batch"]
    m = np.array([s.plan.micro_batches_per_rank for s in manifest.steps], dtype=np.int64)
    bad = (step < 0) | (step >= len(m))
    placed = np.where(bad, len(m), step)  # a step outside: the 0 appended (a manifest of none)
    bad |= (rank < 0) | (rank >= manifest.dp) | (mb < 0) | (mb >= np.append(m, 0)[placed])
    cp = recorded_split(manifest.config).cp
    if "cp_degree" in samples:
        k, a = samples["cp_degree"], samples["cp_start"]
        bad |= (k < 1) | (a < 0) | (a + k > cp)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    where = ", ".join(f"{c} {int(samples[c][i])}" for c in (*_READ[:3], *_HYBRID) if c in samples)
    has = f"{len(m)} steps of {manifest.dp} ranks"
    if 0 <= step[i] < len(m):
        has += f", step {int(step[i])} {int(m[step[i]])} micro-batches a rank"
    if "cp_degree" in samples:
        has += f", cp {cp}"
    return f"sample {int(samples['sample_index'][i])} is at {where}; the manifest has {has}"


def by_step(samples: Columns) -> dict[int, Columns]:
    """`samples` split by step, each step's rows in their order (none: no steps)."""
    if not len(samples["step"]):  # (np.split would give one empty part for no step)
        return {}
    order = np.argsort(samples["step"], kind="stable")
    steps, first = np.unique(samples["step"][order], return_index=True)
    parts = np.split(order, first[1:])
    return {
        int(s): {c: v[rows] for c, v in samples.items()}
        for s, rows in zip(steps.tolist(), parts, strict=True)
    }


def env_lengths(samples: Columns, envs: list[str], n_steps: int) -> dict[str, ValueCounts]:
    """Per env (in order of first appearance among the samples of the first `n_steps` steps),
    its samples' lengths."""
    read = samples["step"] < n_steps
    code, length = samples["env"][read], samples["length"][read]
    codes, first = np.unique(code, return_index=True)
    return {envs[c]: ValueCounts.of(length[code == c]) for c in codes[np.argsort(first)].tolist()}


def packed_stats(
    path: str | Path,
    *,
    step: int | None = None,
    limit: int | None = None,
    alternatives: bool = True,
    mapper: Mapper | None = None,
) -> Stats:
    """Statistics of a packed directory: the report dict and trained sample lengths per env (see the module docstring).

    ``limit``: only the first N steps; ``step``: the step to show in detail (recorded as
    ``selected_step``; ``steps`` always lists every step read); ``mapper``: computes each
    step's figures (`step_stats`, pure) elsewhere, e.g. as Ray tasks, the same report.
    """
    ds = open_packed(path)
    manifest = ds.manifest
    shown = ds.path if ds.location.local else ds.location.shown
    n_steps = _steps_read(shown, manifest.num_steps, step, limit)
    workload = Workload.from_record(manifest.workload)
    samples, envs = read_samples(ds.location)
    wrong = placement_problem(samples, manifest)
    if wrong is not None:
        raise RolltoolError(
            f"{shown}: samples.parquet does not match manifest.json ({wrong})",
            hint="check the directory with `rolltool verify`",
        )
    steps_of = by_step(samples)
    empty = {c: v[:0] for c, v in samples.items()}
    records = manifest.steps[:n_steps]
    world = world_layout(manifest)
    split = recorded_split(manifest.config)
    ring = _ring(manifest, workload) if split.hybrid else None
    fn = functools.partial(_step_figures, row_len=world["group_row_len"], run=workload,
                           alternatives=alternatives, split=split, ring=ring)  # fmt: skip
    grids = [
        shared_grid(ds, r, _gpu_workload(r, workload)) if manifest.config.share_prefix else None
        for r in records
    ]  # fmt: skip
    items = [(r, steps_of.get(r.step, empty), g) for r, g in zip(records, grids, strict=True)]
    steps = [fn(x) for x in items] if mapper is None else list(mapper(fn, items))
    across = {k: percentiles(np.array([_get(s, k) for s in steps], dtype=object)) for k in ACROSS}
    report = {
        "kind": "packed",
        "path": str(shown),
        "dp": manifest.dp,
        "world": world,
        "num_steps": manifest.num_steps,
        "steps_read": n_steps,
        "config": _settings(manifest),
        "workload": {"kind": workload.kind, "describe": workload.describe()},
        "samples": dataclasses.asdict(manifest.samples),
        "totals": _totals(steps, records),
        "across_steps": across,
        "selected_step": step,
        "steps": steps,
    }
    return Stats(report=report, lengths=env_lengths(samples, envs, n_steps))


def _ring(manifest: Manifest, workload: Workload) -> RingModel:
    """The ring model a --hybrid-cp pack was planned with (its recorded settings)."""
    c = manifest.config
    link, tflops = c.cp_link_bandwidth or 0.0, c.gpu_tflops or 0.0
    if link <= 0 or tflops <= 0:
        raise RolltoolError(
            "manifest.json: a --hybrid-cp pack without its cp_link_bandwidth and gpu_tflops",
            hint="check the directory with `rolltool verify`",
        )
    return RingModel.for_workload(workload, bandwidth=link * 1e9, speed=tflops * 1e12)


def world_layout(manifest: Manifest) -> dict[str, Any]:
    """Who shares the work (see the module docstring): dp groups of k = sp or cp GPUs, the
    per-GPU budget and the group's (x k, CP padding counted), the row length per GPU and the
    group's (None without --row-len)."""
    split = recorded_split(manifest.config)
    k = split.size
    budget, row_len = manifest.config.micro_batch_tokens, manifest.config.row_len
    return {
        "dp": manifest.dp,
        "sp": split.sp,
        "cp": split.cp,
        **({"hybrid_cp": True} if split.hybrid else {}),
        "group_size": k,
        "gpus": manifest.dp * k,
        "gpu_budget": budget,
        "group_budget": None if budget is None else budget * k,
        "row_len": row_len,
        "group_row_len": None if row_len is None else row_len * k,
    }


def _step_figures(
    item: tuple[StepRecord, Columns, tuple[np.ndarray, np.ndarray] | None],
    *,
    row_len: int | None,
    run: Workload,
    alternatives: bool,
    split: GroupSplit,
    ring: RingModel | None = None,
) -> dict[str, Any]:
    """`step_stats` of one (record, trained samples) pair, with the step's per-GPU workload."""
    record, frame, grid = item
    return step_stats(record, frame, row_len=row_len, workload=_gpu_workload(record, run),
                      alternatives=alternatives, split=split, ring=ring, grid=grid)  # fmt: skip


def _gpu_workload(record: StepRecord, run: Workload) -> Workload:
    """The per-GPU cost the step was planned with (its plan record's workload: the run's divided
    by sp or cp), else the run's (manifests written before the split)."""
    recorded = record.plan.workload
    return run if recorded is None else Workload.from_record(recorded)


def _steps_read(path: Path | str, num_steps: int, step: int | None, limit: int | None) -> int:
    """How many steps to read (``--limit``), checking ``--step`` against them."""
    if limit is not None and limit < 1:
        raise RolltoolError(f"--limit must be at least 1, got {limit}")
    n_steps = num_steps if limit is None else min(limit, num_steps)
    if not n_steps:
        raise RolltoolError(f"{path}: the packed run has no steps")
    if step is not None and not 0 <= step < n_steps:
        raise RolltoolError(f"--step {step} out of range (the run has {n_steps} steps)")
    return n_steps


def _settings(manifest: Manifest) -> dict[str, Any]:
    """The pack settings the report shows (from the manifest's recorded config)."""
    config = manifest.config
    epochs, mini_batches = recorded_structure(config) or (1, 1)
    return {
        "balance": config.balance,
        "align": config.align,
        "micro_batch_tokens": config.micro_batch_tokens,
        "micro_batch_size": config.micro_batch_size,
        "row_len": config.row_len,
        "batch_unit": config.steps.batch_unit,
        "batch_size": config.steps.batch_size,
        "mini_batches": mini_batches,
        "epochs": epochs,
    }
