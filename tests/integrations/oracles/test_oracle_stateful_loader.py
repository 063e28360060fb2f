"""torchdata's ``StatefulDataLoader`` resumes a rank's CP view in a new process exactly.

This process reads a few micro-batches through a ``StatefulDataLoader`` (2 workers) of
``torch_dataset(0, cp_rank=1)``, saves ``loader.state_dict()`` with torch.save and stops; a new
Python process (`oracle_worker.py resume`) builds a fresh loader, loads the state and reads on.
What the two read, in order, must be the rank's whole stream of CP rank 1 views, each once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import oracle_ports
import pytest

import rolltool

torch = pytest.importorskip("torch")
sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (test extra)")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's own call
def test_resume_in_a_new_process(packs: Callable[..., Any], tmp_path: Path) -> None:
    out = packs("--cp", 2, "--micro-batch-tokens", 40)
    ds = rolltool.open_packed(out)
    stream = [(s, j, v["input_ids"].tolist()) for s, j, v in ds.rank_iter(0, cp_rank=1)]
    assert len(stream) >= 4
    k = len(stream) // 2 | 1  # odd: the next item is the second worker's
    loader = sdl.StatefulDataLoader(ds.torch_dataset(0, cp_rank=1), batch_size=None, num_workers=2)
    it = iter(loader)
    seen = [(int(b["step"]), int(b["micro_batch"]), b["input_ids"].tolist()) for b in (next(it) for _ in range(k))]  # fmt: skip
    state = {"rank": 0, "cp_rank": 1, "num_workers": 2, "loader": loader.state_dict()}
    del it, loader
    torch.save(state, tmp_path / "state.pt")
    (rest,) = oracle_ports.run_gloo("resume", 1, tmp_path, out, tmp_path / "state.pt")
    assert seen + rest == stream
