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
            "balance": _balance(r),
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
    # A --cp/--sp pack's rows also hold its layout's padding: compare the samples' own tokens.
    real = [r["split"]["real_tokens"] if "split" in r else r["tokens"] for r in reports]
    same = len({(line["samples"], n) for line, n in zip(lines, real, strict=True)}) == 1
    return {"lines": lines, "best": best, "same_input": same}


def _balance(report: Mapping[str, Any]) -> str | None:
    """The workload a directory was balanced on, and its --cp/--sp layout: ``flops (cp 2)``."""
    kind = report["workload"]["kind"] if report.get("workload") else None
    split = report.get("split")
    return f"{kind} ({split['kind']} {split['size']})" if split else kind
