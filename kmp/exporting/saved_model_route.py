"""The TensorFlow SavedModel route: the model's call as a signature, run by TensorFlow.

Keras 3.15's ``model.export`` (and ``ExportArchive``) stores every variable twice in a
SavedModel, once per Python object that wraps it (keras-team/keras#23553): twice the file
and twice the memory of whoever serves it. kmp saves a plain ``tf.Module`` that tracks the
model's own ``tf.Variable`` objects once and holds one ``tf.function``, the signature
``serving_default``; a model that holds other TensorFlow resources (lookup tables), which
that module does not track, is written by ``ExportArchive`` instead.

The signature takes the traced input (float32 for a float input, whatever the model
computes in) and returns float32: a model loaded in ``"float16"`` or ``"bfloat16"``
computes in 16 bits with 16-bit weights inside the file, and its outputs are cast to
float32 in the signature, so a caller sees float32 at both ends whatever the precision.
"""

from __future__ import annotations

import shutil
from typing import Any

import keras
import numpy as np

__all__ = ["SIGNATURE", "SavedModelRunner", "write_saved_model"]

SIGNATURE = "serving_default"


def write_saved_model(model: keras.Model, path: str, spec: tuple[tuple, str]) -> None:
    """Write ``model`` as a SavedModel folder at ``path``.

    Args:
        model: The Keras model, in the precision the file holds.
        path: The folder to write (it must not exist).
        spec: The input's ``(shape, dtype)``.
    """
    import tensorflow as tf

    shape, dtype = spec
    signature = [tf.TensorSpec(shape, dtype, name="inputs")]

    def serve(inputs: Any) -> Any:
        outputs = model(inputs, training=False)
        if outputs.dtype.is_floating and outputs.dtype != tf.float32:
            outputs = tf.cast(outputs, tf.float32)
        return outputs

    module = tf.Module()
    module.weights = [v.value for v in model.variables]  # the tf.Variables, each once
    module.serve = tf.function(serve, input_signature=signature)
    try:
        tf.saved_model.save(
            module, path, signatures={SIGNATURE: module.serve.get_concrete_function()}
        )
        return
    except (AssertionError, ValueError):  # an untracked resource: Keras's archive tracks it
        shutil.rmtree(path, ignore_errors=True)
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve, input_signature=signature)
    archive.write_out(path, verbose=False)


class SavedModelRunner:
    """A SavedModel loaded once in TensorFlow, run through its ``serving_default`` signature.

    Attributes:
        input_dtype: The input dtype of the signature.
        output_dtype: The output dtype of the signature.
    """

    def __init__(self, path: str) -> None:
        """Load the SavedModel folder at ``path``.

        Args:
            path: The exported folder.
        """
        import tensorflow as tf

        self._loaded = tf.saved_model.load(path)  # kept: the signature uses its variables
        self._signature = self._loaded.signatures[SIGNATURE]
        (self._name, spec), *_ = self._signature.structured_input_signature[1].items()
        (output,) = self._signature.structured_outputs.values()
        self._dtype = spec.dtype
        self.input_dtype: str = spec.dtype.name
        self.output_dtype: str = output.dtype.name

    def predict_on_batch(self, inputs: np.ndarray) -> np.ndarray:
        """The signature's output on ``inputs`` (as a tensor of the input dtype).

        Args:
            inputs: A batch of inputs.

        Returns:
            The output, as a NumPy array.
        """
        import tensorflow as tf

        (output,) = self._signature(**{self._name: tf.constant(inputs, self._dtype)}).values()
        return output.numpy()
