"""The LiteRT route: ``model.export(format="litert")``, run by the LiteRT interpreter.

Keras converts through a SavedModel with TensorFlow's TFLite converter. kmp asks it for
TFLite builtin ops only (Keras would also allow TensorFlow "select" ops, which the plain
LiteRT runtime cannot run), so a file that converts runs anywhere LiteRT does; an op
without a builtin is reported as a layer LiteRT cannot hold. For float16 the converter's
post-training float16 pass stores the weights in float16 and dequantizes them once, at
load; inputs and outputs stay float32. The float32 file is converted too, in a
temporary folder, to measure its size.
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np

from kmp.exporting.unsupported import litert_failed_ops, unsupported_error

__all__ = ["run_litert", "write_litert"]

_ADVICE = (
    "Export it with format='saved_model' or 'onnx', or replace the layer with one built "
    "from ops LiteRT has (https://ai.google.dev/edge/litert/models/ops_compatibility)."
)


def _convert(model: keras.Model, path: str, spec: tuple[tuple, str], half: bool) -> None:
    import tensorflow as tf

    shape, dtype = spec
    target: dict = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    options: dict = {}
    if half:
        target["supported_types"] = [tf.float16]
        options["optimizations"] = [tf.lite.Optimize.DEFAULT]
    model.export(
        path,
        format="litert",
        verbose=False,
        input_signature=[tf.TensorSpec(shape, dtype, name="inputs")],
        target_spec=target,
        **options,
    )


def write_litert(
    model: keras.Model,
    path: str,
    spec: tuple[tuple, str],
    layers: dict[str, str],
    half: bool,
) -> int:
    """Write ``model`` (float32) as a ``.tflite`` file at ``path``, in float16 if ``half``.

    Args:
        model: The float32 Keras model.
        path: The ``.tflite`` file to write.
        spec: The input's ``(shape, dtype)``.
        layers: The model's layer paths -> class names (to name a layer LiteRT cannot hold).
        half: Store the weights in float16 (inputs and outputs stay float32).

    Returns:
        The float32 file's size in bytes.

    Raises:
        ValueError: The model holds a layer LiteRT cannot express (the message names it).
    """
    try:
        _convert(model, path, spec, half)
    except Exception as exc:
        ops = litert_failed_ops(str(exc))
        if not ops:
            raise
        raise unsupported_error("LiteRT", ops, layers, _ADVICE) from exc
    if not half:
        return os.path.getsize(path)
    with tempfile.TemporaryDirectory(prefix="kmp-export-") as folder:
        float32_path = os.path.join(folder, "float32.tflite")
        _convert(model, float32_path, spec, half=False)
        return os.path.getsize(float32_path)


def run_litert(path: str, inputs: np.ndarray) -> tuple[np.ndarray, str, str]:
    """Run the ``.tflite`` file at ``path`` in the LiteRT interpreter (ai-edge-litert).

    Args:
        path: The exported file (or folder).
        inputs: The inputs, of the traced input's dtype.

    Returns:
        ``(outputs, input dtype, output dtype)`` as the interpreter reports them.
    """
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    (given,) = interpreter.get_input_details()
    output = interpreter.get_output_details()[0]
    feed = inputs.astype(given["dtype"], copy=False)
    interpreter.resize_tensor_input(given["index"], feed.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(given["index"], feed)
    interpreter.invoke()
    result = np.array(interpreter.get_tensor(output["index"]))
    return result, np.dtype(given["dtype"]).name, np.dtype(output["dtype"]).name
