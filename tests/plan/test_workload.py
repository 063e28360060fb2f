"""The cost model: formulas, presets, config.json loading, calibration files, manifest round trip."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.plan.workload import MODEL_PRESETS, WORKLOADS, ModelShape, Workload, make_workload

# Hugging Face config.json of the 7B shape, as it ships (plus keys we must ignore)
HF_7B = {
    "architectures": ["SomeForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
}


def test_flops_formula_by_hand() -> None:
    shape = MODEL_PRESETS["dense-7b"]
    h, layers, heads, kv, inter, vocab = 3584, 28, 28, 4, 18944, 152064
    d = h // heads
    params = layers * (2 * h * heads * d + 2 * h * kv * d + 3 * h * inter) + h * vocab
    assert shape.matmul_params == params
    w = make_workload("flops", model="dense-7b")
    lengths = np.array([1, 100, 4096, 32768])
    expected = 6.0 * params * lengths + 6.0 * layers * h * lengths.astype(float) ** 2
    np.testing.assert_allclose(w.cost(lengths), expected, rtol=1e-12)
    assert w.cost(lengths).dtype == np.float64


@pytest.mark.parametrize("name", ["dense-0.5b", "dense-7b", "dense-8b"])
def test_bench_counts_the_flops_of_the_flops_workload(name: str) -> None:
    """Defect 8: bench's FLOP count (the TFLOP/s it reports) and the ``flops`` workload (what
    pack balances) were 7x and 6x heads·head_dim·L² per layer. One formula now: a model's layers
    with backward, plus its output projection (2 FLOPs x 3 passes per weight and token, written
    out here), are exactly the workload's cost, and attention alone is its L² term."""
    from rolltool.bench import report as rp
    from rolltool.bench.config import resolve_shape

    layer, _ = resolve_shape(model=name)
    model = MODEL_PRESETS[name]
    w = make_workload("flops", model=name)
    kw: dict[str, Any] = {
        "heads": layer.heads,
        "head_dim": layer.head_dim,
        "layers": model.num_layers,
    }
    for n in (1, 700, 4096, 32_768):
        bench = rp.layer_flops(
            np.array([n]), matmul_params=layer.matmul_params, **kw, backward=True
        )
        output_projection = 2 * 3 * model.hidden_size * model.vocab_size * n
        assert bench + output_projection == pytest.approx(w.cost(np.array([n]))[0], rel=1e-12)
        assert rp.attention_flops(np.array([n]), **kw, backward=True) == pytest.approx(w.b * n * n)
        # forward alone is a third of it, matmuls and attention alike
        assert rp.layer_flops(
            np.array([n]), matmul_params=layer.matmul_params, **kw
        ) == pytest.approx(bench / 3, rel=1e-12)
    # by hand: 2 heads of 1, two segments (3 and 4 tokens, Σ L² = 25), two layers, backward
    assert rp.attention_flops(np.array([3, 4]), heads=2, head_dim=1, layers=2, backward=True) == (
        2 * 25 * 2 * 2 * 3
    )


def test_default_is_flops_of_the_7b_preset() -> None:
    assert make_workload() == make_workload("flops", model="dense-7b")


def test_simple_kinds() -> None:
    lengths = np.array([0, 1, 10, 4096])
    np.testing.assert_array_equal(
        make_workload("verl").cost(lengths), 24576.0 * lengths + lengths**2
    )
    np.testing.assert_array_equal(make_workload("tokens").cost(lengths), lengths.astype(float))
    np.testing.assert_array_equal(make_workload("count").cost(lengths), np.ones(4))


def test_presets_are_named_after_shape_and_grow() -> None:
    assert set(MODEL_PRESETS) >= {"dense-0.5b", "dense-7b", "dense-32b"}
    for name, shape in MODEL_PRESETS.items():
        billions = float(name.removeprefix("dense-").removesuffix("b"))
        assert 0.8 * billions < shape.matmul_params / 1e9 < 1.25 * billions, name


def test_hf_config_gives_the_preset(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_7B))
    w = make_workload("flops", model=str(path))
    assert w.model == MODEL_PRESETS["dense-7b"]
    assert (w.a, w.b) == (make_workload().a, make_workload().b)
    assert w.source == str(path)


def test_hf_config_text_config_and_head_dim(tmp_path) -> None:
    inner = {**HF_7B, "head_dim": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "vlm", "text_config": inner}))
    w = make_workload("flops", model=str(path))
    assert w.model is not None and w.model.attention_width == 28 * 256
    assert w.b == 6.0 * 28 * 28 * 256


