"""``rolltool pack --hybrid-cp`` (issue 22): the option, its refusals, what the manifest
records, and what it leaves alone.

A hybrid pack records ``hybrid_cp`` and the ring settings in its config, each step's per-GPU
figures in its plan, and is format version 3 (a reader of versions 1-2 would serve its rows as
plain ``--cp`` rows); every other pack's manifest is byte for byte what it was before the option
existed: the new keys are omitted at their defaults (`rolltool.format.codec.OMIT_DEFAULT`), and
a manifest without them loads with the defaults.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import cli, pack

import rolltool
from rolltool.errors import OptionConflict, RolltoolError
from rolltool.format import Manifest, to_json
from rolltool.format.shards import file_record, read_shard
from rolltool.input.synth import SynthConfig, generate
from rolltool.plan.config import DEFAULT_CP_LINK_BANDWIDTH, DEFAULT_GPU_TFLOPS, PackConfig
from rolltool.plan.hybrid import RingModel, gpu_tokens
from rolltool.plan.workload import make_workload

LONG = ("--batch-size", 16, "--micro-batch-tokens", 1024)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory, synth_path_module: Path) -> Path:
    out = tmp_path_factory.mktemp("hy") / "p"
    pack(synth_path_module, out, "--dp", 2, "--cp", 4, "--hybrid-cp", *LONG,
         "--cp-link-bandwidth", 50, "--gpu-tflops", 300)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def synth_path_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 synthetic groups of samples up to 3,000 tokens: several over a 1,024-token GPU."""
    path = tmp_path_factory.mktemp("in") / "in.parquet"
    pq.write_table(generate(SynthConfig(groups=16, seed=1, max_len=3000)), path)
    return path


def test_a_hybrid_manifest_records_the_option_and_the_ring(hybrid: Path) -> None:
    doc = json.loads((hybrid / "manifest.json").read_text())
    assert doc["format_version"] == 3
    c = doc["config"]
    recorded = (c["cp"], c["hybrid_cp"], c["cp_link_bandwidth"], c["gpu_tflops"])
    assert recorded == (4, True, 50.0, 300.0)
    m = rolltool.open_packed(hybrid).manifest
    for st in m.steps:
        h = st.plan.hybrid
        assert h is not None and h.gpus == 8 and h.lockstep_overhead >= 1.0
        assert sum(h.split_samples.values()) == st.samples
        assert sum(h.split_tokens.values()) == st.sampled_tokens
        assert st.plan.max_tokens == 4 * 1024 and st.plan.workload is not None
        assert len({r.micro_batches for r in st.ranks}) == 1  # equal counts on every rank
    assert any("2" in st.plan.hybrid.split_samples or "4" in st.plan.hybrid.split_samples
               for st in m.steps if st.plan.hybrid)  # fmt: skip
    r = cli("verify", hybrid)
    assert r.exit_code == 0, r.stdout


def test_the_plan_prices_the_ring_with_the_recorded_settings(hybrid: Path) -> None:
    """Each step's recorded per-GPU lockstep overhead is the one the recorded settings give
    (verify recomputes it; here directly from a step's rows, the slow way)."""
    ds = rolltool.open_packed(hybrid)
    m = ds.manifest
    wl = make_workload("flops")
    ring = RingModel.for_workload(wl, bandwidth=50e9, speed=300e12)
    for step, st in enumerate(m.steps):
        per_gpu = np.zeros((m.dp * 4, st.plan.micro_batches_per_rank))
        for rank in range(m.dp):
            for j, row in enumerate(ds.micro_batches(step, rank)):
                lens = np.diff(row["cu_seqlens"])
                for q, i in enumerate(row["sample_index"].tolist()):
                    if i < 0:
                        continue
                    a = int(row["cp_start"][q])
                    k = int(row["cp_groups"][a])
                    n = np.array([lens[q]])
                    padded = gpu_tokens(n, np.array([k])) * k if k > 1 else n
                    c = wl.cost(padded)[0] / k + ring.exposed(n, np.array([k]), wl.b)[0]
                    per_gpu[rank * 4 + a : rank * 4 + a + k, j] += c
        want = per_gpu.max(axis=0).sum() / (per_gpu.sum() / len(per_gpu))
        assert st.plan.hybrid is not None
        assert st.plan.hybrid.lockstep_overhead == pytest.approx(want, rel=1e-9)


