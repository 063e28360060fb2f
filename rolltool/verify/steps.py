"""Invariants of each step's records: denominators, the weight formula, step and rank counts.

Each is recomputed from samples.parquet (whose agreement with the rows is checked sample by
sample in `rolltool.verify.rows`), so a value is judged against a record it was not derived
from, and a step whose denominators are off is reported once: its weights are not also judged
against a formula fed with the wrong denominators.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolltool.format import STATUSES, Denominators, PlanRecord, StepCounts, StepRecord
from rolltool.plan.advantages import reward_moments
from rolltool.plan.minibatches import recorded_structure
from rolltool.plan.partition import metrics
from rolltool.plan.workload import Workload
from rolltool.util.problems import Problem
from rolltool.verify.context import Context, Samples
from rolltool.verify.hybrid import HybridGrid
from rolltool.verify.shared import shared_plans

WEIGHT_RTOL = 2.0**-23
"""Weights are float32 roundings of exact values: at most half an ulp (2^-24 relative) off."""
SUM_RTOL = 1e-6
"""Sums of float32 weights against float64 sums."""


def formula_weights(
    agg: str, trainable: np.ndarray, den: Denominators, scale_factor: float | None
) -> np.ndarray:
    """Weight of each trainable token of each sample (float64, 0 for samples without one), from
    the aggregation formulas and the step's recorded T and S (see rolltool.plan.loss; recomputed
    here on purpose). ValueError for an unknown aggregation or a bad scale factor."""
    t = np.asarray(trainable, dtype=np.float64)
    T, S = den.trainable_tokens, den.trained_samples
    if agg == "token-mean":
        per = np.full(len(t), 1.0 / T if T else 0.0)
    elif agg == "seq-mean-token-mean":
        per = np.divide(1.0, S * t, out=np.zeros(len(t)), where=t > 0)
    elif agg == "seq-mean-token-sum":
        per = np.full(len(t), 1.0 / S if S else 0.0)
    elif agg == "seq-mean-token-sum-norm":
        if not scale_factor or not np.isfinite(scale_factor) or scale_factor <= 0:
            raise ValueError(f"scale factor {scale_factor!r}")
        per = np.full(len(t), 1.0 / (S * scale_factor) if S else 0.0)
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return np.where(t > 0, per, 0.0)


def formula_sum(agg: str, den: Denominators, scale_factor: float | None) -> float:
    """The step's weight sum the aggregation implies (1 for the means)."""
    T, S = den.trainable_tokens, den.trained_samples
    if agg in ("token-mean", "seq-mean-token-mean"):
        return 1.0 if (T if agg == "token-mean" else S) else 0.0
    if agg == "seq-mean-token-sum":
        return T / S if S else 0.0
    return T / (S * scale_factor) if S and scale_factor else 0.0


def _close(a: float, b: float, rtol: float, atol: float = 1e-12) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


def _formula_error(ctx: Context) -> str | None:
    loss = ctx.manifest.loss
    try:
        formula_weights(loss.agg, np.zeros(0), _NO_SAMPLES, loss.scale_factor)
    except ValueError as e:
        return str(e)
    return None


_NO_SAMPLES = Denominators(trainable_tokens=0, trained_samples=0, scale_factor=None, weight_sum=0)


def _step_denominators(ctx: Context, s: int, formula_ok: bool) -> list[Problem]:
    """What is wrong with step s's denominators ([] when they are right)."""
    den, loss = ctx.manifest.steps[s].denominators, ctx.manifest.loss
    t = ctx.samples.trainable[ctx.samples.planned(s)]
    where, found = f"step {s}", []
    for key, recorded, value in (
        ("trainable_tokens", den.trainable_tokens, int(t.sum())),
        ("trained_samples", den.trained_samples, int((t > 0).sum())),
    ):
        if recorded != value:
            text = f"denominators {key} is {recorded}, samples.parquet gives {value}"
            found.append(Problem("step.denominators", where, text))
    if den.scale_factor != loss.scale_factor:
        text = f"denominators scale_factor {den.scale_factor}, the loss has {loss.scale_factor}"
        found.append(Problem("step.denominators", where, text))
    want = formula_sum(loss.agg, den, loss.scale_factor) if formula_ok else den.weight_sum
    if not _close(den.weight_sum, want, 1e-12):
        text = f"denominators weight_sum is {den.weight_sum}, the {loss.agg} aggregation gives {want:.12g}"
        found.append(Problem("step.denominators", where, text))
    return found


