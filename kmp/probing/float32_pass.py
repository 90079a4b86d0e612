"""The float32 pass of :func:`kmp.probe`: every layer's outputs and the gradients reaching them.

For the pass, every layer of the model (nested ones included) computes in float32 and its
``call`` is wrapped to record what it returns; afterwards the policies, the ``call``
methods and the non-trainable state (BatchNormalization statistics, random seeds) are put
back as they were, also when the pass fails.

* TensorFlow: one forward pass under a ``GradientTape`` and one ``tape.gradient`` with
  respect to the recorded outputs and the trainable variables.
* JAX: the outputs' shapes come from ``jax.eval_shape`` (tracing only); then one
  ``jax.vjp`` of ``model.stateless_call`` in which a zero is added to every recorded
  output, so the gradient with respect to those zeros is the gradient reaching the output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from kmp.layer_walk import calls_replaced, walk

__all__ = ["Pass", "float32_pass", "probed_layers"]

BACKENDS = ("tensorflow", "jax")


@dataclasses.dataclass
class Pass:
    """What one float32 pass measured (float32 NumPy arrays).

    Attributes:
        loss: The loss of the batch.
        inputs: Per layer (by identity), the float inputs of each call, in call order.
        outputs: Per layer (by identity), the float outputs of each call, in call order.
        output_grads: The same for the gradients reaching those outputs (None: the output
            does not reach the loss).
        layers: The walk the pass recorded, ``(layer, name)`` (see :func:`probed_layers`).
        variable_grads: Per trainable variable, its gradient (the touched rows of an
            embedding's sparse gradient only), None where it does not reach the loss.
    """

    loss: float
    inputs: dict[int, list[np.ndarray]]
    outputs: dict[int, list[np.ndarray]]
    output_grads: dict[int, list[np.ndarray | None]]
    variable_grads: list[np.ndarray | None]
    layers: list[tuple[keras.layers.Layer, str]] = dataclasses.field(default_factory=list)


def probed_layers(model: keras.Model) -> list[tuple[keras.layers.Layer, str]]:
    """Every layer below ``model`` (nested models and sublayers) once, with its path.

    The walk and the paths are :func:`kmp.layer_walk.walk`'s (``InputLayer`` objects
    left out), so a name the probe reports is one ``kmp.keep_float32`` selects and
    ``kmp.audit`` shows.
    """
    return [(v.layer, v.path) for v in walk(model, inputs=False)]


class _Recorder:
    """Wraps layers' ``call``; records outputs (and adds JAX's zero perturbations)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Any]] = []  # (layer id, float output), in call order
        self.inputs: list[tuple[int, Any]] = []  # (layer id, float input), in call order
        self.perturbations: list[Any] | None = None

    def wrap(self, layer: keras.layers.Layer) -> Callable:
        original = layer.call

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            for leaf in keras.tree.flatten((args, kwargs)):
                if _is_float_tensor(leaf):
                    self.inputs.append((id(layer), leaf))
            outputs = original(*args, **kwargs)
            leaves = keras.tree.flatten(outputs)
            changed = False
            for i, leaf in enumerate(leaves):
                if not _is_float_tensor(leaf):
                    continue
                if self.perturbations is not None:
                    leaf = leaf + self.perturbations[len(self.calls)]
                    leaves[i], changed = leaf, True
                self.calls.append((id(layer), leaf))
            return keras.tree.pack_sequence_as(outputs, leaves) if changed else outputs

        return call


def _is_float_tensor(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "shape"):
        return False
    try:
        return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))
    except Exception:  # a dtype Keras does not know (strings, resources)
        return False


