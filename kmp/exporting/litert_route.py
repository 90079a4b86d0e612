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

from kmp.exporting.signature import Runner, Signature, dtypes, tensor_specs
from kmp.exporting.unsupported import litert_failed_ops, unsupported_error

__all__ = ["LiteRTRunner", "write_litert"]

_ADVICE = (
    "Export it with format='saved_model' or 'onnx', or replace the layer with one built "
    "from ops LiteRT has (https://ai.google.dev/edge/litert/models/ops_compatibility)."
)


def _convert(model: keras.Model, path: str, signature: Signature, half: bool) -> None:
    import tensorflow as tf

    target: dict = {"supported_ops": [tf.lite.OpsSet.TFLITE_BUILTINS]}
    options: dict = {}
    if half:
        target["supported_types"] = [tf.float16]
        options["optimizations"] = [tf.lite.Optimize.DEFAULT]
    model.export(
        path,
        format="litert",
        verbose=False,
        input_signature=tensor_specs(signature),
        target_spec=target,
        **options,
    )


def write_litert(
    model: keras.Model,
    path: str,
    signature: Signature,
    layers: dict[str, str],
    half: bool,
) -> int:
    """Write ``model`` (float32) as a ``.tflite`` file at ``path``, in float16 if ``half``.

    Args:
        model: The float32 Keras model.
        path: The ``.tflite`` file to write.
        signature: The served inputs (each a signature input of that name).
        layers: The model's layer paths -> class names (to name a layer LiteRT cannot hold).
        half: Store the weights in float16 (inputs and outputs stay float32).

    Returns:
        The float32 file's size in bytes.

    Raises:
        ValueError: The model holds a layer LiteRT cannot express (the message names it).
    """
    try:
        _convert(model, path, signature, half)
    except Exception as exc:
        ops = litert_failed_ops(str(exc))
        if not ops:
            raise
        raise unsupported_error("LiteRT", ops, layers, _ADVICE) from exc
    if not half:
        return os.path.getsize(path)
    with tempfile.TemporaryDirectory(prefix="kmp-export-") as folder:
        float32_path = os.path.join(folder, "float32.tflite")
        _convert(model, float32_path, signature, half=False)
        return os.path.getsize(float32_path)


class LiteRTRunner(Runner):
    """The LiteRT interpreter (ai-edge-litert) on one ``.tflite`` file, run on many batches.

    Inputs and outputs are found by name through the file's signature. Resizing an
    interpreter's inputs reallocates its tensors, so one interpreter is kept per set of
    input shapes. ``kmp.export`` verifies the file with it; a server (bench/inference.py)
    keeps one.

    Attributes:
        input_names: The signature's inputs.
        output_names: Its outputs.
        input_dtype: The inputs' dtypes the interpreter reports (distinct ones, joined).
        output_dtype: The outputs' dtypes, the same way.
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
        runner = first.get_signature_runner()
        given, outputs = runner.get_input_details(), runner.get_output_details()
        self._inputs = {name: (d["index"], d["dtype"]) for name, d in given.items()}
        self._outputs = {name: d["index"] for name, d in outputs.items()}
        self.input_names: list[str] = list(given)
        self.input_shapes = {
            n: tuple(None if d < 0 else int(d) for d in g["shape_signature"])
            for n, g in given.items()
        }
        self.output_names: list[str] = list(outputs)
        self.input_dtype: str = dtypes(np.dtype(d["dtype"]).name for d in given.values())
        self.output_dtype: str = dtypes(np.dtype(d["dtype"]).name for d in outputs.values())
        self._unsized: Any = first  # the first set of shapes takes it
        self._by_shape: dict[tuple, Any] = {}

    def _open(self) -> Any:
        return self._interpreter_class(model_path=self._path, num_threads=self._threads)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The file's outputs on ``inputs`` (by name, cast to the file's dtypes).

        Args:
            inputs: A batch for each input, by name.

        Returns:
            The outputs, in :attr:`output_names` order.
        """
        feed = {
            name: (index, inputs[name].astype(dtype, copy=False))
            for name, (index, dtype) in self._inputs.items()
        }
        shapes = tuple(value.shape for _, value in feed.values())
        interpreter = self._by_shape.get(shapes)
        if interpreter is None:
            interpreter = self._unsized if self._unsized is not None else self._open()
            self._unsized = None
            for index, value in feed.values():
                interpreter.resize_tensor_input(index, value.shape)
            interpreter.allocate_tensors()
            self._by_shape[shapes] = interpreter
        for index, value in feed.values():
            interpreter.set_tensor(index, value)
        interpreter.invoke()
        return [np.array(interpreter.get_tensor(i)) for i in self._outputs.values()]
