"""The oracle tests' input: three steps of hand-made rollouts chosen so that the packs hold
rows of one long sample, rows of several short ones, and (with ``--dp 2``) empty micro-batches
(a rank with fewer samples than the other still steps as often), plus one sample trained from
its first token (no prompt).

``packs(name, *args)`` packs it (``--dp 2 --batch-size 3``, the per-GPU budget given) once per
session and returns the directory, or the CLI's Result when pack refused the arguments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, rollouts

GROUPS = (
    G("math", [1, 0, 1], [70, 66, 75]),  # 3 long samples over 2 ranks: one rank steps empty
    G("code", [0, 1, 1, 0, 1], [9, 23, 5, 14, 31]),  # several samples per row
    G("chat", [1, 0, 0], [17, 12, 26]),
)
NO_PROMPT = 9  # sample_index of the sample whose loss mask starts at its first token


@pytest.fixture(scope="session")
def oracle_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    table = rollouts(GROUPS, seed=21)
    masks = table.column("loss_mask").to_pylist()
    masks[NO_PROMPT] = [True] * len(masks[NO_PROMPT])
    i = table.schema.get_field_index("loss_mask")
    table = table.set_column(i, "loss_mask", pa.array(masks, pa.list_(pa.bool_())))
    path = tmp_path_factory.mktemp("oracle_input") / "in.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="session")
def packs(oracle_input: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    root = tmp_path_factory.mktemp("oracle_packs")
    made: dict[tuple[Any, ...], Any] = {}

    def pack(*args: Any) -> Any:
        if args not in made:
            out = root / f"p{len(made)}"
            result = cli("pack", oracle_input, "-o", out, "--dp", 2, "--batch-size", 3,
                         *args, "--json")  # fmt: skip
            assert "Traceback" not in result.stderr
            made[args] = out if result.exit_code == 0 else result
        return made[args]

    return pack
