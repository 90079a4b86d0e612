# %% [markdown]
# # Transformers in float16: where the numbers go, and what loss scaling buys
#
# Mixed precision breaks in transformers more often than in CNNs: attention scores and masks
# can overflow float16, a large vocabulary's logits lose digits in 16 bits, and the gradients
# of a language model's loss are *averaged over every token of the batch*, so each token's
# share of them shrinks as the batch grows. float16's smallest subnormal is 2^-24 (about
# 6e-8): below it a gradient is zero.
#
# This notebook trains a small causal transformer language model on real text that is on
# every machine (the Python standard library's own sources, read as bytes) under
# `mixed_float16`, and measures:
#
# 1. what `kmp.audit` says about the model's structure before training;
# 2. what `kmp.probe` measures on a real batch: every layer's values and gradients against
#    float16's range, the layers to keep in float32 and the loss scale that fits;
# 3. how much of the float16 gradient is lost **without** loss scaling, against the same
#    gradient computed with a loss scale, as the tokens per batch grow;
# 4. two training runs from the same seed on the same batches: `loss_scale=None` against kmp's
#    dynamic loss scale started where the probe recommends, their validation-loss curves, the
#    scale and the skipped steps.
#
# It is the same model as `launch/train.py --model gpt` (there on 2 ranks); the numerics table
# in docs/benchmarks.md compares float32, mixed_bfloat16 and mixed_float16 on it over 3 seeds.

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
os.environ.pop("KMP_POLICY", None)  # this notebook sets its policy explicitly

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf

import kmp
from kmp.datasets import text

# %% [markdown]
# ## The data: bytes of the Python standard library
#
# `kmp.datasets.text.read_corpus()` reads a fixed, sorted list of the standard library's
# top-level `.py` files, capped at 1 MiB, so every machine with the same Python reads the same
# bytes (the SHA-256 says which). The last 10 % is held out for validation. A sequence of 128
# bytes is the input; the same bytes one further are the targets.

# %%
SEQ_LEN = 128
corpus = text.read_corpus()
x_train, y_train = text.windows(text.split_bytes(corpus.data, "train"), SEQ_LEN)
x_val, y_val = text.windows(text.split_bytes(corpus.data, "validation"), SEQ_LEN)
print(f"{len(corpus.data):,} bytes from {len(corpus.files)} files in {corpus.source}")
print(f"sha256 {corpus.sha256[:16]}...; {len(x_train):,} training and {len(x_val):,} "
      f"validation sequences of {SEQ_LEN} bytes")
print(repr(bytes(x_train[3, :64].astype(np.uint8)).decode("utf-8", "replace")))

# %% [markdown]
# ## The model: a small GPT in plain Keras layers
#
# Token and learned position embeddings, two pre-norm blocks (LayerNorm, causal
# `MultiHeadAttention`, residual; LayerNorm, a GELU MLP, residual), a final LayerNorm and an
# untied Dense head over the 256 byte values. Built after `kmp.enable`, every layer computes in
# float16 and keeps float32 weights; `kmp.float32_outputs` makes the logits float32 so the
# softmax cross-entropy is computed in float32.


# %%
def positions_layer(length, width):
    """A learned position embedding, added to the token embedding."""

    class AddPositions(keras.layers.Layer):
        def build(self, input_shape):
            init = keras.initializers.RandomNormal(stddev=0.02)
            self.table = self.add_weight(shape=(length, width), initializer=init, name="table")

        def call(self, x):
            return x + keras.ops.cast(self.table, x.dtype)

    return AddPositions(name="positions")


def small_gpt(seq_len=SEQ_LEN, vocab=256, width=128, depth=2, heads=4):
    tokens = keras.Input((seq_len,), dtype="int32")
    x = keras.layers.Embedding(vocab, width, name="tokens")(tokens)
    x = positions_layer(seq_len, width)(x)
    for i in range(depth):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(heads, width // heads, name=f"attention{i}")(
            h, h, use_causal_mask=True
        )
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(4 * width, activation="gelu", name=f"mlp{i}_in")(h)
        x = x + keras.layers.Dense(width, name=f"mlp{i}_out")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(tokens, keras.layers.Dense(vocab, name="logits")(x), name="small_gpt")


choice = kmp.enable("mixed_float16")
print(choice)
keras.utils.set_random_seed(0)
model = kmp.float32_outputs(small_gpt())
print(f"{model.count_params():,} parameters; logits dtype {model.outputs[0].dtype}")
print(kmp.audit(model).summary(max_rows=12))

# %% [markdown]
# ## Measuring instead of guessing: `kmp.probe`
#
# The audit reads structure: attention computed in float16 *may* overflow. `kmp.probe` runs
# one forward and backward pass on a real batch in float32 (the model's policy and weights are
# left as they were) and records every layer's output magnitudes, the gradients reaching them
# and every variable's gradient. From those it says which layers overflow float16, which
# gradients fall below float16's smallest value (2^-24) without loss scaling, the initial
# loss scale that leaves the largest gradient 8x below 65504, and which layers to keep in
# float32. `kmp.keep_float32(model, *report.keep_float32)` acts on the list (an empty list
# changes nothing). The attention key biases' gradients show as lost: their exact gradient is
# zero (a softmax ignores a shift of every score), so what is measured there is rounding noise.

# %%
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
report = kmp.probe(model, x_train[:16], y_train[:16], loss=loss_fn)
print("\n".join(str(report).splitlines()[:12]))
print("kept in float32:", kmp.keep_float32(model, *report.keep_float32))
fig = report.plot()
plt.show()

