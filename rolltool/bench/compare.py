"""Side by side: several packed directories of the same input (e.g. different ``--balance``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TIMES = ("dp_time", "lockstep_time")


def compare(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One line per report with its totals; ``best`` gives the index of the fastest
    directory per time, and each line lists the times it is best at.

    ``same_input`` is False when the runs did not replay the same number of samples and tokens
    (then the comparison is not like for like).
    """
    lines = []
    for r in reports:
        t = r["total"]
        lines.append({
            "path": r["path"],
            "balance": r["workload"]["kind"] if r.get("workload") else None,
            "steps": t["steps"],
            "rows": len(r["rows"]),
            "samples": r["samples"],
            "tokens": r["tokens"],
            "dp_time": t["dp_time"],
            "lockstep_time": t["lockstep_time"],
            "ideal_time": t["ideal_time"],
            "dp_efficiency": t["dp_efficiency"],
            "lockstep_efficiency": t["lockstep_efficiency"],
            "tflops": r["throughput"]["tflops"],
        })  # fmt: skip
    best = {key: min(range(len(lines)), key=lambda i: lines[i][key]) for key in TIMES}
    for i, line in enumerate(lines):
        line["best"] = [key for key in TIMES if best[key] == i]
    same = len({(line["samples"], line["tokens"]) for line in lines}) == 1
    return {"lines": lines, "best": best, "same_input": same}
