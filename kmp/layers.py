"""Keeping a model's outputs, and chosen layers, in float32.

Under a mixed policy every layer computes in float16 or bfloat16, the last one included, so
a softmax would produce low-precision probabilities and the loss would be computed from
them. :func:`float32_outputs` rebuilds a Sequential or Functional model so that each output
layer produces *logits*, and a :class:`Float32Output` layer then casts the logits to float32
and applies the final activation (softmax, sigmoid, ...) in float32.

Any other model (a subclassed model, a KerasHub task model such as ``GPT2CausalLM``) cannot
be rebuilt from its layers: it is given float32 outputs in place instead, by moving it to a
subclass of its own class that casts every 16-bit floating output of ``call`` to float32
(:class:`Float32Outputs`). Its logits are still computed in 16 bits (no float32 copy of the
vocabulary matmul); the loss then reads them in float32.

Chosen layers are kept in float32 by :func:`kmp.float32_layers.keep_float32`.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from kmp._model_mixins import mixin_class, move_to, wrapped_config
from kmp._names import LOW_FLOATS
from kmp.float32_layers import KeptFloat32  # noqa: F401  (registers the kept layers' policy)

__all__ = ["Float32Output", "float32_outputs", "has_float32_outputs"]

_LINEAR_NAMES = ("linear", None)


def activation_name(activation: Any) -> str | None:
    """The activation's name: a built-in's (``"softmax"``), else its registered or class name.

    Never raises: an activation Keras cannot serialize is named by its Python name
    (``"unknown:<name>"`` when even that is missing), so callers report it instead of
    guessing.
    """
    if activation is None:
        return None
    try:
        name = keras.activations.serialize(activation)
    except Exception:  # an unserializable callable is still named
        name = None
    if isinstance(name, dict):  # custom, registered or parametrised activation
        config = name.get("config")
        if isinstance(config, dict) and isinstance(config.get("name"), str):
            return config["name"]
        if isinstance(config, str):  # a registered function: "keras_hub>gelu_approximate"
            return config
        name = name.get("registered_name") or name.get("class_name")
    if isinstance(name, str):
        return name
    return getattr(activation, "__name__", None) or f"unknown:{type(activation).__name__}"


@keras.saving.register_keras_serializable(package="kmp")
class Float32Output(keras.layers.Layer):
    """Casts its input to float32 and applies an activation in float32.

    Put it at the end of a mixed-precision model, after a layer that produces logits:
    ``Float32Output("softmax")`` computes the probabilities (and so the loss) in float32
    whatever the global policy.

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


def _cast_low_floats(outputs: Any) -> Any:
    """``outputs`` with every float16/bfloat16 tensor cast to float32, the rest as they are."""

    def cast(t: Any) -> Any:
        dtype = getattr(t, "dtype", None)
        if dtype is not None and keras.backend.standardize_dtype(dtype) in LOW_FLOATS:
            return ops.cast(t, "float32")
        return t

    return keras.tree.map_structure(cast, outputs)


@keras.saving.register_keras_serializable(package="kmp", name="Float32Outputs")
class Float32Outputs:
    """Mixin for a model whose floating outputs leave ``call`` in float32.

    :func:`float32_outputs` moves a model it cannot rebuild (subclassed, KerasHub task
    models) to ``Float32Outputs[<its class>]``, a subclass of both: the model keeps its
    class (``isinstance(model, keras_hub.models.GPT2CausalLM)`` stays true), its layers,
    weights, ``fit``/``evaluate``/``predict``/``generate`` and its config, and ``call``
    casts every float16/bfloat16 output to float32. Such a model saves as
    ``"kmp>Float32Outputs"`` wrapping its own config and loads back the same way with
    :func:`kmp.load_model` (or ``keras.saving.load_model`` once ``kmp.layers`` is imported).
    Never instantiate it directly.
    """

    _kmp_base: type | None = None  # the model's own class, set on each subclass

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return _cast_low_floats(super().call(*args, **kwargs))  # type: ignore[misc]

    def get_config(self) -> dict:
        return {"model": wrapped_config(self._kmp_base, super().get_config())}  # type: ignore[misc]

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> keras.Model:
        model = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        # The head's reverse_dtype is not in every model's config (KerasHub backbones
        # build their ReversibleEmbedding themselves): decide it again, as it was decided.
        _compute_heads_in_low_precision(model)
        _move_to_float32_class(model)
        return model


def _move_to_float32_class(model: keras.Model) -> None:
    move_to(model, mixin_class(Float32Outputs, type(model), "_kmp_base", "Float32Outputs"))


