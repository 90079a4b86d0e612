# %% [markdown]
# # Train mixed, serve anywhere
#
# A model trained under a mixed policy is saved with each layer's policy, and Keras builds
# every layer with it again when the file loads: trained under `mixed_bfloat16`, it computes
# in bfloat16 wherever it is served, even where bfloat16 is slow. Serving wants a choice:
# float32 where accuracy is all, 16 bits where the hardware is fast at them, int8 where
# memory and speed matter most, and a file that runs without Keras (ONNX, LiteRT).
#
# This notebook trains a small CNN on real handwritten digits under `mixed_bfloat16`, saves
# it once, and then:
#
# 1. loads it to compute in **float32** and in **bfloat16** (`kmp.load_model(path, policy=...)`);
# 2. **exports** it to ONNX with float16 weights (`kmp.export`), verified in onnxruntime;
# 3. **quantizes** a float32 copy to int8 (`kmp.quantize`), each layer's error measured first;
# 4. measures every one of them side by side: accuracy on the held-out digits against
#    throughput, in one plot;
# 5. fine-tunes a KerasHub GPT-2 under `mixed_float16`, exports it to ONNX float16 and its
#    greedy generation loop to a SavedModel, and generates from the file.
#
# It runs on a laptop CPU in about a minute and downloads nothing (the digits ship inside
# scikit-learn, the text is Python's own standard library). `kmp bench --only inference`
# is the same measurement on larger models (ResNet50, a GPT); docs/serving.md and
# docs/exporting.md have its figures.

# %%
# Colab, or a kernel without kmp: install it first, from a clone of kmp's repository in ./kmp
# (or the path or URL in KMP_SOURCE). Where kmp is installed, this cell does nothing.
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("kmp") is None:
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", os.environ.get("KMP_SOURCE", "./kmp")]
    )

# %%
%matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up logs quiet
os.environ.pop("KMP_POLICY", None)  # this notebook sets its policies explicitly

import tempfile
import time

import keras
import matplotlib.pyplot as plt
import numpy as np

import kmp
from kmp.datasets import digits

WORK = tempfile.mkdtemp(prefix="kmp-serving-")
print("files go to", WORK)

# %% [markdown]
# ## 1. Train under mixed_bfloat16, save once
#
# The scikit-learn digits (1,797 images of 8x8 pixels), split 80/20 by class. The model
# is trained under `mixed_bfloat16` (bfloat16 arithmetic, float32 weights), its output
# layer in float32 (`kmp.float32_outputs`), and saved with `kmp.save_model`: the file holds
# the weights, the optimizer and each layer's policy.

# %%
images, labels = digits.load_arrays()
train, test = digits.split_indices(labels)
x = images.astype("float32") / 255.0
x_train, y_train, x_test, y_test = x[train], labels[train], x[test], labels[test]

keras.utils.set_random_seed(0)
with kmp.policy_scope("mixed_bfloat16"):
    model = kmp.float32_outputs(
        keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10, activation="softmax", name="probs"),
            ],
            name="digits_cnn",
        )
    )
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-3)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=64, epochs=6, verbose=0)
    _, trained_accuracy = model.evaluate(x_test, y_test, verbose=0)

saved = os.path.join(WORK, "digits.keras")
kmp.save_model(model, saved)
print(f"trained under mixed_bfloat16: test accuracy {trained_accuracy:.3f}")
print(f"saved {os.path.getsize(saved) / 1e6:.2f} MB, {model.count_params():,} parameters")

# %% [markdown]
# ## 2. Load it in another precision
#
# `kmp.load_model(path, policy=...)` rewrites each saved layer's policy before Keras builds
# the model: with `"float32"` every layer computes and stores its variables in float32;
# with `"bfloat16"` the weights themselves are bfloat16 (half the memory). The outputs stay
# float32 either way, and the saved weights are cast once, as they load.

# %%
served = {}
for policy in ("float32", "bfloat16"):
    served[policy] = kmp.load_model(saved, policy=policy)
    m = served[policy]
    weight_dtypes = sorted({str(w.dtype) for w in m.weights})
    probs = m.predict_on_batch(x_test)
    accuracy = np.mean(np.argmax(probs, -1) == y_test)
    print(f"{policy:9s} weights {weight_dtypes}, outputs {probs.dtype}, accuracy {accuracy:.3f}")