def _sound_steps(ctx: Context) -> list[int]:
    """Steps whose denominators are right (the weight checks below judge only these)."""
    ok = _formula_error(ctx) is None
    return [s for s in range(ctx.manifest.num_steps) if not _step_denominators(ctx, s, ok)]


def denominators(ctx: Context) -> Iterator[Problem]:
    """Per step, T and S recomputed from samples.parquet equal the recorded denominators, and so
    do the loss's scale factor and the weight sum the aggregation implies."""
    error = _formula_error(ctx)
    if error is not None:
        yield Problem(
            "loss.formula", "manifest.json", f"loss weights cannot be recomputed ({error})"
        )
    for s in range(ctx.manifest.num_steps):
        yield from _step_denominators(ctx, s, error is None)


def weight_formula(ctx: Context) -> Iterator[Problem]:
    """Every trained sample's token_loss_weight equals the aggregation formula's weight up to
    float32 rounding (the rows' weights equal samples.parquet's exactly: `sample_fields`)."""
    if _formula_error(ctx) is not None:
        return
    s, loss = ctx.samples, ctx.manifest.loss
    for step in _sound_steps(ctx):
        planned = s.planned(step)
        den = ctx.manifest.steps[step].denominators
        want = formula_weights(loss.agg, s.trainable[planned], den, loss.scale_factor)
        got = s.weight[planned].astype(np.float64)
        for j in np.flatnonzero(~(np.abs(got - want) <= WEIGHT_RTOL * want)):
            yield Problem(
                "sample.formula",
                s.where(int(planned[j])),
                f"loss weights {got[j]:.9g} per trainable token, the {loss.agg} formula gives "
                f"{want[j]:.9g}",
            )


def _moments(adv: np.ndarray) -> tuple[float | None, float | None]:
    """Mean and unbiased std of float32 advantages, in float64; None where undefined."""
    a = adv.astype(np.float64)
    mean = float(a.mean()) if len(a) else None
    return mean, float(a.std(ddof=1)) if len(a) > 1 else None


@dataclass(frozen=True)
class Scope:
    """One scope of a step (all its samples, or one env's) as samples.parquet has it."""

    where: str
    trained: np.ndarray  # samples trained at the step
    dropped: np.ndarray  # samples of the uniform groups it skipped (status uniform_dropped)
    overlong: np.ndarray  # its samples over the token budget (status overlong_dropped)

    def only(self, env: np.ndarray, e: int, name: str) -> Scope:
        """The part of this scope in env code `e` (`env`: every sample's env code)."""
        return Scope(
            f"{self.where} env {name}",
            *(a[env[a] == e] for a in (self.trained, self.dropped, self.overlong)),
        )


def _by_step(s: Samples, status: str, num_steps: int) -> list[np.ndarray]:
    """Per step, the samples with `status` that samples.parquet puts at it, in sample order."""
    idx = np.flatnonzero((s.fate == STATUSES.index(status)) & (s.step >= 0) & (s.step < num_steps))
    idx = idx[np.argsort(s.step[idx], kind="stable")]
    bounds = np.searchsorted(s.step[idx], np.arange(num_steps + 1))
    return [idx[bounds[k] : bounds[k + 1]] for k in range(num_steps)]


def uniform_groups(s: Samples) -> np.ndarray | None:
    """[G] bool per group code: two or more rollouts, all rewards equal (None without rewards).

    Whole groups are placed, so a group's rows in samples.parquet are all of its rollouts."""
    if s.reward is None:
        return None
    g = int(s.group.max()) + 1 if s.n else 0
    lo, hi = np.full(g, np.inf), np.full(g, -np.inf)
    np.minimum.at(lo, s.group, s.reward)
    np.maximum.at(hi, s.group, s.reward)
    _, first = np.unique(s.rollout, return_index=True)
    size = np.bincount(s.group[first], minlength=g)
    return (size >= 2) & (lo == hi)


