"""`rolltool synth`: deterministic, valid, and shaped like real multi-environment RL traffic."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import rolltool
from rolltool.errors import RolltoolError
from rolltool.input.resolve import resolve_inputs
from rolltool.input.synth import VOCAB_SIZE, SynthConfig, generate, synth_lengths
from rolltool.schema import scan

# Large enough for the shares below to mean something, small enough to build in ~0.1 s.
BIG = SynthConfig(groups=120, seed=1)


@pytest.fixture(scope="module")
def big() -> pa.Table:
    return generate(BIG)


def _lengths(table: pa.Table) -> np.ndarray:
    return pc.list_value_length(table["input_ids"]).to_numpy()


def _masks(table: pa.Table) -> list[np.ndarray]:
    return [np.asarray(m, dtype=np.int8) for m in table["loss_mask"].to_pylist()]


def _env(table: pa.Table, env: str) -> pa.Table:
    return table.filter(pc.equal(table["env"], env))


def _rollouts_per_group(table: pa.Table) -> dict[str, set[str]]:
    groups: dict[str, set[str]] = defaultdict(set)
    for g, r in zip(table["group_id"].to_pylist(), table["rollout_id"].to_pylist(), strict=True):
        groups[g].add(r)
    return groups


def _group_rewards(table: pa.Table) -> dict[str, dict[str, float]]:
    """group -> rollout -> reward (one entry per rollout, not per branch)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for g, r, w in zip(
        table["group_id"].to_pylist(),
        table["rollout_id"].to_pylist(),
        table["reward"].to_pylist(),
        strict=True,
    ):
        out[g][r] = w
    return out


def _transitions(mask: np.ndarray) -> int:
    """Number of 0 -> 1 steps in a loss mask (a mask starting with 1 counts one)."""
    return int(np.sum(np.diff(np.concatenate([[0], mask])) == 1))


def _uniform_share(table: pa.Table) -> float:
    groups = _group_rewards(table)
    return float(np.mean([len(set(r.values())) == 1 for r in groups.values()]))


# ------------------------------------------------------------------------------------------
# Determinism and validity.


def test_same_seed_same_table() -> None:
    config = SynthConfig(groups=10, seed=7, max_len=4096)
    assert generate(config).equals(generate(config))


def test_different_seed_different_table() -> None:
    a = generate(SynthConfig(groups=10, seed=7, max_len=4096))
    b = generate(SynthConfig(groups=10, seed=8, max_len=4096))
    assert not a.equals(b)
    assert a["reward"].to_pylist() != b["reward"].to_pylist()


def test_schema_is_valid_and_complete(synth_path: Path, synth_table: pa.Table) -> None:
    assert set(synth_table.column_names) == {
        "group_id",
        "rollout_id",
        "sample_id",
        "env",
        "reward",
        "input_ids",
        "loss_mask",
        "logprobs",
        "finished_at",
    }
    assert all(c.null_count == 0 for c in synth_table.columns)
    r = scan(resolve_inputs([synth_path]))  # raises on any problem
    assert r.warnings == []
    assert r.has_logprobs and r.finished_at is not None
    assert (r.trainable > 0).all()
    assert len(set(synth_table["sample_id"].to_pylist())) == synth_table.num_rows
    assert r.env_names and set(r.env_names) == {"math", "code", "agent"}


def test_token_values(big: pa.Table) -> None:
    ids = pc.list_flatten(big["input_ids"]).to_numpy()
    assert ids.min() >= 0 and ids.max() < VOCAB_SIZE
    logp = pc.list_flatten(big["logprobs"]).to_numpy()
    mask = pc.list_flatten(big["loss_mask"]).to_numpy(zero_copy_only=False)
    assert np.isfinite(logp).all() and (logp <= 0).all()
    assert (logp[~mask] == 0).all()  # no behaviour log-prob where the policy did not sample
    assert (logp[mask] < 0).any()


# ------------------------------------------------------------------------------------------
# The shapes the issue asks for.