def test_bad_model_config(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(RolltoolError, match="has no 'num_attention_heads'"):
        make_workload("flops", model=str(path))
    with pytest.raises(RolltoolError, match="does not exist"):
        make_workload("flops", model=str(tmp_path / "missing.json"))
    with pytest.raises(RolltoolError, match="unknown model"):
        make_workload("flops", model="dense-9000b")
    with pytest.raises(RolltoolError, match="multiple"):
        ModelShape(
            hidden_size=64,
            num_layers=2,
            num_heads=3,
            num_kv_heads=2,
            intermediate_size=1,
            vocab_size=1,
        )


def test_calibrated(tmp_path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"a": 2e-7, "b": 3e-12, "device": "H200", "r2": 0.999}))
    w = make_workload("calibrated", calibration=path)
    np.testing.assert_allclose(w.cost(np.array([1000])), [2e-7 * 1000 + 3e-12 * 1e6])
    assert w.notes == {"device": "H200", "r2": 0.999}
    path.write_text(json.dumps({"a": 1.0}))
    with pytest.raises(RolltoolError, match="'a' and 'b'"):
        make_workload("calibrated", calibration=path)
    path.write_text("{not json")
    with pytest.raises(RolltoolError, match="cannot read"):
        make_workload("calibrated", calibration=path)
    with pytest.raises(RolltoolError, match="needs a calibration file"):
        make_workload("calibrated")


def test_argument_mistakes() -> None:
    with pytest.raises(RolltoolError, match="unknown workload") as e:
        make_workload("walltime")
    assert e.value.hint and "flops" in e.value.hint
    with pytest.raises(RolltoolError, match="takes no model"):
        make_workload("tokens", model="dense-7b")
    with pytest.raises(RolltoolError, match="calibration file goes with"):
        make_workload("flops", calibration="x.json")
    with pytest.raises(RolltoolError, match="coefficient a"):
        Workload(kind="tokens", a=-1.0)


def test_round_trip_through_the_manifest(tmp_path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"a": 1.5, "b": 0.25, "c": 3.0}))
    made = [make_workload(kind) for kind in ("flops", "verl", "tokens", "count")]
    made.append(make_workload("calibrated", calibration=path))
    made.append(make_workload("flops", model="dense-32b"))
    assert {w.kind for w in made} == set(WORKLOADS)
    for w in made:
        back = Workload.from_dict(json.loads(json.dumps(w.to_dict())))
        assert back == w
        assert w.kind in w.describe()


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(set(WORKLOADS) - {"calibrated"})),
    lengths=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=50),
)
def test_cost_never_falls_as_length_grows(kind: str, lengths: list[int]) -> None:
    # the planner relies on this: longest first is also costliest first
    arr = np.sort(np.array(lengths))
    cost = make_workload(kind).cost(arr)
    assert np.all(np.diff(cost) >= 0) and np.all(cost >= 0)


def _config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF_7B, **changes}))
    return str(path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_size", "abc"),
        ("hidden_size", "3584"),
        ("hidden_size", [3584]),
        ("hidden_size", {"x": 1}),
        ("hidden_size", 64.7),
        ("hidden_size", True),
        ("num_hidden_layers", 0),
        ("num_attention_heads", -28),
        ("num_key_value_heads", False),
        ("intermediate_size", 0),
        ("vocab_size", 1.5),
        ("head_dim", 0),
        ("head_dim", "128"),
    ],
)
def test_model_config_values_must_be_positive_integers(tmp_path, key, value) -> None:
    path = _config(tmp_path, **{key: value})
    with pytest.raises(
        RolltoolError, match=re.escape(f"{path}: '{key}' must be a positive integer")
    ):
        make_workload("flops", model=path)


def test_model_config_non_finite_value(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_7B).replace("3584", "NaN"))
    with pytest.raises(RolltoolError, match="'hidden_size' must be a positive integer"):
        make_workload("flops", model=str(path))


def test_model_config_integral_floats_are_fine(tmp_path) -> None:
    path = _config(tmp_path, hidden_size=3584.0, num_hidden_layers=28.0, head_dim=None)
    assert make_workload("flops", model=path).model == MODEL_PRESETS["dense-7b"]


def test_model_config_head_dim_of_zero(tmp_path) -> None:
    tiny = {"hidden_size": 64, "num_attention_heads": 128, "num_key_value_heads": 128}
    path = _config(tmp_path, **tiny)
    with pytest.raises(RolltoolError, match=r"'hidden_size' \(64\).*'num_attention_heads' \(128\)"):
        make_workload("flops", model=path)
    path = _config(tmp_path, hidden_size=100, num_attention_heads=28)
    with pytest.raises(RolltoolError, match="not a multiple of 'num_attention_heads'"):
        make_workload("flops", model=path)
    # an explicit head_dim makes both fine
    w = make_workload("flops", model=_config(tmp_path, **tiny, head_dim=32))
    assert w.model is not None and w.model.attention_width == 128 * 32
    with pytest.raises(RolltoolError, match="head_dim of 0"):
        ModelShape(
            hidden_size=64,
            num_layers=2,
            num_heads=128,
            num_kv_heads=128,
            intermediate_size=1,
            vocab_size=1,
        )


