# %% [markdown]
# # Loss scaling explained
#
# Under the `mixed_float16` policy the forward and backward passes compute in float16. float16
# has only 5 exponent bits, so it covers a narrow range of magnitudes, and gradients are
# usually *small* numbers: many of them fall below what float16 can represent and become
# exactly zero. The model then stops learning from them, silently.
#
# **Loss scaling** is the fix: multiply the loss by a large factor *S* before the backward pass,
# so every gradient is *S* times larger and lands inside float16's range, then divide the
# (float32) gradients by *S* before the optimizer uses them. Too small an *S* and gradients
# still underflow; too large and they overflow to `inf`. **Dynamic** loss scaling finds a good
# *S* while training: it skips any step whose gradients are not finite and halves *S*, and it
# doubles *S* after a run of good steps.
#
# This notebook measures all of that on a real model and real data (scikit-learn's digits):
#
# 1. the float16 range, in numbers;
# 2. a histogram of real gradient magnitudes against that range;
# 3. how many gradients a float16 model actually loses at different scales;
# 4. a real training run with dynamic loss scaling: the scale's trajectory and the skipped steps.
#
# bfloat16 has float32's 8 exponent bits, so it does not need any of this; section 5 shows that
# kmp switches loss scaling off for it.

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
os.environ.pop("KMP_POLICY", None)  # this notebook sets policies explicitly

import gc
import warnings

import keras
import matplotlib.pyplot as plt
import ml_dtypes  # NumPy dtypes for bfloat16; installed with Keras
import numpy as np
import tensorflow as tf

import kmp
from kmp.datasets import digits

# %% [markdown]
# ## 1. The float16 range
#
# A float16 number has 1 sign bit, 5 exponent bits and 10 fraction bits. The largest finite
# value is 65504; the smallest *normal* value is 2^-14 (about 6.1e-5); below that, *subnormal*
# numbers trade precision for range down to 2^-24 (about 6.0e-8); anything smaller rounds to 0.

# %%
rows = [("float32", np.finfo(np.float32)), ("float16", np.finfo(np.float16)),
        ("bfloat16", ml_dtypes.finfo(ml_dtypes.bfloat16))]
print(f"{'dtype':9s} {'max':>11s} {'smallest normal':>16s} {'smallest subnormal':>19s} "
      f"{'significant bits':>17s}")
for name, fi in rows:
    print(f"{name:9s} {float(fi.max):11.4g} {float(fi.smallest_normal):16.4g} "
          f"{float(fi.smallest_subnormal):19.4g} {fi.nmant + 1:17d}")

F16_MAX = float(np.finfo(np.float16).max)                    # 65504
F16_NORMAL = float(np.finfo(np.float16).smallest_normal)      # 2**-14
F16_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)  # 2**-24

print()
with np.errstate(over="ignore"):  # 7e4 overflowing is the point of the example
    for value in (1e-3, 1e-5, 1e-7, 1e-8, 7e4):
        stored = float(np.float16(value))
        error = abs(stored - value) / value
        print(f"{value:8g} stored in float16 = {stored:<14.8g} relative error {error:.2%}")

# %% [markdown]
# 1e-3 is stored to float16's usual precision (about 3 decimal digits); 1e-5 and 1e-7 are
# subnormals and lose more of their digits the smaller they are; 1e-8 becomes 0, and 70000
# becomes `inf`. bfloat16 reaches down to about 1e-38 like float32, but with only
# 8 significant bits instead of float32's 24 (and float16's 11).
#
# ## 2. Real gradient magnitudes
#
# A small MLP on the 1,438 training digits, trained in float32 for a few epochs. We take the
# gradients of the loss on one batch of 64 examples with respect to every weight, once at
# initialisation and once after training, and look at their absolute values.

# %%
images, labels = digits.load_arrays()  # the real digits, shipped inside scikit-learn
train_idx, test_idx = digits.split_indices(labels)
x_all = (images.reshape(len(images), -1) / 255.0).astype("float32")
y_all = labels.astype("int32")
x_train, y_train = x_all[train_idx], y_all[train_idx]
x_test, y_test = x_all[test_idx], y_all[test_idx]
print("train", x_train.shape, "test", x_test.shape)


def build_mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="mlp")


EPOCHS = 6
loss_fn = keras.losses.SparseCategoricalCrossentropy()
xb, yb = x_train[:64], y_train[:64]


