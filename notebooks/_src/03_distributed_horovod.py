# %% [markdown]
# # Distributed training with Horovod, started from a notebook
#
# Horovod trains data-parallel: **one process per accelerator**, each with a full copy of the
# model, each reading a different shard of the data. After every backward pass the processes
# (*ranks*) average their gradients with an *allreduce*, so every rank applies the same update
# and the copies never drift apart. With *N* ranks each step sees *N* times more examples.
#
# A Jupyter kernel is a single process, so the ranks cannot live inside it. The notebook
# therefore does what you would do on a cluster: it writes a training script and starts it on
# two processes with `kmp launch -np 2` (which runs Horovod's `horovodrun`, here with its Gloo
# controller, so no MPI is needed). Horovod also has a Python launcher, `horovod.run(fn, np=2)`,
# which pickles a function into the workers; a script is easier to debug and is exactly what
# runs later under `kmp launch --hostfile` or SLURM.
#
# What the run shows:
#
# 1. **The ranks stay in sync.** Each rank starts from *different* random weights on purpose;
#    `kmp.callbacks.BroadcastInitialState` copies rank 0's weights to all ranks before the
#    first step, and `kmp.wrap_optimizer` averages the gradients in one grouped allreduce per
#    step. Each rank gathers every rank's weights (`allgather`) and reports the largest
#    difference: it must be exactly 0.
# 2. **Gradient compression.** `compression="fp16"` sends the gradients through the allreduce
#    in float16: half the bytes, a little rounding.
# 3. **Learning-rate scaling and warm-up.** Two ranks double the batch, so
#    `scale_lr=True` doubles the learning rate, and `kmp.callbacks.LearningRateWarmup` ramps up
#    to it over the first epochs instead of starting there.
#
# Everything runs on CPU processes here; on GPUs each rank would get its own GPU
# (`kmp.distributed.init()` sets that up from the local rank).

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
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

WORK = Path(tempfile.mkdtemp(prefix="kmp-notebook-03-"))
SCRIPT = WORK / "train_digits.py"
print("the script and the per-rank results go to", WORK)

# %% [markdown]
# ## 1. The training script
#
# This is an ordinary kmp training script; nothing in it is specific to notebooks. It trains
# the same model twice, without and with fp16 gradient compression, and writes what its rank
# saw to `rank<R>.json`. The comments mark the lines that make it distributed.

# %%
%%writefile {SCRIPT}
"""Train a small CNN on the digits on every rank; write what this rank saw as JSON."""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np

import kmp

OUT = sys.argv[1]
BATCH, EPOCHS, WARMUP_EPOCHS, BASE_LR = 32, 4, 2, 1e-3

world = kmp.distributed.init()  # Horovod under kmp launch / horovodrun; a no-op otherwise
spec = kmp.data.shard_spec("kmp_digits", "train", batch_size=BATCH)  # per-rank steps


def build_model():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def max_weight_diff(model):
    """Largest |w_rank - w_rank0| over all weights and ranks (0.0: identical copies)."""
    flat = np.concatenate([np.ravel(v.numpy()) for v in model.weights]).astype(np.float64)
    every_rank = np.asarray(kmp.distributed.allgather(flat)).reshape(world.size, -1)
    return float(np.max(np.abs(every_rank - every_rank[0])))


class Recorder(keras.callbacks.Callback):
    """Per step: the learning rate the warm-up set, and the loss of this rank's batch."""

    def on_train_begin(self, logs=None):
        self.lr, self.loss = [], []
        self.start_diff = max_weight_diff(self.model)  # runs after BroadcastInitialState

    def on_epoch_begin(self, epoch, logs=None):
        self._mean = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self.lr.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        # Keras logs the running mean over the epoch; recover this batch's own loss.
        mean = float(logs["loss"])
        self.loss.append((batch + 1) * mean - batch * self._mean)
        self._mean = mean


