import dataclasses
import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp.hardware import GPU, Hardware

GPU_HW = Hardware(gpus=(GPU("a100", (8, 0)),))


def softmax_model():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ],
        name="planted",
    )


def test_flags_planted_float16_softmax_output():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    report = kmp.audit(softmax_model())
    assert not report.ok
    assert {"low-precision-activation", "low-precision-output"} <= report.codes()
    assert all(f.severity == "error" for f in report.errors)
    text = str(report)
    assert "NOT OK" in text and "float16" in text and "dense_1" in text


def test_passes_model_with_float32_outputs():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    report = kmp.audit(kmp.float32_outputs(softmax_model()))
    assert report.ok, str(report)
    assert report.findings == ()
    row = {r.name: r for r in report.rows}["dense"]
    assert (row.compute_dtype, row.variable_dtype, row.output_dtype) == (
        "float16",
        "float32",
        "float16",
    )


def test_pure_float16_variables_are_an_error():
    keras.config.set_dtype_policy("float16")
    report = kmp.audit(softmax_model())
    assert "low-precision-variables" in report.codes()


def test_policy_mismatch_is_flagged():
    model = softmax_model()  # built under float32
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)  # too late for this model
    report = kmp.audit(model)
    assert "policy-mismatch" in report.codes()
    mismatch = next(f for f in report.findings if f.code == "policy-mismatch")
    assert "call kmp.enable() before building the model" in mismatch.message
    assert report.ok  # a warning, not an error


