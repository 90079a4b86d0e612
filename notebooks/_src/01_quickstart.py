# %% [markdown]
# # Quickstart: mixed precision with kmp
#
# **Mixed precision** means doing the heavy arithmetic of a network (matrix multiplies,
# convolutions) in a 16-bit floating-point type while keeping the weights, the optimizer state
# and the loss in float32. Hardware with 16-bit matrix units (NVIDIA tensor cores from Volta on,
# TPUs, recent Intel and AMD CPUs with bfloat16 instructions) runs those operations several
# times faster and moves half the bytes, so training gets faster and fits bigger batches.
#
# It can also go wrong in three quiet ways, and kmp exists to keep them from happening:
#
# 1. **The wrong 16-bit type for the hardware.** float16 and bfloat16 are only fast where the
#    chip has instructions for them; elsewhere they are *slower* than float32.
#    `kmp.enable()` picks the policy from the hardware and tells you why.
# 2. **Outputs in 16 bits.** A softmax computed in bfloat16 rounds probabilities such as 0.999
#    to 1.0, and the loss (and its gradient) vanish. `kmp.float32_outputs(model)` moves the last
#    activation to float32, and `kmp.audit(model)` shows which layer computes in which dtype.
# 3. **Gradients that underflow in float16.** That needs loss scaling, which
#    `kmp.wrap_optimizer` does (notebook 02 shows it in detail).
#
# This notebook trains a small CNN on real handwritten digits, in float32 and in the policy
# kmp picks, and measures both. It runs on a laptop CPU in about a minute and downloads
# nothing: the digits ship inside scikit-learn.

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
# This notebook sets policies explicitly; KMP_POLICY in the environment would override them.
os.environ.pop("KMP_POLICY", None)

import gc
import sys
import time

import keras
import matplotlib.pyplot as plt
import numpy as np

import kmp

print("Python    ", sys.executable)
print("Keras     ", keras.__version__, "on the", keras.backend.backend(), "backend")
print("kmp       ", kmp.__version__)

# %% [markdown]
# ## 1. Let kmp pick the policy
#
# `kmp.enable()` (the same as `kmp.enable("auto")`) looks at the machine, sets Keras's global
# dtype policy and returns a `PolicyChoice` that says what it set **and why**. Call it before
# building the model: layers take the policy that is current when they are created.

# %%
choice = kmp.enable()
print("policy       ", choice.name)
print("compute dtype", choice.compute_dtype, "| variable dtype", choice.variable_dtype)
print("loss scaling ", choice.loss_scaling)
print("why          ", choice.reason)
print()
print("this machine:", kmp.hardware.detect())

# %% [markdown]
# The machine that last ran this notebook is a CPU with AVX512_BF16 and no GPU, so "auto"
# picked **mixed_bfloat16** (the output above says why). On a CPU without AVX512_BF16 or AMX
# it picks **float32**: without bfloat16 instructions the CPU emulates 16-bit arithmetic, and
# without float16 hardware at all float16 is slower still. That is the right answer there, not
# a fallback.
#
# The rule itself is a pure function of the hardware, so we can ask what it would pick on
# other machines without owning them:

# %%
from kmp.hardware import CPU, GPU, Hardware
from kmp.policy import choose_policy

machines = {
    "NVIDIA H100 (9.0)": Hardware(gpus=(GPU("NVIDIA H100", (9, 0)),)),
    "NVIDIA A100 (8.0)": Hardware(gpus=(GPU("NVIDIA A100", (8, 0)),)),
    "NVIDIA V100 (7.0)": Hardware(gpus=(GPU("Tesla V100", (7, 0)),)),
    "NVIDIA T4 (7.5)": Hardware(gpus=(GPU("Tesla T4", (7, 5)),)),
    "NVIDIA K80 (3.7)": Hardware(gpus=(GPU("Tesla K80", (3, 7)),)),
    "CPU with AVX512_BF16": Hardware(cpu=CPU("Xeon", 32, avx512_bf16=True)),
    "CPU without bf16": Hardware(cpu=CPU("Xeon", 32)),
    "this machine": kmp.hardware.detect(),
}
for label, hw in machines.items():
    name, reason = choose_policy(hw)
    print(f"{label:28s} -> {name:15s} {reason}")

# %% [markdown]
# Two things to notice. bfloat16 wins wherever it is fast: it has float32's exponent range, so
# it needs no loss scaling. float16 is only chosen on GPUs that have float16 tensor cores but
# no fast bfloat16 (Volta and Turing), and then always together with loss scaling. And kmp
# never picks float16 on a CPU.

