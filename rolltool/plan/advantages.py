r"""Group advantages: each sample's advantage comes only from its own group.

A group is the set of rollouts sharing a ``group_id``; a rollout is counted once however many
branches (samples) it has, and every branch of a rollout gets the rollout's advantage.
With r the rollout's reward, n the number of rollouts in its group, mean the group's mean reward
and std its unbiased (n-1) standard deviation, the estimators match verl 0.9.1:

- ``grpo``:      A = (r - mean) / (std + eps), eps = 1e-6 (``std_eps``). Singleton: mean 0, std 1,
                 so A = r / (1 + eps).
- ``dr_grpo``:   A = r - mean (GRPO without the std division). Singleton: A = r.
- ``rloo``:      A = n / (n - 1) * (r - mean), the leave-one-out baseline. Singleton: A = r.
- ``opo``:       A = r - b, b = sum(len * r) / sum(len) over the group's rollouts, len = the
                 rollout's trainable tokens (all branches). Singleton: b = 0.
- ``reinforce_pp_baseline``: a = r - mean (mean 0 for singletons), then whitened at token level:
                 with m and v the mean and unbiased variance of a over all trainable tokens (each
                 sample counted once per trainable token) of the samples using this estimator,
                 A = (a - m) / sqrt(v + 1e-8).

A uniform group (two or more rollouts, all rewards equal) gets A = 0 from every estimator except
``reinforce_pp_baseline``, whose whitening shifts it by -m / sqrt(v + 1e-8). A singleton group is
never uniform. All arithmetic is float64; advantages are returned as float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format.codec import to_json
from rolltool.util.ranges import slices

if TYPE_CHECKING:
    from rolltool.schema import Rollouts


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    estimator: str = "grpo"
    """Estimator for every env without an override (a name in ESTIMATORS)."""
    env_estimators: Mapping[str, str] = field(default_factory=dict)
    """Per-env overrides, e.g. {"code": "rloo"}."""
    std_eps: float = 1e-6
    """Epsilon added to the group std by `grpo`."""

    def __post_init__(self) -> None:
        for name in [self.estimator, *self.env_estimators.values()]:
            if name not in ESTIMATORS:
                raise RolltoolError(
                    f"unknown estimator {name!r}",
                    hint=f"choose from {', '.join(sorted(ESTIMATORS))}",
                )
        if not (self.std_eps >= 0 and np.isfinite(self.std_eps)):
            raise RolltoolError(f"--std-eps must be a finite number >= 0, got {self.std_eps}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON (the manifest records them as `rolltool.format.RecordedAdvantages`)."""
        return to_json(self)


@dataclass(frozen=True, kw_only=True)
class AdvantageInput:
    """What the estimators read: the light columns, one entry per sample (input row).

    Codes are dense: ``group`` in 0..G-1, ``rollout`` in 0..R-1 (unique across groups, shared by
    a rollout's branches). Example: two groups, the first with rollouts of 1 and 2 branches:
    ``group = [0, 0, 0, 1]``, ``rollout = [0, 1, 1, 2]``.
    """

    group: np.ndarray  # [n] int64 dense group code
    rollout: np.ndarray  # [n] int64 dense rollout code
    env: np.ndarray  # [n] int32 code into env_names
    env_names: Sequence[str]
    """Every env of the input; a subset (one step) may have no sample of some."""
    reward: np.ndarray  # [n] float64, equal for a rollout's branches
    trainable: np.ndarray  # [n] int64 targets: loss_mask ones but the first token (schema)
    group_ids: Any = None
    """[G] the user's group_id of each group code (a pyarrow array or a sequence), for
    messages; None names groups by code."""

    def __post_init__(self) -> None:
        n = len(self.group)
        for name in ("rollout", "env", "reward", "trainable"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"AdvantageInput: {name} has {len(getattr(self, name))} "
                                 f"entries, group has {n}")  # fmt: skip

    def __len__(self) -> int:
        return len(self.group)

    @classmethod
    def from_rollouts(cls, ro: Rollouts) -> AdvantageInput:
        """The scanned input's light columns (`rolltool.schema.scan`)."""
        return cls(group=ro.group, rollout=ro.rollout, env=ro.env, env_names=ro.env_names,
                   reward=ro.reward, trainable=ro.trainable, group_ids=ro.group_ids)  # fmt: skip

    def take(self, indices: np.ndarray) -> AdvantageInput:
        """The samples at ``indices`` (in that order), group and rollout codes made dense again
        (numbered in order of the old codes); env codes and names unchanged.

        Take whole groups: a group's statistics come from the samples taken.
        """
        return AdvantageInput(
            group=_dense(self.group[indices]),
            rollout=_dense(self.rollout[indices]),
            env=self.env[indices],
            env_names=self.env_names,
            reward=self.reward[indices],
            trainable=self.trainable[indices],
            group_ids=_take(self.group_ids, np.unique(self.group[indices])),
        )

    def group_name(self, g: int) -> str:
        """How messages name group code g: its group_id when known."""
        if self.group_ids is None:
            return f"group code {g}"
        value = self.group_ids[g]
        return f"group {getattr(value, 'as_py', lambda: value)()!r}"

    def without_tokens(self, mask: np.ndarray) -> AdvantageInput:
        """The same samples, those where ``mask`` holds bringing no trainable tokens: they stay
        in their group's statistics but out of token-level whitening (and out of ``opo``'s
        lengths)."""
        return replace(self, trainable=np.where(mask, 0, self.trainable))