@pytest.mark.parametrize(
    ("env", "group_size", "shortest", "longest"),
    [("math", 16, 200, 2_000), ("code", 8, 1_000, 8_000)],
)
def test_single_turn_env_shape(
    big: pa.Table, env: str, group_size: int, shortest: int, longest: int
) -> None:
    table = _env(big, env)
    assert table.num_rows > 0
    groups = _rollouts_per_group(table)
    assert {len(r) for r in groups.values()} == {group_size}
    assert table.num_rows == group_size * len(groups)  # one branch per rollout
    lengths = _lengths(table)
    assert lengths.min() >= shortest and lengths.max() <= longest
    for mask in _masks(table):  # prompt masked, response trained
        assert mask[0] == 0 and mask[-1] == 1 and _transitions(mask) == 1


def test_math_rewards(big: pa.Table) -> None:
    math = _env(big, "math")
    assert set(math["reward"].to_pylist()) == {0.0, 1.0}
    # a good share of uniform groups, all-0 and all-1 both present, but not everything
    kinds = {frozenset(r.values()) for r in _group_rewards(math).values()}
    assert frozenset({0.0}) in kinds and frozenset({1.0}) in kinds
    assert 0.2 <= _uniform_share(math) <= 0.7


def test_code_rewards(big: pa.Table) -> None:
    rewards = np.array(_env(big, "code")["reward"].to_pylist())
    assert ((rewards >= 0) & (rewards <= 1)).all()
    fractional = (rewards > 0) & (rewards < 1)
    assert fractional.mean() > 0.3
    assert len(np.unique(rewards)) >= 5


def test_agent_env(big: pa.Table) -> None:
    agent = _env(big, "agent")
    assert agent.num_rows > 0
    groups = _rollouts_per_group(agent)
    assert {len(r) for r in groups.values()} == {8}
    # multi-turn: tool output masked between trained assistant turns
    transitions = np.array([_transitions(m) for m in _masks(agent)])
    assert (transitions >= 2).all()
    assert transitions.max() >= 6
    lengths = _lengths(agent)
    assert lengths.max() <= BIG.max_len
    assert lengths.max() > 4 * np.median(lengths)  # a heavy tail
    assert set(agent["reward"].to_pylist()) <= {0.0, 1.0}


def test_agent_branches(big: pa.Table) -> None:
    agent = _env(big, "agent")
    per_rollout: dict[str, list[tuple[float, object]]] = defaultdict(list)
    for r, w, t in zip(
        agent["rollout_id"].to_pylist(),
        agent["reward"].to_pylist(),
        agent["finished_at"].to_pylist(),
        strict=True,
    ):
        per_rollout[r].append((w, t))
    counts = np.array([len(v) for v in per_rollout.values()])
    assert counts.min() == 1 and counts.max() <= 4
    assert set(counts.tolist()) >= {1, 2, 3}
    assert 0.05 < (counts > 1).mean() < 0.6  # "some rollouts"
    for branches in per_rollout.values():
        assert len(set(branches)) == 1  # same reward, finished together


def test_env_shares_follow_group_count(big: pa.Table) -> None:
    groups = {g.split("/")[0] for g in big["group_id"].to_pylist()}
    assert groups == {"math", "code", "agent"}
    per_env = {e: len(_rollouts_per_group(_env(big, e))) for e in groups}
    assert sum(per_env.values()) == BIG.groups
    assert per_env["math"] > per_env["code"] > per_env["agent"]


def test_groups_complete_out_of_order(big: pa.Table) -> None:
    fin = pc.cast(pc.cast(big["finished_at"], pa.timestamp("us")), pa.int64()).to_numpy()
    group_ids = big["group_id"].to_pylist()
    launch = np.array([int(g.split("/")[1]) for g in group_ids])  # groups launch in number order
    done: dict[int, int] = {}
    for g, t in zip(launch, fin, strict=True):
        done[g] = max(done.get(g, 0), int(t))
    order = [g for g, _ in sorted(done.items(), key=lambda kv: kv[1])]
    assert order != sorted(order)
    # finished_at grows with the tokens generated: strongly correlated within a group
    trainable = np.array([m.sum() for m in _masks(big)])
    corrs = []
    for g in np.unique(launch):
        sel = launch == g
        if np.ptp(trainable[sel]) > 0 and np.ptp(fin[sel]) > 0:
            corrs.append(np.corrcoef(trainable[sel], fin[sel])[0, 1])
    assert np.mean(corrs) > 0.5


