"""Shared pieces of the thin CLI layer: error handling, JSON output, consoles, progress, and
the parsing of repeated KEY=VALUE options."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import click
from rich.console import Console

from rolltool.errors import RolltoolError
from rolltool.jsonable import jsonable

F = TypeVar("F", bound=Callable[..., Any])

# Results go to stdout, everything else (progress, warnings) to stderr.
out = Console(highlight=False)
if not out.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    out = Console(highlight=False, width=160)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # log lines: never wrapped


def handle_errors(fn: F) -> F:
    """Turn a RolltoolError into `Error: ...` + hint on stderr and exit code 1; options that
    exclude each other (`rolltool.config.OptionConflict`) are a usage error, exit 2.

    Set ROLLTOOL_DEBUG=1 to get the traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from rolltool.config import OptionConflict

        try:
            return fn(*args, **kwargs)
        except RolltoolError as e:
            if os.environ.get("ROLLTOOL_DEBUG"):
                raise
            if isinstance(e, OptionConflict):
                hint = f"\nHint: {e.hint}" if e.hint else ""
                ctx = click.get_current_context(silent=True)
                raise click.UsageError(e.message + hint, ctx) from None
            click.echo(f"Error: {e.message}", err=True)
            if e.hint:
                click.echo(f"Hint: {e.hint}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def print_json(doc: Any) -> None:
    """Print exactly one JSON document on stdout (NaN/inf become null)."""
    sys.stdout.write(json.dumps(jsonable(doc), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    err.print(f"[yellow]Warning:[/yellow] {message}")


T = TypeVar("T")


def progress(items: Iterable[T], total: int | None, description: str) -> Iterator[T]:
    """Iterate with a rich progress bar on stderr, only when stderr is a terminal."""
    if not err.is_terminal:
        yield from items
        return
    from rich.progress import Progress

    with Progress(console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def parse_mapping(pairs: Iterable[str], option: str) -> dict[str, str]:
    """Parse repeated `KEY=VALUE` options; a malformed one, or a KEY given twice, is a usage
    error (exit 2): the last one silently winning would hide a typo."""
    result: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint=option)
        if key in result:
            raise click.BadParameter(
                f"{key} is given twice ({key}={result[key]} and {pair})", param_hint=option
            )
        result[key] = value
    return result


def parse_columns(pairs: Iterable[str]) -> dict[str, str]:
    """`--column NEW=OLD` pairs; one OLD read into two NEWs is a usage error (exit 2) too."""
    from rolltool.source import invert_mapping

    mapping = parse_mapping(pairs, "--column")
    try:
        invert_mapping(mapping)
    except RolltoolError as e:
        raise click.BadParameter(e.message, param_hint="--column") from None
    return mapping