def gradient_magnitudes(model: keras.Model, scale: float = 1.0) -> np.ndarray:
    """|d loss / d w| for every weight, computed with the loss multiplied by `scale`."""
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True)) * scale
    grads = tape.gradient(loss, model.trainable_variables)
    return np.concatenate([np.abs(g.numpy().astype(np.float64).ravel()) for g in grads])


kmp.enable("float32")
keras.utils.set_random_seed(0)
mlp = build_mlp()
mlp.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy",
            metrics=["accuracy"])
g_init = gradient_magnitudes(mlp)
mlp.fit(x_train, y_train, epochs=EPOCHS, batch_size=32, verbose=0)
g_trained = gradient_magnitudes(mlp)
trained_weights = mlp.get_weights()
f32_acc = mlp.evaluate(x_test, y_test, verbose=0)[1]
print(f"float32: test accuracy {f32_acc:.3f} after {EPOCHS} epochs")


def describe(name: str, g: np.ndarray) -> None:
    nz = g[g > 0]
    print(f"{name}: {g.size} weights, {np.mean(g == 0):.1%} exactly zero (inactive ReLUs); "
          f"of the non-zero ones: median {np.median(nz):.2g}, max {nz.max():.2g}, "
          f"{np.mean(nz < F16_SUBNORMAL):.2%} below 2^-24 (become 0 in float16), "
          f"{np.mean(nz < F16_NORMAL):.1%} below 2^-14 (subnormal or 0)")


describe("at initialisation", g_init)
describe("after training   ", g_trained)

# %%
bins = np.linspace(-13, 6, 96)
fig, ax = plt.subplots(figsize=(11, 4.2))
ax.axvspan(bins[0], np.log10(F16_SUBNORMAL), color="red", alpha=0.12, label="becomes 0 in float16")
ax.axvspan(np.log10(F16_SUBNORMAL), np.log10(F16_NORMAL), color="orange", alpha=0.15,
           label="float16 subnormal (precision lost)")
ax.axvspan(np.log10(F16_MAX), bins[-1], color="purple", alpha=0.12, label="overflows to inf")
for g, name, color in ((g_init, "at initialisation", "tab:gray"),
                       (g_trained, "after training", "tab:blue")):
    ax.hist(np.log10(g[g > 0]), bins=bins, histtype="step", lw=2, color=color, label=name)
scale = 2.0**15
ax.hist(np.log10(g_trained[g_trained > 0] * scale), bins=bins, histtype="stepfilled",
        alpha=0.35, color="tab:green", label="after training, x 2^15 (loss scaled)")
for v, text in ((F16_SUBNORMAL, "2^-24"), (F16_NORMAL, "2^-14"), (F16_MAX, "65504")):
    ax.axvline(np.log10(v), color="k", lw=0.8, ls="--")
    ax.text(np.log10(v), 0.97, f"{text} ", transform=ax.get_xaxis_transform(), rotation=90,
            fontsize=9, va="top", ha="right")
ax.set_yscale("log")  # the tails matter here, so count on a log axis
ax.set_xlabel("log10 |gradient|")
ax.set_ylabel("number of weights (log scale)")
ax.set_title("Gradient magnitudes of a real MLP on the digits, against the float16 range")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
plt.show()

# %% [markdown]
# What the histogram shows:
#
# * Gradients **shrink as training converges**: once the model predicts most training examples
#   well, the loss (and its slope) is small. The trained model's gradients sit lower than the
#   initial ones, and a tail (about 1% of the non-zero gradients here, see the numbers
#   above) falls below 2^-24 (red): in float16 those are exactly 0. About a tenth sit in the
#   subnormal band (orange), where float16 keeps only a few bits of them.
# * Nothing comes near the **overflow** side: without scaling, float16 wastes most of its
#   range above these gradients.
# * Multiplying the loss by 2^15 (green) **shifts the whole distribution** by 15 binary orders
#   of magnitude, out of the underflow region, while the largest values stay well below 65504.
#   Shift it by 2^30 and the top of the distribution overflows instead.
#
# The histogram shows float32 gradients *as if* they were stored in float16. A real float16
# model loses more than that, because the backward pass multiplies float16 numbers at every
# layer. So let us measure it.
#
# ## 3. What a float16 model actually loses
#
# The same trained weights, loaded into the same MLP built under `mixed_float16` (with its
# softmax kept in float32 by `kmp.float32_outputs`). For several loss scales we compute the
# gradients in float16, divide them by the scale, and compare with float32: how many
# gradients that are non-zero in float32 came out as exactly 0, and are they all finite?

