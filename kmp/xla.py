"""XLA for the compute of a training step, with Horovod's collectives outside it.

:func:`step_jit_compile` says which ``jit_compile`` a kmp step takes on each backend
(False on TensorFlow, True on JAX).

``model.compile(jit_compile=True)`` compiles the whole step, the optimizer's
allreduce included, and this Horovod build has no XLA kernels for its ops, so a
multi-rank job fails. :func:`jit_gradients` splits the step instead::

    forward + loss + scale_loss + backward     one XLA cluster (tf.function(jit_compile=True))
    optimizer.apply_gradients                  plain TensorFlow: allreduce, check, apply
    compute_metrics                            plain TensorFlow

The gradients leave the XLA cluster all at once, so they cannot be reduced in
buckets while the backward pass runs: XLA and overlap exclude each other. Whether
XLA pays depends on the model, the CPU and the threading (``bench/peers.py``
measures it; docs/performance.md has the figures): in the final run here it lost
on both the digits CNN and the dense ``wide_mlp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["fused", "jit_gradients", "step_jit_compile"]


def step_jit_compile(backend: str | None = None) -> bool:
    """The ``jit_compile`` a kmp training step takes on ``backend`` (default: Keras's).

    The one home of this rule. On TensorFlow, ``False``: the optimizer's Horovod ops
    have no XLA kernels (:func:`jit_gradients` compiles the rest). On JAX, ``True``:
    Keras compiles the whole step, kmp's optimizer and the JAX engine's collectives
    included; with ``False`` Keras runs every step op by op, and the loss scale's
    ``cond`` is compiled again at each one (measured on the digits CNN, one process on
    2 cores: 56 against 3,524 images/s under mixed_float16, docs/performance.md).

    Args:
        backend: ``"tensorflow"``, ``"jax"`` or another Keras backend name.

    Returns:
        ``model.compile``'s ``jit_compile`` value.

    Raises:
        TypeError: ``backend`` is not a string.
    """
    if backend is None:
        import keras

        backend = keras.backend.backend()
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a Keras backend name (str), got {type(backend).__name__}."
        )
    return backend == "jax"


def fused(fn: Callable) -> Callable:
    """``fn`` compiled into one XLA computation on TensorFlow; ``fn`` itself on JAX.

    For the elementwise chains of an update (stochastic rounding, Kahan sums): run op by
    op, TensorFlow passes over the tensor once per op (about 20 for a stochastic
    rounding); compiled, once. Measured on a 67M-element bfloat16 weight on 2 cores:
    278 ms op by op against 14 ms compiled, the same bits. JAX compiles the whole step
    already (:func:`step_jit_compile`), so there is nothing to add. ``fn`` must hold no
    Horovod op (they have no XLA kernels).

    Args:
        fn: A function of tensors (positional arguments; variables are read first).

    Returns:
        A callable with ``fn``'s signature.
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        return fn
    import tensorflow as tf

    compiled = tf.function(fn, jit_compile=True, autograph=False)

    def call(*args: Any) -> Any:
        # Values, not variables: a variable argument would be traced by its identity.
        return compiled(*(tf.convert_to_tensor(a) for a in args))

    return call


def _check_model(model: Any) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(
            f"jit_gradients needs a compiled Keras 3 model, got {type(model).__name__}."
        )
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"jit_gradients splits a TensorFlow train step; KERAS_BACKEND is "
            f"{keras.backend.backend()!r}. On JAX, model.compile(jit_compile=True) already "
            "compiles the whole step."
        )
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            "Compile the model first (model.compile(optimizer=kmp.wrap_optimizer(...), "
            "loss=..., jit_compile=False)), then call kmp.xla.jit_gradients(model)."
        )
    if model.jit_compile:
        raise ValueError(
            "The model was compiled with jit_compile=True, which compiles the optimizer's "
            "Horovod allreduce too (no XLA kernels). Compile it with jit_compile=False; "
            "jit_gradients compiles the forward and backward pass itself."
        )


def jit_gradients(model: Any) -> Any:
    """Compile ``model``'s forward and backward pass with XLA; keep the optimizer outside.

    Replaces ``train_step`` on this model instance (``fit`` traces it again);
    evaluation and prediction are unchanged. Everything the optimizer does
    (allreduce in buckets, the finite check, skipping, the loss scale) runs as
    without XLA, so every rank still applies or skips each step together.

    Args:
        model: A Keras 3 model on the TensorFlow backend, compiled with
            ``jit_compile=False``.

    Returns:
        The same model.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: Another backend, a model not compiled yet, or compiled with
            ``jit_compile=True``.
    """
    _check_model(model)
    import keras
    import tensorflow as tf

    def forward_backward(x: Any, y: Any, sample_weight: Any) -> tuple[list, Any]:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            first = next(t for t in tf.nest.flatten(x) if t is not None)
            model._loss_tracker.update_state(loss, sample_weight=tf.shape(first)[0])
            loss = model.optimizer.scale_loss(loss)
        return tape.gradient(loss, model.trainable_weights), y_pred

    compiled = tf.function(forward_backward, jit_compile=True, reduce_retracing=True)

    def train_step(data: Any) -> dict:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grads, y_pred = compiled(x, y, sample_weight)
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights, strict=True))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    train_step.xla_function = compiled  # the compiled part, for inspection
    model.train_step = train_step
    model.train_function = None  # traced again with the new step
    return model
