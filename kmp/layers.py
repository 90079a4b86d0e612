"""Keeping a model's outputs in float32.

Under a mixed policy every layer computes in float16 or bfloat16, the last one
included, so a softmax would produce low-precision probabilities and the loss
would be computed from them. :func:`float32_outputs` rebuilds a Sequential or
Functional model so that each output layer produces *logits*, and a
:class:`Float32Output` layer then casts the logits to float32 and applies the
final activation (softmax, sigmoid, ...) in float32.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

__all__ = ["Float32Output", "float32_outputs"]

_LINEAR_NAMES = ("linear", None)


def _activation_name(activation: Any) -> str | None:
    if activation is None:
        return None
    name = keras.activations.serialize(activation)
    if isinstance(name, dict):  # custom or parametrised activation
        return name.get("config", {}).get("name") or name.get("class_name")
    return name


@keras.saving.register_keras_serializable(package="kmp")
class Float32Output(keras.layers.Layer):
    """Casts its input to float32 and applies an activation in float32.

    Put it at the end of a mixed-precision model, after a layer that produces
    logits: ``Float32Output("softmax")`` computes the probabilities (and so the
    loss) in float32 whatever the global policy.

    Args:
        activation: Activation applied after the cast (name or callable);
            None or ``"linear"`` only casts.
        **kwargs: Passed to ``keras.layers.Layer``; ``dtype`` is always float32.
    """

    def __init__(self, activation: str | Any = None, **kwargs: Any) -> None:
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        self.activation = keras.activations.get(activation)
        self.supports_masking = True

    def call(self, inputs):  # noqa: D102
        return self.activation(ops.cast(inputs, "float32"))

    def compute_output_shape(self, input_shape):  # noqa: D102
        return input_shape

    def get_config(self) -> dict:  # noqa: D102
        config = super().get_config()
        config.pop("dtype", None)
        config["activation"] = keras.activations.serialize(self.activation)
        return config


def _needs_float32_head(layer: keras.layers.Layer, tensor: Any) -> bool:
    if isinstance(layer, Float32Output):
        return False
    return str(tensor.dtype) != "float32" or layer.compute_dtype != "float32"


def float32_outputs(model: keras.Model) -> keras.Model:
    """Return a copy of ``model`` whose outputs are float32, activations included.

    For each model output produced by a layer that computes in a lower
    precision, the layer is rebuilt without its final activation (so it
    produces logits) and followed by :class:`Float32Output` with that
    activation: softmax and sigmoid are then computed in float32 from the
    logits, not cast after a float16 softmax. ``Activation`` and ``Softmax``
    output layers are replaced by ``Float32Output`` directly. Weights are copied;
    the original model is left untouched. Outputs that are already float32 are
    kept as they are, so calling this twice changes nothing.

    Args:
        model: A built Sequential or Functional Keras model.

    Returns:
        A Functional model with the same inputs, weights and names.

    Raises:
        TypeError: ``model`` is not a Keras model, or is a subclassed model (its
            layers cannot be rebuilt): add ``kmp.layers.Float32Output(activation)``
            as its last step instead, with the last layer producing logits.
        ValueError: The model has no defined inputs (build or call it first).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"float32_outputs expects a Keras Sequential or Functional model, got "
            f"{type(model).__name__}. For a single layer, add kmp.layers.Float32Output "
            "after it instead."
        )
    is_functional = isinstance(model, keras.Sequential) or type(model).__name__ == "Functional"
    if not is_functional:
        raise TypeError(
            f"float32_outputs cannot rebuild the subclassed model {type(model).__name__!r}: "
            "its layers and calls are Python code. Instead, make the last layer produce "
            "logits and return kmp.layers.Float32Output('softmax')(logits) (or sigmoid) from "
            "call(); kmp.audit(model) then checks the result."
        )
    try:
        outputs = model.outputs
    except (AttributeError, ValueError) as exc:
        outputs = None
        cause = exc
    if not outputs:
        raise ValueError(
            "The model has no defined inputs/outputs yet. Give the Sequential model an "
            "input shape (keras.Input(shape=...)) or call it on data once, then call "
            "float32_outputs again."
        ) from (cause if outputs is None else None)

    targets = {
        id(t._keras_history.operation)
        for t in model.outputs
        if _needs_float32_head(t._keras_history.operation, t)
    }
    if not targets:
        return model

    heads: dict[int, Any] = {}  # id(new layer) -> activation to apply in float32

    def clone_function(layer: keras.layers.Layer) -> keras.layers.Layer:
        config = layer.get_config()
        if id(layer) in targets:
            if isinstance(layer, keras.layers.Softmax):
                new = Float32Output("softmax", name=f"{layer.name}_float32")
                heads[id(new)] = "replaced"
                return new
            if isinstance(layer, keras.layers.Activation):
                new = Float32Output(layer.activation, name=f"{layer.name}_float32")
                heads[id(new)] = "replaced"
                return new
            activation = getattr(layer, "activation", None)
            if activation is not None and _activation_name(activation) not in _LINEAR_NAMES:
                config["activation"] = "linear"
                new = layer.__class__.from_config(config)
                heads[id(new)] = activation
                return new
            new = layer.__class__.from_config(config)
            heads[id(new)] = None
            return new
        return layer.__class__.from_config(config)

    def call_function(layer: keras.layers.Layer, *args: Any, **kwargs: Any) -> Any:
        out = layer(*args, **kwargs)
        head = heads.get(id(layer), "replaced")
        if head != "replaced":
            out = Float32Output(head, name=f"{layer.name}_float32")(out)
        return out

    # Keras clones only Functional graphs with a call_function: view a Sequential
    # model as the Functional graph of the same layers first.
    source = model
    if isinstance(model, keras.Sequential):
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        outputs = model.outputs[0] if len(model.outputs) == 1 else model.outputs
        source = keras.Model(inputs, outputs, name=model.name)
    cloned = keras.models.clone_model(
        source, clone_function=clone_function, call_function=call_function
    )
    for old in model.layers:
        if old.weights:  # replaced Activation/Softmax layers have none
            cloned.get_layer(old.name).set_weights(old.get_weights())
    return cloned