# %%
del mlp
keras.backend.clear_session()
gc.collect()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kmp.enable("mixed_float16")
for w in caught:  # kmp warns that float16 is slow on a CPU: true, and fine for this measurement
    print("kmp warns:", str(w.message)[:150], "...")
mlp16 = build_mlp()
mlp16.set_weights(trained_weights)
mlp16 = kmp.float32_outputs(mlp16)
print("layers compute in:", {l.name: l.compute_dtype for l in mlp16.layers[1:]})

reference = g_trained
nonzero = reference > 0
scales = [2.0**k for k in range(0, 33, 2)]
lost, finite = [], []
for s in scales:
    g = gradient_magnitudes(mlp16, s) / s
    ok = bool(np.isfinite(g).all())
    finite.append(ok)
    lost.append(float(np.mean(g[nonzero] == 0)) if ok else np.nan)
    status = f"{lost[-1]:7.3%} of non-zero gradients lost" if ok else "inf/NaN: step must be skipped"
    print(f"scale 2^{int(np.log2(s)):<2d}: {status}")

# %%
log2s = np.log2(scales)
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.plot(log2s[np.array(finite)], 100 * np.array(lost)[np.array(finite)], "o-", color="tab:blue",
        label="gradients lost to underflow")
first_bad = log2s[np.argmin(finite)] if not all(finite) else None
if first_bad is not None:
    ax.axvspan(first_bad - 1, log2s[-1] + 1, color="purple", alpha=0.12,
               label="gradients overflow (inf)")
ax.set_xlabel("loss scale (log2)")
ax.set_ylabel("% of non-zero float32 gradients\nthat are 0 in float16")
ax.set_title("The loss-scale window of a real float16 model")
ax.legend()
plt.show()

# %% [markdown]
# There is a **window**. Without scaling (2^0) the float16 model loses a share of its
# gradients to underflow; with a moderate scale it loses none; with a very large one the
# largest gradients overflow to `inf` and the step is unusable. Where the window lies depends
# on the model, the data and the stage of training, and it moves as training goes on. A fixed
# scale is therefore a guess; **dynamic loss scaling** tracks the window instead:
#
# * start with a large scale (kmp's default is 2^15);
# * after every step, check the unscaled gradients: if any is `inf` or `NaN`, **skip the
#   update and halve the scale**;
# * after `growth_interval` finite steps in a row (default 2000), **double the scale** to probe
#   whether a larger one fits again;
# * kmp's default also doubles it **sooner while the gradients underflow**: after
#   `underflow_patience` finite steps (100), when more than `underflow_threshold` (1 %) of the
#   gradient values sit below float16's smallest normal number once scaled, and the doubled
#   scale still leaves 8x headroom below 65504 (`underflow_threshold=None` gives Keras's and
#   PyTorch's rule, which watches overflow only).
#
# A skipped step costs one batch of work and nothing else: the weights and the optimizer state
# are left untouched.
#
# ## 4. A real run: the loss-scale trajectory and the skipped steps
#
# `kmp.wrap_optimizer` does all of it in one optimizer. To make the mechanism visible we start
# far too high, at 2^30, and let the scale try to grow every 30 steps (instead of 2000). The
# scale always stays within `[min_scale, max_scale]` (by default 1 to 2^24), so starting at
# 2^30 means raising `max_scale` as well. The other knobs are `growth_factor` (2.0),
# `backoff_factor` (0.5) and `hysteresis` (1: back off at every overflowing step).
# `kmp.callbacks.LossScaleMonitor` puts `loss_scale` and `skipped_steps` into the Keras logs
# and prints a line whenever a step is skipped; a small recorder callback after it keeps the
# per-step values for the plot.

# %%
del mlp16
keras.backend.clear_session()  # note: this also resets Keras's dtype policy to float32 ...
gc.collect()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (the float16-on-a-CPU warning again)
    kmp.enable("mixed_float16")  # ... so the policy is set again, after clear_session()
keras.utils.set_random_seed(0)
model = kmp.float32_outputs(build_mlp())
optimizer = kmp.wrap_optimizer(keras.optimizers.Adam(2e-3), initial_scale=2**30,
                               max_scale=2**30, growth_interval=30)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
print("loss scaling:", optimizer.loss_scale_mode, "| starting scale 2^30 =", optimizer.loss_scale)


class Recorder(keras.callbacks.Callback):
    """Keep the per-step logs that LossScaleMonitor (listed before it) fills in."""

    def on_train_begin(self, logs=None):
        self.scale, self.skipped, self.loss = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.scale.append(logs["loss_scale"])
        self.skipped.append(logs["skipped_steps"])
        self.loss.append(logs["loss"])


