"""The suite's helpers do not depend on the name ``tests`` being free (issue 21, defect 4).

verl's wheel ships a top-level regular package ``tests``; installed beside rolltool, it wins
over this folder (a directory without ``__init__.py`` is only a namespace portion, and a regular
package anywhere on ``sys.path`` takes precedence), so ``from tests.pack_helpers import ...``
failed. The helpers are imported as top-level modules from this folder (pytest puts the root
conftest's folder first on ``sys.path``), which such a package cannot shadow.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_no_test_module_imports_through_the_name_tests() -> None:
    offenders = []
    for path in sorted(HERE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [
                f"{path.relative_to(HERE)}:{node.lineno}"
                for n in names
                if n == "tests" or n.startswith("tests.")
            ]
    assert offenders == []


def test_the_suite_collects_with_a_foreign_tests_package_installed(tmp_path: Path) -> None:
    # what `pip install verl` does to site-packages: a regular package named `tests`
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("# verl's tests package\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    # the modules that import the shared helpers (collecting all of them takes ~20 s)
    helpers = {p.stem for p in HERE.glob("*.py") if not p.stem.startswith(("test_", "conftest"))}
    users = [
        str(p)
        for p in sorted(HERE.rglob("test_*.py"))
        if p != Path(__file__)
        and re.search(rf"^from (tests\.)?({'|'.join(helpers)}) import", p.read_text(), re.M)
    ]
    assert len(users) >= 3
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *users],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1].lower()
