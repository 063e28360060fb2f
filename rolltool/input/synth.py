"""Synthetic rollouts that look like real multi-environment RL traffic.

`generate(SynthConfig(...))` returns a pyarrow Table in the rollout schema (README, "Rollout
schema") with every optional column filled. It is the example data, the test fixture and the
benchmark input, so the shapes matter more than the token values:

- ``math``: single-turn, group size 16, 200-2,000 tokens, binary rewards; a task is either far
  too hard, far too easy or in between, so a good share of groups are all-0 or all-1 (uniform).
- ``code``: single-turn, group size 8, 1k-8k tokens, fractional rewards (tests passed / 10).
- ``agent``: multi-turn, group size 8, tool output masked out of the loss, lengths with a heavy
  tail up to ``max_len``; about a quarter of the rollouts yield 2-4 trainable branches (context
  compaction), all carrying the rollout's reward.

``finished_at`` grows with the number of generated tokens, so long groups complete late and groups
complete out of order. Everything is a deterministic function of the config (seed included).

Token columns are built from flat NumPy buffers and offsets, never from Python lists, so a
million samples take seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rolltool.errors import RolltoolError

VOCAB_SIZE = 151_936
# Group launch interval and decode speed used for `finished_at` (seconds).
_GROUP_INTERVAL_S = 0.5
_SECONDS_PER_TOKEN = 0.012
_EPOCH_US = 1_764_000_000_000_000  # 2025-11-24, a fixed start time in microseconds


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    groups: int = 64
    """Number of groups (tasks) to generate, spread over `envs` by `env_shares`."""
    seed: int = 0
    """Seed of the random generator; the output is a pure function of the config."""
    envs: tuple[str, ...] = ("math", "code", "agent")
    """Environments to draw groups from (names in ENVS)."""
    max_len: int = 32_768
    """Longest sample in tokens; the agent env's heavy tail is clipped here."""
    shared_prompts: bool = False
    """A group's rollouts start with the same prompt tokens (the agent env: the same system
    prompt, each sample its first ``min(system, length / 3)`` tokens of it), as GRPO data does:
    what ``pack --share-prefix`` computes once. Off, every sample's tokens are drawn on their own
    (the default data of earlier versions, byte for byte); on, only the prompt tokens change."""
    group_size: int | None = None
    """Rollouts per group in every env (``None``: each env's own, math 16, code 8, agent 8)."""
    prompt_len: int | None = None
    """Every prompt exactly this many tokens (the agent env: its system prompt); a single-turn
    response keeps its env's length distribution, clipped to ``[16, max_len - prompt_len]``
    instead of the env's total-length range; an agent trajectory's body to
    ``[600, max_len - prompt_len]`` (so at most ``max_len - 600`` with the agent env, else
    ``max_len - 16``). ``None``: each env's own prompt lengths."""

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise RolltoolError(f"--groups must be at least 1, got {self.groups}")
        if self.seed < 0:
            raise RolltoolError(f"--seed must be 0 or more, got {self.seed}")
        if self.max_len < 256:
            raise RolltoolError(f"--max-len must be at least 256 tokens, got {self.max_len}")
        if self.group_size is not None and self.group_size < 1:
            raise RolltoolError(f"--group-size must be at least 1, got {self.group_size}")
        room = 600 if "agent" in self.envs else 16  # an agent body, a single-turn response
        if self.prompt_len is not None and self.max_len - room < 1:
            raise RolltoolError(
                f"--prompt-len needs --max-len {room + 1:,} or more"
                f"{' with the agent env' if room == 600 else ''}, got {self.max_len:,}",
                hint="raise --max-len",
            )
        if self.prompt_len is not None and not 1 <= self.prompt_len <= self.max_len - room:
            raise RolltoolError(
                f"--prompt-len {self.prompt_len:,} leaves no room for a response under --max-len "
                f"{self.max_len:,}: it must be 1 to {self.max_len - room:,} (--max-len - {room}"
                f"{', the agent env' if room == 600 else ''})",
                hint="raise --max-len, or lower --prompt-len",
            )
        unknown = [e for e in self.envs if e not in ENVS]
        if unknown or not self.envs:
            raise RolltoolError(
                f"unknown environment(s) {', '.join(unknown) or '(none given)'}",
                hint=f"choose from {', '.join(sorted(ENVS))}",
            )


