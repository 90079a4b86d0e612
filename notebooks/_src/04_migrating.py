# %% [markdown]
# # Migrating to kmp
#
# Four common starting points, each with the old code (shown, not run: it needs PyTorch, Apex,
# an old TensorFlow or a GPU) and the kmp code that does the same job, run for real on the
# digits data:
#
# 1. NVIDIA Apex `amp.initialize`
# 2. `torch.cuda.amp`: `autocast` + `GradScaler`
# 3. `tf.keras.mixed_precision.experimental`
# 4. a Horovod TF1 session script
#
# The ideas carry over one to one, because every mixed-precision system solves the same three
# problems: *which ops run in 16 bits* (a policy), *how the weights stay accurate* (float32
# master weights), and *how gradients survive float16's narrow range* (loss scaling). What
# changes is where each one lives. In kmp:
#
# | concern | kmp |
# | --- | --- |
# | which ops run in 16 bits | `kmp.enable(policy)` sets Keras's global dtype policy; every layer built afterwards computes in that dtype |
# | float32 master weights | built in: `mixed_*` policies keep variables in float32 |
# | numerically sensitive outputs | `kmp.float32_outputs(model)`; `kmp.audit(model)` checks |
# | loss scaling (+ Horovod averaging) | `kmp.wrap_optimizer(optimizer)` |
# | watching the scale | `kmp.callbacks.LossScaleMonitor()` |
#
# The runs below use `mixed_float16` to mirror the float16 code they replace. On this CPU it is
# slow (kmp warns about it); on your hardware, `kmp.enable()` picks the fastest safe policy,
# and the rest of the code stays the same.

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
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up logs quiet
os.environ.pop("KMP_POLICY", None)  # this notebook sets policies explicitly

import gc
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf

import kmp
from kmp.datasets import digits

# The real digits from scikit-learn, flattened to 64 features, with kmp's fixed split.
images, labels = digits.load_arrays()
train_idx, test_idx = digits.split_indices(labels)
x_all = (images.reshape(len(images), -1) / 255.0).astype("float32")
x_train, y_train = x_all[train_idx], labels[train_idx].astype("int32")
x_test, y_test = x_all[test_idx], labels[test_idx].astype("int32")


def build_mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ], name="mlp")


def fresh(policy: str) -> None:
    """Start a section from a clean slate under `policy`.

    keras.backend.clear_session() also resets the dtype policy, so the policy is set after it.
    """
    keras.backend.clear_session()
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "float16 on a CPU is slow": known, see above
        kmp.enable(policy)
    keras.utils.set_random_seed(0)


print("train", x_train.shape, "test", x_test.shape)

# %% [markdown]
# ## 1. From Apex `amp.initialize`
#
# Apex patched a PyTorch model and optimizer in place. The usual script:
#
# ```python
# from apex import amp
#
# model = Net().cuda()
# optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
# model, optimizer = amp.initialize(model, optimizer, opt_level="O1")   # or "O2"
#
# for x, y in loader:
#     optimizer.zero_grad()
#     loss = F.cross_entropy(model(x), y)
#     with amp.scale_loss(loss, optimizer) as scaled_loss:   # dynamic loss scaling
#         scaled_loss.backward()
#     optimizer.step()
#
# torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
#             "amp": amp.state_dict()}, "checkpoint.pt")       # the loss scaler's state
# ```
#
# The `opt_level`s map onto Keras dtype policies:
#
# | Apex | what it did | kmp |
# | --- | --- | --- |
# | `O0` | float32 | `kmp.enable("float32")` |
# | `O1` | float16 for whitelisted ops (matmul, conv), float32 for the rest, float32 weights | `kmp.enable("mixed_float16")`: layers compute in float16, variables stay float32; softmax/loss in float32 with `float32_outputs` |
# | `O2` | float16 model, float32 master weights in the optimizer, batch norm in float32 | the same `mixed_float16` policy: Keras keeps the master weights in the variables themselves, and its normalisation layers compute their statistics in float32 |
# | `O3` | pure float16, no master weights | `kmp.enable("float16")`, and `kmp.audit` flags it as an error (below) |
# | `amp.scale_loss(...)` | dynamic loss scaling | `kmp.wrap_optimizer(optimizer)` |
# | `amp.state_dict()` | scaler state in the checkpoint | nothing to do: the loss scale is an optimizer variable, saved by `model.save` |
#
# Why the difference in style: Apex had to *patch* PyTorch functions to change their dtypes;
# Keras layers have a dtype policy of their own, so setting it before building the model is
# enough, and nothing is patched. The kmp version, run:

