"""Benchmark: how long the `rolltool` command takes to start, against importing what it needs.

    python benchmarks/startup.py [--repeats 7]

Runs each command as a fresh process (``sys.executable``), the commands interleaved, ``--repeats``
rounds after one warm-up round, and prints the median wall and CPU time of each and what a
``-X importtime`` run of it imports (modules, and whether torch, pyarrow's S3 filesystem, polars
or pyarrow are among them). The children may write bytecode (``PYTHONDONTWRITEBYTECODE`` is
dropped from their environment), as an installed package has it: a checkout without
``__pycache__`` would otherwise compile rolltool's modules at every start (~0.1 s).

  python -c pass                      the interpreter alone
  python -c "import polars, json"     the floor issue 25 compares with
  rolltool --version / --help         the group: no subcommand's implementation imported
  rolltool stats --help               one subcommand's options
  rolltool stats PACKED --json        stats of a small packed directory (made on first use)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _data import synth_dataset

HEAVY = ("torch", "pyarrow._s3fs", "polars", "pyarrow")


def small_pack() -> Path:
    out = Path(tempfile.gettempdir()) / "rolltool-bench-startup-packed"
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "rolltool", "pack", str(synth_dataset(64)), "-o", str(out),
               "--dp", "2", "--batch-size", "64", "--keep-last", "--force"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def commands() -> dict[str, list[str]]:
    py, rt = [sys.executable], [sys.executable, "-m", "rolltool"]
    return {
        "python -c pass": [*py, "-c", "pass"],
        'python -c "import polars, json"': [*py, "-c", "import polars, json"],
        "rolltool --version": [*rt, "--version"],
        "rolltool --help": [*rt, "--help"],
        "rolltool stats --help": [*rt, "stats", "--help"],
        "rolltool stats PACKED --json": [*rt, "stats", str(small_pack()), "--json"],
    }


def imported(cmd: list[str]) -> list[str]:
    """The modules `cmd` imports (``python -X importtime``, read from stderr)."""
    run = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True,
                         check=True)  # fmt: skip
    names = []
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.append(line.rsplit("|", 1)[1].strip())
    return names[1:]  # the header line's "package"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    cmds = commands()
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    for round_ in range(args.repeats + 1):
        for name, cmd in cmds.items():
            start, used = time.perf_counter(), _children_cpu()
            subprocess.run(cmd, check=True, capture_output=True, env=env)
            if round_:  # round 0 warms the page cache and writes bytecode
                times[name].append(time.perf_counter() - start)
                cpu[name].append(_children_cpu() - used)
    floor = statistics.median(times['python -c "import polars, json"'])
    print(f"{'command':34s} {'median s':>9s} {'x floor':>8s} {'CPU s':>6s} {'modules':>8s}  "
          "heavy imports")  # fmt: skip
    for name, cmd in cmds.items():
        mods = imported(cmd)
        heavy = [h for h in HEAVY if h in mods]
        t, c = statistics.median(times[name]), statistics.median(cpu[name])
        print(f"{name:34s} {t:9.3f} {t / floor:8.2f} {c:6.3f} {len(mods):8d}  "
              f"{', '.join(heavy) or '-'}")  # fmt: skip


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


if __name__ == "__main__":
    main()
