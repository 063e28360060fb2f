"""`rolltool verify`: check a packed directory's files, records and (optionally) its input."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rolltool.cli._common import handle_errors, out, print_json, warn
from rolltool.errors import RolltoolError
from rolltool.storage.fs import is_remote, locate


def _check_packed_path(path: str) -> None:
    """A file where a packed directory is expected is named as such, before anything opens it
    (the reader would only say "no such directory")."""
    p = Path(path)
    if p.is_file() if not is_remote(path) else locate(path).is_file():
        hint = (
            f"verify checks what `rolltool pack {path} -o DIR` wrote: give DIR; to look at "
            f"rollout Parquet, run `rolltool stats {path}`"
            if p.suffix == ".parquet"
            else "give the directory `rolltool pack -o DIR` wrote"
        )
        raise RolltoolError(f"{path}: is a file, not a packed directory", hint=hint)


@click.command(short_help="Check a packed directory's hashes and invariants.")
@click.argument("path", type=click.Path())
@click.option("--no-hash", is_flag=True, help="Skip sha256 checks (sizes are still checked).")
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="PATH",
    help="Compare tokens, loss mask and logprobs with this input (files, directories or globs; "
    "repeatable). Default: the input files the manifest records, when they are all found.",
)
@click.option("--no-input", is_flag=True, help="Do not read the input, even where it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@handle_errors
def verify(
    path: str, no_hash: bool, inputs: tuple[str, ...], no_input: bool, as_json: bool
) -> None:
    """Check a packed directory: hashes, every layout invariant, every sample's length, trainable
    tokens, advantage and loss weight against samples.parquet and the aggregation formula, the
    step counts and denominators, and the tokens against the input. Exit 1 if anything is off."""
    from rolltool.verify import run_verify

    if inputs and no_input:
        raise click.UsageError("--input and --no-input exclude each other")
    _check_packed_path(path)
    report = run_verify(
        path, hashes=not no_hash, inputs=list(inputs) or None, recorded_inputs=not no_input
    )
    for note in report.notes:
        warn(note)
    if report.input.startswith("not found"):
        warn(
            f"tokens NOT compared with the input: the recorded input is {report.input} "
            "(give --input PATH, or --no-input to skip the comparison)"
        )
    if as_json:
        print_json(report.to_json())
    elif report.ok:
        c = report.checked
        compared = (
            f", {c['input_samples']} compared with the input"
            if "input_samples" in c
            else ", tokens not compared with the input"
        )
        out.print(
            f"OK: {c.get('files', 0)} files, {c.get('steps', 0)} steps, {c.get('rows', 0)} "
            f"rows, {c.get('segments', 0)} samples checked{compared}"
        )
    else:
        out.print(f"FAILED: {report.problems.count} problem(s) in {path}", markup=False)
        for line in report.problems.lines():
            out.print(f"  {line}", markup=False)
    if not report.ok:
        sys.exit(1)