def has_float32_outputs(model: Any) -> bool:
    """True when ``model``'s ``call`` casts its 16-bit floating outputs to float32.

    That is, the model went through :func:`float32_outputs`'s in-place path (subclassed and
    KerasHub models). A rebuilt Sequential or Functional model shows its float32 outputs in
    ``model.outputs`` instead.
    """
    return isinstance(model, Float32Outputs)


def _computes_in_low_precision(model: keras.Model) -> bool:
    layers = [model, *model._flatten_layers(include_self=False)]
    return any(getattr(layer, "compute_dtype", None) in LOW_FLOATS for layer in layers)


def upcasting_reverse_head(layer: Any) -> bool:
    """True for a tied ``ReversibleEmbedding`` whose vocabulary matmul silently runs in float32.

    Keras's ``ReversibleEmbedding`` (KerasHub's LM heads) reads its float32 embedding
    without autocasting, so with no ``reverse_dtype`` of its own the reverse matmul
    multiplies 16-bit hidden states by the float32 table: the backend upcasts and the
    whole vocabulary matmul runs in float32, whatever its symbolic output dtype says.
    """
    reversible = getattr(keras.layers, "ReversibleEmbedding", None)
    return (
        reversible is not None
        and isinstance(layer, reversible)
        and getattr(layer, "tie_weights", False)
        and getattr(layer, "reverse_dtype", "set") is None
        and layer.compute_dtype in LOW_FLOATS
    )


def _compute_heads_in_low_precision(model: keras.Model) -> None:
    """Run each upcasting reverse head's matmul in its compute dtype (call() casts the logits)."""
    for layer in model._flatten_layers(include_self=False):
        if upcasting_reverse_head(layer):
            layer.reverse_dtype = layer.compute_dtype


def _float32_outputs_in_place(model: keras.Model) -> keras.Model:
    if isinstance(model, Float32Outputs) or not _computes_in_low_precision(model):
        return model
    _compute_heads_in_low_precision(model)
    _move_to_float32_class(model)
    return model


def _needs_float32_head(layer: keras.layers.Layer, tensor: Any) -> bool:
    if isinstance(layer, Float32Output):
        return False
    return str(tensor.dtype) != "float32" or layer.compute_dtype != "float32"


def float32_outputs(model: keras.Model) -> keras.Model:
    """Return ``model`` with float32 outputs, activations included where it can.

    A Sequential or Functional model is copied: for each model output produced by a layer
    that computes in a lower precision, the layer is rebuilt without its final activation
    (so it produces logits) and followed by :class:`Float32Output` with that activation:
    softmax and sigmoid are then computed in float32 from the logits, not cast after a
    float16 softmax. ``Activation`` and ``Softmax`` output layers are replaced by
    ``Float32Output`` directly. Weights are copied; the original model is left untouched.

    Any other model (subclassed, or a KerasHub task model such as ``GPT2CausalLM``,
    ``GemmaCausalLM``, ``BertTextClassifier``) is changed **in place** and returned: it
    moves to a subclass of its own class (:class:`Float32Outputs`) whose ``call`` casts
    every float16/bfloat16 output to float32, so the loss reads float32 logits while the
    head's matmul stays 16-bit. It keeps its class, layers, weights and methods
    (``generate`` included, which samples from its own 16-bit logits). An activation inside
    such a model's last layer is not moved: make it produce logits (KerasHub task models do)
    and put the activation in the loss (``from_logits=True``). A tied
    ``ReversibleEmbedding`` head (KerasHub's language models) without a ``reverse_dtype`` of
    its own gets the compute dtype as ``reverse_dtype``: Keras would otherwise upcast its
    whole vocabulary matmul to float32 (see :func:`upcasting_reverse_head`); set
    ``reverse_dtype="float32"`` on it first to keep that.

    Outputs that are already float32 are kept as they are, so calling this twice changes
    nothing.

    Args:
        model: A Keras model; a Sequential model must have an input shape.

    Returns:
        The Functional copy, or ``model`` itself (in place, or already float32).

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: A Sequential or Functional model has no defined inputs (build
            or call it first).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"float32_outputs expects a Keras model, got {type(model).__name__}. For a "
            "single layer, add kmp.layers.Float32Output after it instead."
        )
    is_functional = isinstance(model, keras.Sequential) or type(model).__name__ == "Functional"
    if not is_functional:
        return _float32_outputs_in_place(model)
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
            if activation is not None and activation_name(activation) not in _LINEAR_NAMES:
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
