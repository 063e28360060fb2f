"""PackConfig is the one source of pack's defaults and cross-option rules: the API and the CLI
build the same resolved record from the same settings, and refuse the same combinations."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import rolltool.jobs.pack
from rolltool.cli import main
from rolltool.cli.pack import pack as pack_command
from rolltool.errors import OptionConflict, RolltoolError
from rolltool.plan.advantages import ESTIMATORS, AdvantageConfig
from rolltool.plan.batches import BATCH_UNITS, ORDERS, UNIFORM_POLICIES, StepConfig
from rolltool.plan.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MICRO_BATCH_TOKENS,
    OVERLONG,
    PackConfig,
)
from rolltool.plan.loss import LOSS_AGGS
from rolltool.plan.partition import ALIGNS
from rolltool.plan.workload import WORKLOADS


class _Captured(Exception):
    def __init__(self, config: PackConfig) -> None:
        self.config = config


def _cli_config(monkeypatch: pytest.MonkeyPatch, *args: Any) -> PackConfig:
    """The PackConfig `rolltool pack ARGS` hands to run_pack (which is not run)."""
    calls = []

    def capture(inputs: Any, output: Any, config: PackConfig, **_: Any) -> None:
        calls.append(config)
        raise _Captured(config)

    monkeypatch.setattr(rolltool.jobs.pack, "run_pack", capture)
    result = CliRunner().invoke(main, ["pack", "in.parquet", "-o", "out", *map(str, args)])
    assert isinstance(result.exception, _Captured), result.output
    assert len(calls) == 1
    return calls[0]


# (CLI arguments, the same settings through the API)
SAME = [
    (["--dp", 2], dict(dp=2)),
    (["--dp", 2, "--row-len", 8192], dict(dp=2, row_len=8192)),
    (["--dp", 2, "--row-len", 40000], dict(dp=2, row_len=40000)),
    (["--dp", 2, "--row-len", 9000, "--micro-batch-tokens", 4096], dict(dp=2, row_len=9000, micro_batch_tokens=4096)),
    (["--dp", 3, "--micro-batch-size", 4, "--row-len", 70000], dict(dp=3, micro_batch_size=4, row_len=70000)),
    (["--dp", 1, "--batch-size", 64, "--batch-unit", "samples", "--keep-last", "--env-weight", "math=2"],
     dict(dp=1, steps=StepConfig(batch_size=64, batch_unit="samples", keep_last=True, env_weights={"math": 2.0}))),
    (["--dp", 2, "--estimator", "rloo", "--env-estimator", "code=grpo", "--std-eps", 0.1],
     dict(dp=2, advantages=AdvantageConfig(estimator="rloo", env_estimators={"code": "grpo"}, std_eps=0.1))),
    (["--dp", 2, "--loss-agg", "seq-mean-token-sum-norm", "--loss-scale-factor", 4096],
     dict(dp=2, loss_agg="seq-mean-token-sum-norm", loss_scale_factor=4096.0)),
    (["--dp", 4, "--align", "total", "--balance", "tokens", "--equal-count", "--overlong", "drop"],
     dict(dp=4, align="total", balance="tokens", equal_count=True, overlong="drop")),
    (["--dp", 2, "--model-config", "m.json", "--pad-id", 7, "--shard-mb", 1, "--cache-mb", 0],
     dict(dp=2, model="m.json", pad_id=7, shard_mb=1.0, cache_mb=0.0)),
]  # fmt: skip


@pytest.mark.parametrize(("args", "settings"), SAME)
def test_cli_and_api_resolve_to_the_same_config(
    monkeypatch: pytest.MonkeyPatch, args: list[Any], settings: dict[str, Any]
) -> None:
    from_cli = _cli_config(monkeypatch, *args)
    from_api = PackConfig(**settings)
    assert from_cli == from_api
    assert from_cli.to_dict() == from_api.to_dict()  # what the manifest records


def test_budget_defaults_to_the_row_length_in_the_api_too() -> None:
    """Defect #4: PackConfig(row_len=8192) used to fail (shorter than the 32,768 default budget)
    while the CLI silently made the budget the row length."""
    assert PackConfig(dp=1, row_len=8192).micro_batch_tokens == 8192
    assert PackConfig(dp=1, row_len=40000).micro_batch_tokens == 40000
    assert PackConfig(dp=1).micro_batch_tokens == DEFAULT_MICRO_BATCH_TOKENS
    fixed = PackConfig(dp=1, micro_batch_size=4, row_len=100)
    assert fixed.micro_batch_tokens is None and fixed.token_cap == 100
    assert fixed.to_dict()["micro_batch_tokens"] is None
    assert PackConfig(dp=1, row_len=8192).to_dict()["micro_batch_tokens"] == 8192
    with pytest.raises(RolltoolError, match="--row-len 100 is shorter"):
        PackConfig(dp=1, row_len=100, micro_batch_tokens=256)
    # The resolved budget is a value like any other: replace keeps it, None resolves again.
    c = PackConfig(dp=1, row_len=8192)
    assert dataclasses.replace(c, micro_batch_tokens=None, row_len=4096).micro_batch_tokens == 4096
    assert PackConfig(dp=1).steps == StepConfig(batch_size=DEFAULT_BATCH_SIZE)


CONFLICTS = [
    (dict(micro_batch_tokens=10, micro_batch_size=2), ["--micro-batch-tokens", 10, "--micro-batch-size", 2], "not both"),
    (dict(micro_batch_size=2, align="total"), ["--micro-batch-size", 2, "--align", "total"], "--align total"),
    (dict(loss_scale_factor=2.0), ["--loss-scale-factor", 2], "seq-mean-token-sum-norm only"),
    (dict(loss_agg="seq-mean-token-mean", loss_scale_factor=2.0),
     ["--loss-agg", "seq-mean-token-mean", "--loss-scale-factor", 2], "not to seq-mean-token-mean"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "args", "words"), CONFLICTS)
def test_conflicts_are_refused_alike(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], args: list[Any], words: str
) -> None:
    """The API raises OptionConflict (a RolltoolError); the CLI, the same message, exit 2."""
    with pytest.raises(OptionConflict, match=re.escape(words)):
        PackConfig(dp=2, **settings)
    monkeypatch.setattr(rolltool.jobs.pack, "run_pack", lambda *a, **k: pytest.fail("ran"))
    result = CliRunner().invoke(main, ["pack", "in.parquet", "-o", "out", "--dp", "2", *map(str, args)])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Traceback" not in result.output


def test_align_total_with_fixed_micro_batches_is_refused_not_ignored(tmp_path: Path) -> None:
    """Defect #7: --align total with --micro-batch-size laid out the same rows as lockstep yet was
    recorded as `total` (and priced as plain DP by stats). Now it is refused; lockstep (the
    default) still packs in fixed mode."""
    with pytest.raises(OptionConflict, match="no effect with --micro-batch-size"):
        PackConfig(dp=2, micro_batch_size=4, align="total")
    assert PackConfig(dp=2, micro_batch_size=4).align == "lockstep"
    assert PackConfig(dp=2, micro_batch_tokens=4096, align="total").align == "total"


def test_from_options_routes_flat_settings() -> None:
    c = PackConfig.from_options(dp=8, batch_size=64, order="shuffle", seed=3, estimator="rloo",
                                row_len=8192, loss_agg="seq-mean-token-mean")  # fmt: skip
    assert c == PackConfig(
        dp=8,
        steps=StepConfig(batch_size=64, order="shuffle", seed=3),
        advantages=AdvantageConfig(estimator="rloo"),
        row_len=8192,
        loss_agg="seq-mean-token-mean",
    )
    assert PackConfig.from_options(dp=1) == PackConfig(dp=1)
    with pytest.raises(TypeError):
        PackConfig.from_options(dp=1, no_such_setting=1)


def _option(name: str) -> click.Option:
    (param,) = [p for p in pack_command.params if p.name == name]
    assert isinstance(param, click.Option)
    return param


def test_cli_defaults_and_choices_come_from_the_config() -> None:
    """Every pack option named like a setting defaults to the config's default, and every choice
    list is the module's constant."""
    d = PackConfig(dp=1)
    ctx = pack_command.make_context("pack", ["in.parquet", "-o", "out", "--dp", "1"])
    checked = 0
    for record in (d, d.steps, d.advantages):
        for f in dataclasses.fields(record):
            if f.name in ctx.params and f.name not in ("micro_batch_tokens", "batch_size"):
                assert ctx.params[f.name] == getattr(record, f.name), f.name
                checked += 1
    assert checked >= 20  # the loop really compared the options
    assert ctx.params["micro_batch_tokens"] is None  # resolved by the config
    assert ctx.params["batch_size"] is None  # resolved by the config (its unit decides)
    assert PackConfig.from_options(dp=1, batch_size=None).steps == d.steps
    for name, choices in (("align", ALIGNS), ("overlong", OVERLONG), ("loss_agg", LOSS_AGGS),
                          ("batch_unit", BATCH_UNITS), ("order", ORDERS),
                          ("uniform", UNIFORM_POLICIES), ("balance", sorted(WORKLOADS)),
                          ("estimator", sorted(ESTIMATORS))):  # fmt: skip
        param_type = _option(name).type
        assert isinstance(param_type, click.Choice)
        assert list(param_type.choices) == list(choices), name


