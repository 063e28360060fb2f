"""Invariants of each step's records: denominators, the weight formula, step and rank counts.

Each is recomputed from samples.parquet (whose agreement with the rows is checked sample by
sample in `rolltool.verify.rows`), so a value is judged against a record it was not derived
from, and a step whose denominators are off is reported once: its weights are not also judged
against a formula fed with the wrong denominators.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from rolltool.format import Denominators, StepCounts
from rolltool.problems import Problem
from rolltool.verify.context import Context

WEIGHT_RTOL = 2.0**-23
"""Weights are float32 roundings of exact values: at most half an ulp (2^-24 relative) off."""
SUM_RTOL = 1e-6
"""Sums of float32 weights against float64 sums."""


def formula_weights(
    agg: str, trainable: np.ndarray, den: Denominators, scale_factor: float | None
) -> np.ndarray:
    """Weight of each trainable token of each sample (float64, 0 for samples without one), from
    the aggregation formulas and the step's recorded T and S (see rolltool.loss; recomputed
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


def _scope_problems(
    ctx: Context, where: str, rec: StepCounts, sel: np.ndarray, weights: bool
) -> Iterator[Problem]:
    """One scope of a step (all samples or one env's): counts, weight sum, advantage moments."""
    s = ctx.samples
    for key, value in (
        ("samples", len(sel)),
        ("sampled_tokens", int(s.length[sel].sum())),
        ("trainable_tokens", int(s.trainable[sel].sum())),
    ):
        if getattr(rec, key) != value:
            recorded = getattr(rec, key)
            text = (
                f"{value} {key.replace('_', ' ')} in samples.parquet, the manifest says {recorded}"
            )
            yield Problem("step.counts", where, text)
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


def step_metadata(ctx: Context) -> Iterator[Problem]:
    """Per step, overall and per env: samples, sampled and trainable tokens, the loss-weight sum
    and the advantage mean/std of the step's trained samples equal the step's record."""
    s = ctx.samples
    sound = set(_sound_steps(ctx)) if _formula_error(ctx) is None else set()
    for step, rec in enumerate(ctx.manifest.steps):
        planned = s.planned(step)
        weights = step in sound
        yield from _scope_problems(ctx, f"step {step}", rec, planned, weights)
        env_of = s.env[planned]
        names = sorted(set(rec.envs) | {s.env_names[e] for e in np.unique(env_of)})
        for name in names:
            sel = planned[env_of == s.env_names.index(name)] if name in s.env_names else planned[:0]
            if name not in rec.envs:
                yield Problem(
                    "step.counts",
                    f"step {step}",
                    f"no record for env {name!r} ({len(sel)} samples)",
                )
                continue
            yield from _scope_problems(ctx, f"step {step} env {name}", rec.envs[name], sel, weights)


def rank_counts(ctx: Context) -> Iterator[Problem]:
    """Per step and rank: samples and their tokens (samples.parquet), and tokens in its rows
    padding included (the shards), equal the rank's record."""
    m, s, seg = ctx.manifest, ctx.samples, ctx.segments
    tokens = np.zeros((m.num_steps, m.dp), dtype=np.int64)
    np.add.at(tokens, (seg.row_step, seg.row_rank), seg.row_tokens)
    broken = seg.broken_pairs()
    for step, rec in enumerate(m.steps):
        planned = s.planned(step)
        placed = bool(s.inside_run(m.num_steps, m.dp)[planned].all())  # else samples.place
        rank_of = s.rank[planned] if placed else np.zeros(0, np.int64)
        samples = np.bincount(rank_of, minlength=m.dp)
        real = np.bincount(rank_of, weights=s.length[planned] if placed else None, minlength=m.dp)
        for r, rank in enumerate(rec.ranks):
            found = []
            if placed:
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
