"""kmp.load_model(path, policy=...): a saved model served in another precision (issue 43).

A model trained under mixed_float16, one layer kept in float32 (kmp.keep_float32), saved
with kmp.save_model, loads to compute in float32, bfloat16, float16 or a mixed policy: every
layer in that policy but the kept one and kmp's float32 head, the weights cast once, the
predictions close to the trained model's (the bounds are the measured differences with a
margin, docs/serving.md).
"""

from __future__ import annotations

import json
import warnings
import zipfile

import keras
import numpy as np
import pytest

import kmp
from kmp.hardware import GPU, Hardware
from kmp.layer_walk import walk
from kmp.load_precision import plan_policies, quantized_layers, rewrite_config
from kmp.training_state import TrainingState
from tests import _zoo

GPU_HW = Hardware(gpus=(GPU("a100", (8, 0)),))  # no float16-on-CPU warning
KEPT = "norm"
HEAD = "out_float32"  # the Float32Output float32_outputs puts after "out"
# Largest |difference| of the softmax outputs from the mixed_float16 model's, measured for
# the model below (Keras 3.15, CPU; TensorFlow / JAX): 4.9e-4 / 7.9e-4 in float32, 4.4e-3 /
# 4.5e-3 in bfloat16 and mixed_bfloat16, 0 in float16 (the same float16 products). The
# bounds leave about 4x.
BOUNDS = {"float32": 3e-3, "bfloat16": 2e-2, "mixed_bfloat16": 2e-2, "float16": 1e-3}

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 16)).astype("float32")
Y = rng.integers(0, 4, size=(64,))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained a few steps under mixed_float16, "norm" kept; its file and predictions."""
    keras.utils.set_random_seed(0)  # the measured figures are this model's
    with kmp.policy_scope("mixed_float16", hardware=GPU_HW):
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu", name="dense1"),
                keras.layers.LayerNormalization(name=KEPT),
                keras.layers.Dense(32, activation="relu", name="dense2"),
                keras.layers.Dense(4, activation="softmax", name="out"),
            ]
        )
        model = kmp.float32_outputs(model)
        assert kmp.keep_float32(model, KEPT) == [KEPT]
        model.compile(
            optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)),
            loss="sparse_categorical_crossentropy",
        )
        model.fit(X, Y, epochs=2, batch_size=16, verbose=0)
        predictions = keras.ops.convert_to_numpy(model(X))
        path = tmp_path_factory.mktemp("served") / "model.keras"
        kmp.save_model(model, path)
    return path, predictions, int(model.optimizer.iterations)


def layers_of(model):
    """Path -> (compute dtype, the dtypes of the layer's variables)."""
    return {
        v.path: (v.layer.compute_dtype, {w.dtype for w in v.layer.weights})
        for v in walk(model, inputs=False)
    }


def difference(model, predictions) -> float:
    out = model(X)
    assert out.dtype == "float32"  # kmp's head keeps the outputs float32
    return float(np.max(np.abs(keras.ops.convert_to_numpy(out) - predictions)))


def test_the_file_records_the_kept_layer(trained):
    path, _, _ = trained
    assert kmp.saving.read_state(path).kept_float32 == (KEPT,)
    # A record written before the field existed reads as "none kept".
    old = json.loads(TrainingState(kept_float32=(KEPT,)).to_json())
    del old["kept_float32"]
    assert TrainingState.from_json(json.dumps(old)).kept_float32 == ()


def test_loaded_in_float32_everything_is_float32(trained):
    path, predictions, _ = trained
    model = kmp.load_model(path, policy="float32")
    assert all(
        compute == "float32" and variables <= {"float32"}
        for compute, variables in layers_of(model).values()
    )
    assert difference(model, predictions) < BOUNDS["float32"]
    assert not getattr(model, "compiled", False)  # served: no optimizer


@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_loaded_in_a_pure_16_bit_policy(trained, policy):
    path, predictions, _ = trained
    model = kmp.load_model(path, policy)
    layers = layers_of(model)
    assert layers.pop(KEPT) == ("float32", {"float32"})  # kept, weights too (in the config)
    assert layers.pop(HEAD) == ("float32", set())
    assert layers == {name: (policy, {policy}) for name in ("dense1", "dense2", "out")}
    assert difference(model, predictions) < BOUNDS[policy]
    # Cast once, at load: each weight is the saved float32 value rounded to the new dtype.
    saved = kmp.load_model(path, compile=False)
    for name in ("dense1", "out"):
        pairs = zip(model.get_layer(name).weights, saved.get_layer(name).weights, strict=True)
        for new, old in pairs:
            want = keras.ops.convert_to_numpy(old).astype(policy)
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(new), want)