def _take(ids: Any, codes: np.ndarray) -> Any:
    if ids is None:
        return None
    return ids.take(codes) if hasattr(ids, "take") else [ids[int(c)] for c in codes]


def _dense(codes: np.ndarray) -> np.ndarray:
    """Codes renumbered 0..k-1 in sorted order: ``[7, 3, 7] -> [1, 0, 1]``."""
    return np.unique(codes, return_inverse=True)[1].astype(np.int64)


SAFE_REWARD = 1e150
"""Largest reward magnitude whose squares and sums stay finite in float64 (1e300 each, ~1e8 of
them); a group with a larger reward is computed in units of its largest |reward|."""


@dataclass(frozen=True)
class GroupStats:
    """Per-rollout view of the input that the estimators work on (arrays indexed by rollout).

    Rewards, means and stds are in units of the group's ``scale``: 1 (values as given, the
    arithmetic exactly as written) unless a reward's magnitude passes `SAFE_REWARD`, where it is
    the group's largest |reward|, so that squares and sums of finite rewards stay finite.
    """

    group: np.ndarray  # [R] int64 dense group code of each rollout
    reward: np.ndarray  # [R] float64, in units of its group's scale
    trainable: np.ndarray | None  # [R] int64 trainable tokens summed over the rollout's branches
    size: np.ndarray  # [G] int64 rollouts per group
    mean: np.ndarray  # [G] float64 group mean reward, in units of scale
    std: np.ndarray  # [G] float64 unbiased group std (0 for singletons), in units of scale
    uniform: np.ndarray  # [G] bool: two or more rollouts, all rewards equal
    scale: np.ndarray  # [G] float64: 1, or the group's largest |reward| past SAFE_REWARD

    def tokens(self) -> np.ndarray:
        """``trainable``, for the estimators that read it (`TOKEN_ESTIMATORS`)."""
        if self.trainable is None:
            raise ValueError("bug: group statistics made without trainable tokens")
        return self.trainable


TOKEN_ESTIMATORS = {"opo", "reinforce_pp_baseline"}
"""Estimators that read the rollouts' trainable tokens (`GroupStats.tokens`); for the others
`rollout_advantages` does not count them."""


def _rollout_tokens(rollout: np.ndarray, trainable: np.ndarray, n_rollouts: int) -> np.ndarray:
    """[R] int64 trainable tokens summed over each rollout's branches."""
    r_train = np.zeros(n_rollouts, dtype=np.int64)
    if np.asarray(trainable).dtype.kind in "iu":  # whole counts: summed as integers, in place
        np.add.at(r_train, rollout, trainable)
    else:
        r_train[:] = np.bincount(rollout, weights=trainable, minlength=n_rollouts)
    return r_train


def _scales(r_group: np.ndarray, r_reward: np.ndarray, n_groups: int) -> np.ndarray:
    big = np.zeros(n_groups)
    np.maximum.at(big, r_group, np.abs(r_reward))
    return np.where(big > SAFE_REWARD, big, 1.0)