# %%
fresh("mixed_float16")  # Apex O1/O2; on your hardware: kmp.enable()
model = kmp.float32_outputs(build_mlp())  # the softmax computes in float32
optimizer = kmp.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9))  # dynamic scaling
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, epochs=2, batch_size=32, verbose=2,
          callbacks=[kmp.callbacks.LossScaleMonitor(verbose=1)])
print("test accuracy:", round(model.evaluate(x_test, y_test, verbose=0)[1], 3))

# The checkpoint carries the loss scale and the step count, like amp.state_dict() did.
path = os.path.join(tempfile.mkdtemp(), "checkpoint.keras")
model.save(path)
restored = keras.saving.load_model(path)
print(f"saved and restored: loss scale {restored.optimizer.loss_scale:g} "
      f"(was {optimizer.loss_scale:g}), step {int(restored.optimizer.iterations)} "
      f"(was {int(optimizer.iterations)})")

# %% [markdown]
# And Apex's `O3` (float16 weights, no master copy), which kmp accepts by name but the audit
# rejects: small updates to float16 weights are rounded away, and the softmax output is float16.

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with kmp.policy_scope("float16"):
        report = kmp.audit(build_mlp())
print("report.ok =", report.ok)
for finding in report.errors:
    print(f"[{finding.code}] {finding.layer}: {finding.message}")

# %% [markdown]
# ## 2. From `torch.cuda.amp`: `autocast` + `GradScaler`
#
# PyTorch's native AMP, in a hand-written training loop:
#
# ```python
# scaler = torch.cuda.amp.GradScaler()          # init_scale=2**16, growth_interval=2000
# for x, y in loader:
#     optimizer.zero_grad()
#     with torch.cuda.amp.autocast():            # ops inside run in float16 where safe
#         loss = F.cross_entropy(model(x), y)
#     scaler.scale(loss).backward()              # gradients of the scaled loss
#     scaler.unscale_(optimizer)                 # (only needed to clip the true gradients)
#     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
#     scaler.step(optimizer)                     # skips the step if any gradient is inf/NaN
#     scaler.update()                            # halve on overflow, grow after 2000 good steps
# ```
#
# In Keras the policy replaces `autocast` (it is set once, not per block), and the wrapped
# optimizer is the `GradScaler`: `scale_loss` scales, and `apply` unscales, checks, applies or
# skips, and updates the scale in one call. Clipping goes on the inner optimizer
# (`clipnorm=1.0`), which receives the already unscaled gradients, so no `unscale_` step is
# needed. The same loop, in TensorFlow:

# %%
fresh("mixed_float16")  # replaces autocast
model = kmp.float32_outputs(build_mlp())
optimizer = kmp.wrap_optimizer(
    keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=1.0),  # clips the unscaled gradients
    initial_scale=2**16, growth_interval=2000)  # GradScaler's defaults
loss_fn = keras.losses.SparseCategoricalCrossentropy()


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled_loss = optimizer.scale_loss(loss)  # scaler.scale(loss)
    grads = tape.gradient(scaled_loss, model.trainable_variables)  # .backward()
    optimizer.apply(grads, model.trainable_variables)  # scaler.step() + scaler.update()
    return loss


loader = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2000, seed=0).batch(32)
for epoch in range(2):
    losses = [float(train_step(x, y)) for x, y in loader]
    print(f"epoch {epoch + 1}: mean loss {np.mean(losses):.4f}, loss scale "
          f"{optimizer.loss_scale:g} (scaler.get_scale()), skipped steps {optimizer.skipped_steps}")
predictions = np.argmax(model.predict(x_test, verbose=0), axis=-1)
print("test accuracy:", round(float(np.mean(predictions == y_test)), 3))