def test_help_says_what_the_budget_defaults_to(run_cli: Any) -> None:
    text = " ".join(run_cli("pack", "--help").stdout.split())
    assert f"--row-len when given, else {DEFAULT_MICRO_BATCH_TOKENS}" in text
    assert "none with --micro-batch-size" in text


def test_help_lists_options_under_sections(run_cli: Any) -> None:
    text = run_cli("pack", "--help").stdout
    sections = ["Steps:", "Partition:", "Rows:", "Loss:", "Advantages:", "Input:", "Output:"]
    where = [text.index(f"\n{s}\n") for s in sections]
    assert where == sorted(where)
    expect = {"--batch-size": "Steps:", "--dp": "Partition:", "--align": "Partition:",
              "--row-len": "Rows:", "--loss-scale-factor": "Loss:", "--std-eps": "Advantages:",
              "--column": "Input:", "--shard-mb": "Output:", "--json": "Output:"}  # fmt: skip
    for flag, heading in expect.items():
        at = text.index(f"  {flag} ")
        owner = max((w, s) for w, s in zip(where, sections, strict=True) if w < at)[1]
        assert owner == heading, flag
    for command in ("advantages", "synth"):
        assert "\nOutput:\n" in run_cli(command, "--help").stdout


def test_unknown_estimator_for_an_env_is_the_same_error_in_advantages_and_pack(
    run_cli: Any, synth_path: Path, tmp_path: Path
) -> None:
    """Both commands share the estimator options; an unknown estimator in --env-estimator was a
    usage error (exit 2) in one and the config's error (exit 1) in the other."""
    pack = run_cli("pack", synth_path, "-o", tmp_path / "p", "--dp", 1, "--env-estimator", "math=nope")  # fmt: skip
    adv = run_cli("advantages", synth_path, "-o", tmp_path / "a.parquet", "--env-estimator", "math=nope")  # fmt: skip
    assert pack.exit_code == adv.exit_code == 1
    assert pack.stderr == adv.stderr and "unknown estimator 'nope'" in pack.stderr
    for args in (
        ["--env-estimator", "math"],
        ["--env-estimator", "a=rloo", "--env-estimator", "a=grpo"],
    ):
        assert run_cli("advantages", synth_path, "-o", tmp_path / "b.parquet", *args).exit_code == 2
        assert run_cli("pack", synth_path, "-o", tmp_path / "q", "--dp", 1, *args).exit_code == 2