class NaiveNormalization(keras.layers.Layer):
    """Mean and variance computed in the compute dtype: float16 overflows at x ~ 300."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        var = keras.ops.mean(x * x, axis=-1, keepdims=True) - mean * mean
        return (x - mean) / keras.ops.sqrt(var + 1e-3)


class UpcastingNorm(keras.layers.Layer):
    """The same statistics computed in float32, cast back: not a finding."""

    def call(self, x):
        x32 = keras.ops.cast(x, "float32")
        mean = keras.ops.mean(x32, axis=-1, keepdims=True)
        var = keras.ops.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean
        return keras.ops.cast((x32 - mean) / keras.ops.sqrt(var + 1e-3), self.compute_dtype)


def norm_model(*norms):
    inp = keras.Input((8,))
    x = keras.layers.Dense(8)(inp)
    for norm in norms:
        x = norm(x)
    return keras.Model(inp, kmp.layers.Float32Output()(x))


def test_low_precision_custom_normalization_warns():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = norm_model(
        NaiveNormalization(name="my_normalization"),
        keras.layers.BatchNormalization(),  # upcasts internally: not flagged
    )
    report = kmp.audit(model)
    flagged = [f for f in report.findings if f.code == "low-precision-norm"]
    assert [f.layer for f in flagged] == ["my_normalization"]
    assert "non-finite float16 output" in flagged[0].message  # measured, not listed
    assert flagged[0].severity == "warning"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_norm_check_measures_instead_of_listing_classes(policy):
    kmp.enable(policy, hardware=GPU_HW)
    model = norm_model(
        keras.layers.LayerNormalization(name="keras_ln"),
        UpcastingNorm(name="upcasting_norm"),  # an unknown class that upcasts: fine
        NaiveNormalization(name="naive_norm"),
    )
    report = kmp.audit(model)
    flagged = {f.layer: f.message for f in report.findings if f.code == "low-precision-norm"}
    assert list(flagged) == ["naive_norm"]
    assert "against float32" in flagged["naive_norm"] or "non-finite" in flagged["naive_norm"]
    assert keras.config.dtype_policy().name == policy  # the checks restore the policy


def test_norm_check_numbers_for_keras_layers():
    from kmp.auditing.measured import MeasuredChecks

    kmp.enable("mixed_float16", hardware=GPU_HW)
    checks = MeasuredChecks()
    results = {}
    for layer in (
        keras.layers.LayerNormalization(),
        keras.layers.GroupNormalization(groups=2),
        NaiveNormalization(),
    ):
        inp = keras.Input((3, 8))
        keras.Model(inp, layer(inp))
        results[type(layer).__name__] = checks.norm(layer)
    assert results["LayerNormalization"].status == "ok"
    assert results["LayerNormalization"].error < 4 * 2.0**-10
    assert results["GroupNormalization"].status == "ok"
    assert results["NaiveNormalization"].status == "bad"


def test_norm_check_that_cannot_run_is_reported_not_guessed():
    class NeedsTwoInputsNorm(keras.layers.Layer):
        def call(self, x, y):
            return x - y

    kmp.enable("mixed_float16", hardware=GPU_HW)
    inp = keras.Input((4,))
    out = kmp.layers.Float32Output()(NeedsTwoInputsNorm(name="odd_norm")(inp, inp))
    report = kmp.audit(keras.Model(inp, out))
    assert "low-precision-norm" not in report.codes()
    info = [f for f in report.findings if f.code == "not-checked" and f.layer == "odd_norm"]
    assert info and info[0].severity == "info" and "not measured" in info[0].message


def test_large_float32_layer_costs_speed_warning():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((512,))
    x = keras.layers.Dense(512, dtype="float32", name="big")(inp)
    out = kmp.layers.Float32Output()(keras.layers.Dense(2)(x))
    report = kmp.audit(keras.Model(inp, out))
    assert [f.layer for f in report.findings if f.code == "float32-large-layer"] == ["big"]


def test_nested_models_are_walked():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="inner")
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, activation="softmax", name="head")(inner(inp))
    report = kmp.audit(keras.Model(inp, out))
    assert "inner/dense" in {r.name for r in report.rows}
    assert not report.ok


def test_report_to_dict_is_json():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    data = json.loads(json.dumps(kmp.audit(softmax_model()).to_dict()))
    assert data["ok"] is False and data["global_policy"] == "mixed_float16"
    assert {f["code"] for f in data["findings"]} >= {"low-precision-output"}


def test_bad_inputs():
    with pytest.raises(TypeError, match="Keras model"):
        kmp.audit("model.keras")
    with pytest.raises(ValueError, match="not built"):
        kmp.audit(keras.Sequential([keras.layers.Dense(1)]))


def _kmp(*args):
    return subprocess.run(
        [sys.executable, "-m", "kmp.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_audit_exit_codes(tmp_path):
    kmp.enable("mixed_float16", hardware=GPU_HW)
    bad = softmax_model()
    good = kmp.float32_outputs(bad)
    bad.save(tmp_path / "bad.keras")
    good.save(tmp_path / "good.keras")
    (tmp_path / "notes.txt").write_text("hi")
    r = _kmp("audit", str(tmp_path / "bad.keras"))
    assert r.returncode == 1, r.stderr
    assert "low-precision-output" in r.stdout
    r = _kmp("audit", "--json", str(tmp_path / "good.keras"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    r = _kmp("audit", str(tmp_path / "missing.keras"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _kmp("audit", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and "model.save" in r.stderr


def test_summary_is_the_table_for_small_models_and_short_for_large_ones():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    model = softmax_model()
    report = kmp.audit(model)
    assert report.summary() == str(report)
    short = report.summary(max_rows=1)
    lines = short.splitlines()
    assert lines[0] == str(report).splitlines()[0]  # the verdict
    assert lines[1].startswith(f"{len(report.rows)} layers: ") and "compute in bfloat16" in lines[1]
    assert "------" not in short  # no table
    assert all(f.code in short for f in report.findings)


# --------------------------------------------------------------- never crash on the unknown


@keras.saving.register_keras_serializable(package="kmp_tests")
def approx_gelu(x):
    return keras.activations.gelu(x, approximate=True)


@keras.saving.register_keras_serializable(package="kmp_tests")
class ScaledTanh:
    """A parametrised activation: a callable object with a config."""

    def __init__(self, scale=2.0):
        self.scale = scale

    def __call__(self, x):
        return self.scale * keras.ops.tanh(x)

    def get_config(self):
        return {"scale": self.scale}


def test_registered_and_parametrised_activations_do_not_crash():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    inp = keras.Input((4,))
    x = keras.layers.Dense(4, activation=approx_gelu, name="registered")(inp)
    x = keras.layers.Dense(4, activation=ScaledTanh(3.0), name="parametrised")(x)
    x = keras.layers.Dense(4, activation=lambda t: t * 2, name="anonymous")(x)
    report = kmp.audit(keras.Model(inp, kmp.layers.Float32Output()(x)))
    assert report.ok, str(report)
    assert {"registered", "parametrised", "anonymous"} <= {r.name for r in report.rows}


class Block(keras.layers.Layer):
    """A custom layer whose sublayers only exist inside its call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner_dense = keras.layers.Dense(8, name="inner_dense")
        self.inner_norm = NaiveNormalization(name="inner_norm")

    def call(self, x):
        return self.inner_norm(self.inner_dense(x))


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_subclassed_model_with_nested_sublayers_is_walked():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = Subclassed(name="sub")
    model(np.zeros((2, 8), "float32"))
    report = kmp.audit(model)
    rows = {r.name: r for r in report.rows}
    assert {"block", "block/inner_dense", "block/inner_norm", "head"} <= set(rows)
    assert rows["block/inner_dense"].output_dtype == "?"  # never called symbolically
    assert rows["block/inner_dense"].compute_dtype == "float16"
    codes = {(f.code, f.layer) for f in report.findings}
    assert ("low-precision-norm", "block/inner_norm") in codes  # measured inside the block
    unknown = [f for f in report.findings if f.code == "not-checked" and f.layer == "sub"]
    assert unknown and "subclassed" in unknown[0].message