def group_stats(
    group: np.ndarray, rollout: np.ndarray, reward: np.ndarray, trainable: np.ndarray | None
) -> GroupStats:
    """Collapse samples to rollouts (first branch's reward) and compute per-group moments.

    `group`, `rollout`: dense codes per sample; rollout codes are unique across groups.
    """
    n_rollouts = int(rollout.max()) + 1 if len(rollout) else 0
    n_groups = int(group.max()) + 1 if len(group) else 0
    r_group = np.zeros(n_rollouts, dtype=np.int64)  # int64: bincount takes it without a copy
    r_reward = np.zeros(n_rollouts, dtype=np.float64)
    # Assign in reverse so the first branch's values win (branches share one reward anyway).
    r_group[rollout[::-1]] = group[::-1]
    r_reward[rollout[::-1]] = reward[::-1]
    scale = _scales(r_group, r_reward, n_groups)
    np.divide(r_reward, scale[r_group], out=r_reward)  # exact where the scale is 1
    r_train = None if trainable is None else _rollout_tokens(rollout, trainable, n_rollouts)
    size = np.bincount(r_group, minlength=n_groups).astype(np.int64)
    lo = np.full(n_groups, np.inf)
    hi = np.full(n_groups, -np.inf)
    np.minimum.at(lo, r_group, r_reward)
    np.maximum.at(hi, r_group, r_reward)
    uniform = (size >= 2) & (lo == hi)
    mean = np.bincount(r_group, weights=r_reward, minlength=n_groups) / np.maximum(size, 1)
    # sum/n of equal rewards can be off by an ulp (3 x 0.1); take the reward itself so that a
    # uniform group gets std 0 and advantage exactly 0.
    mean = np.where(lo == hi, lo, mean)
    dev = mean[r_group]  # (r - mean) ** 2 in one [R] buffer: the same values
    np.subtract(r_reward, dev, out=dev)
    sq = np.bincount(r_group, weights=np.square(dev, out=dev), minlength=n_groups)
    del dev
    std = np.sqrt(np.divide(sq, size - 1, out=np.zeros(n_groups), where=size > 1))
    return GroupStats(r_group, r_reward, r_train, size, mean, std, uniform, scale)


Estimator = Callable[[GroupStats, np.ndarray, float], np.ndarray]
"""(stats, mask of rollouts to compute, std_eps) -> advantage per rollout (float64; only the
masked entries are used)."""


def _centered(s: GroupStats) -> np.ndarray:
    single = s.size[s.group] == 1
    return np.where(single, s.reward, s.reward - s.mean[s.group])


