"""`rolltool verify` of ``--share-prefix`` packs (issue 24): a good pack passes with every
sample compared with the input (reassembled from its chain), and each forgery, hashes updated,
is reported under its kind: a prefix token (every sample through it differs from the input), a
prefix's weight or parent or advantage (``row.shared``), a continuation's weight
(``sample.weight``), a plan figure (``step.plan``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack
from shared_helpers import shared_rollouts
from verify_helpers import edit_manifest, edit_shard, kinds, shards

from rolltool.verify import verify

ARGS = ("--dp", 2, "--share-prefix", "--batch-size", 9, "--micro-batch-tokens", 1024)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(input, pack): agent branches with a trained trunk, trees cut by a 1,024-token budget."""
    root = tmp_path_factory.mktemp("vshared")
    table = shared_rollouts(groups=4, rollouts=3, branches=3, identical=1, seed=2,
                            prompt=(150, 300), trajectory=(80, 120))  # fmt: skip
    pq.write_table(table, root / "in.parquet")
    pack(root / "in.parquet", root / "p", *ARGS)
    return root / "in.parquet", root / "p"


def _copy(packed: tuple[Path, Path], tmp_path: Path) -> Path:
    shutil.copytree(packed[1], tmp_path / "p")
    return tmp_path / "p"


def _prefix_shard(out: Path) -> tuple[str, int, int]:
    """(shard, first prefix segment with trained tokens, its first child) of the pack."""
    from rolltool.format.shards import read_shard

    for name in shards(out):
        a = read_shard(out / name)
        par = a["seg_parent"]
        cu = np.concatenate([[0], np.cumsum(a["seq_lens"].astype(np.int64))])
        for j in np.flatnonzero(par >= 0).tolist():
            p = int(par[j]) + int(
                a["row_segments"][np.searchsorted(a["row_segments"], j, "right") - 1]
            )
            if a["loss_mask"][cu[p] + 1 : cu[p + 1]].any():
                return name, p, j
    raise AssertionError("no trained prefix")


def test_a_shared_pack_verifies(packed: tuple[Path, Path]) -> None:
    report = verify(packed[1], inputs=[packed[0]])
    assert report["ok"], report["problems"]
    assert report["input"] == "compared"
    assert report["checked"]["segments"] == report["checked"]["input_samples"] > 0


def test_a_forged_prefix_token_is_every_sample_s(packed: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(packed, tmp_path)
    name, p, _ = _prefix_shard(out)

    def forge(a: dict[str, np.ndarray]) -> None:
        at = int(a["seq_lens"][:p].astype(np.int64).sum()) + 3
        a["input_ids"][at] += 1

    edit_shard(out, name, forge)
    found = kinds(out, inputs=[packed[0]])
    assert found.get("input.input_ids", 0) >= 2  # every sample through the prefix


FORGERIES: dict[str, tuple[Any, str]] = {
    "prefix weight": (lambda a, p, j: a["seg_weight"].__setitem__(p, a["seg_weight"][p] * 2),
                      "row.shared"),
    "prefix advantage": (lambda a, p, j: a["seg_advantage"].__setitem__(p, 7.0), "row.shared"),
    "prefix sample": (lambda a, p, j: a["sample_index"].__setitem__(p, a["sample_index"][j] + 1),
                      "row.shared"),
    "parent": (lambda a, p, j: a["seg_parent"].__setitem__(j, j - int(a["row_segments"][
        np.searchsorted(a["row_segments"], j, "right") - 1])), "shard.corrupt"),
    "continuation weight": (lambda a, p, j: a["seg_weight"].__setitem__(j, a["seg_weight"][j] * 3),
                            "sample.weight"),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(FORGERIES))
def test_a_forged_shared_row_is_reported(
    packed: tuple[Path, Path], tmp_path: Path, what: str
) -> None:
    out = _copy(packed, tmp_path)
    name, p, j = _prefix_shard(out)
    forge, kind = FORGERIES[what]
    edit_shard(out, name, lambda a: forge(a, p, j))
    found = kinds(out, inputs=[packed[0]])
    assert kind in found, found


def test_a_forged_plan_figure_is_reported(packed: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(packed, tmp_path)

    def forge(m: dict[str, Any]) -> None:
        m["steps"][0]["plan"]["shared"]["tokens"] += 1

    edit_manifest(out, forge)
    assert "step.plan" in kinds(out, inputs=[packed[0]])
