"""The TensorFlow SavedModel route: the model's call as a signature, run by TensorFlow.

Keras 3.15's ``model.export`` (and ``ExportArchive``) stores every variable twice in a
SavedModel, once per Python object that wraps it (keras-team/keras#23553): twice the file
and twice the memory of whoever serves it. kmp saves a plain ``tf.Module`` that tracks the
model's own ``tf.Variable`` objects once and holds one ``tf.function``, the signature
``serving_default``; a model that holds other TensorFlow resources (lookup tables), which
that module does not track, is written by ``ExportArchive`` instead.

The signature takes the served inputs by name (:mod:`kmp.exporting.signature`: float32 for
a float input, whatever the model computes in; integer ids and masks as they are) and
returns the outputs by name in float32: a model loaded in ``"float16"`` or ``"bfloat16"``
computes in 16 bits with 16-bit weights inside the file, and its outputs are cast to
float32 in the signature, so a caller sees float32 at both ends whatever the precision.
"""

from __future__ import annotations

import shutil
from typing import Any

import keras
import numpy as np

from kmp.exporting.generation_models import compiled_when_served
from kmp.exporting.signature import Runner, Signature, dtypes, output_items, tensor_specs

__all__ = ["SIGNATURE", "SavedModelRunner", "serving_function", "write_saved_model"]

SIGNATURE = "serving_default"


def serving_function(model: keras.Model) -> Any:
    """The served call: the model on its inputs, every output named and float outputs float32.

    Backend-neutral (Keras ops), so TensorFlow traces it and Keras's JAX export converts it.

    Args:
        model: The Keras model, in the precision the file holds.

    Returns:
        A function of the inputs (as the model takes them) returning ``{name: tensor}``.
    """

    def serve(inputs: Any) -> dict[str, Any]:
        served = {}
        for name, tensor in output_items(model(inputs, training=False)):
            dtype = keras.backend.standardize_dtype(tensor.dtype)
            if "float" in dtype and dtype != "float32":
                tensor = keras.ops.cast(tensor, "float32")
            served[name] = tensor
        return served

    return serve


def write_saved_model(model: keras.Model, path: str, signature: Signature) -> None:
    """Write ``model`` as a SavedModel folder at ``path``.

    Under TensorFlow a ``tf.Module`` holds each variable once; under JAX (or with an
    untracked resource) Keras's ``ExportArchive`` writes it (under JAX through jax2tf).

    Args:
        model: The Keras model, in the precision the file holds.
        path: The folder to write (it must not exist).
        signature: The served inputs.
    """
    import tensorflow as tf

    serve = serving_function(model)
    specs = tensor_specs(signature)
    if keras.backend.backend() == "tensorflow":
        module = tf.Module()
        module.weights = [v.value for v in model.variables]  # the tf.Variables, each once
        jit = compiled_when_served(model) or None  # a decoding loop: XLA, as Keras would
        module.serve = tf.function(serve, input_signature=specs, jit_compile=jit)
        try:
            tf.saved_model.save(
                module, path, signatures={SIGNATURE: module.serve.get_concrete_function()}
            )
            return
        except (AssertionError, ValueError):  # an untracked resource: Keras's archive tracks it
            shutil.rmtree(path, ignore_errors=True)
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve, input_signature=specs)
    archive.write_out(path, verbose=False)


class SavedModelRunner(Runner):
    """A SavedModel loaded once in TensorFlow, run through its ``serving_default`` signature.

    Attributes:
        input_names: The signature's inputs, in the order it lists them.
        output_names: Its outputs.
        input_dtype: The inputs' dtypes (distinct ones, joined with ", ").
        output_dtype: The outputs' dtypes, the same way.
    """

    def __init__(self, path: str) -> None:
        """Load the SavedModel folder at ``path``.

        Args:
            path: The exported folder.
        """
        import tensorflow as tf

        self._loaded = tf.saved_model.load(path)  # kept: the signature uses its variables
        self._signature = self._loaded.signatures[SIGNATURE]
        self._specs = dict(self._signature.structured_input_signature[1])
        outputs = self._signature.structured_outputs
        self.input_names: list[str] = list(self._specs)
        self.input_shapes = {n: tuple(s.shape.as_list()) for n, s in self._specs.items()}
        self.output_names: list[str] = list(outputs)
        self.input_dtype: str = dtypes(s.dtype.name for s in self._specs.values())
        self.output_dtype: str = dtypes(o.dtype.name for o in outputs.values())

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The signature's outputs on ``inputs`` (by name), in :attr:`output_names` order.

        Args:
            inputs: A batch for each input, by name.

        Returns:
            The outputs, as NumPy arrays.
        """
        import tensorflow as tf

        given = {n: tf.constant(inputs[n], self._specs[n].dtype) for n in self.input_names}
        outputs = self._signature(**given)
        return [outputs[name].numpy() for name in self.output_names]