def test_layer_whose_dtype_cannot_be_read_is_unknown():
    class Opaque(keras.layers.Layer):
        broken = False

        @property
        def compute_dtype(self):
            if self.broken:
                raise RuntimeError("no dtype here")
            return super().compute_dtype

        def call(self, x):
            return x

    kmp.enable("mixed_float16", hardware=GPU_HW)
    inp = keras.Input((4,))
    x = keras.layers.Dense(4)(inp)
    opaque = Opaque(name="opaque")
    model = keras.Model(inp, kmp.layers.Float32Output()(opaque(x)))
    opaque.broken = True
    report = kmp.audit(model)
    row = {r.name: r for r in report.rows}["opaque"]
    assert row.compute_dtype == "?"
    assert any(f.code == "not-checked" and f.layer == "opaque" for f in report.findings)


def test_audit_changes_neither_the_model_nor_the_policy():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = norm_model(NaiveNormalization(), keras.layers.LayerNormalization())
    before = [w.copy() for w in model.get_weights()]
    policies = [layer.dtype_policy.name for layer in model.layers]
    kmp.audit(model)
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert [layer.dtype_policy.name for layer in model.layers] == policies
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


# --------------------------------------------------------------------- transformer rules


class OverflowingMaskAttention(keras.layers.MultiHeadAttention):
    """Applies its mask with -1e9 in the compute dtype: -inf and NaN in float16.

    Keras runs ``_masked_softmax`` when the layer has dropout (otherwise it uses the
    backend's fused attention).
    """

    def _masked_softmax(self, attention_scores, attention_mask=None):
        if attention_mask is not None:
            mask = keras.ops.cast(keras.ops.expand_dims(attention_mask, 1), attention_scores.dtype)
            big = keras.ops.cast(-1e9, attention_scores.dtype)
            attention_scores = attention_scores + (1.0 - mask) * big
        return keras.ops.softmax(attention_scores, axis=-1)


def attention_model(attention):
    tokens = keras.Input((4, 8))
    mask = keras.Input((4, 4), dtype="bool")
    x = attention(tokens, tokens, attention_mask=mask)
    return keras.Model([tokens, mask], kmp.layers.Float32Output()(keras.layers.Dense(2)(x)))


@pytest.mark.parametrize(
    ("policy", "severity"),
    [("mixed_float16", "warning"), ("mixed_bfloat16", "info"), ("float32", None)],
)
def test_attention_in_16_bits(policy, severity):
    keras.config.set_dtype_policy(policy)
    model = attention_model(keras.layers.MultiHeadAttention(2, 4, name="mha"))
    report = kmp.audit(model)
    found = [f for f in report.findings if f.code == "low-precision-attention"]
    if severity is None:
        assert found == []
        return
    assert [(f.layer, f.severity) for f in found] == [("mha", severity)]
    assert "Mask check" in found[0].message and "output finite" in found[0].message
    assert "attention-mask-overflow" not in report.codes()  # Keras's mask fits float16


def test_attention_mask_overflow_is_measured():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    report = kmp.audit(attention_model(OverflowingMaskAttention(2, 4, dropout=0.1, name="bad_mha")))
    errors = [f for f in report.errors if f.code == "attention-mask-overflow"]
    assert [f.layer for f in errors] == ["bad_mha"]
    assert "non-finite" in errors[0].message
    assert not report.ok


def test_float32_embedding_feeding_16_bit_layers():
    kmp.enable("mixed_float16", hardware=GPU_HW)

    def build(dtype):
        inp = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(50, 8, dtype=dtype, name="emb")(inp)
        x = keras.layers.Dense(4)(x)
        return keras.Model(inp, kmp.layers.Float32Output()(x))

    found = [f for f in kmp.audit(build("float32")).findings if f.code == "float32-embedding"]
    assert [(f.layer, f.severity) for f in found] == [("emb", "warning")]
    assert "float16" in found[0].message
    assert "float32-embedding" not in kmp.audit(build(None)).codes()


