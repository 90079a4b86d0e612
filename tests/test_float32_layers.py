"""kmp.keep_float32 (kmp/float32_layers.py): chosen layers, sublayers included, in float32."""

import keras
import numpy as np
import pytest

import kmp
from kmp.float32_layers import is_kept
from kmp.layer_walk import walk
from kmp.layers import Float32Output
from tests.test_layers import GPU_HW, sequential  # the same fixtures as kmp.layers' tests

ATTENTION = "block0_attention"
ATTENTION_LAYERS = [
    ATTENTION,
    f"{ATTENTION}/query",
    f"{ATTENTION}/key",
    f"{ATTENTION}/value",
    f"{ATTENTION}/softmax",
    f"{ATTENTION}/dropout",
    f"{ATTENTION}/attention_output",
]


def attention_model(classes=3, name="gpt"):
    """Attention, a residual add, pooling and a Dense head: 10 layers, built."""
    inp = keras.Input((5, 8))
    a = keras.layers.MultiHeadAttention(2, 4, name=ATTENTION)(inp, inp)
    h = keras.layers.Add(name="add")([inp, a])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inp, keras.layers.Dense(classes, name="head")(h), name=name)


def batch(seed=0):
    return np.random.default_rng(seed).normal(size=(4, 5, 8)).astype("float32")


def computes(model):
    """Each layer's compute dtype, by the path kmp.keep_float32 reports (and kmp.audit shows)."""
    return {v.path: v.layer.compute_dtype for v in walk(model, inputs=False)}


@pytest.mark.parametrize(
    "selector",
    [
        keras.layers.MultiHeadAttention,  # a class
        ATTENTION,  # a name (and its path)
        "MultiHeadAttention",  # a class name
        "block*_attention",  # a glob pattern
        "*0_att*",
    ],
)
def test_keep_float32_selects_by_class_name_and_glob(selector):
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model()
    assert kmp.keep_float32(model, selector) == ATTENTION_LAYERS
    dtypes = computes(model)
    assert {dtypes[n] for n in ATTENTION_LAYERS} == {"float32"}
    assert {dtypes[n] for n in ("add", "pool", "head")} == {"float16"}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_kept_attention_computes_in_float32_sublayers_included(policy):
    kmp.enable(policy, hardware=GPU_HW)
    model = attention_model()
    attention = model.get_layer(ATTENTION)
    x = keras.ops.convert_to_tensor(batch())
    assert keras.backend.standardize_dtype(attention(x, x).dtype) == policy[6:]
    kmp.keep_float32(model, ATTENTION)
    assert attention._softmax.compute_dtype == "float32"
    assert attention._query_dense.compute_dtype == "float32"
    assert attention._query_dense.variable_dtype == "float32"
    assert keras.backend.standardize_dtype(attention(x, x).dtype) == "float32"
    scores = keras.ops.expand_dims(x, 1)  # (batch, heads, queries, keys)
    assert keras.backend.standardize_dtype(attention._softmax(scores).dtype) == "float32"
    # The graph says so too: the symbolic outputs are traced again.
    assert attention.output.dtype == "float32"
    assert model.get_layer("add").output.dtype == policy[6:]
    assert keras.backend.standardize_dtype(model(batch()).dtype) == policy[6:]
    kmp.keep_float32(model, "head")
    assert model.outputs[0].dtype == "float32"
    assert keras.backend.standardize_dtype(model(batch()).dtype) == "float32"


def test_keep_float32_by_path_in_a_nested_model():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    inner = attention_model()
    inp = keras.Input((5, 8))
    model = keras.Model(inp, inner(inp), name="outer")
    # The path kmp.audit shows (through the nested model) selects, and is what comes back;
    # Keras's own layer.path selects too.
    nested = f"gpt/{ATTENTION}"
    assert kmp.keep_float32(model, f"{nested}/softmax") == [f"{nested}/softmax"]
    assert kmp.keep_float32(model, f"{ATTENTION}/query") == [f"{nested}/query"]
    # A probe's report passes its layer paths as separate arguments.
    names = ["block0_attention", "head"]
    assert kmp.keep_float32(model, *names) == [
        nested,
        f"{nested}/key",
        f"{nested}/value",
        f"{nested}/dropout",
        f"{nested}/attention_output",
        "gpt/head",
    ]
    assert model.outputs[0].dtype == "float32"
    # The whole nested model: every layer it holds.
    assert kmp.keep_float32(model, "gpt") == ["gpt", "gpt/add", "gpt/pool"]
    assert set(computes(model).values()) == {"float32"}


def test_keep_float32_on_a_sequential_softmax_head():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = sequential()
    head = model.layers[-1]
    assert "low-precision-activation" in kmp.audit(model).codes()
    assert kmp.keep_float32(model, head.name) == [head.name]
    assert model.outputs[0].dtype == "float32"
    assert model(np.ones((2, 6), "float32")).dtype == "float32"
    assert kmp.audit(model).ok  # the softmax is computed in float32
    assert kmp.float32_outputs(model) is model


def test_keep_float32_lists_only_what_it_changed():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, dtype="float32", name="already")(inp)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(h))
    assert kmp.keep_float32(model, "already") == []  # matched, nothing to change: no error
    assert kmp.keep_float32(model, "already", "head", "Dense") == ["head"]
    assert kmp.keep_float32(model, "head") == []  # twice changes nothing