def run(compression):
    keras.backend.clear_session()
    choice = kmp.enable()  # "auto" (clear_session reset the policy, so set it again)
    keras.utils.set_random_seed(100 + world.rank)  # a different start on every rank, on purpose
    model = kmp.float32_outputs(build_model())
    before = max_weight_diff(model)
    optimizer = kmp.wrap_optimizer(
        keras.optimizers.Adam(BASE_LR),
        scale_lr=True,  # learning rate x number of ranks
        compression=compression,  # None or "fp16": the dtype gradients travel in
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    # This rank's shard of the training split, reshuffled every epoch.
    train = kmp.data.load("kmp_digits", "train", batch_size=BATCH, epochs=None, seed=0)
    recorder = Recorder()
    callbacks = kmp.callbacks.default_callbacks(  # broadcast, metric averaging, ...
        warmup_epochs=WARMUP_EPOCHS, extra=[recorder], verbose=1)  # ... warm-up, then ours
    start = time.perf_counter()
    history = model.fit(train, epochs=EPOCHS, steps_per_epoch=spec.steps_per_epoch,
                        callbacks=callbacks, shuffle=False,
                        verbose=kmp.callbacks.verbosity(2))  # progress lines on rank 0 only
    seconds = time.perf_counter() - start
    test = kmp.data.load("kmp_digits", "test", batch_size=None, shuffle=False,
                         rank=0, size=1).batch(128)  # the whole test split on every rank
    _, test_acc = model.evaluate(test, verbose=0)
    return {
        "policy": choice.name,
        "weights_max_diff_before_broadcast": before,
        "weights_max_diff_at_start": recorder.start_diff,
        "weights_max_diff_after_training": max_weight_diff(model),
        "allreduce_bytes_per_step": optimizer.allreduce_bytes_per_step,
        "params": model.count_params(),
        "lr": recorder.lr,
        "batch_loss": recorder.loss,
        "epoch_loss": [float(v) for v in history.history["loss"]],  # averaged over ranks
        "test_accuracy": float(test_acc),
        "seconds": seconds,
    }


results = {"rank": world.rank, "size": world.size, "steps_per_epoch": spec.steps_per_epoch,
           "base_lr": BASE_LR, "warmup_epochs": WARMUP_EPOCHS, "runs": {}}
for compression in (None, "fp16"):
    if world.rank == 0:
        print(f"--- compression={compression}", flush=True)
    results["runs"][str(compression)] = run(compression)
with open(os.path.join(OUT, f"rank{world.rank}.json"), "w") as f:
    json.dump(results, f)

# %% [markdown]
# ## 2. Start two workers
#
# `kmp launch` builds the `horovodrun` command, passes `KMP_*` settings on to every rank, and
# runs the script with this notebook's Python (the project's `.venv`). `OMP_NUM_THREADS=1`
# keeps the two processes from fighting over a laptop's few cores. horovodrun tags every line
# of output with the rank that printed it, e.g. `[0]<stdout>:`.

# %%
cmd = [sys.executable, "-m", "kmp.cli", "launch", "-np", "2", "--gloo", str(SCRIPT), str(WORK)]
print("$ kmp launch -np 2 --gloo", SCRIPT.name, WORK)
start = time.perf_counter()
proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                      text=True, timeout=900)
print(f"(exit status {proc.returncode}, {time.perf_counter() - start:.0f} s)\n")
print("\n".join(line for line in proc.stdout.splitlines() if "<stdout>" in line))
if proc.returncode != 0:
    raise RuntimeError(f"kmp launch failed ({proc.returncode}):\n{proc.stderr[-5000:]}")

# %% [markdown]
# ## 3. Did the ranks stay in sync?
#
# Each rank wrote its own view. Both started from different weights (the first column is far
# from 0); after the broadcast at the start of `fit` they are identical, and after training on
# *different* shards they are still identical, bit for bit: the gradients really were averaged.

# %%
ranks = [json.loads((WORK / f"rank{r}.json").read_text()) for r in range(2)]
print(f"{'compression':12s}{'rank':>5s}{'diff before':>13s}{'after bcast':>13s}"
      f"{'after train':>13s}{'bytes/step':>12s}{'test acc':>10s}{'fit s':>8s}")
for name in ("None", "fp16"):
    for r in ranks:
        run = r["runs"][name]
        print(f"{name:12s}{r['rank']:>5d}{run['weights_max_diff_before_broadcast']:>13.4g}"
              f"{run['weights_max_diff_at_start']:>13.4g}"
              f"{run['weights_max_diff_after_training']:>13.4g}"
              f"{run['allreduce_bytes_per_step']:>12,d}{run['test_accuracy']:>10.3f}"
              f"{run['seconds']:>8.1f}")
in_sync = all(r["runs"][n]["weights_max_diff_after_training"] == 0.0
              for r in ranks for n in ("None", "fp16"))
print("\nall ranks identical after training:", in_sync)
assert in_sync, "the ranks drifted apart: gradients were not averaged"

# %% [markdown]
# ## 4. Learning-rate scaling and warm-up, and what each rank saw