def test_large_vocabulary_output_in_16_bits_is_an_error():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(3000, name="logits")(inp))
    report = kmp.audit(model)
    found = [f for f in report.errors if f.code == "large-vocab-16bit"]
    assert [f.layer for f in found] == ["logits"]
    assert "3,000 classes" in found[0].message
    assert "use kmp.float32_outputs(model)" in found[0].message.lower()
    fixed = kmp.audit(kmp.float32_outputs(model))
    assert fixed.ok and "large-vocab-16bit" not in fixed.codes()


def test_small_custom_float32_layer_between_16_bit_layers():
    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * keras.ops.cast(self.w, x.dtype)

    kmp.enable("mixed_float16", hardware=GPU_HW)

    def build(dtype):
        inp = keras.Input((8,))
        x = keras.layers.Dense(8)(inp)
        x = Scale(dtype=dtype, name="scale")(x)
        return keras.Model(inp, kmp.layers.Float32Output()(keras.layers.Dense(2)(x)))

    found = [f for f in kmp.audit(build("float32")).findings if f.code == "float32-large-layer"]
    assert [(f.layer, f.severity) for f in found] == [("scale", "info")]
    assert "next to layers computing in float16" in found[0].message
    assert "float32-large-layer" not in kmp.audit(build(None)).codes()


# -------------------------------------------------------------- layers kept in float32


def test_attention_kept_in_float32_is_no_risk():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model(OverflowingMaskAttention(2, 4, dropout=0.1, name="bad_mha"))
    before = kmp.audit(model)
    assert {"low-precision-attention", "attention-mask-overflow"} <= before.codes()
    assert kmp.keep_float32(model, keras.layers.MultiHeadAttention)[0] == "bad_mha"
    report = kmp.audit(model)
    assert report.ok and "policy-mismatch" not in report.codes(), str(report)
    # A custom layer in float32 between 16-bit ones: its cost, as information only.
    assert [(f.code, f.severity) for f in report.findings] == [("float32-large-layer", "info")]
    rows = {r.name: r for r in report.rows}
    assert (rows["bad_mha"].compute_dtype, rows["bad_mha"].output_dtype) == ("float32", "float32")
    assert rows["bad_mha/softmax"].compute_dtype == "float32"


def test_large_vocabulary_head_kept_in_float32():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(3000, name="logits")(inp))
    assert "large-vocab-16bit" in kmp.audit(model).codes()
    assert kmp.keep_float32(model, "logits") == ["logits"]
    report = kmp.audit(model)
    assert report.ok and "large-vocab-16bit" not in report.codes(), str(report)
    assert report.findings == ()


def test_large_layer_kept_in_float32_is_information():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)

    def build():
        inp = keras.Input((512,))
        x = keras.layers.Dense(512, name="big")(inp)
        return keras.Model(inp, kmp.layers.Float32Output()(keras.layers.Dense(2)(x)))

    model = build()
    kmp.keep_float32(model, "big")
    [found] = kmp.audit(model).findings
    assert (found.code, found.layer, found.severity) == ("float32-large-layer", "big", "info")
    assert "kmp.keep_float32" in found.message


def test_rules_for_kept_layers():
    from kmp.auditing.report import LayerFacts
    from kmp.auditing.rules import AuditContext, layer_findings

    ctx = AuditContext("mixed_float16", 1000)
    embedding = LayerFacts(
        "emb",
        "Embedding",
        "float32",
        "float32",
        kinds=frozenset({"embedding", "keras"}),
        consumer_computes=("float16",),
    )
    given = {(f.code, f.severity) for f in layer_findings(embedding, ctx)}
    assert given == {("float32-embedding", "warning"), ("policy-mismatch", "warning")}
    kept = dataclasses.replace(embedding, kept_float32=True)
    assert [(f.code, f.severity) for f in layer_findings(kept, ctx)] == [
        ("float32-embedding", "info")
    ]


def test_kept_layers_after_loading(tmp_path):
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model(keras.layers.MultiHeadAttention(2, 4, name="mha"))
    kmp.keep_float32(model, "mha")
    model.save(tmp_path / "kept.keras")
    # model.save, then Keras's loader and kmp's: the mark came with the model itself.
    for loaded in (
        keras.saving.load_model(tmp_path / "kept.keras"),
        kmp.load_model(tmp_path / "kept.keras"),
    ):
        assert loaded.get_layer("mha").compute_dtype == "float32"
        report = kmp.audit(loaded)
        assert report.findings == ()  # kept on purpose: no policy mismatch
        kept = [r.name for r in report.rows if r.kept_float32]
        assert kept[0] == "mha" and all(k.startswith("mha") for k in kept)
        assert "float32 (kept)" in str(report)
        assert kmp.keep_float32(loaded, "mha") == []  # nothing to change


