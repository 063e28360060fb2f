"""The options several commands share, and callbacks that turn option text into settings.

A callback made by ``parsed`` returns the setting (``--env-weight`` as a dict of floats,
``--steps`` as a tuple); its ValueError is a usage error (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from rolltool.cli._common import parse_columns, parse_mapping
from rolltool.cli.sections import opt


def parsed(parse: Callable[[Any], Any]) -> Any:
    """A callback parsing a value with ``parse``; its ValueError is a usage error (exit 2)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return None if value is None else parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return callback


def mapping_callback(option: str, convert: Callable[[str], Any] = str, what: str = "") -> Any:
    """A callback parsing repeated ``KEY=VALUE`` into a dict, each value through ``convert``."""

    def parse(pairs: tuple[str, ...]) -> dict[str, Any]:
        result = {}
        for key, value in parse_mapping(pairs, option).items():
            try:
                result[key] = convert(value)
            except ValueError:
                raise ValueError(f"{key}={value}: {what}") from None
        return result

    return parsed(parse)


POSITIVE = click.IntRange(min=1)
"""A whole number >= 1."""


def estimator_options(estimators: Any, defaults: Any, note: str = "") -> list[dict[str, Any]]:
    """--estimator, --env-estimator ENV=NAME (repeatable), --std-eps: pack and advantages.

    An unknown estimator in --env-estimator is the config's error (exit 1) in both commands.
    """
    return [
        opt("--estimator", tuple(sorted(estimators)), defaults.estimator, f"Advantage estimator{note}."),
        opt("--env-estimator env_estimators", str, (), "Estimator for one env (repeatable).",
            multiple=True, metavar="ENV=NAME", callback=mapping_callback("--env-estimator")),
        opt("--std-eps", float, defaults.std_eps, "Epsilon added to the group std (grpo)."),
    ]  # fmt: skip


def given_by_user(*params: str) -> bool:
    """Whether the user set any of these parameters (command line or environment), as opposed
    to click's defaults."""
    ctx = click.get_current_context()
    sources = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    return any(ctx.get_parameter_source(p) in sources for p in params)


def column_option() -> dict[str, Any]:
    """``--column NEW=OLD`` of every command that reads rollout Parquet, parsed to a dict."""
    return opt("--column columns", str, (), "Read schema column NEW from input column OLD (repeatable).",
               multiple=True, metavar="NEW=OLD", callback=parsed(parse_columns))  # fmt: skip


def engine_options(work: str) -> list[dict[str, Any]]:
    """--engine local|ray and --ray-address: what runs `work` (one phrase, e.g. "reads the
    pieces of the input"); the same output either way."""
    from rolltool.engine.base import ENGINES  # no Ray import: ENGINES only

    return [
        opt("--engine", ENGINES, "local", f"What {work}: this process, or Ray tasks (the [ray] extra; on several machines the input is a URI on object storage, e.g. s3://, or on a filesystem every node mounts); the same output either way."),
        opt("--ray-address", str, None, "The Ray cluster --engine ray attaches to (auto, HOST:6379, ray://HOST:10001) [default: RAY_ADDRESS, else one `ray start` began on this machine, else a new local cluster]."),
    ]  # fmt: skip


def json_option(what: str = "one JSON document instead of tables") -> dict[str, Any]:
    return opt("--json as_json", bool, False, f"Print {what}.")


def force_option(what: str = "an existing output") -> dict[str, Any]:
    return opt("--force", bool, False, f"Replace {what}.")
