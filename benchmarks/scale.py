"""Benchmark: scale-out (issue 12): workers, the exchange path, the plan at millions of samples, Ray.

    python benchmarks/scale.py [--groups 2000] [--repeats 3] [--samples 1000000 10000000]
                               [--sections workers exchange plan scan] [--plan-trees DIR ...]
                               [--ray] [--ray-nodes]

Sections (each in fresh processes, on the same synth input, medians of --repeats):
  workers   `rolltool pack IN --dp 8 --batch-size 256` with --workers 1, 2 and 4 (the pack pool
            starts at 4 workers), against the I/O floor of benchmarks/pack.py (read the input
            Parquet, write as many bytes); peak RSS of the driver process (pool workers not
            included: ru_maxrss is per process)
  exchange  --order shuffle with --cache-mb 64 (the input is >= 4x the token cache): the plan's
            read amplification, then the run with --exchange never and --exchange always
  scan      pack's scan (`rolltool.schema.scan_deferred`: light columns and loss_mask; the token
            columns are checked where pack fetches them) with 1 and 2 local workers (row groups
            as forked tasks) and the full scan (every column, one process) for scale: seconds,
            input MB/s, and the driver's own CPU seconds (forked workers not counted: what stays
            on the driver when the row groups are tasks: the fold and the cross-row rules)
  plan      `rolltool.plan.schedule.schedule` on synthetic light columns of N samples (groups of 8,
            log-normal lengths, one env; codes and counts int32 where the tree's scan makes them
            so, `rolltool.schema.rollouts.narrow`, else int64): seconds, the process's peak
            RSS, and per sample what planning adds over the light columns at its peak and what
            the returned plan keeps (RSS); --plan-trees A B ... runs it on other checkouts too (e.g. a `git worktree`
            of an older commit), interleaved, to compare before/after in one run; the last
            column hashes every step's rows and outline: equal on two trees = the same plan
  ray       (--ray) the pack with --engine ray starting its own local cluster, against
            --workers 1; (--ray-nodes) the same job attached to a simulated 2-node cluster
            (ray.cluster_utils.Cluster, 1 CPU per node), overheads included as measured
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
from pack import _floor


def _run(
    cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[float, int, dict]:
    """(seconds, peak RSS MB of the process, its JSON output) of one command in a new process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})}, cwd=cwd or None
        )
        _, status, usage = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status):
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read().decode()[-2000:]}")
        out.seek(0)
        text = out.read()
    return dt, usage.ru_maxrss // 1024, json.loads(text) if text.strip() else {}


def _pack(src: Path, out: Path, *extra: str) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "rolltool", "pack", str(src), "--dp", "8", "-o", str(out),
           "--batch-size", "256", "--force", "--json", *extra]  # fmt: skip
    return _run(cmd)


def _median(runs: list[tuple[float, int, dict]]) -> tuple[float, int, dict]:
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def workers(src: Path, work: Path, repeats: int) -> None:
    print("\n## workers: pack --dp 8 --batch-size 256 (peak RSS of the driver process)")
    print(f"{'mode':<16}{'seconds':>9}{'x floor':>9}{'x one':>8}{'peak MB':>9}")
    floors, rows = [], {}
    for mode in ("--workers 1", "--workers 2", "--workers 4"):
        runs = [_pack(src, work / f"w{i}", *mode.split()) for i in range(repeats)]
        rows[mode] = _median(runs)
        nbytes = sum(f["bytes"] for f in rows[mode][2]["files"].values())
        floors += [_floor(src, nbytes, work / "floor.bin") for _ in range(repeats)]
    floor = statistics.median(floors)
    one = rows["--workers 1"][0]
    print(f"{'I/O floor':<16}{floor:>9.2f}{1.0:>9.2f}{'':>8}{'':>9}")
    for mode, (dt, rss, _) in rows.items():
        print(f"{mode:<16}{dt:>9.2f}{dt / floor:>9.2f}{dt / one:>8.2f}{rss:>9,}")


def exchange(src: Path, work: Path, repeats: int) -> None:
    print("\n## exchange: --order shuffle --cache-mb 64 (the input >= 4x the token cache)")
    print(
        f"{'path':<10}{'seconds':>9}{'amplification':>15}{'read MB':>9}{'needed MB':>11}{'peak MB':>9}"
    )
    for path in ("never", "always"):
        runs = [
            _pack(src, work / f"x{i}", "--order", "shuffle", "--cache-mb", "64", "--exchange", path)
            for i in range(repeats)
        ]
        dt, rss, m = _median(runs)
        r = m["reads"]
        read = (
            r["cached_read_bytes"] if path == "never" else 0
        )  # the exchange reads row groups once
        print(f"{r['path']:<10}{dt:>9.2f}{r['cached_amplification']:>15.1f}{read / 1e6:>9,.0f}"
              f"{r['needed_bytes'] / 1e6:>11,.0f}{rss:>9,}")  # fmt: skip