@pytest.mark.parametrize("max_len", [256, 1_000, 3_000])
def test_lengths_never_exceed_max_len(max_len: int) -> None:
    table = generate(SynthConfig(groups=30, seed=3, max_len=max_len))
    lengths = _lengths(table)
    assert lengths.max() <= max_len
    assert lengths.min() > 0
    assert all(m.sum() > 0 for m in _masks(table))  # still something to train on


def test_synth_lengths_matches_generate() -> None:
    lengths = synth_lengths(200, seed=2, max_len=8_192)
    assert lengths.dtype == np.int64 and len(lengths) == 200
    assert lengths.min() > 0 and lengths.max() <= 8_192


def test_config_validation() -> None:
    with pytest.raises(RolltoolError, match="groups"):
        SynthConfig(groups=0)
    with pytest.raises(RolltoolError, match="max-len"):
        SynthConfig(max_len=100)
    with pytest.raises(RolltoolError, match="unknown environment"):
        SynthConfig(envs=("math", "chess"))
    with pytest.raises(RolltoolError):
        SynthConfig(envs=())
    with pytest.raises(RolltoolError, match="group-size"):
        SynthConfig(group_size=0)
    with pytest.raises(RolltoolError, match=r"prompt-len 4,096 leaves no room .* 1 to 3,496"):
        SynthConfig(prompt_len=4096, max_len=4096)
    with pytest.raises(RolltoolError, match=r"1 to 284 \(--max-len - 16\)"):
        SynthConfig(envs=("math",), max_len=300, prompt_len=290)  # no agent: room for 16
    with pytest.raises(RolltoolError, match="needs --max-len 601 or more with the agent env"):
        SynthConfig(max_len=600, prompt_len=1)
    assert SynthConfig(envs=("math",), max_len=300, prompt_len=284).prompt_len == 284


# ------------------------------------------------------------------------------------------
# Shared prompts, group size and prompt length (what `pack --share-prefix` is measured on).


def _first_untrained(table: pa.Table) -> np.ndarray:
    """Per sample, the length of its leading run of loss_mask 0 (its prompt, or system prompt)."""
    return np.array([int(np.argmax(m)) if m.any() else len(m) for m in _masks(table)])


def test_shared_prompts_change_only_the_prompt_tokens(big: pa.Table) -> None:
    shared = generate(dataclasses.replace(BIG, shared_prompts=True))
    assert shared.drop_columns(["input_ids"]).equals(big.drop_columns(["input_ids"]))
    prompt = _first_untrained(big)
    plain = big["input_ids"].to_pylist()
    ids = shared["input_ids"].to_pylist()
    groups = big["group_id"].to_pylist()
    changed = 0
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        by_group[g].append(i)
        assert ids[i][prompt[i] :] == plain[i][prompt[i] :]  # responses untouched
        changed += ids[i][: prompt[i]] != plain[i][: prompt[i]]
    assert changed > len(ids) // 2
    for members in by_group.values():
        longest = max(members, key=lambda i: (prompt[i], -i))
        for i in members:  # every prompt a prefix of the group's longest
            assert ids[i][: prompt[i]] == ids[longest][: prompt[i]]
    other = [j for g, m in by_group.items() for j in m[:1]]
    heads = {tuple(ids[j][:16]) for j in other}
    assert len(heads) == len(other)  # groups still differ from each other


@pytest.mark.parametrize("envs", [("math",), ("code",), ("agent",)])
def test_group_size_and_prompt_len(envs: tuple[str, ...]) -> None:
    config = SynthConfig(groups=6, seed=2, envs=envs, max_len=8192, group_size=5, prompt_len=700)
    table = generate(config)
    rollouts = defaultdict(set)
    for g, r in zip(table["group_id"].to_pylist(), table["rollout_id"].to_pylist(), strict=True):
        rollouts[g].add(r)
    assert len(rollouts) == 6 and all(len(r) == 5 for r in rollouts.values())
    assert (_first_untrained(table) == 700).all()
    lengths = _lengths(table)
    assert lengths.max() <= 8192 and lengths.min() >= 700 + 16