# %% [markdown]
# ## 3. From `tf.keras.mixed_precision.experimental`
#
# TensorFlow 2.1 to 2.3 shipped Keras mixed precision as an experimental API. TensorFlow 2.4
# made it stable as `tf.keras.mixed_precision` (with a different `LossScaleOptimizer`
# signature), later releases removed the experimental module, and in Keras 3 the policy is
# set with `keras.config.set_dtype_policy`. The old code:
#
# ```python
# from tensorflow.keras.mixed_precision import experimental as mixed_precision
#
# policy = mixed_precision.Policy("mixed_float16")
# mixed_precision.set_policy(policy)
#
# inputs = keras.Input(shape=(64,))
# x = layers.Dense(128, activation="relu")(inputs)
# x = layers.Dense(10)(x)
# outputs = layers.Activation("softmax", dtype="float32")(x)   # by hand, at every output
# model = keras.Model(inputs, outputs)
#
# opt = keras.optimizers.RMSprop(1e-3)
# opt = mixed_precision.LossScaleOptimizer(opt, loss_scale="dynamic")
# model.compile(loss="sparse_categorical_crossentropy", optimizer=opt)
# ```
#
# That module is gone from the TensorFlow this notebook runs on:

# %%
print("TensorFlow", tf.__version__, "| Keras", keras.__version__)
print("tf.keras.mixed_precision.experimental exists:",
      hasattr(tf.keras.mixed_precision, "experimental"))

# %% [markdown]
# The kmp version drops the hand-written float32 `Activation`: `float32_outputs` finds every
# output and fixes it, and `audit` proves it. A model that already follows the old guide (with
# its float32 `Activation`) audits clean as it is, and `float32_outputs` leaves it unchanged.
# `wrap_optimizer` accepts a plain optimizer, or an existing Keras `LossScaleOptimizer`, whose
# inner optimizer and current scale it takes over:

# %%
fresh("mixed_float16")  # replaces mixed_precision.set_policy(Policy("mixed_float16"))
model = kmp.float32_outputs(build_mlp())
print(kmp.audit(model))

# Code that already built a Keras LossScaleOptimizer can pass it as it is:
old_style = keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(1e-3),
                                                initial_scale=2**12)
optimizer = kmp.wrap_optimizer(old_style)
print(f"\nwrapped: {type(optimizer).__name__} around "
      f"{type(optimizer.inner_optimizer).__name__}, starting scale {optimizer.loss_scale:g}")
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(x_train, y_train, epochs=2, batch_size=32, verbose=2,
          callbacks=[kmp.callbacks.LossScaleMonitor(verbose=1)])
print("test accuracy:", round(model.evaluate(x_test, y_test, verbose=0)[1], 3))

# %% [markdown]
# ## 4. From a Horovod TF1 session script
#
# The classic Horovod TensorFlow 1 recipe: a hand-built `ConfigProto` pinning one GPU per
# process, an optimizer with the learning rate scaled by the number of ranks and wrapped in
# `hvd.DistributedOptimizer`, and a hook that broadcasts rank 0's variables:
#
# ```python
# import tensorflow as tf
# import horovod.tensorflow as hvd
#
# hvd.init()
# config = tf.ConfigProto()
# config.gpu_options.allow_growth = True
# config.gpu_options.visible_device_list = str(hvd.local_rank())
#
# loss = ...                                               # the graph
# opt = tf.train.AdamOptimizer(0.001 * hvd.size())
# opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
# # optional, float16 on V100s:
# # opt = tf.train.experimental.enable_mixed_precision_graph_rewrite(opt)
# train_op = opt.minimize(loss, global_step=tf.train.get_or_create_global_step())
#
# hooks = [hvd.BroadcastGlobalVariablesHook(0)]
# with tf.train.MonitoredTrainingSession(config=config, hooks=hooks) as sess:
#     while not sess.should_stop():
#         sess.run(train_op)
# ```
#
# `kmp.compat.v1` keeps the graph and the session and replaces the boilerplate around them.
# Two things are more than renames:
#
# * `distributed_optimizer(..., loss_scale="force_dynamic")` replaces both `hvd.DistributedOptimizer`
#   and the deprecated graph-rewrite optimizer. It averages the gradients over the ranks
#   *before* it unscales and checks them, so every rank skips an overflowing step together; two
#   separately wrapped optimizers do not guarantee that order.
# * `session_config()` picks the GPU from the local rank itself, and
#   `session_config(mixed_precision="float16")` switches on Grappler's float16 rewrite per
#   session instead of globally.
#
# The kmp version, run in this single process (`kmp.distributed.init()` then describes a world
# of one process and every collective is a no-op; under `kmp launch -np N` the same code
# averages over N ranks):

