"""Step assembly: which groups form optimizer step s (the *batch*, kept apart from packing).

A step is counted in one of three units (``batch_unit``): ``rollouts``, trainable ``samples``
(branches) or sampled ``tokens``. Groups are never split across steps. Groups are taken in
``input`` order (first appearance), ``completion`` order (when their last rollout finished, as an
asynchronous trainer sees them) or a seeded ``shuffle``.

Filling one step, per environment queue (one queue for all envs unless ``env_weights``):

- the env's quota is its share of ``batch_size`` (largest-remainder rounding, summing to the size);
- with ``uniform="drop"``, a uniform group (>= 2 rollouts, equal rewards: zero advantage) is
  skipped and counted as dropped in this step; the queue keeps filling from later groups;
- a group is added while the env's total stays within its quota; the first group that would
  overflow closes the env's share *short* (an error with ``exact``, except in token units); it
  opens the next step;
- a single group larger than the whole quota is taken alone (status ``oversize``, reported);
- when a queue runs dry before its quota is met, the step is *partial*: it is the last step, kept
  only with ``keep_last``; groups still queued in other envs are leftovers.

Worked example (batch_unit="rollouts", batch_size=32, groups of 16, 16, 8, 16, 16 rollouts):
step 0 = groups 0, 1 (32, full); step 1 = groups 2, 3 (24): group 4 would make 40, so the step
closes short; step 2 = group 4 (16), then the input runs dry: partial, dropped unless keep_last.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rolltool.errors import RolltoolError

BATCH_UNITS = ("rollouts", "samples", "tokens")
ORDERS = ("input", "completion", "shuffle")
UNIFORM_POLICIES = ("keep", "drop")


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    batch_size: int
    """Nominal step size in `batch_unit`s."""
    batch_unit: str = "rollouts"
    """What batch_size counts: rollouts, samples (trainable branches) or tokens (sampled)."""
    exact: bool = False
    """Make a step that closes short of batch_size an error (rollouts/samples units)."""
    uniform: str = "keep"
    """keep: train on uniform groups (zero advantage); drop: skip them and keep filling."""
    order: str = "input"
    """Group order: input, completion (finished_at of the last rollout) or shuffle."""
    seed: int = 0
    """Seed for order="shuffle" (>= 0, as NumPy's generators take)."""
    env_weights: Mapping[str, float] = field(default_factory=dict)
    """Each env's share of every step, in batch units; empty: envs pooled in one queue."""
    keep_last: bool = False
    """Keep a final step that the input could not fill."""
    mini_batches: int = 1
    """Optimizer steps per batch and epoch (`rolltool.plan.minibatches`): the batch is cut into this
    many mini-batches, whole groups where it can be."""
    epochs: int = 1
    """Passes over each batch (PPO epochs); every pass after the first in a seeded shuffled
    group order."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise RolltoolError(f"--batch-size must be at least 1, got {self.batch_size}")
        for name, value, choices in (
            ("--batch-unit", self.batch_unit, BATCH_UNITS),
            ("--order", self.order, ORDERS),
            ("--uniform", self.uniform, UNIFORM_POLICIES),
        ):
            if value not in choices:
                raise RolltoolError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.seed < 0:
            raise RolltoolError(f"--seed must be >= 0, got {self.seed}")
        for flag, count in (("--mini-batches", self.mini_batches), ("--epochs", self.epochs)):
            if count < 1:
                raise RolltoolError(f"{flag} must be at least 1, got {count}")
        for env, w in self.env_weights.items():
            if not (np.isfinite(w) and w > 0):
                raise RolltoolError(f"--env-weight {env}={w}: weights must be positive numbers")

    @property
    def per_batch(self) -> int:
        """Optimizer steps per batch: epochs x mini-batches."""
        return self.epochs * self.mini_batches


@dataclass(frozen=True)
class Groups:
    """Per-group light columns, the input of step assembly (arrays indexed by group code)."""

    env: np.ndarray  # [G] int32 env code
    rollouts: np.ndarray  # [G] int64 rollouts with at least one trained sample
    samples: np.ndarray  # [G] int64 trained samples
    tokens: np.ndarray  # [G] int64 sampled tokens of the trained samples
    uniform: np.ndarray  # [G] bool
    completed_at: np.ndarray | None  # [G] float64 finish time of the group's last rollout

    def units(self, unit: str) -> np.ndarray:
        return {"rollouts": self.rollouts, "samples": self.samples, "tokens": self.tokens}[unit]


@dataclass(frozen=True)
class Step:
    """One optimizer step's groups (by group code, in the order they were taken)."""

    index: int
    groups: np.ndarray  # [g] int64 groups trained in this step
    dropped: np.ndarray  # [d] int64 uniform groups skipped while filling this step
    skipped: np.ndarray  # [e] int64 groups with nothing left to train (all samples over-long)
    nominal: int  # batch_size
    actual: int  # size in batch units
    status: str  # full | short | oversize | partial


@dataclass(frozen=True)
class Assembly:
    steps: list[Step]
    leftover: np.ndarray  # groups not placed in any kept step (partial step dropped, envs run dry)
    unweighted: np.ndarray  # groups of envs that --env-weight gave no share
    partial_dropped: Step | None  # the final partial step, when not kept


def group_order(groups: Groups, config: StepConfig) -> np.ndarray:
    """Group codes in the order steps are filled from."""
    n = len(groups.env)
    if config.order == "input":
        return np.arange(n, dtype=np.int64)
    if config.order == "shuffle":
        return np.random.default_rng(config.seed).permutation(n).astype(np.int64)
    if groups.completed_at is None:
        raise RolltoolError(
            "--order completion needs a 'finished_at' column", hint="use --order input or shuffle"
        )
    return np.lexsort((np.arange(n), groups.completed_at)).astype(np.int64)


def quotas(weights: Mapping[int, float], size: int) -> dict[int, int]:
    """Split `size` units by `weights` with largest-remainder rounding (sums to `size`).

    >>> quotas({0: 0.7, 1: 0.3}, 10)
    {0: 7, 1: 3}
    """
    keys = sorted(weights)
    w = np.array([weights[k] for k in keys], dtype=np.float64)
    exact = w / w.sum() * size
    base = np.floor(exact).astype(np.int64)
    rest = size - int(base.sum())
    order = np.lexsort((np.arange(len(keys)), -(exact - base)))
    base[order[:rest]] += 1
    return {k: int(b) for k, b in zip(keys, base, strict=True)}


def _check_weights(env_names: list[str], config: StepConfig) -> dict[int, int]:
    """Each weighted env's quota per step, by env code (every weighted env gets at least 1)."""
    missing = sorted(set(config.env_weights) - set(env_names))
    if missing:
        raise RolltoolError(
            f"--env-weight names env(s) not in the input: {', '.join(missing)}",
            hint=f"envs in the input: {', '.join(env_names)}",
        )
    codes = {env_names.index(e): w for e, w in config.env_weights.items()}
    quota = quotas(codes, config.batch_size)
    zero = [e for e, q in quota.items() if q == 0]
    if zero:
        raise RolltoolError(
            f"--env-weight gives {', '.join(env_names[e] for e in zero)} less than one "
            f"{config.batch_unit[:-1]} per step of {config.batch_size}",
            hint="raise the weight or the batch size",
        )
    return quota


@dataclass(frozen=True)
class _Queues:
    """What each step is filled from: per queue key (env code, or -1 for all envs pooled)."""

    quota: dict[int, int]  # queue key -> its share of every step, in batch units
    queues: dict[int, list[int]]  # queue key -> group codes in fill order
    unweighted: np.ndarray  # [u] int64 groups of envs without a share (never queued)


def _weighted_queues(groups: Groups, order: np.ndarray, quota: dict[int, int]) -> _Queues:
    """One queue per weighted env (in fill order); groups of other envs are unweighted."""
    queues = {e: [int(g) for g in order if groups.env[g] == e] for e in quota}
    unweighted = np.array([g for g in order if int(groups.env[g]) not in quota], dtype=np.int64)
    return _Queues(quota=quota, queues=queues, unweighted=unweighted)


def _pooled_queue(order: np.ndarray, batch_size: int) -> _Queues:
    """All envs in one queue with the whole step as its quota."""
    return _Queues(
        quota={-1: batch_size},
        queues={-1: [int(g) for g in order]},
        unweighted=np.zeros(0, dtype=np.int64),
    )


@dataclass(frozen=True)
class _EnvFill:
    """One queue's contribution to one step."""

    head: int  # queue position after this fill
    taken: list[int]
    dropped: list[int]
    skipped: list[int]
    filled: int  # batch units taken
    outcome: str  # full | short | oversize | partial (the queue ran dry first)


def _fill_env(
    queue: list[int], head: int, quota: int, units: np.ndarray, drop: np.ndarray | None
) -> _EnvFill:
    """Take whole groups from `queue[head:]` until `quota` is met (see the module docstring).

    `drop` marks groups to skip and count as dropped (uniform groups under ``uniform="drop"``);
    groups with 0 units (nothing left to train) are skipped. Neither counts towards the quota.
    """
    taken: list[int] = []
    dropped: list[int] = []
    skipped: list[int] = []
    filled, outcome = 0, "partial"
    while head < len(queue):
        g = queue[head]
        u = int(units[g])
        if u == 0:
            skipped.append(g)
        elif drop is not None and drop[g]:
            dropped.append(g)
        elif filled + u <= quota or filled == 0:
            taken.append(g)  # a group over the whole quota goes alone (oversize)
            filled += u
        else:
            outcome = "short"
            break
        head += 1
        if filled >= quota:
            outcome = "full" if filled == quota else "oversize"
            break
    return _EnvFill(head, taken, dropped, skipped, filled, outcome)


def _step_status(outcomes: list[str]) -> str:
    """A step is partial when any queue ran dry, else the first queue's short/oversize."""
    if "partial" in outcomes:
        return "partial"
    return next((o for o in outcomes if o != "full"), "full")


def _next_step(
    index: int,
    q: _Queues,
    heads: dict[int, int],
    units: np.ndarray,
    drop: np.ndarray | None,
    batch_size: int,
) -> tuple[Step, dict[int, int]]:
    """Fill step `index` from every queue in turn; return it with the queues' new heads."""
    fills = {
        e: _fill_env(q.queues[e], heads[e], quota, units, drop) for e, quota in q.quota.items()
    }
    step = Step(
        index=index,
        groups=np.array([g for f in fills.values() for g in f.taken], dtype=np.int64),
        dropped=np.array([g for f in fills.values() for g in f.dropped], dtype=np.int64),
        skipped=np.array([g for f in fills.values() for g in f.skipped], dtype=np.int64),
        nominal=batch_size,
        actual=sum(f.filled for f in fills.values()),
        status=_step_status([f.outcome for f in fills.values()]),
    )
    return step, {e: f.head for e, f in fills.items()}


def _check_exact(step: Step, config: StepConfig) -> None:
    """With ``exact``, a step that closes short or oversize is an error (not in token units)."""
    if step.status in ("short", "oversize") and config.exact and config.batch_unit != "tokens":
        raise RolltoolError(
            f"step {step.index} holds {step.actual} {config.batch_unit}, not --batch-size "
            f"{config.batch_size}: whole groups do not fill it exactly (--exact)",
            hint="choose a batch size that whole groups fill, or drop --exact",
        )


def _leftover(steps: list[Step], q: _Queues) -> np.ndarray:
    """Queued groups that no kept step took, dropped or skipped (sorted group codes)."""
    parts = [x for s in steps for x in (s.groups, s.dropped, s.skipped)]
    placed = np.concatenate([np.zeros(0, np.int64), *parts]).astype(np.int64, copy=False)
    in_queues = np.fromiter(itertools.chain.from_iterable(q.queues.values()), dtype=np.int64)
    taken = np.zeros(int(max(in_queues.max(initial=-1), placed.max(initial=-1))) + 1, dtype=bool)
    taken[placed] = True  # a mask over group codes: setdiff1d's two sorts of every group, skipped
    return np.unique(in_queues[~taken[in_queues]])


def assemble(groups: Groups, env_names: list[str], config: StepConfig) -> Assembly:
    """Form optimizer steps from whole groups; see the module docstring for the rules."""
    order = group_order(groups, config)
    units = groups.units(config.batch_unit)
    q = (
        _weighted_queues(groups, order, _check_weights(env_names, config))
        if config.env_weights
        else _pooled_queue(order, config.batch_size)
    )
    drop = groups.uniform if config.uniform == "drop" else None
    heads = dict.fromkeys(q.queues, 0)
    steps: list[Step] = []
    partial: Step | None = None
    while True:
        step, heads = _next_step(len(steps), q, heads, units, drop, config.batch_size)
        if step.status == "partial":
            if len(step.groups) and config.keep_last:
                steps.append(step)
            elif len(step.groups) or len(step.dropped):
                partial = step
            break
        _check_exact(step, config)
        steps.append(step)
    return Assembly(
        steps=steps, leftover=_leftover(steps, q), unweighted=q.unweighted, partial_dropped=partial
    )