# %% [markdown]
# ## 2. The data: real handwritten digits, no download
#
# `kmp.data.load("kmp_digits", ...)` reads scikit-learn's bundled digits (1,797 real 8x8 scans,
# 10 classes) through TensorFlow Datasets, with a fixed stratified train/test split. The first
# call prepares the data set in `~/.cache/kmp` in a few seconds; later calls read it back. The
# same call gives each Horovod rank its own shard (notebook 03), and casts the images to the
# compute dtype of the current policy so the model is fed in the dtype it computes in.

# %%
BATCH = 32
spec = kmp.data.shard_spec("kmp_digits", "train", batch_size=BATCH)
print(spec)

sample = kmp.data.load("kmp_digits", "test", batch_size=None, shuffle=False).take(20)
fig, axes = plt.subplots(2, 10, figsize=(10, 2.6))
for ax, (image, label) in zip(axes.flat, sample, strict=True):
    ax.imshow(image.numpy().astype("float32")[..., 0], cmap="gray_r")  # bfloat16 under auto
    ax.set_title(int(label), fontsize=10)
    ax.axis("off")
fig.suptitle("kmp_digits: 8x8 handwritten digits from scikit-learn (test split)", y=1.05)
plt.show()

# %% [markdown]
# ## 3. Build the model, keep the outputs in float32, audit it
#
# To see what the audit is for, build the model under a *mixed* policy. `kmp.policy_scope`
# sets a policy for a `with` block and restores the previous one afterwards. The model is an
# ordinary Keras model that ends in `Dense(10, activation="softmax")`.

# %%
def build_model() -> keras.Model:
    """A small CNN for 8x8x1 digits; the last layer's softmax is what the audit checks."""
    inputs = keras.Input((8, 8, 1), name="images")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="probs")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


with kmp.policy_scope("mixed_bfloat16"):
    naive = build_model()
    print(kmp.audit(naive))

# %% [markdown]
# The audit reports an error: the softmax that produces the model's output computes in
# bfloat16. Why that matters, in two lines: bfloat16 keeps only 8 significant bits, so a
# confident but not certain prediction rounds to exactly 1, and the cross-entropy
# `-log(p)` of the right class, and with it the gradient, becomes 0.

# %%
p = keras.ops.convert_to_tensor([0.9990, 0.9970, 0.9900])
for dtype in ("float32", "bfloat16"):
    q = keras.ops.cast(p, dtype)
    loss = 0.0 - keras.ops.log(keras.ops.cast(q, "float32"))
    print(f"{dtype:9s} p = {keras.ops.convert_to_numpy(keras.ops.cast(q, 'float32'))}"
          f"   -log(p) = {keras.ops.convert_to_numpy(loss)}")

# %% [markdown]
# `kmp.float32_outputs` rebuilds the model so that the last `Dense` produces logits in the
# compute dtype and a `Float32Output("softmax")` layer applies the softmax in float32. The
# weights are copied; the big layers keep computing in 16 bits. The audit is now clean:

# %%
with kmp.policy_scope("mixed_bfloat16"):
    fixed = kmp.float32_outputs(naive)
    report = kmp.audit(fixed)
    print(report)
    print("\nreport.ok =", report.ok)

del naive, fixed  # layers built here would otherwise outlive the policy changes below

# %% [markdown]
# ## 4. Train: float32, "auto" and mixed_bfloat16 side by side
#
# The same model, data and seed under three policies. The optimizer is always
# `kmp.wrap_optimizer(Adam)`: it scales the loss only where the policy computes in float16,
# so under float32 and bfloat16 it is exactly Adam (in a Horovod job it also averages the
# gradients, notebook 03).
#
# The first epoch includes tracing the training step into a TensorFlow graph, so it is timed
# separately; the "steady" time is the median of the later epochs.

# %%
EPOCHS = 4