@dataclass
class _Plan:
    """Light per-sample columns of one env, before tokens are drawn."""

    group: np.ndarray  # [n] int64, global group number
    rollout: np.ndarray  # [n] int64, rollout number within the group
    branch: np.ndarray  # [n] int64, branch number within the rollout
    reward: np.ndarray  # [n] float64
    gen_tokens: np.ndarray  # [n] int64, tokens the rollout generated (drives finished_at)
    seg_len: list[np.ndarray]  # per sample: segment lengths (prompt, turn, tool, turn, ...)
    seg_train: list[np.ndarray]  # per sample: 1 where the segment is trained on


def _single_turn(
    rng: np.random.Generator,
    groups: np.ndarray,
    group_size: int,
    prompt: tuple[int, int],
    response_median: float,
    response_sigma: float,
    total: tuple[int, int],
    rewards: Callable[[np.random.Generator, int, int], np.ndarray],
    config: SynthConfig,
) -> _Plan:
    g = len(groups)
    group_size = config.group_size or group_size
    n = g * group_size
    if config.prompt_len is not None:
        prompt, total = (config.prompt_len, config.prompt_len), (0, config.max_len)
    hi = min(total[1], config.max_len)
    # A prompt leaves room for at least 16 response tokens, so no sample exceeds max_len.
    prompt_len = np.minimum(rng.integers(prompt[0], prompt[1] + 1, size=g), hi - 16)
    prompt_len = prompt_len.repeat(group_size)
    resp = rng.lognormal(np.log(response_median), response_sigma, size=n).astype(np.int64)
    resp = np.clip(resp, np.maximum(total[0] - prompt_len, 16), np.maximum(hi - prompt_len, 16))
    reward = rewards(rng, g, group_size).reshape(-1)
    seg_len = [np.array([p, r], dtype=np.int64) for p, r in zip(prompt_len, resp, strict=True)]
    seg_train = [np.array([0, 1], dtype=np.int8)] * n
    return _Plan(
        group=groups.repeat(group_size),
        rollout=np.tile(np.arange(group_size), g),
        branch=np.zeros(n, dtype=np.int64),
        reward=reward,
        gen_tokens=resp,
        seg_len=seg_len,
        seg_train=seg_train,
    )


def _binary_rewards(rng: np.random.Generator, g: int, size: int) -> np.ndarray:
    # A task is hopeless (30%), trivial (20%) or in between; uniform groups follow from that.
    kind = rng.choice(3, size=g, p=[0.3, 0.2, 0.5])
    p = np.where(kind == 0, 0.02, np.where(kind == 1, 0.98, rng.beta(1.5, 1.5, size=g)))
    return (rng.random((g, size)) < p[:, None]).astype(np.float64)


def _fraction_rewards(rng: np.random.Generator, g: int, size: int) -> np.ndarray:
    # Some tasks fail every test (15%); the rest pass a task-dependent share of 10 tests.
    p = np.where(rng.random(g) < 0.15, 0.0, rng.beta(1.2, 1.5, size=g))
    return rng.binomial(10, np.repeat(p[:, None], size, axis=1)) / 10.0


def _math(rng: np.random.Generator, groups: np.ndarray, config: SynthConfig) -> _Plan:
    return _single_turn(
        rng, groups, 16, (60, 400), 550.0, 0.55, (200, 2_000), _binary_rewards, config
    )


def _code(rng: np.random.Generator, groups: np.ndarray, config: SynthConfig) -> _Plan:
    return _single_turn(
        rng, groups, 8, (300, 1_500), 2_400.0, 0.6, (1_000, 8_000), _fraction_rewards, config
    )


