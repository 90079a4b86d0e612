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

__all__ = ["run_onnx", "write_onnx"]

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


def run_onnx(path: str, inputs: np.ndarray) -> tuple[np.ndarray, str, str]:
    """Run the ONNX file at ``path`` in onnxruntime on the CPU.

    Args:
        path: The exported file (or folder).
        inputs: The inputs, of the traced input's dtype.

    Returns:
        ``(outputs, input dtype, output dtype)`` as onnxruntime reports them.
    """
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    output = session.get_outputs()[0]
    in_dtype = _ONNX_DTYPES.get(given.type, given.type)
    feed = inputs.astype(in_dtype, copy=False) if in_dtype in _ONNX_DTYPES.values() else inputs
    (result,) = session.run([output.name], {given.name: feed})
    return np.asarray(result), in_dtype, _ONNX_DTYPES.get(output.type, output.type)