as_saved = kmp.load_model(saved)
print("loaded as saved: the Dense layer computes in", as_saved.layers[-2].compute_dtype)

# %% [markdown]
# ## 3. Export to ONNX with float16 weights
#
# `kmp.export` writes the file and then runs it in its own runtime (onnxruntime here) on
# the inputs you pass, against the model in float32: the largest difference, the top-1
# agreement, the accuracy with labels, and the file's size beside its float32 size.
# Inputs and outputs stay float32; only the weights and the arithmetic are 16-bit.

# %%
onnx_path = os.path.join(WORK, "digits-float16.onnx")
exported = kmp.export(
    served["float32"], onnx_path, format="onnx", precision="float16",
    sample=x_test, labels=y_test,
)

# %% [markdown]
# ## 4. Quantize to int8
#
# `kmp.quantize` measures first: each layer Keras can quantize is copied, the copy
# quantized and fed the layer's real inputs from your batch, and only the layers whose
# error stays under the threshold are quantized in place. The report says, per layer,
# what happened and why.

# %%
int8_model = kmp.load_model(saved, policy="float32")
report = kmp.quantize(int8_model, "int8", x_train[:512], labels=y_train[:512])
print(report)

# %% [markdown]
# ## 5. Accuracy against speed, side by side
#
# Each version predicts the held-out digits (accuracy) and is timed on batches of 64
# (median of 30 calls after two warm-up calls, in this one process). The ONNX file is
# timed in an onnxruntime session, as a server would keep it.

# %%
import onnxruntime

session = onnxruntime.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
onnx_input = session.get_inputs()[0].name
candidates = {
    "trained (mixed_bfloat16)": as_saved.predict_on_batch,
    "float32": served["float32"].predict_on_batch,
    "bfloat16": served["bfloat16"].predict_on_batch,
    "int8": int8_model.predict_on_batch,
    "ONNX float16": lambda batch: session.run(None, {onnx_input: batch})[0],
}


def examples_per_second(predict, batch, calls=30):
    for _ in range(2):
        predict(batch)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        predict(batch)
        times.append(time.perf_counter() - start)
    return len(batch) / float(np.median(times))


rows = []
for name, predict in candidates.items():
    accuracy = float(np.mean(np.argmax(np.asarray(predict(x_test)), -1) == y_test))
    speed = examples_per_second(predict, x_test[:64])
    rows.append((name, accuracy, speed))
    print(f"{name:26s} accuracy {accuracy:.3f}   {speed:10,.0f} examples/s")

fig, ax = plt.subplots(figsize=(7, 4))
for name, accuracy, speed in rows:
    ax.scatter(speed, accuracy, s=60)
    ax.annotate(name, (speed, accuracy), textcoords="offset points", xytext=(6, 4))
ax.set_xscale("log")
ax.set_xlabel("examples/s at batch 64 (log scale)")
ax.set_ylabel("test accuracy")
ax.set_title("One trained model, served five ways")
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ### What these numbers mean
#
# * **Accuracy barely moves.** The weights were trained in float32 (mixed precision keeps
#   them so); serving them in bfloat16, float16 or int8 rounds them once, and the model's
#   decisions change on a handful of test images at most. `kmp.quantize` keeps any layer
#   whose measured error would be too large.
# * **Speed depends on the machine and on the model's size.** A model this small spends
#   most of a Keras `predict_on_batch` call in per-call overhead, which is why the
#   onnxruntime session, with almost none, is far ahead. bfloat16 pays on CPUs with
#   AVX512_BF16 or AMX and on recent GPUs; elsewhere it is converted to float32 and back.
#   `kmp bench --only inference` measures the same on ResNet50 and a GPT, where the
#   arithmetic dominates: docs/serving.md has the figures and the CPU they ran on.
# * **Files**: the float16 ONNX file is about half the float32 one
#   (`exported.size_ratio` above); the int8 model's kernels take a quarter of float32's.