PLAN = """
import gc, json, os, resource, sys, time
import numpy as np, pyarrow as pa
from rolltool.schema.rollouts import Rollouts
try:  # the layered tree (0.2); --plan-trees may name a checkout from before it
    from rolltool.engine.local import plan_mapper
    from rolltool.input.parquet import InputFile
    from rolltool.plan.config import PackConfig
    from rolltool.plan.schedule import schedule
except ImportError:
    plan_mapper = None
    from rolltool.config import PackConfig
    from rolltool.schedule import schedule
    from rolltool.source import InputFile
def rss():  # bytes resident now
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
try:  # the columns as the tree's scan gives them: int32 codes and counts where they fit
    from rolltool.schema.rollouts import narrow
except ImportError:  # a tree before that: int64
    narrow = lambda a: a.astype(np.int64)
n = int(sys.argv[1]) // 8 * 8
rng = np.random.default_rng(0)
length = narrow(np.clip(rng.lognormal(7.5, 1.0, n), 64, 32768).astype(np.int64))
ro = Rollouts(files=[InputFile("synthetic.parquet", n, resolved="/synthetic.parquet")],
    file_index=np.zeros(n, np.int32), sample_id=pa.array(np.arange(n)),
    group=narrow(np.repeat(np.arange(n // 8), 8)), group_ids=pa.array(np.arange(n // 8)),
    rollout_ids=pa.array(np.arange(n)), rollout=narrow(np.arange(n)), env=np.zeros(n, np.int32),
    env_names=["math"], reward=rng.integers(0, 2, n).astype(np.float64), length=length,
    trainable=narrow((length * 0.6).astype(np.int64)), finished_at=None, token_format="input_ids",
    has_logprobs=False, columns=[])
gc.collect()
light = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
before = rss()
config = PackConfig.from_options(dp=8, batch_size=1024)
def cpu():  # CPU seconds of this process and its finished children
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
t0, c0 = time.perf_counter(), cpu()
if plan_mapper is not None:  # the layered tree hands schedule a mapper; older trees took workers
    kw = {"mapper": plan_mapper(int(sys.argv[2]), ro.num_samples)}
else:
    kw = {"workers": int(sys.argv[2])}
plan = schedule(ro, config, config.workload(), **kw)
dt, cpu_s = time.perf_counter() - t0, cpu() - c0
try:  # which plan: every step's rows and outline (equal hashes = the same plan on two trees)
    import hashlib
    h = hashlib.sha256(plan.rows.tobytes() + plan.row_starts.tobytes())
    for o in plan.outlines:
        h.update(o.sizes.tobytes())
    digest = h.hexdigest()[:16]
except AttributeError:  # a tree before the flat plan
    digest = "-"
gc.collect()
kept = rss() - before
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(json.dumps({"seconds": dt, "cpu": cpu_s, "steps": len(plan.steps), "light_mb": light, "peak_mb": peak,
                  "kept_bytes": kept, "n": n, "hash": digest}))
"""


def plan(sizes: list[int], repeats: int, trees: list[str]) -> None:
    """Per N and workers: medians over `repeats` (runs interleaved over `trees`, "" = this
    checkout). ``cpu s``: CPU seconds of the planning process and its workers (steadier than
    wall time on a shared machine). ``+peak B/s``: the peak over the light columns, per sample; ``kept B/s``: the
    RSS the returned plan holds, per sample; ``B/s``: the whole peak less ~90 MB (interpreter
    and imports), per sample."""
    print("\n## plan: schedule() on synthetic light columns (dp 8, 1,024 rollouts per step)")
    print(f"{'tree':<12}{'samples':>12}{'workers':>8}{'steps':>7}{'seconds':>9}{'cpu s':>7}{'light MB':>10}"
          f"{'peak MB':>9}{'+peak B/s':>10}{'kept B/s':>9}{'B/s':>6}  plan hash")  # fmt: skip
    for n in sizes:
        for w in (1, 2):
            runs: dict[str, list[dict]] = {t: [] for t in trees}
            for _ in range(repeats):
                for t in trees:
                    env = {"PYTHONPATH": t} if t else None
                    runs[t].append(
                        _run([sys.executable, "-c", PLAN, str(n), str(w)], env, cwd=t)[2]
                    )
            for t, rs in runs.items():
                r = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "hash"}
                print(f"{Path(t).name or 'this':<12}{n:>12,}{w:>8}{r['steps']:>7,.0f}"
                      f"{r['seconds']:>9.1f}{r['cpu']:>7.1f}{r['light_mb']:>10,.0f}{r['peak_mb']:>9,.0f}"
                      f"{(r['peak_mb'] - r['light_mb']) * 2**20 / n:>10,.0f}"
                      f"{r['kept_bytes'] / n:>9,.0f}{(r['peak_mb'] - 90) * 2**20 / n:>6,.0f}"
                      f"  {rs[0]['hash']}")  # fmt: skip


