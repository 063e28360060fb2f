"""`rolltool verify` finds the input it was packed from, says when it cannot, and refuses a
malformed manifest with one clear error (issue 9, defects 3 and 6).

Defect 3: input paths were recorded as typed (relative), so verify run from another directory
silently skipped the token comparison and still said OK. Defect 6: a manifest that is JSON but
not an object (or has a wrongly typed key) crashed reader, verify and stats with a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, pack
from verify_helpers import ARGS, edit_manifest

import rolltool
from rolltool.errors import RolltoolError
from rolltool.input.synth import SynthConfig, generate
from rolltool.verify import verify


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tmp/in.parquet packed into tmp/packed from inside tmp, with the relative input path."""
    tmp = tmp_path_factory.mktemp("input")
    pq.write_table(generate(SynthConfig(groups=6, seed=5, max_len=2048)), tmp / "in.parquet")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        pack(Path("in.parquet"), Path("packed"), *ARGS)
    return tmp


@pytest.fixture
def tree(made: Path, tmp_path: Path) -> Path:
    """A copy of `made` (input and packed directory side by side) and an unrelated cwd."""
    shutil.copytree(made, tmp_path / "tree")
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "tree"


def _compared(out: Path, inputs: list[Path] | None = None) -> None:
    result = cli("verify", out, *[a for p in inputs or [] for a in ("--input", p)])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "compared with the input" in result.stdout and not result.stderr
    report = verify(out, inputs=inputs)
    assert report["input"] == "compared"
    assert report["checked"]["input_samples"] == report["checked"]["segments"] > 0


def test_verify_from_another_directory_compares_with_the_input(
    made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _compared(made / "packed")


@pytest.mark.parametrize("recorded", ["in.parquet", "tree/in.parquet"])
def test_an_old_relative_path_is_resolved_beside_the_pack_then_here(
    tree: Path, monkeypatch: pytest.MonkeyPatch, recorded: str
) -> None:
    """Manifests written before paths were resolved: against the packed directory's parent,
    then the current directory."""

    def relative(m: dict[str, Any]) -> None:
        m["inputs"][0]["path"] = recorded
        m["inputs"][0].pop("given", None)

    edit_manifest(tree / "packed", relative)
    monkeypatch.chdir(tree.parent)
    _compared(tree / "packed")
    monkeypatch.chdir(tree.parent / "elsewhere")
    if recorded == "in.parquet":
        _compared(tree / "packed")
    else:
        assert verify(tree / "packed")["input"] == f"not found: {recorded}"


def test_a_moved_input_is_said_loudly(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = str(tree / "in.parquet")  # as pack records it: resolved, and as given
    edit_manifest(
        tree / "packed", lambda m: m["inputs"][0].update(path=recorded, given="in.parquet")
    )
    (tree / "in.parquet").rename(tree.parent / "moved.parquet")
    monkeypatch.chdir(tree.parent / "elsewhere")
    result = cli("verify", tree / "packed")
    assert result.exit_code == 0  # the records agree; the tokens were not compared
    assert "tokens not compared with the input" in result.stdout
    assert "tokens NOT compared with the input" in result.stderr and recorded in result.stderr
    report = json.loads(cli("verify", tree / "packed", "--json").stdout)
    assert report["input"] == f"not found: {recorded}" and report["ok"]
    assert "input_samples" not in report["checked"]
    quiet = cli("verify", tree / "packed", "--no-input")
    assert quiet.exit_code == 0 and not quiet.stderr
    assert verify(tree / "packed", recorded_inputs=False)["input"] == "skipped"
    _compared(tree / "packed", [tree.parent / "moved.parquet"])


# -- malformed manifests: one clear error, never a traceback ---------------------------------------


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda m: [], "a JSON array, not an object"),
        (lambda m: {**m, "dp": "2"}, "'dp' must be an integer"),
        (lambda m: {**m, "steps": {}}, "'steps' must be an array"),
        (lambda m: {**m, "config": {**m["config"], "row_len": "x"}}, "'config.row_len'"),
    ],
)
def test_a_malformed_manifest_is_one_clear_error(tree: Path, write: Any, words: str) -> None:
    path = tree / "packed" / "manifest.json"
    path.write_text(json.dumps(write(json.loads(path.read_text()))))
    for args in ((), ("--json",), ("--no-input", "--no-hash")):
        result = cli("verify", tree / "packed", *args)
        assert result.exit_code == 1 and not result.stdout
        first = result.stderr.splitlines()[0]
        assert first.startswith("Error: ") and "manifest.json" in first and words in first
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "words"),
    [("[]", "a JSON array, not an object"), ("{", "unreadable manifest"), ("7", "a JSON number")],
)
def test_the_reader_refuses_a_malformed_manifest(tree: Path, text: str, words: str) -> None:
    (tree / "packed" / "manifest.json").write_text(text)
    with pytest.raises(RolltoolError, match=words):
        rolltool.open_packed(tree / "packed")
    result = cli("verify", tree / "packed")
    assert result.exit_code == 1 and words in result.stderr and "Traceback" not in result.stderr