def test_hybrid_loss_weights_equal_the_plain_cp_pack(hybrid: Path, synth_path_module: Path,
                                                     tmp_path: Path) -> None:  # fmt: skip
    plain = tmp_path / "cp"
    pack(synth_path_module, plain, "--dp", 2, "--cp", 4, *LONG)
    a, b = pq.read_table(hybrid / "samples.parquet"), pq.read_table(plain / "samples.parquet")
    for col in ("sample_index", "step", "status", "advantage", "token_loss_weight"):
        assert a.column(col).equals(b.column(col)), col
    ma, mb = rolltool.open_packed(hybrid).manifest, rolltool.open_packed(plain).manifest
    for x, y in zip(ma.steps, mb.steps, strict=True):
        assert x.denominators == y.denominators and x.loss_weight_sum == y.loss_weight_sum


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (("--cp", 3, "--hybrid-cp"), 2, ["--hybrid-cp", "power of two", "--cp 3"]),
        (("--cp", 1, "--hybrid-cp"), 2, ["--hybrid-cp", "power of two"]),
        (("--sp", 2, "--cp", 2, "--hybrid-cp"), 2, ["--sp or --cp"]),
        (("--cp", 2, "--hybrid-cp", "--micro-batch-size", 2), 2, ["--micro-batch-size"]),
        (("--cp", 2, "--hybrid-cp", "--align", "total"), 2, ["--align total"]),
        (("--cp", 2, "--hybrid-cp", "--equal-count"), 2, ["--equal-count"]),
        (("--cp", 2, "--gpu-tflops", 100), 2, ["--gpu-tflops", "--hybrid-cp only"]),
        (("--cp", 2, "--hybrid-cp", "--cp-link-bandwidth", 0), 2, ["--cp-link-bandwidth"]),
    ],
)
def test_options_refused(synth_path_module: Path, tmp_path: Path, args: tuple, code: int,
                         words: list[str]) -> None:  # fmt: skip
    r = cli("pack", synth_path_module, "-o", tmp_path / "x", "--dp", 2, "--batch-size", 16,
            "--micro-batch-tokens", 4096, *args)  # fmt: skip
    assert r.exit_code == code, r.output
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert not (tmp_path / "x").exists()


def test_config_resolves_the_ring_settings_once() -> None:
    c = PackConfig(dp=2, cp=4, hybrid_cp=True)
    assert (c.cp_link_bandwidth, c.gpu_tflops) == (DEFAULT_CP_LINK_BANDWIDTH, DEFAULT_GPU_TFLOPS)
    rec = to_json(c.record())
    assert rec["hybrid_cp"] is True and rec["cp_link_bandwidth"] == DEFAULT_CP_LINK_BANDWIDTH
    plain = to_json(PackConfig(dp=2, cp=4).record())
    assert not {"hybrid_cp", "cp_link_bandwidth", "gpu_tflops"} & set(plain)
    with pytest.raises(OptionConflict, match="--cp-link-bandwidth applies to --hybrid-cp only"):
        PackConfig(dp=2, cp=4, cp_link_bandwidth=10.0)


# -- what the option leaves alone --------------------------------------------------------------