SCAN = """
import json, resource, sys, time
import pyarrow as pa
pa.array([0])  # pyarrow's first conversion imports pandas (~0.4 s): not the scan's
from rolltool.engine.local import local_mapper
from rolltool.input.resolve import resolve_inputs
from rolltool.schema import scan, scan_deferred
files = resolve_inputs([sys.argv[1]])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0, c0 = time.perf_counter(), cpu()
if sys.argv[2] == "full":
    scan(files)
else:
    scan_deferred(files, mapper=local_mapper(int(sys.argv[2]), "scanning row groups"))
print(json.dumps({"seconds": time.perf_counter() - t0, "driver_cpu": cpu() - c0}))
"""


def scan_section(src: Path, repeats: int) -> None:
    """pack's scan, serial and as tasks, against the full scan (module docstring)."""
    import pyarrow.parquet as pq

    mb = src.stat().st_size / 1e6
    groups = pq.ParquetFile(src).metadata.num_row_groups
    print(f"\n## scan: {mb:,.0f} MB, {groups} row groups (tasks from 8)")
    print(f"{'scan':<26}{'seconds':>9}{'MB/s':>8}{'driver CPU s':>14}")
    modes = ["1", "2", "full"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            runs[m].append(_run([sys.executable, "-c", SCAN, str(src), m])[2])
    for m in modes:
        dt = statistics.median(r["seconds"] for r in runs[m])
        cpu = statistics.median(r["driver_cpu"] for r in runs[m])
        name = "full (every column)" if m == "full" else f"deferred, {m} worker(s)"
        print(f"{name:<26}{dt:>9.2f}{mb / dt:>8,.0f}{cpu:>14.2f}")


RAY_NODES = """
import json, subprocess, sys, time
from ray.cluster_utils import Cluster
t0 = time.perf_counter()
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
c.add_node(num_cpus=1)
c.wait_for_nodes()
up = time.perf_counter() - t0
cmd = [sys.executable, "-m", "rolltool", "pack", sys.argv[1], "--dp", "8", "-o", sys.argv[2],
       "--batch-size", "256", "--force", "--json", "--engine", "ray", "--ray-address", c.address]
t0 = time.perf_counter()
subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
dt = time.perf_counter() - t0
c.shutdown()
print(json.dumps({"up": up, "seconds": dt}))
"""


def ray(src: Path, work: Path, repeats: int, nodes: bool) -> None:
    print("\n## ray: the same pack on Ray (its own local cluster each run) vs --workers 1")
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    print(f"{'mode':<34}{'seconds':>9}")
    one = _median([_pack(src, work / f"r1-{i}", "--workers", "1") for i in range(repeats)])[0]
    print(f"{'--workers 1':<34}{one:>9.2f}")
    cmd = [sys.executable, "-m", "rolltool", "pack", str(src), "--dp", "8", "-o", str(work / "r"),
           "--batch-size", "256", "--force", "--json", "--engine", "ray"]  # fmt: skip
    dt = statistics.median(_run(cmd, env)[0] for _ in range(repeats))
    print(f"{'--engine ray (local cluster)':<34}{dt:>9.2f}")
    if nodes:
        _, _, r = _run([sys.executable, "-c", RAY_NODES, str(src), str(work / "rn")], env)
        print(f"{'simulated 2 nodes: cluster up':<34}{r['up']:>9.2f}")
        print(f"{'simulated 2 nodes: --engine ray':<34}{r['seconds']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, nargs="*", default=[1_000_000])
    ap.add_argument("--sections", nargs="*", default=["workers", "exchange", "plan"])
    ap.add_argument("--plan-trees", nargs="*", default=[""], help="checkouts for the plan section")
    ap.add_argument("--ray", action="store_true", help="also the ray section")
    ap.add_argument("--ray-nodes", action="store_true", help="and a simulated 2-node cluster")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    src = Path()  # the plan section makes its own light columns
    if args.ray or {"workers", "exchange", "scan"} & set(args.sections):
        src = synth_dataset(args.groups)
        print(f"input: {src} ({src.stat().st_size / 1e6:,.0f} MB)")
    print(f"{os.cpu_count()} CPUs")
    if "workers" in args.sections:
        workers(src, work, args.repeats)
    if "exchange" in args.sections:
        exchange(src, work, args.repeats)
    if "scan" in args.sections:
        scan_section(src, args.repeats)
    if "plan" in args.sections:
        plan(args.samples, args.repeats, args.plan_trees)
    if args.ray:
        ray(src, work, args.repeats, args.ray_nodes)


if __name__ == "__main__":
    main()