def test_kept_layers_train_and_predict_in_float32():
    # mixed_bfloat16: JAX on a CPU cannot fit float16 matmuls (F16_F16_F32 dot_general).
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    model = attention_model()
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = batch(), np.zeros((4, 3), "float32")
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    assert str(model.predict(x, verbose=0).dtype) == "bfloat16"
    kmp.keep_float32(model, ATTENTION, "head")
    # fit/predict traced their step before: traced again with the new dtypes.
    assert model.predict(x, verbose=0).dtype == np.float32
    history = model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert kmp.audit(model).ok


def test_keep_float32_and_float32_outputs_work_together():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model()
    kmp.keep_float32(model, "head")
    assert kmp.float32_outputs(model) is model  # its output is float32 already
    fixed = kmp.float32_outputs(attention_model(name="other"))
    changed = kmp.keep_float32(fixed, ATTENTION)  # the clone's sublayers: new names
    assert changed[0] == ATTENTION and len(changed) == len(ATTENTION_LAYERS)
    assert isinstance(fixed.layers[-1], Float32Output)
    assert keras.backend.standardize_dtype(fixed(batch()).dtype) == "float32"


def test_kept_layers_survive_save_and_load(tmp_path):
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model()
    kmp.keep_float32(model, ATTENTION)
    path = tmp_path / "kept.keras"
    model.save(path)
    loaded = kmp.load_model(path)
    attention = loaded.get_layer(ATTENTION)
    kept = attention._flatten_layers(include_self=True)  # new names for the nameless ones
    assert len(kept) == len(ATTENTION_LAYERS)
    assert {x.compute_dtype for x in kept} == {"float32"}
    assert loaded.get_layer("head").compute_dtype == "float16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(batch())), keras.ops.convert_to_numpy(model(batch()))
    )


class AttentionNet(keras.Model):
    """A subclassed model: attention and a head, in Python code."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 4, name="attention")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(keras.ops.mean(self.attention(x, x), axis=1))


def test_keep_float32_in_a_subclassed_model():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    net = AttentionNet()
    x = batch()
    net(x)
    changed = kmp.keep_float32(net, "attention")  # its name and path; Keras's path is longer
    assert changed[0] == "attention" and net.attention.path == "attention_net/attention"
    assert "attention/softmax" in changed and len(changed) == 7
    assert net.attention._softmax.compute_dtype == "float32"
    assert keras.backend.standardize_dtype(net.attention(x, x).dtype) == "float32"
    assert keras.backend.standardize_dtype(net(x).dtype) == "bfloat16"
    assert kmp.keep_float32(net, keras.layers.Dense) == ["head"]
    assert keras.backend.standardize_dtype(net(x).dtype) == "float32"


@pytest.mark.backend_agnostic  # KerasHub on JAX: test_probing's KerasHub test
def test_keep_float32_in_a_keras_hub_model():
    pytest.importorskip("keras_hub", reason="KerasHub models need keras-hub installed")
    from tests import _zoo

    kmp.enable("mixed_float16", hardware=GPU_HW)
    lm = kmp.float32_outputs(_zoo.gpt2_causal_lm())  # its head's matmul in float16
    attention = "gpt2_backbone/transformer_layer_0/self_attention"  # as kmp.audit shows it
    assert "low-precision-attention" in kmp.audit(lm).codes()
    changed = kmp.keep_float32(lm, "transformer_layer_0/self_attention")  # Keras's path
    assert changed[0] == attention and f"{attention}/query" in changed
    block = lm.backbone.get_layer("transformer_layer_0")
    assert block._self_attention_layer._softmax.compute_dtype == "float32"
    assert block.compute_dtype == "float16"  # the rest of the block stays 16-bit
    report = kmp.audit(lm)
    assert "low-precision-attention" not in report.codes() and report.ok
    # The tied head: its layer and its reverse matmul.
    assert kmp.keep_float32(lm, "token_embedding") == ["gpt2_backbone/token_embedding"]
    head = lm.backbone.token_embedding
    assert (head.compute_dtype, head.reverse_dtype) == ("float32", "float32")
    x, _ = _zoo.lm_batch(np.random.default_rng(0))
    assert keras.backend.standardize_dtype(lm(x).dtype) == "float32"


def test_keep_float32_errors_change_nothing():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = attention_model()
    before = computes(model)
    with pytest.raises(TypeError, match="expects a Keras model"):
        kmp.keep_float32("model", "head")
    with pytest.raises(TypeError, match="separate arguments"):
        kmp.keep_float32(model, ["head"])
    for bad in (3, int, None):
        with pytest.raises(TypeError, match="layer names, paths, glob patterns"):
            kmp.keep_float32(model, "head", bad)
    assert kmp.keep_float32(model) == []  # an empty probe list: nothing to keep
    with pytest.raises(ValueError, match="call it on a batch or build it first"):
        kmp.keep_float32(keras.Sequential([keras.layers.Dense(2)]), "dense")
    with pytest.raises(ValueError, match="matches no layer") as info:
        kmp.keep_float32(model, ATTENTION, "block0_atention")  # the first one matches
    message = str(info.value)
    assert "'block0_atention'" in message and "glob patterns" in message
    assert f"{ATTENTION}, {ATTENTION}/query" in message and "head" in message
    with pytest.raises(ValueError, match="'Embedding' matches no layer"):
        kmp.keep_float32(model, keras.layers.Embedding)
    assert computes(model) == before  # nothing was half applied
    assert not any(is_kept(x) for x in model._flatten_layers())


def test_keep_float32_lists_ten_layers_in_its_error():
    deep = keras.Sequential([keras.Input((2,)), *[keras.layers.Dense(2) for _ in range(12)]])
    with pytest.raises(ValueError, match=r"layers: dense, dense_1, .*, \.\.\. \(12 in all\)"):
        kmp.keep_float32(deep, "nope")