def _grpo(s: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    single = s.size[s.group] == 1
    scale = s.scale[s.group]
    # (r - mean) / (std + eps) in units of the scale: the scale cancels but for eps / scale.
    denom = np.where(single, 1.0 / scale, s.std[s.group]) + eps / scale
    # A uniform group has std 0: with std_eps 0 it gets 0, not 0/0 = nan (verl's result).
    return np.divide(_centered(s), denom, out=np.zeros(len(denom)), where=denom > 0)


def _dr_grpo(s: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    return _centered(s) * s.scale[s.group]


def _rloo(s: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    n = s.size[s.group].astype(np.float64)
    factor = np.divide(n, n - 1, out=np.ones_like(n), where=n > 1)
    return factor * _centered(s) * s.scale[s.group]


def _opo(s: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    n_groups = len(s.size)
    # b = sum(len * r) / sum(len), written as mean + sum(len * (r - mean)) / sum(len) so that a
    # uniform group gets b = r exactly and advantage 0 (sum/sum can be off by an ulp).
    dev = s.tokens() * (s.reward - s.mean[s.group])
    num = np.bincount(s.group, weights=dev, minlength=n_groups)
    den = np.bincount(s.group, weights=s.tokens(), minlength=n_groups)
    base = s.mean + np.divide(num, den, out=np.zeros(n_groups), where=den > 0)
    # verl divides 0/0 = nan for a group with no trainable tokens; we keep the reward (b = 0)
    # there, which is what the singleton rule gives, and the samples carry no loss anyway.
    base = np.where((s.size > 1) & (den > 0), base, 0.0)
    return (s.reward - base[s.group]) * s.scale[s.group]


def _reinforce_pp_baseline(s: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    # Whitening is scale-free: in units of the largest group scale S (1 for ordinary rewards,
    # where this is the formula as written), (a - m) / sqrt(v + 1e-8) = (a' - m') /
    # sqrt(v' + 1e-8 / S**2).
    top = float(s.scale[s.group[mask]].max()) if mask.any() else 1.0
    a = _centered(s) * (s.scale[s.group] / top)
    w = s.tokens()[mask].astype(np.float64)
    total = w.sum()
    if total < 2:
        raise RolltoolError(
            "reinforce_pp_baseline whitens over trainable tokens and needs at least 2 of them; "
            f"the samples using it have {int(total)}",
            hint="use another estimator for this data, or check the loss_mask column",
        )
    m = float((w * a[mask]).sum() / total)
    var = float((w * (a[mask] - m) ** 2).sum() / (total - 1))
    return (a - m) / np.sqrt(var + 1e-8 / top / top)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "opo": _opo,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
}


@dataclass(frozen=True)
class Advantages:
    """Output columns, one entry per sample (input row)."""

    advantage: np.ndarray  # [n] float32, equal for all branches of a rollout
    group_size: np.ndarray  # [n] int64 rollouts in the sample's group
    group_reward_mean: np.ndarray  # [n] float64
    group_reward_std: np.ndarray  # [n] float64 unbiased; 0 for singleton groups
    group_uniform: np.ndarray  # [n] bool
    estimator: np.ndarray  # [n] object, the estimator used for the sample's env


def compute_advantages(config: AdvantageConfig, rollouts: AdvantageInput) -> Advantages:
    """Advantages for every sample of ``rollouts``: see the module docstring for the formulas.

    Whitening estimators (``reinforce_pp_baseline``) whiten over all samples of the envs that use
    them; call this once per optimizer step (``rollouts.take(step_samples)``) to whiten per step
    instead. ``env_names`` may name envs without samples here (a step's subset of the input): an
    estimator none of whose envs has a sample is skipped.
    """
    ro = rollouts
    per = rollout_advantages(config, ro)
    stats, g = per.stats, ro.group
    return Advantages(
        advantage=per.value[ro.rollout].astype(np.float32),
        group_size=stats.size[g],
        group_reward_mean=(stats.mean * stats.scale)[g],
        group_reward_std=(stats.std * stats.scale)[g],  # inf past float64's range
        group_uniform=stats.uniform[g],
        estimator=per.names[ro.env] if len(ro.env) else np.zeros(0, dtype=object),
    )


ELEMENTWISE = {"grpo", "dr_grpo", "rloo"}
"""Estimators that price each rollout from its reward and its group's moments alone: computed
`CHUNK` rollouts at a time, the same values in a few MB of scratch rather than ~34 bytes per
rollout of temporaries (``opo`` and ``reinforce_pp_baseline`` sum over groups or envs)."""

CHUNK = 1 << 20
"""Rollouts per pass of an `ELEMENTWISE` estimator."""


def _estimate(name: str, stats: GroupStats, mask: np.ndarray, eps: float) -> np.ndarray:
    """``ESTIMATORS[name](stats, mask, eps)`` as float64, chunk by chunk where it may be."""
    estimator, n = ESTIMATORS[name], len(stats.group)
    if name not in ELEMENTWISE or n <= CHUNK:
        return np.asarray(estimator(stats, mask, eps), dtype=np.float64)
    out = np.empty(n, dtype=np.float64)
    for part in slices(n, CHUNK):
        tokens = None if stats.trainable is None else stats.trainable[part]
        sub = replace(stats, group=stats.group[part], reward=stats.reward[part], trainable=tokens)
        out[part] = estimator(sub, mask[part], eps)
    return out


@dataclass(frozen=True)
class RolloutAdvantages:
    """`compute_advantages` per rollout, before it is spread over the samples."""

    stats: GroupStats
    value: np.ndarray  # [R] float64 advantage of each rollout code
    names: np.ndarray  # [E] object: the estimator of each env code


def rollout_advantages(config: AdvantageConfig, ro: AdvantageInput) -> RolloutAdvantages:
    """Each rollout's advantage (`compute_advantages` without the per-sample columns: what the
    run plan needs of a large input, in ~8 bytes per rollout rather than ~40 per sample)."""
    unknown = sorted(set(config.env_estimators) - set(ro.env_names))
    if unknown:
        raise RolltoolError(
            f"--env-estimator names env(s) not in the input: {', '.join(unknown)}",
            hint=f"envs in the input: {', '.join(ro.env_names)}",
        )
    names = np.array(
        [config.env_estimators.get(e, config.estimator) for e in ro.env_names], dtype=object
    )
    used = sorted(set(names.tolist()))
    tokens = ro.trainable if TOKEN_ESTIMATORS & set(used) else None  # 8 bytes a rollout
    stats = group_stats(ro.group, ro.rollout, ro.reward, tokens)
    n_rollouts = len(stats.group)
    if len(used) == 1:  # one estimator for every rollout (no env codes needed)
        r_adv = _estimate(used[0], stats, np.ones(n_rollouts, dtype=bool), config.std_eps)
    else:
        r_adv = np.zeros(n_rollouts, dtype=np.float64)
        r_env = np.zeros(n_rollouts, dtype=np.int64)
        r_env[ro.rollout] = ro.env
        for name in used:
            mask = np.isin(r_env, np.flatnonzero(names == name))
            if not mask.any():  # none of its envs in this subset (e.g. a step): nothing to do
                continue
            r_adv[mask] = _estimate(name, stats, mask, config.std_eps)[mask]
    _check_range(r_adv, stats, ro)
    return RolloutAdvantages(stats, r_adv, names)


FLOAT32_LIMIT = float(np.finfo(np.float32).max) + 2.0**103
"""Smallest magnitude float32 rounds to inf (its maximum plus half an ulp)."""


def _check_range(r_adv: np.ndarray, stats: GroupStats, ro: AdvantageInput) -> None:
    """Refuse advantages that are not finite or that float32 (the stored dtype) cannot hold,
    naming the first such group: finite rewards can still be too far apart for estimators
    that do not divide by the spread."""
    bad = ~((r_adv < FLOAT32_LIMIT) & (r_adv > -FLOAT32_LIMIT))  # |a| < limit; nan is bad
    if not bad.any():
        return
    r = int(np.flatnonzero(bad)[0])
    g = int(stats.group[r])
    sel = stats.group == g
    spread = (stats.reward[sel].max() - stats.reward[sel].min()) * stats.scale[g]
    raise RolltoolError(
        f"{ro.group_name(g)}: advantage {r_adv[r]:.4g} is beyond float32's range (+-3.4e38) "
        f"(its rewards span {spread:.4g}); {int(bad.sum())} rollout(s) are",
        hint="rescale these rewards, or use --estimator grpo (it divides by the group's std)",
    )


def summarize(adv: Advantages, ro: AdvantageInput) -> tuple[list[dict], dict]:
    """(one row per env, the overall row): groups, rollouts, samples, uniform groups, reward
    mean/std over rollouts, advantage mean/std/min/max over samples. The overall row is kept
    apart so that an env may be called anything, "all" included."""
    group, rollout, env, reward = ro.group, ro.rollout, ro.env, ro.reward

    def row(sel: np.ndarray, name: str | None) -> dict:
        groups = np.unique(group[sel])
        _, first = np.unique(rollout[sel], return_index=True)
        r = reward[sel][first]
        a = adv.advantage[sel].astype(np.float64)
        uniform_groups = len(np.unique(group[sel][adv.group_uniform[sel]]))
        return {
            "env": name,
            "estimator": str(adv.estimator[sel][0]) if name is not None and sel.any() else None,
            "groups": len(groups),
            "rollouts": len(first),
            "samples": int(sel.sum()),
            "uniform_groups": uniform_groups,
            "uniform_share": uniform_groups / len(groups) if len(groups) else 0.0,
            **reward_moments(r),
            "advantage_mean": float(a.mean()) if len(a) else None,
            "advantage_std": float(a.std(ddof=1)) if len(a) > 1 else None,
            "advantage_min": float(a.min()) if len(a) else None,
            "advantage_max": float(a.max()) if len(a) else None,
        }

    rows = [row(env == i, name) for i, name in enumerate(ro.env_names)]
    return rows, row(np.ones(len(env), dtype=bool), None)


def reward_moments(r: np.ndarray) -> dict[str, float | None]:
    """Mean and unbiased std of rewards, in units of the largest |reward| past `SAFE_REWARD`
    (as the group statistics are) so that finite rewards give a finite mean."""
    scale = float(np.abs(r).max()) if len(r) else 1.0
    scale = scale if scale > SAFE_REWARD else 1.0
    x = r / scale
    return {
        "reward_mean": float(x.mean()) * scale if len(r) else None,
        "reward_std": float(x.std(ddof=1)) * scale if len(r) > 1 else None,
    }
