"""Option help under sections: click has no option groups.

``SectionedCommand`` lists each option under the ``section(...)`` it was declared in, sections in
declaration order, options declared without one (``--help``) last. ``opt`` is one line per
option: flags, kind (a click type, a tuple of choices, ``bool`` for a flag), default (from the
config records, never re-typed) and help.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

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
                with formatter.section(name), _whole_words():
                    formatter.write_dl(records)


def _wrap(
    text: str,
    width: int = 78,
    initial_indent: str = "",
    subsequent_indent: str = "",
    preserve_paragraphs: bool = False,
) -> str:
    """click's ``wrap_text`` for one option's help, never breaking a word at a hyphen: a choice
    such as seq-mean-token-sum-norm stays whole (it may be copied)."""
    return textwrap.fill(text, width, initial_indent=initial_indent,
                         subsequent_indent=subsequent_indent, break_on_hyphens=False,
                         break_long_words=False)  # fmt: skip


@contextmanager
def _whole_words() -> Iterator[None]:
    """``HelpFormatter.write_dl`` wraps through ``click.formatting.wrap_text``: swap in `_wrap`
    for the block."""
    saved = click.formatting.wrap_text
    click.formatting.wrap_text = _wrap
    try:
        yield
    finally:
        click.formatting.wrap_text = saved


MAX_CHOICES_WIDTH = 50
"""Choices longer than this, joined with "|", are listed in the help text (wrapped to the
terminal) instead of next to the option name, where they would pass 80 columns."""


def opt(flags: str, kind: Any, default: Any, help: str, **extra: Any) -> dict[str, Any]:
    """One option: ``flags`` split on spaces (a word without dashes names the parameter),
    ``kind`` a click type, a tuple of choices or ``bool`` (a flag), ``default`` shown in the
    help unless None. Long choice lists (`MAX_CHOICES_WIDTH`) go into the help as NAME."""
    kw: dict[str, Any] = {"param_decls": flags.split(), "help": help}
    if default is not None:  # click 8.3 takes an explicit None as a value (never "missing")
        kw["default"] = default
    if kind is bool:
        kw.update(is_flag=True, default=bool(default))
    elif isinstance(kind, tuple | list):
        kw.update(type=click.Choice(list(kind)), show_default=default is not None)
        if len("|".join(kind)) > MAX_CHOICES_WIDTH and "metavar" not in extra:
            kw.update(metavar="NAME", help=f"{help} One of: {', '.join(kind)}.")
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