def test_loaded_in_mixed_bfloat16_the_audit_sees_the_kept_layer(trained, tmp_path):
    path, predictions, _ = trained
    model = kmp.load_model(path, "mixed_bfloat16")
    layers = layers_of(model)
    assert layers.pop(KEPT) == ("float32", {"float32"})
    assert layers.pop(HEAD) == ("float32", set())
    assert layers == {name: ("bfloat16", {"float32"}) for name in ("dense1", "dense2", "out")}
    assert difference(model, predictions) < BOUNDS["mixed_bfloat16"]
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert not [f for f in kmp.audit(model).findings if f.code == "policy-mismatch"]
    # Without kmp's record (the state entry left out, as model.save writes the file) the
    # mark travels in the layer's config and the model's: kept on every load, and shown.
    plain = tmp_path / "plain.keras"
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(plain, "w") as new:
        for name in old.namelist():
            if name != "kmp_state.json":
                new.writestr(name, old.read(name))
    assert layers_of(kmp.load_model(plain, "mixed_bfloat16"))[KEPT][0] == "float32"
    for loaded in (kmp.load_model(plain, compile=False), keras.saving.load_model(plain)):
        assert layers_of(loaded)[KEPT][0] == "float32"
        assert [r.name for r in kmp.audit(loaded).rows if r.kept_float32] == [KEPT]


def test_policy_none_loads_as_saved(trained):
    path, predictions, iterations = trained
    model = kmp.load_model(path)
    layers = layers_of(model)
    assert layers["dense1"] == ("float16", {"float32"})
    assert layers[KEPT] == ("float32", {"float32"})
    assert int(model.optimizer.iterations) == iterations  # the optimizer, as before
    assert difference(model, predictions) == 0.0


def test_auto_is_this_machines_choice(trained, monkeypatch):
    monkeypatch.setattr(kmp.hardware, "detect", lambda: GPU_HW)
    model = kmp.load_model(trained[0], policy="auto")
    assert layers_of(model)["dense1"] == ("bfloat16", {"float32"})  # an A100: mixed_bfloat16
    assert keras.config.dtype_policy().name == "float32"  # the global policy is left alone


def test_bad_policies_are_refused(trained):
    path = trained[0]
    with pytest.raises(ValueError, match="Valid names: auto, float32, mixed_float16"):
        kmp.load_model(path, policy="fp8")
    with pytest.raises(TypeError, match="policy name"):
        kmp.load_model(path, policy=16)
    with pytest.raises(ValueError, match="uncompiled"):
        kmp.load_model(path, policy="float32", compile=True)


def test_the_plan_is_read_from_the_config_alone(trained):
    with zipfile.ZipFile(trained[0]) as archive:
        config = json.loads(archive.read("config.json"))
    plan = plan_policies(config, "bfloat16", kept=[KEPT])
    # Every layer with a policy (a Functional root, the input layer and the head have none).
    assert plan == {
        "dense1": "bfloat16",
        KEPT: "float32",
        "dense2": "bfloat16",
        "out": "bfloat16",
    }
    text = json.dumps(rewrite_config(config, plan))
    assert '"mixed_float16"' not in text and '"dtype": "float32", "sparse"' in text  # the input
    assert json.dumps(config).count("mixed_float16") > 0  # the original is unchanged