@pytest.mark.parametrize(
    "moe",
    [
        {"num_local_experts": 8, "num_experts_per_tok": 2},
        {"num_experts": 128, "moe_intermediate_size": 768},
        {"n_routed_experts": 256},
        {"moe_intermediate_size": 768},
    ],
)
def test_mixture_of_experts_is_refused(tmp_path, moe) -> None:
    path = _config(tmp_path, **moe)
    with pytest.raises(RolltoolError, match="mixture of experts") as e:
        make_workload("flops", model=path)
    assert e.value.hint and "--balance calibrated" in e.value.hint and "tokens" in e.value.hint
    # also inside a multimodal config's text_config
    (tmp_path / "vlm.json").write_text(json.dumps({"text_config": {**HF_7B, **moe}}))
    with pytest.raises(RolltoolError, match="mixture of experts"):
        make_workload("flops", model=str(tmp_path / "vlm.json"))


def test_one_expert_or_none_is_dense(tmp_path) -> None:
    path = _config(tmp_path, num_local_experts=1, num_experts=None, n_routed_experts=0)
    assert make_workload("flops", model=path).model == MODEL_PRESETS["dense-7b"]


def test_model_name_mistakes(tmp_path) -> None:
    with pytest.raises(RolltoolError, match="unknown model ''"):
        make_workload("flops", model="")
    with pytest.raises(RolltoolError, match="unknown model ' '"):
        make_workload("flops", model=" ")
    with pytest.raises(RolltoolError, match="/dev/null is not a file"):
        make_workload("flops", model="/dev/null")
    with pytest.raises(RolltoolError, match=re.escape(f"{tmp_path} is not a file")):
        make_workload("flops", model=str(tmp_path))
    with pytest.raises(RolltoolError, match="does not exist"):
        make_workload("flops", model=str(tmp_path / "no" / "config"))
    # an existing file needs no .json suffix
    path = tmp_path / "config"
    path.write_text(json.dumps(HF_7B))
    assert make_workload("flops", model=str(path)).model == MODEL_PRESETS["dense-7b"]


@pytest.mark.parametrize(
    ("coefficients", "key"),
    [
        ({"a": True, "b": False}, "a"),
        ({"a": 1.0, "b": False}, "b"),
        ({"a": 1.0, "b": 1.0, "c": True}, "c"),
        ({"a": "1e-7", "b": 1.0}, "a"),
        ({"a": None, "b": 1.0}, "a"),
        ({"a": [1.0], "b": 1.0}, "a"),
        ({"a": -1.0, "b": 1.0}, "a"),
        ({"a": 1.0, "b": float("inf")}, "b"),
        ({"a": float("nan"), "b": 1.0}, "a"),
        ({"a": 1.0, "b": 1.0, "c": -0.5}, "c"),
    ],
)
def test_calibration_coefficients_must_be_numbers(tmp_path, coefficients, key) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(coefficients))  # writes NaN and Infinity, as Python's json does
    with pytest.raises(
        RolltoolError, match=re.escape(f"{path}: '{key}' must be a finite number >= 0")
    ):
        make_workload("calibrated", calibration=path)


def test_calibration_file_mistakes(tmp_path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"a": 0, "b": 0.0}))
    with pytest.raises(RolltoolError, match="all zero"):
        make_workload("calibrated", calibration=path)
    with pytest.raises(RolltoolError, match="is not a file"):
        make_workload("calibrated", calibration=tmp_path)
    with pytest.raises(RolltoolError, match="does not exist"):
        make_workload("calibrated", calibration=tmp_path / "missing.json")
    path.write_text(json.dumps({"a": 1, "b": 0}))  # integers are numbers
    assert make_workload("calibrated", calibration=path).a == 1.0


def test_unreliable_calibration_is_named(tmp_path) -> None:
    """bench's flag (``reliable: false``) or its warning (files written before the flag) make
    ``Workload.unreliable`` a sentence naming the file; a good file, or another kind, None."""
    import json

    from rolltool.plan.workload import make_workload

    cases = {
        "flagged": ({"a": 1e-7, "b": 1e-12, "reliable": False}, True),
        "old": ({"a": 1e-7, "b": 1e-12, "warning": "the fit is unreliable (R² 0.010 < 0.9)"}, True),
        "good": ({"a": 1e-7, "b": 1e-12, "reliable": True, "r2": 0.99}, False),
    }
    for name, (doc, flagged) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        said = make_workload("calibrated", calibration=path).unreliable()
        assert (said is not None) is flagged, name
        if said is not None:
            assert str(path) in said
    assert "R² 0.010" in (
        make_workload("calibrated", calibration=tmp_path / "old.json").unreliable() or ""
    )
    assert make_workload("flops").unreliable() is None