# %% [markdown]
# ## How much of the gradient float16 loses without loss scaling
#
# One forward and backward pass on a batch, twice: with the loss as it is (scale 1) and with
# the loss multiplied by kmp's initial scale, 2^15, the gradients divided by it afterwards.
# The second is the float16 gradient kmp's optimizer uses; the difference between the two is
# what scale 1 loses to underflow. Because the loss is a mean over the batch's tokens, each
# token's share of the gradient shrinks as the batch holds more tokens: the loss grows with
# the tokens per batch.

# %%
def float16_gradients(x, y, scale):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True)) * scale
    grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
    return [tf.convert_to_tensor(g).numpy().astype(np.float64) / scale for g in grads]


def relative_error(batch):
    """Per variable: |g(scale 1) - g(scale 2**15)| / |g(scale 2**15)|, and the worst five."""
    x, y = x_train[:batch], y_train[:batch]
    unscaled, scaled = float16_gradients(x, y, 1.0), float16_gradients(x, y, 2.0**15)
    errors = {}
    for var, a, b in zip(model.trainable_variables, unscaled, scaled):
        if "attention" in var.path and "key/bias" in var.path:
            continue  # its exact gradient is 0: softmax ignores a shift of every score
        errors[var.path] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return errors


batches = (8, 32, 128)
errors = {b: relative_error(b) for b in batches}
for b in batches:
    worst = sorted(errors[b].items(), key=lambda kv: -kv[1])[:3]
    print(f"{b * SEQ_LEN:6,d} tokens/batch: median error {np.median(list(errors[b].values())):.4f}, "
          "worst " + ", ".join(f"{name} {err:.3f}" for name, err in worst))

fig, ax = plt.subplots(figsize=(7, 3.5))
names = list(errors[batches[0]])
for b in batches:
    ax.plot(range(len(names)), [errors[b][n] for n in names], marker="o",
            label=f"{b * SEQ_LEN:,} tokens per batch")
ax.set_yscale("log")
ax.set_xticks(range(len(names)), [n.replace("small_gpt/", "") for n in names], rotation=90,
              fontsize=7)
ax.set_ylabel("relative error")
ax.set_title("float16 gradient at scale 1 against scale 2^15, per variable")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Training with and without loss scaling, from the same seed
#
# Two runs of the same model from the same initial weights on the same batches (16 sequences
# of 128 bytes, 2,048 tokens a step, Adam with a cosine decay): `loss_scale=None` (float16
# gradients as they come) against `kmp.wrap_optimizer`'s dynamic scale, started at the probe's
# recommendation (`initial_scale=report.recommended_loss_scale`). The validation loss is
# measured every 15 steps on 256 held-out sequences.

# %%
STEPS, EVERY, BATCH = 60, 15, 16
order = np.random.default_rng(0).permutation(len(x_train))[: STEPS * BATCH]


def train(loss_scale):
    keras.utils.set_random_seed(0)
    net = kmp.float32_outputs(small_gpt())
    kmp.keep_float32(net, *report.keep_float32)  # what the probe found, if anything
    schedule = keras.optimizers.schedules.CosineDecay(3e-3, STEPS)
    start = {"initial_scale": report.recommended_loss_scale} if loss_scale else {}
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(schedule), loss_scale=loss_scale, **start)
    net.compile(optimizer=opt, loss=loss_fn)
    history = net.fit(
        x_train[order], y_train[order], batch_size=BATCH, epochs=STEPS // EVERY,
        steps_per_epoch=EVERY, shuffle=False, verbose=0,
        validation_data=(x_val[:256], y_val[:256]), validation_batch_size=128,
    )
    return net, history.history


runs = {}
for label, setting in (("loss_scale=None", None), ("dynamic (kmp)", "dynamic")):
    net, hist = train(setting)
    runs[label] = hist
    print(f"{label:16s} final validation loss {hist['val_loss'][-1]:.4f} nats/byte, "
          f"loss scale {net.optimizer.loss_scale}, skipped steps {net.optimizer.skipped_steps}")
gap = runs["loss_scale=None"]["val_loss"][-1] / runs["dynamic (kmp)"]["val_loss"][-1] - 1
print(f"without loss scaling the final validation loss is {100 * gap:+.2f} % of kmp's")

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
steps = [EVERY * (i + 1) for i in range(STEPS // EVERY)]
for label, hist in runs.items():
    ax.plot(steps, hist["val_loss"], marker="o", label=label)
ax.set_xlabel("training step")
ax.set_ylabel("validation loss, nats per byte")
ax.set_title("mixed_float16 GPT, same seed and batches")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Reading the figures
#
# * The gradient lost to underflow without a loss scale is measured, not assumed: the error
#   printed above for each batch size. It grows with the tokens per batch, because the mean
#   over tokens divides every token's share of the gradient; language models are trained
#   with hundreds of thousands of tokens a step, far beyond what this notebook can afford on
#   a CPU, and there scale 1 loses most of the gradient of the layers printed as worst.
# * At this notebook's 2,048 tokens a step, the two training runs show what that costs on a
#   model this small: the printed difference of the final validation losses. kmp's dynamic
#   scale costs nothing to have on (no step was skipped here) and removes the risk.
# * bfloat16 has float32's exponent range and needs no loss scaling: `kmp.enable("auto")`
#   picks it where the hardware has it, and kmp then leaves loss scaling off.
#
# Next: `kmp.audit` named the attention layers as the places to watch and `kmp.probe`
# measured them on a real batch; `launch/train.py --model gpt` trains the same model on 2
# ranks, and `python bench/numerics.py` compares the three policies over 3 seeds.
