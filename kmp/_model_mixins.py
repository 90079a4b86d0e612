"""A model moved in place to a kmp mixin over its own class, saved around its own config, once.

kmp changes some models without rebuilding them: ``kmp.float32_outputs`` moves a subclassed
or KerasHub model to ``Float32Outputs[<its class>]`` (:mod:`kmp.layers`) and
``kmp.keep_float32`` moves a model to ``KeepsFloat32[<its class>]`` (:mod:`kmp.float32_layers`).
Each such class is a subclass of the mixin and of the model's own class, made once per
class, with the model's class name (``isinstance`` checks stay true), and registered with
Keras under the mixin's name, whichever class it wraps. Its config wraps the model's own
(:func:`wrapped_config`), and the mixin's ``from_config`` deserializes that first. A model can
hold both (``Float32Outputs[KeepsFloat32[Net]]``): each mixin finds its own base by its own
attribute.
"""

from __future__ import annotations

import functools
from typing import Any

import keras

__all__ = ["mixin_class", "move_to", "wrapped_config"]


@functools.cache
def mixin_class(mixin: type, base: type, base_attribute: str, name: str) -> type:
    """The one subclass of ``mixin`` and ``base``, registered as ``"kmp>NAME"``.

    Args:
        mixin: The kmp mixin (its methods come first).
        base: The model's own class, kept on the new class as ``base_attribute``.
        base_attribute: The mixin's own attribute for its base.
        name: The registered name (the mixin's).
    """
    cls = type(
        base.__name__,
        (mixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__, base_attribute: base},
    )
    return keras.saving.register_keras_serializable(package="kmp", name=name)(cls)


def move_to(model: Any, cls: type) -> None:
    """Move ``model`` to ``cls`` in place (Keras caches the call signature per instance)."""
    object.__setattr__(model, "__class__", cls)


def wrapped_config(base: type, config: dict) -> dict:
    """A model of class ``base`` with ``config``, serialized as Keras's loader reads it."""
    return {
        "module": base.__module__,
        "class_name": base.__name__,
        "config": config,
        "registered_name": keras.saving.get_registered_name(base),
    }