def test_shared_prompts_are_what_share_prefix_finds(run_cli, tmp_path: Path) -> None:
    data = tmp_path / "s.parquet"
    args = ["--groups", 6, "--envs", "math", "--group-size", 8, "--prompt-len", 1024]
    assert run_cli("synth", "-o", data, *args, "--max-len", 4096, "--shared-prompts").exit_code == 0
    out = tmp_path / "p"
    pack = ["pack", data, "-o", out, "--dp", 2, "--batch-size", 16, "--share-prefix", "--json"]
    result = run_cli(*pack)
    assert result.exit_code == 0, result.output
    assert run_cli("verify", out).exit_code == 0
    table = pq.read_table(data)
    unshared = int(_lengths(table).sum())
    stored = sum(int(r.real_tokens) for step in rolltool.open_packed(out).manifest.steps
                 for r in step.ranks)  # fmt: skip
    # every group of 8 stores its 1,024-token prompt once, less one re-fed branch token each
    assert unshared - stored == 6 * 7 * 1024 - 6 * 8 + 6


# ------------------------------------------------------------------------------------------
# Through the CLI.


def test_cli_writes_the_generated_table(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    result = run_cli("synth", "-o", out, "--groups", 6, "--seed", 4, "--max-len", 2048, "--json")
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).equals(generate(SynthConfig(groups=6, seed=4, max_len=2048)))
    report = json.loads(result.stdout)
    assert report["rows"] == pq.read_metadata(out).num_rows
    assert report["config"] == {
        "groups": 6,
        "seed": 4,
        "envs": ["math", "code", "agent"],
        "max_len": 2048,
        "shared_prompts": False,
        "group_size": None,
        "prompt_len": None,
    }
    assert sum(report["samples_per_env"].values()) == report["rows"]
    assert report["bytes"] == out.stat().st_size


def test_cli_envs_subset(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    result = run_cli("synth", "-o", out, "--groups", 5, "--envs", "math, code", "--max-len", 4096)
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert set(table["env"].to_pylist()) <= {"math", "code"}
    assert "math" in table["env"].to_pylist()
    only = tmp_path / "agent.parquet"
    assert run_cli("synth", "-o", only, "--groups", 2, "--envs", "agent").exit_code == 0
    assert set(pq.read_table(only)["env"].to_pylist()) == {"agent"}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--envs", "math,chess"], "chess"),
        (["--envs", ","], "environment"),
        (["--groups", "0"], "--groups"),
        (["--max-len", "10"], "--max-len"),
        (["--seed", "-1"], "--seed"),
        (["--group-size", "0"], "--group-size"),
        (["--max-len", "1000", "--prompt-len", "500"], "--prompt-len 500 leaves no room"),
        (["--max-len", "600", "--prompt-len", "1"], "needs --max-len 601"),
    ],
)
def test_cli_bad_options(run_cli, tmp_path: Path, args: list[str], needle: str) -> None:
    out = tmp_path / "s.parquet"
    result = run_cli("synth", "-o", out, *args)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.stderr.startswith("Error: ") and needle in result.stderr
    assert not out.exists()


def test_cli_existing_output(run_cli, tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    out.write_bytes(b"keep me")
    result = run_cli("synth", "-o", out, "--groups", 2)
    assert result.exit_code == 1 and "--force" in result.stderr
    assert out.read_bytes() == b"keep me"
    result = run_cli("synth", "-o", out, "--groups", 2, "--force")  # not rolltool's: refused
    assert result.exit_code == 1 and "not an output rolltool wrote" in result.stderr
    assert out.read_bytes() == b"keep me"
    out.unlink()
    assert run_cli("synth", "-o", out, "--groups", 2).exit_code == 0
    result = run_cli("synth", "-o", out, "--groups", 2, "--max-len", 2048, "--force")
    assert result.exit_code == 0, result.output
    assert pq.read_metadata(out).num_rows > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.parquet"]


def test_cli_unwritable_output(run_cli, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("synth", "-o", blocker / "s.parquet", "--groups", 2)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.stderr.startswith("Error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