class EpochTimer(keras.callbacks.Callback):
    """Wall time of every epoch."""

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def train(policy: str) -> dict:
    keras.backend.clear_session()
    gc.collect()  # the previous run's layers are gone before the policy changes
    keras.utils.set_random_seed(0)
    chosen = kmp.enable(policy)
    model = kmp.float32_outputs(build_model())
    optimizer = kmp.wrap_optimizer(keras.optimizers.Adam(2e-3))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    train_ds = kmp.data.load("kmp_digits", "train", batch_size=BATCH, epochs=None, seed=0)
    test_ds = kmp.data.load("kmp_digits", "test", batch_size=None, shuffle=False).batch(128)
    timer = EpochTimer()
    # shuffle=False: kmp.data already reshuffles every epoch (Keras cannot shuffle a dataset).
    history = model.fit(train_ds, epochs=EPOCHS, steps_per_epoch=spec.steps_per_epoch,
                        callbacks=[timer], shuffle=False, verbose=0)
    _, test_acc = model.evaluate(test_ds, verbose=0)
    return {
        "asked": policy,
        "policy": chosen.name,
        "compute": model.get_layer("conv2d").compute_dtype,
        "loss scaling": optimizer.loss_scale_mode,
        "first epoch s": timer.seconds[0],
        "steady epoch s": float(np.median(timer.seconds[1:])),
        "train loss": history.history["loss"][-1],
        "test accuracy": float(test_acc),
    }


results = [train(p) for p in ("float32", "auto", "mixed_bfloat16")]
kmp.disable()

header = list(results[0])
print("  ".join(f"{h:>14s}" for h in header))
for r in results:
    print("  ".join(f"{v:>14.4f}" if isinstance(v, float) else f"{v!s:>14s}" for v in r.values()))

# %%
labels = [f"{r['asked']}\n({r['policy']})" for r in results]
colors = ["tab:blue", "tab:green", "tab:orange"]
fig, (ax_t, ax_f, ax_a) = plt.subplots(1, 3, figsize=(14, 3.8))
x = np.arange(len(results))
ax_t.bar(x, [r["steady epoch s"] for r in results], 0.5, color=colors)
ax_t.set_xticks(x, labels)
ax_t.set_ylabel("seconds")
ax_t.set_title(f"Steady epoch ({spec.steps_per_epoch} steps of {BATCH}, median)")
ax_f.bar(x, [r["first epoch s"] for r in results], 0.5, color=colors, alpha=0.5)
ax_f.set_xticks(x, labels)
ax_f.set_ylabel("seconds")
ax_f.set_title("First epoch (includes tracing the step)")
accs = [r["test accuracy"] for r in results]
ax_a.bar(x, accs, 0.5, color=colors)
for xi, acc in zip(x, accs, strict=True):
    ax_a.text(xi, acc + 0.005, f"{acc:.3f}", ha="center")
ax_a.set_xticks(x, labels)
ax_a.set_ylim(min(accs) - 0.1, 1.0)
ax_a.set_ylabel("test accuracy")
ax_a.set_title(f"Test accuracy after {EPOCHS} epochs")
fig.tight_layout()
plt.show()

# %% [markdown]
# ### What these numbers mean
#
# * **"auto" is one of the other two** (mixed_bfloat16 on the machine that last ran this, a
#   CPU with AVX512_BF16; float32 on one without), so two bars run the very same computation.
#   Whatever difference you see between them is run-to-run noise (other work on the machine,
#   caches, the tracing of the first epoch): use it as the error bar for the other comparison.
# * **mixed_bfloat16 pays only where the CPU has bfloat16 instructions.** Without them
#   TensorFlow converts to and from float32 around the arithmetic and it is slower. On a CPU
#   *with* AVX512_BF16 or AMX the project measured bfloat16 at about twice the float32
#   throughput for a small CNN, and on tensor-core GPUs NVIDIA reports speed-ups of up to
#   about 3x for models large enough to keep the tensor cores busy. A model this small
#   (8x8 images, under 40,000
#   parameters) is dominated by per-step overhead anywhere, so do not read a speed-up or
#   slow-down from it into your own model: measure yours, on your hardware, with
#   `kmp.enable()` and `kmp.enable("float32")`.
# * **Accuracy is about the same** under every policy: the weights stay in float32 and the
#   softmax and loss run in float32, so the 16-bit arithmetic only adds a little noise. That
#   is the point of mixed (rather than pure 16-bit) precision.
#
# ## Where to go next
#
# * [02_loss_scaling.ipynb](02_loss_scaling.ipynb): why float16 needs loss scaling, with the
#   gradients of a real model.
# * [03_distributed_horovod.ipynb](03_distributed_horovod.ipynb): the same training on two
#   Horovod processes, started from a notebook.
# * [04_migrating.ipynb](04_migrating.ipynb): moving from Apex, `torch.cuda.amp`,
#   `tf.keras.mixed_precision.experimental` or a Horovod TF1 script.
