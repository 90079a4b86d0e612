"""Every use kmp makes of Keras's private internals, each with its fallback per version.

Also what differs between the Kerases kmp supports (kmp.versions: 3.10 to 3.15).

The one home of ``keras.src`` in kmp: no other module imports from it (tests/test_keras_internals.py
checks). Each function says which Keras versions take which route; docs/architecture.md
lists them. When Keras makes one public, or the oldest supported Keras has the public way,
the entry here shrinks to that call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "JAX_TRAIN_STEP",
    "JAX_VARIABLE_INITIALIZE",
    "bitcast",
    "compute_output_spec",
    "global_seed_generator",
    "is_tracer",
    "new_global_seed_generator",
    "patch_tf2onnx",
    "stateless_value",
    "untracked",
]

# Keras's JAX trainer step, which kmp's JAX engine wraps: ``train_step(self, state, data)``
# -> (logs, state), state = (trainable, non_trainable, optimizer, metrics) values. The same
# in Keras 3.10-3.15.
JAX_TRAIN_STEP = ("keras.src.backend.jax.trainer", "JAXTrainer", "train_step")

# Where every Keras variable made eagerly from a value passes on the JAX backend, before
# JAX lays it out over the devices: (module, class names tried in order, method, its
# parameters). The class is ``JaxVariable`` from Keras 3.11 and ``Variable`` in 3.10.
JAX_VARIABLE_INITIALIZE = (
    "keras.src.backend.jax.core",
    ("JaxVariable", "Variable"),
    "_initialize",
    ("self", "value"),
)

# The name of Keras's process-wide SeedGenerator in its global state (3.10-3.15).
_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def bitcast(x: Any, dtype: str) -> Any:
    """``x``'s bits read as ``dtype`` (same width): ``keras.ops.view`` where it exists.

    Keras 3.11 brought ``keras.ops.view``; on 3.10 each backend's own bitcast does it.
    """
    import keras

    if hasattr(keras.ops, "view"):
        return keras.ops.view(x, dtype)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.bitcast(tf.convert_to_tensor(x), dtype)
    if backend == "jax":
        import jax

        return jax.lax.bitcast_convert_type(x, dtype)
    import numpy as np

    return np.asarray(keras.ops.convert_to_numpy(x)).view(dtype)


def global_seed_generator() -> Any:
    """Keras's process-wide ``SeedGenerator`` if one was made, without making one; else None.

    ``keras.random`` functions called without a seed draw from it (Keras 3.10-3.15 keep it
    in ``keras.src.backend.common.global_state``; no public getter exists).
    """
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)


def new_global_seed_generator() -> Any:
    """Keras's process-wide ``SeedGenerator``, made now if there was none."""
    from keras.src.random.seed_generator import global_seed_generator as get

    return get()


def compute_output_spec(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """What ``fn(*args, **kwargs)`` would return, traced on placeholders (Keras 3.10-3.15)."""
    from keras.src.backend import compute_output_spec as spec

    return spec(fn, *args, **kwargs)


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is a JAX tracer (a compiled step is being traced); False elsewhere.

    JAX is not imported: a value is a tracer only where JAX made it. ``jax.core.Tracer``
    is the public name in JAX 0.6-0.12.
    """
    import sys

    jax_core = sys.modules.get("jax.core")
    return jax_core is not None and isinstance(value, jax_core.Tracer)


def stateless_value(variable: Any) -> Any:
    """The value a ``keras.StatelessScope`` in force maps ``variable`` to; None: no such scope.

    Keras 3.10-3.15 keep the scope in ``keras.src.backend.common.global_state`` and give no
    public getter (``keras.StatelessScope`` itself is public).
    """
    from keras.src.backend import get_stateless_scope

    scope = get_stateless_scope()
    return None if scope is None else scope.get_current_value(variable)


def untracked(fn: Callable) -> Callable:
    """Decorate a method so that the attributes it sets are not tracked by Keras."""
    from keras.src.utils.tracking import no_automatic_dependency_tracking

    return no_automatic_dependency_tracking(fn)


def patch_tf2onnx() -> None:
    """Keras's fix of tf2onnx 1.17 for NumPy 2, applied before kmp calls tf2onnx itself.

    ``keras.src.export.tf2onnx_lib.patch_tf2onnx`` in Keras 3.10-3.15 (Keras applies it in
    ``model.export(format="onnx")``; kmp's large-model route calls tf2onnx directly).
    Nothing is done where it is absent.
    """
    try:
        from keras.src.export.tf2onnx_lib import patch_tf2onnx as patch
    except ImportError:  # a Keras without it: tf2onnx needs no patch there
        return
    patch()
