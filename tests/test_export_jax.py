"""kmp.export from Keras's JAX backend: a SavedModel through jax2tf, run in TensorFlow.

A child process on the JAX backend (this suite runs on TensorFlow) trains a two-input
model under mixed_bfloat16, exports it as a float32 and a bfloat16 SavedModel, and
reports what the verification measured; an ONNX request there names the bridge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests._support import ROOT
from tests.test_export import pytestmark as _export_marks
from tests.test_zoo import needs_hub

pytestmark = _export_marks

CHILD = textwrap.dedent(
    """
    import json, sys
    import keras, numpy as np
    import kmp

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = {"features": rng.normal(size=(256, 8)).astype("float32"),
         "token_ids": rng.integers(0, 30, size=(256, 5))}
    y = (x["features"][:, 0] > 0).astype("int32") + 2 * (x["token_ids"][:, 0] > 15)
    with kmp.policy_scope("mixed_bfloat16"):
        features = keras.Input((8,), name="features")
        ids = keras.Input((None,), dtype="int32", name="token_ids")
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 8)(ids))
        hidden = keras.layers.Dense(32, activation="relu")(
            keras.layers.Concatenate()([features, pooled]))
        model = kmp.float32_outputs(keras.Model(
            {"features": features, "token_ids": ids},
            keras.layers.Dense(4, activation="softmax")(hidden)))
        model.compile(kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)),
                      "sparse_categorical_crossentropy")
        model.fit(x, y, epochs=3, verbose=0)
    out = {"backend": keras.backend.backend()}
    for precision in ("float32", "bfloat16"):
        r = kmp.export(model, f"{sys.argv[1]}/{precision}", "saved_model", precision,
                       sample=x, labels=y, verbose=False)
        out[precision] = r.to_dict()
    try:
        kmp.export(model, f"{sys.argv[1]}/m.onnx", "onnx", sample=x)
    except RuntimeError as exc:
        out["onnx_error"] = str(exc)
    print("RESULT " + json.dumps(out, default=str))
    """
)


def _on_jax(script: str, folder) -> dict:
    """Run ``script`` (given ``folder``) in a child on the JAX backend: its RESULT line."""
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(folder)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_a_model_trained_on_jax_exports_a_verified_saved_model(tmp_path):
    out = _on_jax(CHILD, tmp_path)
    assert out["backend"] == "jax"
    exact, half = out["float32"], out["bfloat16"]
    for r in (exact, half):
        assert r["runtime"] == "TensorFlow" and r["samples"] == 256
        assert r["input_dtype"] in ("float32, int32", "int32, float32")
        assert r["output_dtype"] == "float32"
    assert exact["max_abs_diff"] < 1e-5 and exact["top1_agreement"] == 1.0
    assert exact["accuracy"] == exact["float32_accuracy"] > 0.5  # trained: better than 0.25
    assert 0 < half["max_abs_diff"] < 5e-2 and half["top1_agreement"] >= 0.95
    import tensorflow as tf

    stored = {v.dtype.name for v in tf.saved_model.load(str(tmp_path / "bfloat16")).variables}
    assert stored == {"bfloat16"}  # the weights are stored in 16 bits (the graph dominates)
    assert "KERAS_BACKEND=tensorflow" in out["onnx_error"]
    assert os.path.isdir(tmp_path / "bfloat16") and not os.path.exists(tmp_path / "m.onnx")


STEP_CHILD = textwrap.dedent(
    """
    import json, sys
    import keras, keras_hub, numpy as np
    from kmp.exporting import (
        cached_step, export, greedy, greedy_cached, greedy_loop, open_runner)

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=1, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=64)
    gpt = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    gpt.compile(sampler="greedy")
    prompt = np.random.default_rng(0).integers(0, 256, (4, 16)).astype("int32")
    ids = np.zeros((4, 48), "int32"); ids[:, :16] = prompt
    mask = np.zeros_like(ids, bool); mask[:, :16] = True
    ref = gpt.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
    step = cached_step(gpt, 48)  # built on JAX: its spec traced on one token
    cache = np.zeros((4, *step.input["kv_cache"].shape[1:]), "float32")
    one = {"token_ids": prompt[:, :1], "kv_cache": cache, "index": np.zeros(4, "int32")}
    r = export(step, sys.argv[1] + "/step", "saved_model", sample=one, verbose=False)
    runner = open_runner(sys.argv[1] + "/step")
    tokens = greedy_cached(runner, prompt, 32)
    window = {"token_ids": ids, "padding_mask": mask.astype("int32")}
    loop = export(greedy_loop(gpt), sys.argv[1] + "/loop", "saved_model", sample=window,
                  verbose=False)
    looped = greedy(open_runner(sys.argv[1] + "/loop"), prompt, 32)
    print("RESULT " + json.dumps({
        "same": bool((tokens == np.asarray(ref["token_ids"])).all()),
        "loop_same": bool((looped == np.asarray(ref["token_ids"])).all()),
        "loop_identical": loop.outputs["token_ids"].identical,
        "served": {k: list(v) for k, v in runner.input_shapes.items()},
        "max_abs_diff": r.max_abs_diff}))
    """
)


@needs_hub
def test_a_kerashub_step_and_loop_exported_from_jax_generate_kerass_tokens(tmp_path):
    out = _on_jax(STEP_CHILD, tmp_path)
    assert out["served"]["token_ids"] == [None, 1]  # JAX: the sample's length, one token
    assert out["max_abs_diff"] < 1e-4
    assert out["same"]  # the prompt fed token by token, then 32 greedy tokens: Keras's
    assert out["loop_identical"] == 1.0 and out["loop_same"]  # the loop in TensorFlow
