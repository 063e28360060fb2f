"""Shared pieces of the thin CLI layer: error handling, JSON output, consoles, progress, and
the parsing of repeated KEY=VALUE options."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from rich.console import Console

from rolltool.cli.progress import progress as progress_on
from rolltool.errors import RolltoolError

F = TypeVar("F", bound=Callable[..., Any])

# Results go to stdout, everything else (progress, warnings) to stderr.
out = Console(highlight=False)
if not out.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
    out = Console(highlight=False, width=160)  # piped, no COLUMNS: do not squeeze into 80
err = Console(stderr=True, highlight=False, soft_wrap=True)  # log lines: never wrapped


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP), raised in the main thread like SIGINT's KeyboardInterrupt, so that
    the same clean-up runs (temporary outputs removed, a --force swap held until it completes)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


EXIT_SIGINT = 130
"""Exit code of a command stopped by SIGINT, as shells report it (128 + signal): 130; SIGTERM
gives 143, SIGHUP 129."""

_OS_HINTS = {
    errno.ENOSPC: "free some space, or write the output elsewhere with -o",
    errno.EDQUOT: "free some space, or write the output elsewhere with -o",
    errno.EFBIG: "a file-size limit (ulimit -f) stopped the write; raise it, or pass a "
    "smaller --shard-mb to pack",
    errno.EACCES: "check the permissions of that path (it may belong to another user)",
    errno.EPERM: "check the permissions of that path (it may belong to another user)",
    errno.EROFS: "write the output to a writable file system with -o",
}


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def _interrupted(e: KeyboardInterrupt) -> int:
    """Say what an interrupt left, and the exit code for it."""
    from rolltool.storage.outputs import committed

    signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
    name = signal.Signals(signum).name
    if committed:
        click.echo(f"Interrupted by {name} after {committed[-1]} was written (complete).", err=True)
    else:
        click.echo(f"Interrupted by {name}: no output was written.", err=True)
    return 128 + int(signum)


def _os_error(e: OSError) -> None:
    """One line naming the path for a failure of the environment (disk full, permissions)."""
    reason = e.strerror or str(e).splitlines()[0]
    where = e.filename if e.filename is not None else None
    click.echo(f"Error: {where}: {reason}" if where else f"Error: {reason}", err=True)
    hint = _OS_HINTS.get(e.errno) if e.errno is not None else None
    if hint:
        click.echo(f"Hint: {hint}", err=True)


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Terminated` for the block, unless ignored (``nohup``): main
    thread only, the previous handlers restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, _raise_terminated)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def handle_errors(fn: F) -> F:
    """Turn a RolltoolError into `Error: ...` + hint on stderr and exit code 1; options that
    exclude each other (`rolltool.plan.config.OptionConflict`) are a usage error, exit 2. An OSError
    (disk full, permission denied) is one line naming the path, exit 1. SIGINT exits 130 and
    SIGTERM 143, after the same clean-up, saying whether the output was written.

    Set ROLLTOOL_DEBUG=1 to get the traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from rolltool.errors import OptionConflict

        try:
            with _sigterm_raises():
                return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            sys.exit(_interrupted(e))
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
        except OSError as e:
            if os.environ.get("ROLLTOOL_DEBUG"):
                raise
            _os_error(e)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def print_json(doc: Any) -> None:
    """Print exactly one JSON document on stdout (NaN/inf become null)."""
    from rolltool.util.jsonable import jsonable  # imports numpy: not on a command's --help

    sys.stdout.write(json.dumps(jsonable(doc), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    err.print(f"[yellow]Warning:[/yellow] {message}")


T = TypeVar("T")


def progress(
    items: Iterable[T],
    total: int | None,
    description: str,
    *,
    size: Callable[[T], int] | None = None,
    unit: str = "tokens",
) -> Iterator[T]:
    """Iterate telling stderr how far the loop is (`rolltool.cli.progress`): a bar on a
    terminal, a line every 30 s in a log; `size(item)` counts `unit`s for the rate."""
    return progress_on(err, items, total, description, size=size, unit=unit)


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
    mapping = parse_mapping(pairs, "--column")
    if not mapping:  # no --column: the input reader is not imported for nothing
        return mapping
    from rolltool.input.parquet import invert_mapping

    try:
        invert_mapping(mapping)
    except RolltoolError as e:
        raise click.BadParameter(e.message, param_hint="--column") from None
    return mapping