# %%
from kmp.compat import v1 as kv1

tf.get_logger().setLevel("ERROR")  # TF1 optimizers print deprecation notices
v1 = tf.compat.v1
world = kmp.distributed.init()  # replaces hvd.init()
print(world)

graph = tf.Graph()  # a TF1 graph, without switching the whole notebook out of eager mode
with graph.as_default():
    v1.set_random_seed(0)
    data = (tf.data.Dataset.from_tensor_slices((x_train, y_train.astype("int64")))
            .shuffle(2000, seed=0).repeat().batch(64))
    images_t, labels_t = v1.data.make_one_shot_iterator(data).get_next()
    images_t = v1.placeholder_with_default(images_t, [None, 64])  # feedable for the test
    labels_t = v1.placeholder_with_default(labels_t, [None])
    w1 = v1.get_variable("w1", [64, 128], initializer=v1.glorot_uniform_initializer())
    b1 = v1.get_variable("b1", [128], initializer=v1.zeros_initializer())
    w2 = v1.get_variable("w2", [128, 10], initializer=v1.glorot_uniform_initializer())
    b2 = v1.get_variable("b2", [10], initializer=v1.zeros_initializer())
    logits = tf.matmul(tf.nn.relu(tf.matmul(images_t, w1) + b1), w2) + b2
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels_t, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels_t), tf.float32))

    opt = kv1.distributed_optimizer(  # replaces hvd.DistributedOptimizer (+ the rewrite)
        v1.train.AdamOptimizer(0.001),
        scale_lr=True,  # replaces 0.001 * hvd.size()
        compression="fp16",  # replaces hvd.Compression.fp16
        loss_scale=None,  # "force_dynamic" together with session_config(mixed_precision="float16")
    )
    global_step = v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)
    broadcast = kv1.broadcast_global_variables(root=0)  # replaces BroadcastGlobalVariablesHook
    init = v1.global_variables_initializer()

config = kv1.session_config()  # replaces the hand-built ConfigProto
print("session config:\n" + str(config))
with kv1.session(config, graph=graph) as sess:
    sess.run(init)
    sess.run(broadcast)
    for step in range(1, 201):
        _, value = sess.run([train_op, loss])
        if step % 50 == 0:
            print(f"step {step}: loss {value:.4f}")
    test_acc = sess.run(accuracy, {images_t: x_test, labels_t: y_test.astype("int64")})
    print(f"global step {sess.run(global_step)}, test accuracy {test_acc:.3f}")

# %% [markdown]
# What `session_config(mixed_precision="float16")` changes, for the GPU version of this
# script: it switches on Grappler's `auto_mixed_precision` rewrite in the session's
# `ConfigProto`. On this machine without a GPU kmp says that the rewrite would do nothing:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gpu_config = kv1.session_config(mixed_precision="float16")
print("rewrite options:", str(gpu_config.graph_options.rewrite_options).strip())
for w in caught:
    print("kmp warns:", w.message)

# %% [markdown]
# ## Checklist
#
# * Set the policy once, before building the model: `kmp.enable()` (or the policy you were
#   using), not per-block casts or patches.
# * Remove hand-written float32 output layers if you like; `kmp.float32_outputs` and
#   `kmp.audit` take care of them.
# * Replace the loss-scaling and distributed optimizer wrappers with one
#   `kmp.wrap_optimizer` (Keras) or `kmp.compat.v1.distributed_optimizer` (TF1).
# * Replace Horovod's Keras callbacks (broken under Keras 3) with
#   `kmp.callbacks.default_callbacks()`, and `hvd.init()` with `kmp.distributed.init()`.
# * Checkpoints need nothing extra: the loss scale is saved with the optimizer.