def figures(
    s: Samples, scope: Scope, uniform: np.ndarray | None, gpu_budget: int | None = None
) -> dict[str, Any]:
    """The StepCounts figures samples.parquet gives for a scope (reward ones only with
    ``uniform``, i.e. when samples.parquet has rewards; ``over_gpu_budget`` with the per-GPU
    budget of a pack that splits rows over sp or cp GPUs)."""
    sel = scope.trained
    groups = np.unique(s.group[sel])
    _, first = np.unique(s.rollout[sel], return_index=True)
    found: dict[str, Any] = {
        "groups": len(groups),
        "rollouts": len(first),
        "samples": len(sel),
        "sampled_tokens": int(s.length[sel].sum()),
        "trainable_tokens": int(s.trainable[sel].sum()),
        "uniform_groups_dropped": len(np.unique(s.group[scope.dropped])),
        "overlong_dropped": len(scope.overlong),
        "over_gpu_budget": int((s.length[sel] > gpu_budget).sum()) if gpu_budget else 0,
    }
    if uniform is not None and s.reward is not None:
        found["uniform_groups_kept"] = int(uniform[groups].sum())
        found["reward_mean"] = reward_moments(s.reward[sel][first])["reward_mean"]
    return found


def _figure_problems(found: dict[str, Any], rec: StepCounts, where: str) -> Iterator[Problem]:
    for key, value in found.items():
        recorded = getattr(rec, key)
        if key == "reward_mean":
            same = (value is None) == (recorded is None) and (
                value is None or _close(value, recorded, 1e-9, 1e-9) or value == recorded
            )
            if not same:
                text = f"reward_mean {value} in samples.parquet, the manifest says {recorded}"
                yield Problem("step.reward", where, text)
        elif recorded != value:
            text = (
                f"{value} {key.replace('_', ' ')} in samples.parquet, the manifest says {recorded}"
            )
            yield Problem("step.counts", where, text)


def _scope_problems(
    ctx: Context, scope: Scope, rec: StepCounts, weights: bool, found: dict[str, Any]
) -> Iterator[Problem]:
    """One scope of a step: its `figures` (``found``), weight sum, advantage moments."""
    s, sel, where = ctx.samples, scope.trained, scope.where
    yield from _figure_problems(found, rec, where)
    total = float((s.weight[sel].astype(np.float64) * s.trainable[sel]).sum())
    if weights and not _close(total, rec.loss_weight_sum, SUM_RTOL):
        text = f"loss weights sum to {total:.9g}, the manifest says {rec.loss_weight_sum}"
        yield Problem("step.weight_sum", where, text)
    off = []
    for name, moment in zip(
        ("advantage_mean", "advantage_std"), _moments(s.advantage[sel]), strict=True
    ):
        recorded = getattr(rec, name)
        legacy = name == "advantage_std" and len(sel) == 1 and recorded == 0.0  # older packs
        if moment is None and (recorded is None or legacy):
            continue
        if moment is None or recorded is None or not _close(moment, recorded, 1e-9, 1e-9):
            off.append(f"{name} {moment} (the manifest says {recorded})")
    if off:
        text = "the trained samples have " + ", ".join(off)
        yield Problem("step.advantage", where, text)