def test_the_plan_leaves_integer_policies_and_quantized_modes_right():
    def layer(name, dtype, **more):
        return {"class_name": "L", "config": {"name": name, "dtype": dtype, **more}}

    def policy(kind, **config):
        return {"module": "keras", "class_name": kind, "config": config}

    config = layer(
        "task",
        policy("DTypePolicy", name="mixed_float16"),
        layers=[
            layer("tokenizer", policy("DTypePolicy", name="int32")),
            layer("lookup", "string"),
            layer("q", policy("QuantizedDTypePolicy", mode="int8", source_name="mixed_float16")),
            layer(
                "block",
                "mixed_float16",
                layers=[layer("norm", policy("DTypePolicy", name="float32"))],
            ),
        ],
    )
    plan = plan_policies(config, "bfloat16", kept=["block"])
    assert plan == {
        "": "bfloat16",
        "q": "int8_from_bfloat16",
        "block": "float32",
        "block/norm": "float32",
    }
    assert rewrite_config(config, plan)["config"]["layers"][0]["config"]["dtype"]["config"] == {
        "name": "int32"
    }
    assert quantized_layers(config) == ["q"]  # what kmp.load_model reads to resume
    assert quantized_layers(config["config"]["layers"][3]) == []


@keras.saving.register_keras_serializable(package="test_load_precision")
class Net(keras.Model):
    """A subclassed model: its layers are built in __init__, not in its config."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, activation="relu", name="dense")
        self.norm = keras.layers.LayerNormalization(name=KEPT)
        self.logits = keras.layers.Dense(3, name="logits")

    def call(self, x):
        return self.logits(self.norm(self.dense(x)))


def test_a_subclassed_model_loads_in_another_precision(tmp_path):
    x = X[:8]
    with kmp.policy_scope("mixed_bfloat16", hardware=GPU_HW):
        model = Net()
        model(x)
        kmp.keep_float32(model, KEPT)
        model = kmp.float32_outputs(model)  # in place: Float32Outputs[Net]
        kmp.save_model(model, tmp_path / "net.keras")
    # Trained weights are float32: the float32 model is the reference.
    reference = keras.ops.convert_to_numpy(kmp.load_model(tmp_path / "net.keras", "float32")(x))
    served = kmp.load_model(tmp_path / "net.keras", "mixed_float16")
    layers = layers_of(served)
    assert layers == {
        "dense": ("float16", {"float32"}),
        KEPT: ("float32", {"float32"}),
        "logits": ("float16", {"float32"}),
    }
    out = served(x)
    assert out.dtype == "float32"
    assert np.max(np.abs(keras.ops.convert_to_numpy(out) - reference)) < 1e-2
    # Pure bfloat16: the kept layer (built by Net itself) is kept by the model's own config
    # (KeepsFloat32) before it builds, so its weights are float32 too: nothing to warn about.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pure = kmp.load_model(tmp_path / "net.keras", "bfloat16")
    assert layers_of(pure)[KEPT] == ("float32", {"float32"})
    assert layers_of(pure)["dense"] == ("bfloat16", {"bfloat16"})
    # Keras's own loader keeps it too, and kmp.audit shows it as kept.
    loaded = keras.saving.load_model(tmp_path / "net.keras")
    assert layers_of(loaded)[KEPT][0] == "float32"
    assert [r.name for r in kmp.audit(loaded).rows if r.kept_float32] == [KEPT]


def test_a_keras_application_loads_in_another_precision(tmp_path):
    x, _ = _zoo.image_batch(np.random.default_rng(1), batch=2)
    with kmp.policy_scope("mixed_float16", hardware=GPU_HW):
        model = kmp.float32_outputs(
            keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None, classes=10)
        )
        predictions = keras.ops.convert_to_numpy(model(x))
        kmp.save_model(model, tmp_path / "app.keras")
    served = kmp.load_model(tmp_path / "app.keras", "bfloat16")
    assert {w.dtype for w in served.weights} == {"bfloat16"}
    computes = {compute for compute, _ in layers_of(served).values()}
    assert computes == {"bfloat16", "float32"}  # float32: the head alone
    assert [p for p, (c, _) in layers_of(served).items() if c == "float32"] == [
        served.layers[-1].name
    ]
    out = served(x)
    assert out.dtype == "float32"
    assert np.max(np.abs(keras.ops.convert_to_numpy(out) - predictions)) < 2e-2


def test_a_kerashub_task_loads_in_another_precision(tmp_path):
    pytest.importorskip("keras_hub")
    x, _ = _zoo.lm_batch(np.random.default_rng(2))
    with kmp.policy_scope("mixed_bfloat16", hardware=GPU_HW):
        model = kmp.float32_outputs(_zoo.gpt2_causal_lm())
        kept = kmp.keep_float32(model, "*layer_norm")
        predictions = keras.ops.convert_to_numpy(model(x))
        kmp.save_model(model, tmp_path / "lm.keras")
    assert kept and kmp.saving.read_state(tmp_path / "lm.keras").kept_float32 == tuple(kept)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # float32 variables: nothing to report
        served = kmp.load_model(tmp_path / "lm.keras", policy="float32")
    assert {w.dtype for w in served.weights} == {"float32"}
    assert {compute for compute, _ in layers_of(served).values()} == {"float32"}
    out = served(x)
    assert out.dtype == "float32"
    assert np.max(np.abs(keras.ops.convert_to_numpy(out) - predictions)) < 5e-2
    mixed = kmp.load_model(tmp_path / "lm.keras", policy="mixed_float16")
    layers = layers_of(mixed)
    assert all(layers[p][0] == "float32" for p in kept)
    assert layers["gpt2_backbone/token_embedding"][0] == "float16"


# ------------------------------------------ layers pinned by their author (issue 56)


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """The Keras guide's way: a mixed_float16 Functional model with a float32 norm and
    softmax, trained a few steps and saved with Keras's model.save."""
    keras.utils.set_random_seed(0)
    with kmp.policy_scope("mixed_float16", hardware=GPU_HW):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
        hidden = keras.layers.LayerNormalization(dtype="float32", name="ln")(hidden)
        logits = keras.layers.Dense(4, name="logits")(hidden)
        outputs = keras.layers.Activation("softmax", dtype="float32", name="softmax")(logits)
        model = keras.Model(inputs, outputs)
        model.compile(
            kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)), "sparse_categorical_crossentropy"
        )
        model.fit(X, Y, epochs=2, batch_size=16, verbose=0)
        path = tmp_path_factory.mktemp("pinned") / "guide.keras"
        model.save(path)
    return path, keras.ops.convert_to_numpy(model(X))