def test_packs_without_the_option_carry_no_new_key(synth_path_module: Path, tmp_path: Path) -> None:
    """A plain --cp pack's manifest has none of the hybrid keys (config, plans), is format
    version 1, and loads; its config reads back with the defaults."""
    out = tmp_path / "cp"
    pack(synth_path_module, out, "--dp", 2, "--cp", 4, *LONG)
    text = (out / "manifest.json").read_text()
    doc = json.loads(text)
    assert not {"hybrid_cp", "cp_link_bandwidth", "gpu_tflops"} & set(doc["config"])
    assert all("hybrid" not in st["plan"] for st in doc["steps"])
    assert doc["format_version"] == 1
    m = Manifest.from_json(doc)
    assert not m.config.hybrid_cp and m.config.gpu_tflops is None
    assert all(st.plan.hybrid is None for st in m.steps)
    assert m.dumps() == json.dumps(json.loads(text), separators=(",", ":"))  # round trip
    assert not any(k.startswith(("seg_cp", "row_cp")) for k in _shard_keys(out))
    assert not {"cp_start", "cp_degree"} & set(pq.read_schema(out / "samples.parquet").names)


def _shard_keys(out: Path) -> set[str]:
    return {k for p in out.glob("rank-*/*.safetensors") for k in read_shard(p)}


def test_hybrid_shards_carry_the_two_arrays(hybrid: Path) -> None:
    assert {"seg_cp_start", "row_cp_groups"} <= _shard_keys(hybrid)


def test_version_and_option_must_agree(hybrid: Path, tmp_path: Path) -> None:
    """A hybrid manifest relabelled version 1 (or a plain one relabelled 3) is refused; a
    version this rolltool does not know is refused as before."""
    doc = json.loads((hybrid / "manifest.json").read_text())
    with pytest.raises(RolltoolError, match="a --hybrid-cp pack is version 3"):
        Manifest.from_json({**doc, "format_version": 1})
    plain = {**doc, "format_version": 3, "config": {**doc["config"], "hybrid_cp": False}}
    with pytest.raises(RolltoolError, match="a --hybrid-cp pack is version 3"):
        Manifest.from_json(plain)
    with pytest.raises(RolltoolError, match="format version 5 is not supported"):
        Manifest.from_json({**doc, "format_version": 5})


def test_samples_parquet_says_each_sample_s_sub_group(hybrid: Path, tmp_path: Path) -> None:
    """samples.parquet's cp_start / cp_degree are where every GPU's view holds each sample
    (0 for a sample not trained); a forged degree is verify's sample.cp."""
    ds = rolltool.open_packed(hybrid)
    t = pq.read_table(hybrid / "samples.parquet").to_pydict()
    where: dict[int, tuple[int, int]] = {}
    for step in range(ds.num_steps):
        for rank in range(ds.dp):
            for g in range(4):
                for v in ds.micro_batches(step, rank, cp_rank=g):
                    place = (int(v["cp_group_start"][0]), int(v["cp_group_size"][0]))
                    for i in v["sample_index"][v["sample_index"] >= 0].tolist():
                        assert where.setdefault(i, place) == place
    for i, status in enumerate(t["status"]):
        got = (t["cp_start"][i], t["cp_degree"][i])
        assert got == (where[i] if status == "trained" else (0, 0)), i
    out = tmp_path / "p"
    shutil.copytree(hybrid, out)
    table = pq.read_table(out / "samples.parquet")
    k = table.column("cp_degree").to_numpy().copy()
    i = int(np.flatnonzero(k == 1)[0])
    k[i] = 2
    table = table.set_column(table.schema.get_field_index("cp_degree"), "cp_degree", pa.array(k))
    pq.write_table(table, out / "samples.parquet")
    doc = json.loads((out / "manifest.json").read_text())
    doc["files"]["samples.parquet"] = vars(file_record(out / "samples.parquet"))
    (out / "manifest.json").write_text(json.dumps(doc))
    r = cli("verify", out, "--json")
    problems = json.loads(r.stdout)["problems"]
    assert r.exit_code == 1 and any(
        p["kind"] == "sample.cp" and f"sample {i}" in p["where"] for p in problems
    ), problems