def test_rules_are_pure_functions_of_facts():
    from kmp.auditing.report import LayerFacts, Measurement
    from kmp.auditing.rules import AuditContext, layer_findings

    ctx = AuditContext("mixed_float16", 1000)
    facts = LayerFacts(
        "norm",
        "MyNorm",
        "float16",
        "mixed_float16",
        kinds=frozenset({"norm"}),
        norm_check=Measurement("bad", "relative error 0.5", 0.5),
    )
    [finding] = layer_findings(facts, ctx)
    assert (finding.code, finding.severity) == ("low-precision-norm", "warning")
    assert "relative error 0.5" in finding.message
    ok = LayerFacts(
        "norm",
        "MyNorm",
        "float16",
        "mixed_float16",
        kinds=frozenset({"norm"}),
        norm_check=Measurement("ok", "relative error 0.0001", 1e-4),
    )
    assert layer_findings(ok, ctx) == []


# ----------------------------------------------------------------------------- KerasHub


def _hub():
    return pytest.importorskip("keras_hub", reason="KerasHub models need keras-hub installed")


def _zoo():
    """The tiny KerasHub builders shared with the zoo tests (tests/_zoo.py)."""
    _hub()
    from tests import _zoo

    return _zoo


@pytest.mark.backend_agnostic  # KerasHub on JAX: test_probing's KerasHub test
def test_keras_hub_gpt2_causal_lm():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = _zoo().gpt2_causal_lm()
    report = kmp.audit(model)
    names = {r.name for r in report.rows}
    attention = "gpt2_backbone/transformer_layer_0/self_attention"
    assert attention in names and f"{attention}/softmax" in names
    codes = {(f.code, f.layer, f.severity) for f in report.findings}
    assert ("low-precision-attention", attention, "warning") in codes
    # Its symbolic output says float16, but the tied head's matmul really runs (and outputs)
    # in float32: the audit says what it computes, not what the spec claims.
    assert ("float32-head-matmul", "token_embedding", "warning") in codes
    assert "low-precision-output" not in report.codes()
    x = {"token_ids": np.zeros((1, 16), "int32"), "padding_mask": np.ones((1, 16), "int32")}
    assert keras.backend.standardize_dtype(model(x).dtype) == "float32"
    assert "low-precision-norm" not in report.codes()  # Keras LayerNormalization upcasts
    assert keras.config.dtype_policy().name == "mixed_float16"
    # After float32_outputs: the matmul in float16, the logits cast, a clean audit.
    fixed = kmp.float32_outputs(model)
    assert fixed.backbone.token_embedding.reverse_dtype == "float16"
    assert keras.backend.standardize_dtype(fixed(x).dtype) == "float32"
    after = kmp.audit(fixed)
    assert after.ok and "float32-head-matmul" not in after.codes()


@pytest.mark.backend_agnostic  # KerasHub on JAX: test_probing's KerasHub test
def test_keras_hub_gemma_rms_norm_is_measured_not_flagged():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = _zoo().gemma_causal_lm()
    report = kmp.audit(model)
    norms = [r.name for r in report.rows if r.class_name == "RMSNormalization"]
    assert len(norms) >= 3  # the final norm and the two inside the decoder block
    assert "low-precision-norm" not in report.codes()  # it upcasts: measured
    assert not any(f.code == "not-checked" and f.layer in norms for f in report.findings)
    attention = [f for f in report.findings if f.code == "low-precision-attention"]
    assert attention and attention[0].severity == "info"  # its softmax is float32
    assert "policy-mismatch" not in report.codes()  # the float32 softmax is by design


@pytest.mark.backend_agnostic  # KerasHub on JAX: test_probing's KerasHub test
def test_keras_hub_bert_text_classifier():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    model = _zoo().bert_text_classifier()
    report = kmp.audit(model)
    assert any(r.name.endswith("/self_attention_layer") for r in report.rows)
    attention = [f for f in report.findings if f.code == "low-precision-attention"]
    assert attention and all(f.severity == "info" for f in attention)  # bfloat16
    assert "low-precision-output" in {f.code for f in report.errors}
    assert "low-precision-norm" not in report.codes()