# %%
r0 = ranks[0]
steps_per_epoch, warmup = r0["steps_per_epoch"], r0["warmup_epochs"]
target = r0["base_lr"] * r0["size"]
fig, (ax_lr, ax_loss, ax_cmp) = plt.subplots(1, 3, figsize=(15, 4))
for r, style in zip(ranks, ("-", "--"), strict=True):
    lr = r["runs"]["None"]["lr"]
    ax_lr.plot(np.arange(len(lr)) / steps_per_epoch, lr, style, lw=2,
               label=f"rank {r['rank']}")
ax_lr.axhline(r0["base_lr"], color="gray", lw=0.8, ls=":")
ax_lr.axhline(target, color="gray", lw=0.8, ls=":")
ax_lr.text(0.02, r0["base_lr"], " single-rank rate", va="bottom", fontsize=9)
ax_lr.text(0.02, target, f" x {r0['size']} ranks (scale_lr=True)", va="bottom", fontsize=9)
ax_lr.set_xlabel("epoch")
ax_lr.set_ylabel("learning rate")
ax_lr.set_title(f"LearningRateWarmup over {warmup} epochs")
ax_lr.legend(loc="lower right")
for r, color in zip(ranks, ("tab:blue", "tab:orange"), strict=True):
    loss = r["runs"]["None"]["batch_loss"]
    ax_loss.plot(np.arange(len(loss)) / steps_per_epoch, loss, color=color, lw=1.2,
                 label=f"rank {r['rank']}")
ax_loss.set_xlabel("epoch")
ax_loss.set_ylabel("loss of each batch")
ax_loss.set_title("Per-rank batch loss: different data, same weights")
ax_loss.legend()
for name, style in (("None", dict(color="tab:blue", lw=5, alpha=0.4, marker="o")),
                    ("fp16", dict(color="tab:red", ls="--", marker="s"))):
    run = r0["runs"][name]
    epochs = np.arange(1, len(run["epoch_loss"]) + 1)
    ax_cmp.plot(epochs, run["epoch_loss"], **style,
                label=f"compression={name}: test acc {run['test_accuracy']:.3f}")
ax_cmp.set_xlabel("epoch")
ax_cmp.set_ylabel("epoch loss, averaged over ranks")
ax_cmp.set_title("fp16 gradient compression vs none")
ax_cmp.set_xticks(epochs)
ax_cmp.legend(fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Left: the learning rate.** With 2 ranks of 32 examples each, one step averages the
# gradients of 64 examples, twice the single-process batch. The *linear scaling rule*
# (Goyal et al., 2017, "Accurate, Large Minibatch SGD") says to multiply the learning rate by
# the same factor, which `kmp.wrap_optimizer(..., scale_lr=True)` does: 1e-3 becomes 2e-3.
# Starting at the larger rate can throw a freshly initialised model into a bad region in the
# first steps, so `LearningRateWarmup` starts at the single-rank rate and raises it batch by
# batch to the target over the first epochs; after that it leaves the rate alone. Both ranks
# follow exactly the same schedule, because it depends only on the step.
#
# **Middle: the loss of every batch, per rank.** Each rank computes its loss on *its own*
# shard, so the two curves differ even though the weights are identical at every step. The
# epoch-end metrics in the log above are the same on both ranks because
# `kmp.callbacks.MetricAverage` averages them, so callbacks such as early stopping take the
# same decision everywhere.
#
# **Right: compression.** The epoch losses (averaged over the ranks) with and without fp16
# gradient compression, and the test accuracy of each run.
#
# ## 5. Gradient compression
#
# The allreduce moves every gradient once per step. Compressed to float16 it moves half the
# bytes (the `bytes/step` column above): this matters when the network between machines is the
# bottleneck, i.e. for large models on many nodes, and hardly at all for two processes on one
# machine, so do not expect it to be faster here. The cost is precision: each gradient is
# rounded to float16's 11 significant bits before it is averaged (kmp pre-divides by the number
# of ranks so that the sum cannot overflow where the average would not). For this model the
# fp16 run trains as well as the uncompressed one; the ranks stay identical in both, because
# every rank receives the same compressed average.
#
# Gradient compression and mixed precision are independent: compression decides how gradients
# *travel*, the policy decides how the model *computes*. Under `mixed_float16` the allreduce
# runs on the still-scaled gradients, and the finite check happens after it, so every rank
# skips the same overflowing steps (notebook 02).
#
# ## Where to go from here
#
# * The same script runs unchanged on more processes and machines:
#   `kmp launch -np 8 --hostfile hosts.txt train_digits.py OUT`, or from a SLURM job
#   (see `launch/` in the repository).
# * `launch/train.py` is the full reference script: checkpoints and resuming, ResNet-50,
#   any TFDS data set.