@pytest.mark.parametrize("policy", ["bfloat16", "mixed_bfloat16", "float16"])
def test_layers_pinned_with_dtype_float32_stay_float32(pinned, policy):
    path, predictions = pinned
    served = kmp.load_model(path, policy=policy)
    computes = {name: compute for name, (compute, _) in layers_of(served).items()}
    low = policy.removeprefix("mixed_")
    assert computes == {"dense": low, "ln": "float32", "logits": low, "softmax": "float32"}
    out = served(X)
    assert out.dtype == "float32"
    assert np.max(np.abs(keras.ops.convert_to_numpy(out) - predictions)) < BOUNDS[policy]


def test_keep_pinned_false_casts_them_and_keeps_float32_outputs(pinned):
    path, predictions = pinned
    served = kmp.load_model(path, policy="bfloat16", keep_pinned=False)
    computes = {name: compute for name, (compute, _) in layers_of(served).items()}
    # The softmax became kmp's float32 head, so the outputs keep their dtype.
    assert computes == {
        "dense": "bfloat16",
        "ln": "bfloat16",
        "logits": "bfloat16",
        "softmax_float32": "float32",
    }
    assert served(X).dtype == "float32"
    assert np.max(np.abs(keras.ops.convert_to_numpy(served(X)) - predictions)) < 5e-2
    with pytest.raises(TypeError, match="keep_pinned"):
        kmp.load_model(path, policy="bfloat16", keep_pinned="no")


