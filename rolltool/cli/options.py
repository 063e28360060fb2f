"""Options as tables under help sections, and the options several commands share.

click has no option groups; ``SectionedCommand`` lists each option under the section it was
declared in (``section("Steps", opt(...), ...)``), in the order the sections are declared, and
options declared without one (``--help``) last. ``opt`` is one line per option: its flags, its
kind (a click type, a tuple of choices, or ``bool`` for a flag), its default (taken from the
config records, never re-typed) and its help.

Parsed values arrive as settings: ``--env-weight``, ``--env-estimator`` and ``--column`` are
parsed into dicts by their callbacks (a malformed pair is a usage error, exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from rolltool.cli._common import parse_columns, parse_mapping

F = TypeVar("F", bound=Callable[..., Any])

OPTIONS = "Options"
"""The section of options declared without one."""


class SectionOption(click.Option):
    """A ``click.Option`` that knows the help section it is listed under."""

    def __init__(self, *args: Any, section: str = OPTIONS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options under their sections."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "section", OPTIONS), []).append(record)
        sections[OPTIONS] = sections.pop(OPTIONS, [])  # the undeclared ones last
        for name, records in sections.items():
            if records:
                with formatter.section(name):
                    formatter.write_dl(records)


def opt(flags: str, kind: Any, default: Any, help: str, **extra: Any) -> dict[str, Any]:
    """One option: ``flags`` split on spaces (a word without dashes names the parameter),
    ``kind`` a click type, a tuple of choices or ``bool`` (a flag), ``default`` shown in the
    help unless None."""
    kw: dict[str, Any] = {"param_decls": flags.split(), "help": help}
    if default is not None:  # click 8.3 takes an explicit None as a value (never "missing")
        kw["default"] = default
    if kind is bool:
        kw.update(is_flag=True, default=bool(default))
    elif isinstance(kind, tuple | list):
        kw.update(type=click.Choice(list(kind)), show_default=default is not None)
    else:
        kw.update(type=kind, show_default=default is not None)
    return {**kw, **extra}


def section(name: str, *options: dict[str, Any]) -> Callable[[F], F]:
    """Declare ``options`` (from `opt`) under the help section ``name``, in the order given."""

    def apply(fn: F) -> F:
        for kw in reversed(options):  # decorators apply bottom-up
            kw = dict(kw)
            fn = click.option(*kw.pop("param_decls"), cls=SectionOption, section=name, **kw)(fn)
        return fn

    return apply


def mapping_callback(option: str, convert: Callable[[str], Any] = str, what: str = "") -> Any:
    """A callback parsing repeated ``KEY=VALUE`` into a dict, each value through ``convert``."""

    def callback(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> dict:
        result = {}
        for key, value in parse_mapping(pairs, option).items():
            try:
                result[key] = convert(value)
            except ValueError:
                raise click.BadParameter(f"{key}={value}: {what}", param_hint=option) from None
        return result

    return callback


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


def column_option() -> dict[str, Any]:
    """``--column NEW=OLD`` of every command that reads rollout Parquet, parsed to a dict."""
    return opt("--column columns", str, (), "Read schema column NEW from input column OLD (repeatable).",
               multiple=True, metavar="NEW=OLD", callback=lambda c, p, v: parse_columns(v))  # fmt: skip


def json_option(what: str = "one JSON document instead of tables") -> dict[str, Any]:
    return opt("--json as_json", bool, False, f"Print {what}.")


def force_option(what: str = "an existing output") -> dict[str, Any]:
    return opt("--force", bool, False, f"Replace {what}.")