def _agent(rng: np.random.Generator, groups: np.ndarray, config: SynthConfig) -> _Plan:
    group_size = config.group_size or 8
    max_len = config.max_len
    g = len(groups)
    reward = _binary_rewards(rng, g, group_size).reshape(-1)
    rows: dict[str, list] = {k: [] for k in ("group", "rollout", "branch", "reward", "gen")}
    seg_len: list[np.ndarray] = []
    seg_train: list[np.ndarray] = []
    system = rng.integers(800, 2_500, size=g)
    for gi in range(g):
        for ri in range(group_size):
            # Heavy tail: lognormal body with an occasional Pareto excursion.
            total = rng.lognormal(np.log(5_000), 0.8)
            if rng.random() < 0.08:
                total *= 1.0 + rng.pareto(1.2)
            n_branches = int(rng.choice([1, 2, 3, 4], p=[0.75, 0.12, 0.08, 0.05]))
            gen = 0
            for bi in range(n_branches):
                if config.prompt_len is None:
                    length = int(np.clip(total / n_branches**0.5, 600, max_len))
                    prefix = min(int(system[gi]), length // 3)
                else:
                    prefix = config.prompt_len
                    length = prefix + int(np.clip(total / n_branches**0.5, 600, max_len - prefix))
                body = length - prefix
                turns = int(rng.integers(2, 13))
                cuts = np.sort(
                    rng.choice(np.arange(1, body), size=min(2 * turns - 2, body - 1), replace=False)
                )
                pieces = np.diff(np.concatenate([[0], cuts, [body]]))
                lens = np.concatenate([[prefix], pieces]).astype(np.int64)
                train = np.zeros(len(lens), dtype=np.int8)
                train[1::2] = 1  # assistant turns; tool outputs (even pieces) stay masked
                seg_len.append(lens)
                seg_train.append(train)
                gen += int(lens[train == 1].sum())
                rows["group"].append(groups[gi])
                rows["rollout"].append(ri)
                rows["branch"].append(bi)
                rows["reward"].append(reward[gi * group_size + ri])
            rows["gen"].extend([gen] * n_branches)
    return _Plan(
        group=np.array(rows["group"], dtype=np.int64),
        rollout=np.array(rows["rollout"], dtype=np.int64),
        branch=np.array(rows["branch"], dtype=np.int64),
        reward=np.array(rows["reward"], dtype=np.float64),
        gen_tokens=np.array(rows["gen"], dtype=np.int64),
        seg_len=seg_len,
        seg_train=seg_train,
    )


ENVS: dict[str, Callable[[np.random.Generator, np.ndarray, SynthConfig], _Plan]] = {
    "math": _math,
    "code": _code,
    "agent": _agent,
}
ENV_SHARES = {"math": 0.5, "code": 0.3, "agent": 0.2}


def _plans(config: SynthConfig) -> tuple[list[str], list[_Plan], np.random.Generator]:
    rng = np.random.default_rng(config.seed)
    shares = np.array([ENV_SHARES[e] for e in config.envs])
    env_of_group = rng.choice(len(config.envs), size=config.groups, p=shares / shares.sum())
    names, plans = [], []
    for i, env in enumerate(config.envs):
        groups = np.flatnonzero(env_of_group == i).astype(np.int64)
        if len(groups):
            names.append(env)
            plans.append(ENVS[env](rng, groups, config))
    return names, plans, rng


def synth_lengths(n: int, seed: int = 0, max_len: int = 32_768) -> np.ndarray:
    """`n` sample lengths (int64) from the synthetic multi-env distribution, in group order."""
    groups = max(8, n // 8)
    while True:
        _, plans, _ = _plans(SynthConfig(groups=groups, seed=seed, max_len=max_len))
        group = np.concatenate([p.group for p in plans])
        lengths = np.concatenate([np.array([s.sum() for s in p.seg_len]) for p in plans])
        if len(lengths) >= n:
            return lengths[np.argsort(group, kind="stable")][:n].astype(np.int64)
        groups *= 2


def _share_prompts(
    ids: np.ndarray, offsets: np.ndarray, group: np.ndarray, prompt: np.ndarray
) -> None:
    """Give every sample (sorted by group) the first ``prompt[i]`` tokens of its group's sample
    with the longest prompt, in place: a group's prompts are then prefixes of one another."""
    if not len(group):
        return
    run = np.cumsum(np.r_[False, group[1:] != group[:-1]])  # [n] 0..G-1, the sample's group
    longest = np.lexsort((-prompt, run))  # by group, then longest prompt first
    head = np.r_[True, run[longest][1:] != run[longest][:-1]]
    source = longest[head][run]  # [n] the sample whose prompt each one takes
    within = np.arange(int(prompt.sum())) - np.repeat(np.cumsum(prompt) - prompt, prompt)
    ids[np.repeat(offsets[:-1], prompt) + within] = ids[np.repeat(offsets[source], prompt) + within]


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))