def _actual(ctx: Context, step: int, rec: StepRecord, found: dict[str, Any]) -> Iterator[Problem]:
    """The step's ``actual`` size in its batch unit (rollouts, samples or sampled tokens) as
    samples.parquet gives it (``found``: the step's `figures`; with --mini-batches or --epochs
    the whole batch's, its first epoch's samples)."""
    steps = ctx.manifest.config.steps
    unit = steps.batch_unit
    key = {"rollouts": "rollouts", "samples": "samples", "tokens": "sampled_tokens"}.get(unit)
    if key is not None and _per_batch(ctx) > 1:
        first = [
            k for k, r in enumerate(ctx.manifest.steps) if r.batch == rec.batch and r.epoch == 0
        ]
        members = np.concatenate([ctx.samples.planned(k) for k in first] or [np.zeros(0, np.int64)])
        found = figures(ctx.samples, Scope("", members, members[:0], members[:0]), None)
    counted = found[key] if key is not None else rec.actual
    actual_ok = rec.actual == counted
    if not actual_ok:
        text = f"actual is {rec.actual} {unit}, samples.parquet gives {counted}"
        yield Problem("step.counts", f"step {step}", text)
    yield from _status(ctx, step, rec, steps.batch_size, actual_ok)


def _per_batch(ctx: Context) -> int:
    """Optimizer steps per batch the pack config records (epochs x mini-batches; 1 before)."""
    e, m = recorded_structure(ctx.manifest.config) or (1, 1)
    return e * m


