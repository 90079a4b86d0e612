"""The ONNX route: ``model.export(format="onnx")`` (tf2onnx), float16 by onnxconverter-common.

tf2onnx writes a file even for ops it cannot convert (it keeps them as unknown nodes and
logs an error); the file is read back and any node outside the ONNX standard is reported as
a layer ONNX cannot hold (:mod:`kmp.exporting.unsupported`). For float16 the float32 file
is passed through onnxconverter-common's ``convert_float_to_float16`` with
``keep_io_types=True``: every weight is stored in float16, the graph computes in float16
(but for the ops the pass keeps in float32, with casts around them) and casts at both ends,
so the inputs and outputs stay float32.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import keras
import numpy as np

from kmp.exporting.unsupported import unsupported_error

__all__ = ["OnnxRunner", "write_onnx"]

# The ONNX domains onnxruntime's standard kernels implement.
_STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
_ADVICE = (
    "Export it with format='saved_model', or replace the layer with one built from ops "
    "ONNX has (https://onnx.ai/onnx/operators/)."
)
# Ops the float16 pass must leave alone: onnxconverter-common 1.16 retypes a Cast's output
# to float16 but keeps its ``to=float`` (an integer input cast to float, as tf2onnx writes
# for an Embedding's index check), and onnxruntime then refuses the file. Left in float32,
# the pass casts around them instead.
_KEEP_FLOAT32_OPS = ("Cast",)
_ONNX_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """tf2onnx's own error log and NumPy warnings: kmp reports what matters itself."""
    log = logging.getLogger("tf2onnx")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def write_onnx(
    model: keras.Model,
    path: str,
    spec: tuple[tuple, str],
    layers: dict[str, str],
    half: bool,
) -> int:
    """Write ``model`` (float32) as an ONNX file at ``path``, in float16 if ``half``.

    Args:
        model: The float32 Keras model.
        path: The ``.onnx`` file to write.
        spec: The input's ``(shape, dtype)``.
        layers: The model's layer paths -> class names (to name a layer ONNX cannot hold).
        half: Store the weights in float16 (inputs and outputs stay float32).

    Returns:
        The float32 file's size in bytes.

    Raises:
        ValueError: The model holds a layer ONNX cannot express (the message names it).
    """
    import onnx
    import tensorflow as tf

    shape, dtype = spec
    with _quiet():
        model.export(
            path,
            format="onnx",
            verbose=False,
            input_signature=[tf.TensorSpec(shape, dtype, name="inputs")],
        )
    graph = onnx.load(path)
    unknown = [
        (node.op_type, node.name)
        for node in graph.graph.node
        if node.domain not in _STANDARD_DOMAINS or not onnx.defs.has(node.op_type, node.domain)
    ]
    if unknown:
        raise unsupported_error("ONNX", unknown, layers, _ADVICE)
    float32_size = os.path.getsize(path)
    if half:
        from onnxconverter_common import float16

        with _quiet():
            graph = float16.convert_float_to_float16(
                graph,
                keep_io_types=True,
                op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, *_KEEP_FLOAT32_OPS],
            )
        onnx.save(graph, path)
    return float32_size


class OnnxRunner:
    """One onnxruntime session on the CPU, opened once and run on any number of batches.

    ``kmp.export`` verifies the file with it; a server (bench/inference.py) keeps one.

    Attributes:
        input_dtype: The input dtype onnxruntime reports.
        output_dtype: The output dtype onnxruntime reports.
    """

    def __init__(self, path: str) -> None:
        """Open the ONNX file at ``path``.

        Args:
            path: The exported file.
        """
        import onnxruntime

        self._session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        (given,) = self._session.get_inputs()
        output = self._session.get_outputs()[0]
        self._input, self._output = given.name, output.name
        self.input_dtype: str = _ONNX_DTYPES.get(given.type, given.type)
        self.output_dtype: str = _ONNX_DTYPES.get(output.type, output.type)

    def predict_on_batch(self, inputs: np.ndarray) -> np.ndarray:
        """The file's outputs on ``inputs`` (cast to the input dtype where it is a float or int).

        Args:
            inputs: A batch of inputs.

        Returns:
            The outputs, as onnxruntime returns them.
        """
        feed = inputs
        if self.input_dtype in _ONNX_DTYPES.values():
            feed = inputs.astype(self.input_dtype, copy=False)
        (result,) = self._session.run([self._output], {self._input: feed})
        return np.asarray(result)
