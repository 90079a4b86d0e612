"""Child process of the step-memory test (tests/test_master_weights.py): one step peak.

    TF_CPU_ALLOCATOR_USE_BFC=true python -m tests._step_peak MODE fused|op-by-op STEPS

Trains the test's bfloat16 MLP (kmp.wrap_optimizer(Adam), ``master_weights=MODE``) with
each weight's update compiled (``fused``) or run op by op in the same order
(``CompensatedUpdates.fuse_updates = False``), and prints one JSON line: every measured
step's peak bytes above the bytes in use before it, and the bfloat16 gradients' bytes.
TensorFlow runs it with one inter-op thread (the peak of the step, not of a schedule).

TensorFlow keeps statistics only for its BFC CPU allocator, which it picks when it starts,
so the variable must be set in this process's environment (the test does; this module
refuses to run without it rather than measure nothing). One configuration per process:
the allocator starts empty, so another run's freed blocks cannot decide where this one's
tensors go (a BFC allocator counts a whole free block under twice the size asked for).
"""

from __future__ import annotations

import json
import os
import sys

WIDTH, DEPTH, BATCH = 1024, 4, 8
PATHS = ("fused", "op-by-op")


def measure(mode: str, path: str, steps: int) -> dict:
    """Build, trace and train the MLP; return its step peaks and gradient bytes."""
    import keras
    import numpy as np
    import tensorflow as tf

    import kmp

    # One inter-op thread: the step's ops run one after another, so the peak is what the
    # step holds at once by construction, not what the scheduler happened to overlap
    # (with TensorFlow's pool the fused peak varied 2.04-2.52x on an AVX2-only EPYC).
    tf.config.threading.set_inter_op_parallelism_threads(1)

    kmp.enable("bfloat16")
    model = keras.Sequential(
        [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH) for _ in range(DEPTH)]
    )
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-4), master_weights=mode)
    opt.build(model.trainable_variables)
    opt.compensated.fuse_updates = path == "fused"  # before the step is traced
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x = np.random.default_rng(0).normal(size=(BATCH, WIDTH)).astype("float32")
    for _ in range(2):  # trace, then one step more
        model.train_on_batch(x, x)
    peaks = []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(x, x)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return {
        "mode": mode,
        "path": path,
        "peaks": peaks,
        "gradient_bytes": sum(2 * int(np.prod(v.shape)) for v in model.trainable_weights),
        "layer_float32_bytes": 4 * max(int(np.prod(v.shape)) for v in model.trainable_weights),
    }


def main(argv: list[str]) -> None:
    mode, path, steps = argv
    if path not in PATHS:
        raise SystemExit(f"path must be one of {PATHS}, got {path!r}")
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true":
        raise SystemExit("set TF_CPU_ALLOCATOR_USE_BFC=true: TensorFlow reads it when it starts")
    print(json.dumps(measure(mode, path, int(steps))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
