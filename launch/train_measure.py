"""What launch/train.py measures and injects.

Throughput, skipped steps, the ranks' weight check, the closing line, and the test driver's
overflow and early stop.

A sibling of train.py (imported as ``train_measure``). Keras and kmp are passed in or imported
inside the functions, so importing this module is light.
"""

from __future__ import annotations

import math
import time
import zlib

# Above this many parameters the weight check compares checksums, not full weights.
FULL_WEIGHT_CHECK_MAX_PARAMS = 2_000_000


def loss_scale_of(model) -> tuple[float | None, int | None]:
    opt = model.optimizer
    scale = getattr(opt, "loss_scale", None)
    skipped = getattr(opt, "skipped_steps", None)
    return (None if scale is None else float(scale), None if skipped is None else int(skipped))


def state_bytes_per_param(model) -> float:
    """Bytes of the weights and the optimizer's variables per trainable parameter."""
    import numpy as np

    from kmp.master_weights import state_bytes

    params = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    return state_bytes(model) / max(params, 1)


def weights_max_diff(variables, kmp) -> float:
    """Largest difference between any rank's ``variables`` and rank 0's (0.0: identical)."""
    import numpy as np

    values = [np.asarray(v.numpy(), dtype=np.float64).ravel() for v in variables]
    if not values:
        return 0.0
    size = kmp.distributed.size()
    if sum(v.size for v in values) <= FULL_WEIGHT_CHECK_MAX_PARAMS:
        flat = np.concatenate(values)
        gathered = np.asarray(kmp.distributed.allgather(flat)).reshape(size, -1)
        return float(np.max(np.abs(gathered - gathered[0]))) if size > 1 else 0.0
    # Large models: exact byte checksums per variable; any difference shows as a mismatch.
    sums = np.array([zlib.crc32(v.tobytes()) for v in values], dtype=np.int64)
    gathered = np.asarray(kmp.distributed.allgather(sums)).reshape(size, -1)
    return 0.0 if (gathered == gathered[0]).all() else math.inf


def result_line(summary: dict) -> str:
    """Rank 0's closing line: the quality figure, the weight check and the throughput."""
    if "val_loss_nats" in summary:
        quality = (
            f"validation loss {summary['val_loss_nats']:.4f} nats/byte "
            f"({summary['val_bits_per_byte']:.4f} bits/byte)"
        )
    else:
        quality = f"test accuracy {summary['test_accuracy']:.4f}"
    diff = summary["weights_max_diff"]
    rate = summary["images_per_sec"]
    if rate is not None and summary["tokens_per_sec"] is not None:
        speed = f"{summary['tokens_per_sec']:.0f} tokens/s"
    else:
        speed = "no training" if rate is None else f"{rate:.0f} images/s"
    same = "identical" if diff == 0 else f"DIFFER (max {diff:g})"
    return f"{quality} | ranks' weights {same} | {speed}"


def throughput_callback(batch_size: int, kmp):
    import keras

    class Throughput(keras.callbacks.Callback):
        """Images per second over all ranks, per epoch."""

        def __init__(self):
            super().__init__()
            self.per_epoch: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start, self._steps = time.perf_counter(), 0

        def on_train_batch_end(self, batch, logs=None):
            self._steps += 1

        def on_epoch_end(self, epoch, logs=None):
            elapsed = time.perf_counter() - self._start
            # The rank count now: an elastic job may have shrunk or grown since the start.
            images = self._steps * batch_size * kmp.distributed.size()
            self.per_epoch.append(images / elapsed)

    return Throughput()


def skip_recorder(kmp):
    """A callback that lists the steps (0-based, over the run) the optimizer skipped."""
    import keras

    class SkipRecorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps: list[int] = []
            self._seen = 0
            self._step = 0

        def on_train_begin(self, logs=None):
            self._seen = int(getattr(self.model.optimizer, "skipped_steps", 0) or 0)

        def on_train_batch_end(self, batch, logs=None):
            now = int(getattr(self.model.optimizer, "skipped_steps", 0) or 0)
            if now > self._seen:
                self.steps.append(self._step)
            self._seen, self._step = now, self._step + 1

    return SkipRecorder()


def inject_overflow(dataset, step: int):
    """Make batch ``step`` of ``dataset`` all inf: its gradients overflow on this rank only."""
    import tensorflow as tf

    def poison(i, batch):
        x, *rest = batch
        bad = tf.fill(tf.shape(x), tf.constant(float("inf"), x.dtype))
        return (tf.where(tf.equal(i, step), bad, x), *rest)

    return dataset.enumerate().map(poison)


def stop_after(epochs: int):
    import keras

    class StopAfter(keras.callbacks.Callback):
        """End fit() after ``epochs`` epochs of this run, on every rank alike."""

        def __init__(self):
            super().__init__()
            self.done = 0

        def on_epoch_end(self, epoch, logs=None):
            self.done += 1
            if self.done >= epochs:
                self.model.stop_training = True

    return StopAfter()
