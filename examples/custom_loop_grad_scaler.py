"""A GradScaler-style custom training loop, in Keras/TensorFlow with kmp's optimizer.

The original (the seed document, section 2: PyTorch's ``torch.cuda.amp``)::

    scaler = torch.cuda.amp.GradScaler()
    for data, target in dataloader:
        optimizer.zero_grad()
        with torch.cuda.amp.autocast():
            output = model(data)
            loss = criterion(output, target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

What kmp changes. The optimizer that ``kmp.wrap_optimizer`` returns is the scaler:

* ``autocast()`` -> ``kmp.enable("mixed_float16")`` before building the model (Keras layers
  compute in float16 and keep float32 variables), with ``kmp.float32_outputs`` for the head;
* ``GradScaler()`` + ``optimizer`` -> ``opt = kmp.wrap_optimizer(keras.optimizers.SGD(...))``:
  dynamic loss scaling under float16 (``growth_interval=2`` here so that the scale moves in a
  few steps; GradScaler's and kmp's default is 2000);
* ``scaler.scale(loss).backward()`` -> ``opt.scale_loss(loss)`` inside the tape, then
  ``tape.gradient``; ``zero_grad()`` has no counterpart (a tape's gradients are fresh);
* ``scaler.step(optimizer)`` + ``scaler.update()`` -> ``opt.apply(grads, variables)``: it
  unscales, skips a step whose gradients are not finite and moves the scale (the rule of
  ``kmp.loss_scale``), and in a job of several ranks (``kmp.distributed.init()`` first)
  averages the gradients over the ranks before that, so every rank skips the same steps.

As with GradScaler, the first step finds the scale: 32768 (kmp's default initial scale)
overflows float16 here, so step 1 is skipped and the scale halves. Step 3 reads a batch with an
``inf``: skipped too, and the scale halves again; two finite steps later it grows. Run it with
``python examples/custom_loop_grad_scaler.py``; its last line sums it up.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # a TensorFlow example, whatever is set

import warnings

import keras
import numpy as np
import tensorflow as tf

import kmp

STEPS = 6
BAD_STEP = 3  # this batch holds an inf: its gradients overflow


def main() -> dict:
    """Train a few steps with a GradScaler-style loop; return what happened."""
    with warnings.catch_warnings():  # float16 on a CPU is slow, and kmp says so: not here
        warnings.simplefilter("ignore", UserWarning)
        kmp.enable("mixed_float16")  # autocast()
    keras.utils.set_random_seed(0)
    model = kmp.float32_outputs(
        keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
    )
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.05), growth_interval=2)  # GradScaler()
    loss_fn = keras.losses.MeanSquaredError()
    rng = np.random.default_rng(0)
    scales, skipped = [], []
    for step in range(1, STEPS + 1):  # for data, target in dataloader:
        x = rng.normal(size=(16, 8)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        if step == BAD_STEP:
            x[0, 0] = np.inf
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))  # output, loss under the policy
            scaled = opt.scale_loss(loss)  # scaler.scale(loss)
        grads = tape.gradient(scaled, model.trainable_variables)  # .backward()
        opt.apply(grads, model.trainable_variables)  # scaler.step(optimizer); scaler.update()
        scales.append(opt.loss_scale)
        if opt.skipped_steps > len(skipped):
            skipped.append(step)
    result = {
        "scales": scales,
        "skipped": skipped,
        "iterations": int(opt.iterations.numpy()),
        "compute_dtype": model.layers[0].compute_dtype,
        "finite": bool(all(np.isfinite(np.asarray(v)).all() for v in model.weights)),
    }
    print(
        f"kmp: {STEPS} steps, skipped steps {skipped}, loss scale after each step "
        f"{' -> '.join(f'{s:g}' for s in scales)}, layers compute in {result['compute_dtype']}, "
        f"weights finite: {result['finite']}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