def step_structure(ctx: Context) -> Iterator[Problem]:
    """Batches -> epochs -> mini-batches: each batch's optimizer steps are consecutive, epoch
    after epoch, each epoch its mini-batches 0..M-1 in order, batches numbered 0, 1, ...
    (manifests written before mini-batches have no batch: each step is its own)."""
    structure = recorded_structure(ctx.manifest.config)
    if structure is None:
        steps = ctx.manifest.config.steps
        e, m = steps.epochs, steps.mini_batches
        yield Problem("step.structure", "config", f"epochs {e!r} and mini_batches {m!r}")
        return
    e, m = structure
    for k, rec in enumerate(ctx.manifest.steps):
        if rec.batch is None and e * m == 1:
            continue
        want = (k // (e * m), k % (e * m) // m, k % m)
        got = (rec.batch, rec.epoch, rec.mini_batch)
        if got != want:
            text = f"(batch, epoch, mini-batch) is {got}, the run's structure gives {want}"
            yield Problem("step.structure", f"step {k}", text)


STEP_STATUSES = ("full", "short", "oversize", "partial")
"""How a step was filled (`rolltool.plan.batches`): every env's share met exactly, one closed short,
one took a group larger than its share, or the input ran dry (only the last step)."""


def _status(
    ctx: Context, step: int, rec: StepRecord, batch_size: Any, actual_ok: bool
) -> Iterator[Problem]:
    """The step's nominal size is the configured --batch-size, its status one of
    ``STEP_STATUSES``, a ``full`` step exactly its nominal size (unless --equal-count-trim left
    samples out of it), and ``partial`` only the run's last step (or its last batch's steps)."""
    where = f"step {step}"
    # With --equal-count-trim `actual` counts what trains; a wrong actual is step.counts' finding.
    judge_full = actual_ok and not ctx.manifest.config.equal_count_trim
    if batch_size is not None and rec.nominal != batch_size:
        yield Problem(
            "step.status", where, f"nominal is {rec.nominal}, --batch-size was {batch_size}"
        )
    if rec.status not in STEP_STATUSES:
        yield Problem("step.status", where, f"status {rec.status!r} is not one of {STEP_STATUSES}")
    elif rec.status == "full" and rec.actual != rec.nominal and judge_full:
        text = f"status full but actual {rec.actual} is not the nominal {rec.nominal}"
        yield Problem("step.status", where, text)
    elif rec.status == "partial" and not _last_batch(ctx, step, rec):
        yield Problem("step.status", where, "status partial, but only the last step can be")


def _last_batch(ctx: Context, step: int, rec: StepRecord) -> bool:
    """Whether step `step` is the run's last step, or one of its last batch's (--mini-batches,
    --epochs: every step of a partial batch says so)."""
    steps = ctx.manifest.steps
    if rec.batch is None or _per_batch(ctx) == 1:
        return step == len(steps) - 1
    return rec.batch == steps[-1].batch


def step_metadata(ctx: Context) -> Iterator[Problem]:
    """Per step, overall and per env, every StepCounts figure equals what samples.parquet gives:
    groups, rollouts, samples, sampled and trainable tokens, uniform groups kept and dropped,
    over-long samples dropped, samples over the per-GPU budget (--sp/--cp), the reward mean
    (when samples.parquet has rewards), the loss-weight sum and the advantage mean/std of the
    trained samples; and the step's actual size in its batch unit."""
    s, m = ctx.samples, ctx.manifest
    sound = set(_sound_steps(ctx)) if _formula_error(ctx) is None else set()
    dropped = _by_step(s, "uniform_dropped", m.num_steps)
    overlong = _by_step(s, "overlong_dropped", m.num_steps)
    uniform = uniform_groups(s)
    gpu_budget = m.config.micro_batch_tokens if ctx.split.size > 1 else None
    for step, rec in enumerate(m.steps):
        scope = Scope(f"step {step}", s.planned(step), dropped[step], overlong[step])
        weights, found = step in sound, figures(s, scope, uniform, gpu_budget)
        yield from _scope_problems(ctx, scope, rec, weights, found)
        yield from _actual(ctx, step, rec, found)
        present = np.concatenate([scope.trained, scope.dropped, scope.overlong])
        names = sorted(set(rec.envs) | {s.env_names[e] for e in np.unique(s.env[present])})
        for name in names:
            e = s.env_names.index(name) if name in s.env_names else -1
            part = scope.only(s.env, e, name)
            if name not in rec.envs:
                text = f"no record for env {name!r} ({len(part.trained)} samples)"
                yield Problem("step.counts", f"step {step}", text)
                continue
            found = figures(s, part, uniform, gpu_budget)
            yield from _scope_problems(ctx, part, rec.envs[name], weights, found)


def plan_figures(
    s: Samples, planned: np.ndarray, dp: int, m: int, occupied: np.ndarray
) -> dict[str, Any]:
    """The figures of a step's plan record samples.parquet gives (its trained samples
    `planned`, placed inside a run of `dp` ranks; `m` micro-batches per rank; tokens as the
    group's rows hold them, ``occupied`` [n] per samples.parquet row: padded for cp)."""
    rank, mb = s.rank[planned], s.micro_batch[planned]
    used = len(np.unique(rank * (int(mb.max()) + 1 if len(mb) else 1) + mb))
    return {
        "dp": dp,
        "samples": len(planned),
        "samples_per_rank": tuple(int(x) for x in np.bincount(rank, minlength=dp)),
        "tokens": int(occupied[planned].sum()),
        "empty_micro_batches": dp * m - used,
    }


BALANCE_RTOL = 1e-9
"""Balance figures are ratios of float64 sums: equal up to the summation order."""


def balance_figures(
    s: Samples,
    planned: np.ndarray,
    dp: int,
    plan: PlanRecord,
    occupied: np.ndarray,
    hybrid: HybridGrid | None = None,
) -> dict[str, Any]:
    """The plan record's balance figures recomputed from samples.parquet: the ``[dp, M]`` grids
    of tokens (``occupied`` [n]: padded for cp) and of the recorded workload's cost per
    micro-batch (Σ over its samples; with ``hybrid`` each group's slowest GPU, `HybridGrid`),
    their rank imbalance and lockstep overhead, the token fill and the micro-batch lower
    bound."""
    m = plan.micro_batches_per_rank
    if m == 0 or plan.workload is None:
        return {}
    cell = s.rank[planned] * m + s.micro_batch[planned]
    lengths = occupied[planned]
    tokens = np.bincount(cell, weights=lengths, minlength=dp * m).reshape(dp, m)
    workload = Workload.from_record(plan.workload)
    if hybrid is not None:
        costs = hybrid.costs(s, planned, dp, m, workload).max(axis=2)
    else:
        cost = workload.cost(lengths)
        costs = np.bincount(cell, weights=cost, minlength=dp * m).reshape(dp, m)
    found: dict[str, Any] = {}
    for name, x in (("tokens", tokens), ("cost", costs)):
        found[f"imbalance_{name}"] = metrics.imbalance(x)
        found[f"lockstep_overhead_{name}"] = metrics.lockstep_overhead(x)
    if plan.max_tokens and tokens.max() <= plan.max_tokens:  # else row.budget says so, once
        found["token_fill"] = float(tokens.sum()) / (dp * m * plan.max_tokens)
        found["min_micro_batches"] = -(-int(tokens.sum()) // (dp * plan.max_tokens))
    return found


def _differs(recorded: Any, value: Any) -> bool:
    if isinstance(value, float) and isinstance(recorded, float):
        return not _close(recorded, value, BALANCE_RTOL)
    return bool(recorded != value)


def step_plans(ctx: Context) -> Iterator[Problem]:
    """Per step, the plan record's dp, samples, samples per rank, tokens, empty micro-batches,
    token fill, micro-batch lower bound, rank imbalance and lockstep overhead (tokens and cost)
    equal what samples.parquet gives (steps whose samples are all placed inside the run;
    micro-batches per rank are the ranks' record, checked by `rank_files`)."""
    m, s = ctx.manifest, ctx.samples
    if m.config.share_prefix:  # its figures are of stored tokens (`rolltool.verify.shared`)
        yield from shared_plans(ctx)
        return
    inside = s.inside_run(m.num_steps, m.dp)
    grid = HybridGrid.of(ctx) if ctx.split.hybrid else None
    occupied = ctx.split.padded(s.length) if grid is None else grid.occupied(s.length)
    for step, rec in enumerate(m.steps):
        planned = s.planned(step)
        if not inside[planned].all():
            continue  # samples.place says so
        found = plan_figures(s, planned, m.dp, rec.plan.micro_batches_per_rank, occupied)
        found |= balance_figures(s, planned, m.dp, rec.plan, occupied, grid)
        for key, value in found.items():
            recorded = getattr(rec.plan, key)
            if _differs(recorded, value):
                text = f"plan {key} is {recorded}, samples.parquet gives {value}"
                yield Problem("step.plan", f"step {step}", text)
        if grid is not None:
            yield from grid.record_problems(s, planned, step, rec.plan, m.dp)


def rank_counts(ctx: Context) -> Iterator[Problem]:
    """Per step and rank: samples and their tokens (samples.parquet), and tokens in its rows
    padding included (the shards), equal the rank's record. A ``--share-prefix`` pack's record
    counts what its rows store (segments and tokens, prefixes included: the shards')."""
    m, s, seg = ctx.manifest, ctx.samples, ctx.segments
    tokens = np.zeros((m.num_steps, m.dp), dtype=np.int64)
    np.add.at(tokens, (seg.row_step, seg.row_rank), seg.row_tokens)
    stored = np.zeros((2, m.num_steps, m.dp), dtype=np.int64)
    np.add.at(stored[0], (seg.row_step, seg.row_rank), seg.row_real_segments)
    np.add.at(stored[1], (seg.row_step, seg.row_rank), seg.row_real_tokens)
    broken = seg.broken_pairs()
    for step, rec in enumerate(m.steps):
        planned = s.planned(step)
        placed = bool(s.inside_run(m.num_steps, m.dp)[planned].all())  # else samples.place
        rank_of = s.rank[planned] if placed else np.zeros(0, np.int64)
        samples = np.bincount(rank_of, minlength=m.dp)
        real = np.bincount(rank_of, weights=s.length[planned] if placed else None, minlength=m.dp)
        if m.config.share_prefix:  # the record counts stored segments and tokens
            samples, real = stored[0][step], stored[1][step]
        for r, rank in enumerate(rec.ranks):
            found = []
            if placed and not (m.config.share_prefix and (step, r) in broken):
                found += [
                    ("samples", rank.samples, samples[r]),
                    ("real_tokens", rank.real_tokens, int(real[r])),
                ]
            if (step, r) not in broken:
                found.append(("tokens", rank.tokens, tokens[step, r]))
            for key, recorded, value in found:
                if recorded != value:
                    text = f"{value} {key.replace('_', ' ')}, the manifest says {recorded}"
                    yield Problem("rank.counts", f"step {step} rank {r}", text)
