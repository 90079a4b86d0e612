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
from typing import Any

import keras
import numpy as np

from kmp.exporting.unsupported import litert_failed_ops, unsupported_error

__all__ = ["LiteRTRunner", "write_litert"]

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


class LiteRTRunner:
    """The LiteRT interpreter (ai-edge-litert) on one ``.tflite`` file, run on many batches.

    Resizing an interpreter's input reallocates its tensors, so one interpreter is kept per
    batch shape. ``kmp.export`` verifies the file with it; a server (bench/inference.py)
    keeps one.

    Attributes:
        input_dtype: The input dtype the interpreter reports.
        output_dtype: The output dtype the interpreter reports.
    """

    def __init__(self, path: str, num_threads: int | None = None) -> None:
        """Open the ``.tflite`` file at ``path``.

        Args:
            path: The exported file.
            num_threads: The interpreter's threads; None leaves LiteRT's default.
        """
        from ai_edge_litert.interpreter import Interpreter

        self._path, self._threads, self._interpreter_class = path, num_threads, Interpreter
        first = self._open()
        (given,) = first.get_input_details()
        output = first.get_output_details()[0]
        self._input, self._output, self._dtype = given["index"], output["index"], given["dtype"]
        self.input_dtype: str = np.dtype(given["dtype"]).name
        self.output_dtype: str = np.dtype(output["dtype"]).name
        self._unsized: Any = first  # the first batch shape takes it
        self._by_shape: dict[tuple[int, ...], Any] = {}

    def _open(self) -> Any:
        return self._interpreter_class(model_path=self._path, num_threads=self._threads)

    def predict_on_batch(self, inputs: np.ndarray) -> np.ndarray:
        """The file's outputs on ``inputs`` (cast to the input dtype).

        Args:
            inputs: A batch of inputs.

        Returns:
            The outputs, as the interpreter returns them.
        """
        feed = inputs.astype(self._dtype, copy=False)
        interpreter = self._by_shape.get(feed.shape)
        if interpreter is None:
            interpreter = self._unsized if self._unsized is not None else self._open()
            self._unsized = None
            interpreter.resize_tensor_input(self._input, feed.shape)
            interpreter.allocate_tensors()
            self._by_shape[feed.shape] = interpreter
        interpreter.set_tensor(self._input, feed)
        interpreter.invoke()
        return np.array(interpreter.get_tensor(self._output))