# %% [markdown]
# ## 6. A fine-tuned GPT: export it, generate from the file
#
# The models people most often fine-tune and then serve are transformers. KerasHub's
# `GPT2CausalLM` (here a small config with random weights: a preset such as
# `gpt2_base_en` takes the same path) is fine-tuned briefly under `mixed_float16` on real
# text, the Python standard library's sources, one token per byte. Then:
#
# * the task goes to **ONNX with float16 weights**, its next-token logits verified in
#   onnxruntime on held-out text (its two integer inputs, `token_ids` and `padding_mask`,
#   stay integers);
# * Keras's greedy `generate` whole (`kmp.exporting.greedy_loop`: the key/value cache and
#   the loop inside) goes to a **SavedModel**, and `kmp.exporting.greedy` generates from
#   the file in one call. Its tokens are compared with Keras's own `generate`.

# %%
import keras_hub

from kmp.datasets import text
from kmp.exporting import greedy, greedy_loop, open_runner

corpus = text.read_corpus(max_bytes=200_000).data.astype("int32")
windows = corpus[: 1600 * 33].reshape(1600, 33)  # windows of 32 bytes and the next
train_text, held_text = windows[:1536], windows[1536:]


def lm_inputs(rows):
    return {"token_ids": rows[:, :-1], "padding_mask": np.ones_like(rows[:, :-1])}


keras.utils.set_random_seed(0)
with kmp.policy_scope("mixed_float16"):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=2, num_heads=2, hidden_dim=64,
        intermediate_dim=256, max_sequence_length=64,
    )  # fmt: skip
    gpt = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    gpt.compile(kmp.wrap_optimizer(keras.optimizers.Adam(3e-3)))
    gpt.fit(lm_inputs(train_text), train_text[:, 1:], epochs=4, batch_size=32, verbose=0)

gpt_onnx = kmp.export(
    gpt, os.path.join(WORK, "gpt.onnx"), format="onnx", precision="float16",
    sample=lm_inputs(held_text), labels=held_text[:, 1:], verbose=False,
)  # fmt: skip
print(gpt_onnx)

# %% [markdown]
# Generation compares tokens exactly, so it runs on a float32 copy (`kmp.load_model` with
# `policy="float32"`). The prompt is 16 bytes of held-out text; 32 more are generated. A
# model this small, trained for seconds on source code, has learned mostly its indentation:
# expect spaces. What matters here is that the file gives Keras's tokens, in one call.

# %%
gpt_path = os.path.join(WORK, "gpt.keras")
kmp.save_model(gpt, gpt_path)
gpt32 = kmp.load_model(gpt_path, policy="float32")
gpt32.compile(sampler="greedy")

prompt = held_text[:4, :16]
ids = np.zeros((4, 48), "int32")
ids[:, :16] = prompt
mask = np.zeros((4, 48), "int32")
mask[:, :16] = 1


def timed(fn):
    fn()  # the first call compiles (Keras) or plans (the runtime)
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


keras_ids, keras_s = timed(lambda: gpt32.generate(
    {"token_ids": ids, "padding_mask": mask.astype(bool)}, stop_token_ids=None)["token_ids"])

loop_path = os.path.join(WORK, "gpt-loop")
loop = kmp.export(greedy_loop(gpt32), loop_path, format="saved_model",
                  sample={"token_ids": ids, "padding_mask": mask}, verbose=False)  # fmt: skip
runner = open_runner(loop_path)
file_ids, file_s = timed(lambda: greedy(runner, prompt, 32))  # one call: the loop in TF
print("identical to Keras's generate:", bool((file_ids == np.asarray(keras_ids)).all()))
print(f"tokens/s: Keras generate {128 / keras_s:.0f}, the exported loop {128 / file_s:.0f}")
for row in file_ids:
    print(repr(bytes(row[:16].tolist()).decode("utf-8", "replace")), "->",
          repr(bytes(row[16:].tolist()).decode("utf-8", "replace")))  # fmt: skip

# %% [markdown]
# ## Where to go next
#
# * docs/serving.md, docs/exporting.md and docs/quantization.md: the guides, with every
#   option and the measured differences.
# * [05_transformers.ipynb](05_transformers.ipynb): a transformer in float16, where the
#   numbers go.
