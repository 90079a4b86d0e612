"""kmp/layer_walk.py: the one walk over a model's layers, and the paths all three share."""

import keras
import numpy as np
import pytest

import kmp
from kmp.layer_walk import calls_replaced, sublayers, walk
from tests.test_float32_layers import ATTENTION, attention_model, batch
from tests.test_layers import GPU_HW


def nested_model():
    inner = attention_model()  # "gpt": attention, add, pool, head
    inp = keras.Input((5, 8))
    return keras.Model(inp, inner(inp), name="outer")


def test_every_layer_once_parents_first_with_its_path():
    model = nested_model()
    visits = list(walk(model))
    assert len({id(v.layer) for v in visits}) == len(visits)
    paths = [v.path for v in visits if not isinstance(v.layer, keras.layers.InputLayer)]
    assert paths == [
        "gpt",
        f"gpt/{ATTENTION}",
        *(
            f"gpt/{ATTENTION}/{n}"
            for n in ("query", "key", "value", "softmax", "dropout", "attention_output")
        ),
        "gpt/add",
        "gpt/pool",
        "gpt/head",
    ]
    by_path = {v.path: v for v in visits}
    assert by_path["gpt"].is_nested_model and not by_path[f"gpt/{ATTENTION}"].is_nested_model
    # Models are no parents; other enclosing layers are.
    assert by_path[f"gpt/{ATTENTION}"].parents == ()
    assert [p.name for p in by_path[f"gpt/{ATTENTION}/softmax"].parents] == [ATTENTION]
    # InputLayer objects: shown by default (the audit's rows), left out on request.
    inputs = [v for v in visits if isinstance(v.layer, keras.layers.InputLayer)]
    assert len(inputs) == 2
    assert [v.path for v in walk(model, inputs=False)] == paths


def test_a_layer_that_cannot_list_its_sublayers_has_none():
    class Opaque(keras.layers.Layer):
        def _flatten_layers(self, *args, **kwargs):
            raise RuntimeError("no sublayers here")

        def call(self, x):
            return x

    assert sublayers(Opaque()) == []
    inp = keras.Input((4,))
    model = keras.Model(inp, Opaque(name="opaque")(keras.layers.Dense(4, name="d")(inp)))
    assert [v.path for v in walk(model, inputs=False)] == ["d", "opaque"]


def test_audit_probe_and_keep_float32_name_layers_alike():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    model = nested_model()
    paths = [v.path for v in walk(model, inputs=False)]
    rows = [r.name for r in kmp.audit(model).rows]
    assert [p for p in paths if p != "gpt"] == [r for r in rows if "input_layer" not in r]
    report = kmp.probe(model, batch(), np.zeros((4, 3), "float32"), loss="mse")
    probed = [n.name for n in report.layers]
    assert probed and set(probed) <= set(paths)
    for name in reversed(probed):  # inner layers first: each is still 16-bit when kept
        assert kmp.keep_float32(model, name)[0] == name


def test_calls_replaced_sees_every_call_and_gives_back_what_each_layer_had():
    dense, norm = keras.layers.Dense(3, name="d"), keras.layers.LayerNormalization(name="n")
    model = keras.Sequential([keras.Input((4,)), dense, norm])
    own = norm.call  # a call already set on the instance must come back as it was
    object.__setattr__(norm, "call", own)
    seen = []

    def replace(layer):
        original = layer.call
        return lambda *args, **kwargs: seen.append(layer.name) or original(*args, **kwargs)

    x = np.ones((2, 4), "float32")
    with calls_replaced([dense, norm], replace):
        model(x)
    assert seen == ["d", "n"]
    assert "call" not in dense.__dict__ and norm.__dict__["call"] is own
    model(x)
    assert seen == ["d", "n"]
    with pytest.raises(RuntimeError), calls_replaced([dense], replace):
        raise RuntimeError("restored also when the run fails")
    assert "call" not in dense.__dict__
