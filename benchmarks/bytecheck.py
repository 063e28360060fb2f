"""Check: the bytes of ten pack commands on two checkouts, file by file, and what changed in each step.

    python benchmarks/bytecheck.py OLD NEW [--out DIR]

OLD and NEW are checkouts (e.g. ``git worktree add /tmp/old c075061``). Each tree packs, with its
own ``rolltool`` (``PYTHONPATH=TREE``, run from DIR so the current checkout is not imported), the
commands earlier sessions checked: the example data with ``--dp 8`` and ``--dp 2 --cp 2``, and a
200-group synth input with ``--dp 8`` (lockstep), ``--align total``, ``--align lockstep``,
``--cp 4 --row-len 8192``, ``--sp 2``, ``--equal-count-trim``, ``--hybrid-cp`` (dp 2, cp 4) and
``--share-prefix``. Then per command: how many shards differ, whether samples.parquet does, and
whether the manifest does once paths, ``created_at`` and the command line are set aside; where it
does, how many steps changed and whether each changed step's recorded cost (lockstep overhead or
imbalance) went down or up, and any step whose micro-batch count changed; and whether each
tree's ``rolltool stats DIR --json`` of its own pack says the same (paths set aside; it re-plans
each step's token and count alternatives, so a deliberate change of the plan shows there too).
A change that does not come from a deliberate change of the plan is a regression.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.parquet"
COMMANDS: dict[str, tuple[str, list[str]]] = {
    "ex_dp8": ("example", ["--dp", "8"]),
    "ex_dp2cp2": ("example", ["--dp", "2", "--cp", "2"]),
    "s_dp8": ("synth", ["--dp", "8"]),
    "s_total": ("synth", ["--dp", "8", "--align", "total"]),
    "s_lockstep": ("synth", ["--dp", "8", "--align", "lockstep"]),
    "s_cp4": ("synth", ["--dp", "8", "--cp", "4", "--row-len", "8192"]),
    "s_sp2": ("synth", ["--dp", "8", "--sp", "2"]),
    "s_trim": ("synth", ["--dp", "8", "--equal-count-trim"]),
    "s_hybrid": ("synth", ["--dp", "2", "--cp", "4", "--hybrid-cp"]),
    "s_prefix": ("synth", ["--dp", "8", "--share-prefix"]),
}


def rolltool(tree: Path, cwd: Path, *args: str) -> str:
    """Run `tree`'s ``rolltool ARGS`` from `cwd`; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "rolltool", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"failed ({tree}): {' '.join(args)}\n{done.stderr[-2000:]}")
    return done.stdout


def pack_all(tree: Path, out: Path, synth: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    check = "import rolltool, sys; assert rolltool.__file__.startswith(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-c", check, str(tree)], cwd=out.parent, env=env, check=True)
    for name, (data, args) in COMMANDS.items():
        source = EXAMPLE if data == "example" else synth
        rolltool(tree, out.parent, "pack", str(source), *args, "-o", str(out / name), "--force")
        report = rolltool(tree, out.parent, "stats", str(out / name), "--json")
        (out / f"{name}.stats.json").write_text(report.replace(str(out / name), "ROOT"))


def _manifest(path: Path) -> dict[str, Any]:
    doc = json.loads(json.dumps(json.loads((path / "manifest.json").read_text())).replace(
        str(path), "ROOT"))  # fmt: skip
    doc.pop("created_at", None)
    doc.pop("command", None)
    return doc


def _same(old: Path, new: Path, name: str) -> bool:
    return (old / name).read_bytes() == (new / name).read_bytes()


def compare(old: Path, new: Path) -> None:
    for name in COMMANDS:
        a, b = old / name, new / name
        files = {str(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
        files |= {str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()}
        differ = [
            f for f in sorted(files - {"manifest.json"})
            if not (a / f).is_file() or not (b / f).is_file()
            or (a / f).read_bytes() != (b / f).read_bytes()
        ]  # fmt: skip
        shards = sum(f.endswith(".safetensors") for f in differ)
        ma, mb = _manifest(a), _manifest(b)
        samples = "differs" if "samples.parquet" in differ else "same"
        stats = "same" if _same(old, new, f"{name}.stats.json") else "differs"
        print(f"{name:11}  {len(files):4} files  {shards:3} shards differ  samples.parquet {samples}"
              f"  manifest {'same' if ma == mb else 'differs'}  stats {stats}")  # fmt: skip
        if ma == mb:
            continue
        steps_a, steps_b = ma.get("steps", []), mb.get("steps", [])
        changed = [i for i, (x, y) in enumerate(zip(steps_a, steps_b)) if x != y]  # noqa: B905
        lower = higher = 0
        for i in changed:
            pa_, pb = steps_a[i]["plan"], steps_b[i]["plan"]
            key = "lockstep_overhead_cost" if pa_["align"] == "lockstep" else "imbalance_cost"
            lower += pb[key] < pa_[key]
            higher += pb[key] > pa_[key]
            if pa_["micro_batches_per_rank"] != pb["micro_batches_per_rank"]:
                print(f"    step {i}: micro-batches {pa_['micro_batches_per_rank']} -> "
                      f"{pb['micro_batches_per_rank']}")  # fmt: skip
        other = sorted(k for k in set(ma) | set(mb) if k != "steps" and ma.get(k) != mb.get(k))
        print(f"    steps: {len(steps_a)} -> {len(steps_b)}, {len(changed)} changed: recorded cost "
              f"lower in {lower}, higher in {higher}; other keys that differ: {other}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rolltool-bytecheck")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    synth = args.out / "synth200.parquet"
    if not synth.exists():
        rolltool(args.old.resolve(), args.out, "synth", "--groups", "200", "-o", str(synth))
    for side, tree in (("old", args.old), ("new", args.new)):
        pack_all(tree.resolve(), args.out / side, synth)
    compare(args.out / "old", args.out / "new")


if __name__ == "__main__":
    main()