def generate(config: SynthConfig) -> pa.Table:
    """Generate the dataset described in the module docstring, sorted by group."""
    names, plans, rng = _plans(config)
    env = np.concatenate([np.full(len(p.group), i) for i, p in enumerate(plans)])
    p = _Plan(
        group=np.concatenate([q.group for q in plans]),
        rollout=np.concatenate([q.rollout for q in plans]),
        branch=np.concatenate([q.branch for q in plans]),
        reward=np.concatenate([q.reward for q in plans]),
        gen_tokens=np.concatenate([q.gen_tokens for q in plans]),
        seg_len=[s for q in plans for s in q.seg_len],
        seg_train=[s for q in plans for s in q.seg_train],
    )
    order = np.lexsort((p.branch, p.rollout, p.group))
    n = len(order)
    seg_len = [p.seg_len[i] for i in order]
    seg_train = [p.seg_train[i] for i in order]
    lengths = np.array([s.sum() for s in seg_len], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_len = np.concatenate(seg_len)
    mask = np.repeat(np.concatenate(seg_train), flat_len).astype(np.bool_)
    total = int(offsets[-1])
    # Zipf-like token ids (frequent tokens are small ids) compress like real text does.
    ids = (VOCAB_SIZE * rng.random(total, dtype=np.float32) ** 4).astype(np.int32)
    # Behaviour log-probs: near 0 for most sampled tokens, a long tail of unlikely ones;
    # 0 where the policy did not sample the token.
    logp = -rng.exponential(0.35, size=total).astype(np.float32)
    logp = np.where(mask, np.round(logp * 256) / 256, 0).astype(np.float32)
    if config.shared_prompts:
        _share_prompts(ids, offsets, p.group[order], np.array([s[0] for s in seg_len]))

    group, rollout, branch = p.group[order], p.rollout[order], p.branch[order]
    env_names = np.array(names, dtype=object)[env[order]]
    group_ids = np.char.add(
        np.char.add(env_names.astype(str), "/"), np.char.zfill(group.astype(str), 6)
    )
    rollout_ids = np.char.add(np.char.add(group_ids, "/r"), rollout.astype(str))
    sample_ids = np.char.add(np.char.add(rollout_ids, "/b"), branch.astype(str))
    start_s = group * _GROUP_INTERVAL_S
    jitter = rng.gamma(2.0, 1.5, size=n)
    rollout_key = rollout_ids
    # Branches of one rollout finish together: take the jitter of the rollout's first branch.
    _, first = np.unique(rollout_key, return_index=True)
    _, inverse = np.unique(rollout_key, return_inverse=True)
    jitter = jitter[first][inverse]
    finished_us = _EPOCH_US + (
        (start_s + p.gen_tokens[order] * _SECONDS_PER_TOKEN + jitter) * 1e6
    ).astype(np.int64)

    return pa.table(
        {
            "group_id": pa.array(group_ids.tolist(), pa.string()),
            "rollout_id": pa.array(rollout_ids.tolist(), pa.string()),
            "sample_id": pa.array(sample_ids.tolist(), pa.string()),
            "env": pa.array(env_names.tolist(), pa.string()),
            "reward": pa.array(p.reward[order], pa.float64()),
            "input_ids": _list_array(offsets, ids),
            "loss_mask": _list_array(offsets, mask),
            "logprobs": _list_array(offsets, logp),
            "finished_at": pa.array(finished_us, pa.timestamp("us", tz="UTC")),
        }
    )