def test_a_float32_model_served_in_16_bits_keeps_float32_outputs(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(4, activation="softmax")]
    )
    model.save(tmp_path / "f32.keras")
    served = kmp.load_model(tmp_path / "f32.keras", policy="bfloat16")
    assert {c for c, _ in layers_of(served).values()} == {"bfloat16", "float32"}  # + the head
    assert served(X).dtype == "float32"


def layer(name, dtype, **more):
    """A saved layer config whose policy is ``dtype`` (as Keras 3.4+ saves it)."""
    policy = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": dtype}}
    return {"class_name": "L", "config": {"name": name, "dtype": policy, **more}}


def test_what_the_model_trained_in_and_what_is_pinned_are_read_from_the_config():
    from kmp.load_precision import computes_in_16_bits

    def functional(*dtypes):
        layers = [layer(f"l{i}", d) for i, d in enumerate(dtypes)]
        return {"class_name": "Functional", "config": {"name": "f", "layers": layers}}

    assert computes_in_16_bits(functional("mixed_float16", "float32", "float32", "mixed_float16"))
    assert not computes_in_16_bits(functional("float32", "float32", "mixed_float16"))
    assert computes_in_16_bits(layer("seq", "mixed_bfloat16", layers=[layer("a", "float32")]))
    # In a float32 model nothing is pinned; in a 16-bit one, float32 layers are.
    assert plan_policies(functional("float32", "float32", "mixed_float16"), "bfloat16") == {
        "l0": "bfloat16",
        "l1": "bfloat16",
        "l2": "bfloat16",
    }
    mixed = functional("mixed_float16", "float32")
    assert plan_policies(mixed, "bfloat16") == {"l0": "bfloat16", "l1": "float32"}
    assert plan_policies(mixed, "bfloat16", keep_pinned=False) == {
        "l0": "bfloat16",
        "l1": "bfloat16",
    }


def test_whether_the_outputs_were_float32_is_read_from_the_config():
    from kmp.load_precision import forget_kept, outputs_were_float32

    def functional(out_dtype, head=False):
        last = (
            {"class_name": "Float32Output", "config": {"name": "out"}}
            if head
            else layer("out", out_dtype)
        )
        config = {
            "name": "f",
            "layers": [layer("a", "mixed_float16"), last],
            "output_layers": ["out", 0, 0],
        }
        return {"class_name": "Functional", "config": config}

    assert outputs_were_float32(functional("float32"))
    assert not outputs_were_float32(functional("mixed_float16"))
    assert outputs_were_float32(functional(None, head=True))
    named = functional("float32")  # outputs by name, as a model returning a dict saves them
    named["config"]["output_layers"] = {"out": ["out", 0, 0], "a": ["a", 0, 0]}
    assert outputs_were_float32(named) is False  # "a" computes in float16
    del named["config"]["output_layers"]["a"]
    assert outputs_were_float32(named)
    keeps = {
        "registered_name": "kmp>KeepsFloat32",
        "config": {"model": functional("float32"), "kept_float32": ["a"]},
    }
    assert outputs_were_float32(keeps)
    assert forget_kept(keeps)["config"]["kept_float32"] == [] and keeps["config"][
        "kept_float32"
    ] == ["a"]
    subclassed = {"class_name": "Net", "config": layer("n", "mixed_float16")["config"]}
    assert outputs_were_float32(subclassed) is False
    assert outputs_were_float32({"class_name": "Net", "config": {"name": "n"}}) is None