@contextlib.contextmanager
def _float32_and_recorded(
    model: keras.Model, layers: list[keras.layers.Layer], recorder: _Recorder
) -> Iterator[None]:
    """Every layer in float32 with a recording ``call``; state and policies restored after."""
    policies = [(layer, layer.dtype_policy) for layer in [model, *layers]]
    state = [(v, np.array(v.numpy(), copy=True)) for v in model.non_trainable_variables]
    try:
        for layer, _ in policies:
            layer.dtype_policy = keras.dtype_policies.DTypePolicy("float32")
        with calls_replaced(layers, recorder.wrap):
            yield
    finally:
        for layer, policy in policies:
            layer.dtype_policy = policy
        for variable, value in state:
            variable.assign(value)


def _numpy(value: Any) -> np.ndarray:
    values = getattr(value, "values", None)  # tf.IndexedSlices: the rows sent
    if values is not None and hasattr(value, "indices"):
        value = values
    return np.asarray(keras.ops.convert_to_numpy(value), dtype=np.float32)


def _group(calls: list[tuple[int, Any]], values: list[Any]) -> dict[int, list]:
    out: dict[int, list] = {}
    for (layer_id, _), value in zip(calls, values, strict=True):
        out.setdefault(layer_id, []).append(None if value is None else _numpy(value))
    return out


def float32_pass(model: keras.Model, x: Any, y: Any, loss_fn: Callable, sample_weight: Any) -> Pass:
    """Run the float32 forward and backward pass of ``model`` on one batch.

    Args:
        model: A built Keras model.
        x: The inputs, as ``model`` takes them.
        y: The targets (passed to ``loss_fn`` as they are, also when None).
        loss_fn: ``loss_fn(y, y_pred, sample_weight) -> scalar``.
        sample_weight: Passed to ``loss_fn``.

    Returns:
        The :class:`Pass`.
    """
    backend = keras.backend.backend()
    recorder = _Recorder()
    walked = probed_layers(model)
    with _float32_and_recorded(model, [layer for layer, _ in walked], recorder):
        run = _tensorflow_pass if backend == "tensorflow" else _jax_pass
        measured = run(model, x, y, loss_fn, sample_weight, recorder)
    measured.layers = walked
    return measured


def _tensorflow_pass(model, x, y, loss_fn, sample_weight, recorder: _Recorder) -> Pass:
    import tensorflow as tf

    variables = [v.value for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = loss_fn(y, y_pred, sample_weight)
    outputs = [out for _, out in recorder.calls]
    grads = tape.gradient(loss, outputs + variables)
    n = len(outputs)
    return Pass(
        loss=float(loss),
        inputs=_group(recorder.inputs, [x for _, x in recorder.inputs]),
        outputs=_group(recorder.calls, outputs),
        output_grads=_group(recorder.calls, grads[:n]),
        variable_grads=[None if g is None else _numpy(g) for g in grads[n:]],
    )


def _jax_pass(model, x, y, loss_fn, sample_weight, recorder: _Recorder) -> Pass:
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def forward(perturbations, trainable):
        recorder.calls, recorder.inputs, recorder.perturbations = [], [], perturbations
        y_pred, _ = model.stateless_call(trainable, frozen, x, training=True)
        outputs = [out for _, out in recorder.calls]
        inputs = [x for _, x in recorder.inputs]
        return loss_fn(y, y_pred, sample_weight), (outputs, inputs)

    recorder.perturbations = None
    shapes = jax.eval_shape(lambda t: _shapes(model, t, frozen, x, recorder), trainable)
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    loss, pullback, (outputs, inputs) = jax.vjp(forward, zeros, trainable, has_aux=True)
    calls, seen = list(recorder.calls), list(recorder.inputs)
    output_grads, variable_grads = pullback(jnp.ones_like(loss))
    return Pass(
        loss=float(loss),
        inputs=_group(seen, inputs),
        outputs=_group(calls, outputs),
        output_grads=_group(calls, output_grads),
        variable_grads=[_numpy(g) for g in variable_grads],
    )


def _shapes(model, trainable, frozen, x, recorder: _Recorder) -> list:
    recorder.calls, recorder.inputs = [], []
    model.stateless_call(trainable, frozen, x, training=True)
    return [out for _, out in recorder.calls]