recorder = Recorder()
history = model.fit(x_train, y_train, epochs=EPOCHS, batch_size=32, verbose=2,
                    callbacks=[kmp.callbacks.LossScaleMonitor(verbose=1), recorder])
_, test_acc = model.evaluate(x_test, y_test, verbose=0)
print(f"\n{optimizer.skipped_steps} of {len(recorder.scale)} steps skipped; final scale "
      f"2^{np.log2(optimizer.loss_scale):.0f}; test accuracy {test_acc:.3f} "
      f"(float32, same start and epochs: {f32_acc:.3f})")

# %%
steps = np.arange(1, len(recorder.scale) + 1)
skipped = np.diff(np.concatenate([[0], recorder.skipped])) > 0
fig, (ax_s, ax_l) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
ax_s.step(steps, np.log2(recorder.scale), where="post", color="tab:blue", label="loss scale")
ax_s.plot(steps[skipped], np.log2(np.array(recorder.scale))[skipped], "rv", ms=6,
          label=f"skipped step ({skipped.sum()})")
ax_s.set_ylabel("loss scale (log2)")
ax_s.set_title("Dynamic loss scaling under mixed_float16: start at 2^30, grow every 30 good steps")
ax_s.legend()
ax_s.grid(alpha=0.3)
ax_l.plot(steps, recorder.loss, color="tab:gray")
ax_l.plot(steps[skipped], np.array(recorder.loss)[skipped], "rv", ms=6)
ax_l.set_ylabel("training loss\n(running mean of the epoch)")
ax_l.set_xlabel("step")
ax_l.grid(alpha=0.3)
plt.show()

# %% [markdown]
# Reading the plot from the left:
#
# * The first steps all **overflow**: at 2^30 even the gradients of the initial model are too
#   large for float16 (section 3 found the overflow edge of the trained model in the same
#   region; the initial model's larger gradients overflow a little earlier). Each one is skipped and halves the scale,
#   until the scale is low enough that the gradients fit. The loss stays where it was during
#   those steps, because nothing was applied.
# * From then on the scale sits just below the overflow edge. Every 30 good steps it
#   **doubles** to test a larger value; when that overflows, the step is skipped and the scale
#   drops back. That sawtooth is the algorithm working as intended, not a problem. With the
#   default `growth_interval=2000` such probes are rare.
# * Training is unharmed: the skipped steps are a small fraction of all steps, and the test
#   accuracy is close to that of the float32 run in section 2 (same data, same starting
#   weights, same number of epochs).
#
# In a multi-process job kmp averages the gradients over the ranks *before* the finite check,
# so every rank sees the same gradients, skips the same steps and keeps the same scale
# (notebook 03). The scale is an optimizer variable: it is saved in checkpoints and restored
# with the model.
#
# ## 5. bfloat16 needs no loss scaling
#
# With float32's exponent range, bfloat16 gradients do not underflow where float32 ones would
# not, so scaling would only cost a multiply. The same `kmp.wrap_optimizer` call decides this
# from the policy (on first use), so the training code stays the same for every policy:

# %%
with warnings.catch_warnings():
    # kmp.enable's warnings (float16 on a CPU, the model above built under another policy)
    # are beside the point here: this cell builds no layers.
    warnings.simplefilter("ignore")
    for policy in ("mixed_float16", "mixed_bfloat16", "float32"):
        with kmp.policy_scope(policy):
            opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3))
            print(f"{policy:15s} -> loss scaling: {opt.loss_scale_mode:8s} "
                  f"(scale {opt.loss_scale:g})")
kmp.disable();

# %% [markdown]
# ## Summary
#
# * float16 covers roughly 6e-8 to 65504; real gradients, especially late in training, reach
#   below that and are lost.
# * Multiplying the loss by *S* shifts all gradients by *S*; dividing the float32 gradients by
#   *S* afterwards undoes it exactly (powers of two are exact in floating point).
# * Dynamic loss scaling keeps *S* near the largest value that does not overflow, skipping the
#   rare step that does. With kmp it is one line: `kmp.wrap_optimizer(optimizer)`, plus
#   `kmp.callbacks.LossScaleMonitor()` to watch it.
# * On hardware with fast bfloat16 (A100/H100, TPUs, CPUs with AVX512_BF16 or AMX) none of this
#   is needed, and `kmp.enable()` picks bfloat16 there.
