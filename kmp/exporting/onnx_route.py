"""The ONNX route: ``model.export(format="onnx")`` (tf2onnx), float16 by onnxconverter-common.

tf2onnx writes a file even for ops it cannot convert (it keeps them as unknown nodes and
logs an error); the file is read back and any node outside the ONNX standard is reported as
a layer ONNX cannot hold (:mod:`kmp.exporting.unsupported`). For float16 the float32 file
is passed through onnxconverter-common's ``convert_float_to_float16`` with
``keep_io_types=True``: every weight is stored in float16, the graph computes in float16
(but for the ops the pass keeps in float32, with casts around them) and casts at both ends,
so the inputs and outputs stay float32. A model with 1 GiB of float32 weights or more
(:data:`EXTERNAL_DATA_BYTES`) is converted by tf2onnx's external-tensor route and written
as ``model.onnx`` plus ``model.onnx.data`` (one protobuf holds at most 2 GiB);
onnxruntime reads the two together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from kmp.exporting.signature import Runner, Signature, dtypes, tensor_specs
from kmp.exporting.unsupported import unsupported_error

__all__ = ["EXTERNAL_DATA_BYTES", "OnnxRunner", "data_file", "write_onnx"]

# The ONNX domains onnxruntime's standard kernels implement.
_STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")
_ADVICE = (
    "Export it with format='saved_model', or replace the layer with one built from ops "
    "ONNX has (https://onnx.ai/onnx/operators/)."
)
# A model whose float32 weights reach this many bytes is written with its tensors in a
# separate file beside the .onnx (``model.onnx.data``): one ONNX protobuf holds at most
# 2 GiB. Below it the file is one protobuf, as Keras writes it.
EXTERNAL_DATA_BYTES = 1 << 30


def data_file(path: str) -> str:
    """Where an ONNX file's external tensors go: ``<path>.data`` beside it.

    Args:
        path: The ``.onnx`` file.

    Returns:
        The data file's path (it exists only for a model written with external data).
    """
    return path + ".data"


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


def _unshare_blocked_constants(graph: Any, blocked: set[str]) -> None:
    """Give a node the float16 pass keeps in float32 its own copy of a shared constant.

    The pass keeps a constant in float32 when any node it leaves in float32 reads it (a
    ``Range``), and the other nodes that read it (a KerasHub mask's ``Less``) then mix
    float16 and float32, which onnxruntime refuses. A copy per kept node lets the others
    have the float16 one. Weights read only by converted nodes (GPT-2's tied embedding)
    stay shared.

    Args:
        graph: The float32 ONNX model, changed in place.
        blocked: The op types the pass keeps in float32.
    """
    from onnx import TensorProto

    constants = {c.name: c for c in graph.graph.initializer if c.data_type == TensorProto.FLOAT}
    readers: dict[str, list[Any]] = {}
    for node in graph.graph.node:
        for name in node.input:
            if name in constants:
                readers.setdefault(name, []).append(node)
    for name, nodes in readers.items():
        kept = [n for n in nodes if n.op_type in blocked]
        if not kept or len(kept) == len(nodes):
            continue
        for k, node in enumerate(kept):
            copy = graph.graph.initializer.add()
            copy.CopyFrom(constants[name])
            copy.name = f"{name}__kmp_float32_{k}"
            for i, given in enumerate(node.input):
                if given == name:
                    node.input[i] = copy.name


def _cast_as_typed(graph: Any) -> None:
    """Make each ``Cast`` to float32 whose output the float16 pass retyped cast to float16.

    onnxconverter-common 1.16 retypes a ``Cast``'s output to float16 but keeps its
    ``to=float`` (tf2onnx writes one where an integer input meets float math, as in an
    Embedding's index check or a KerasHub model's masks); onnxruntime then refuses the file
    ("bound to different types"). The casts the pass adds itself are typed float32 and
    stay as they are.

    Args:
        graph: The converted ONNX model, changed in place.
    """
    from onnx import TensorProto

    typed = {v.name: v.type.tensor_type.elem_type for v in graph.graph.value_info}
    for node in graph.graph.node:
        if node.op_type != "Cast" or typed.get(node.output[0]) != TensorProto.FLOAT16:
            continue
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.FLOAT16


def _weight_bytes(model: keras.Model) -> int:
    return sum(4 * int(np.prod(w.shape)) for w in model.weights)


def _convert_large(model: keras.Model, signature: Signature) -> Any:
    """tf2onnx's external-tensor route for a model over one protobuf's limit: the graph.

    The served call (:func:`kmp.exporting.saved_model_route.serving_function`) is
    converted with ``large_model=True``, which writes a zip of the graph and its tensors;
    the graph is read back with its tensors.
    """
    import onnx
    import tensorflow as tf
    import tf2onnx

    from kmp._keras_internals import patch_tf2onnx
    from kmp.exporting.saved_model_route import serving_function

    specs = tensor_specs(signature)
    serve = tf.function(serving_function(model), input_signature=specs)
    patch_tf2onnx()
    with tempfile.TemporaryDirectory(prefix="kmp-onnx-") as folder:
        zipped = os.path.join(folder, "model.zip")
        tf2onnx.convert.from_function(serve, specs, large_model=True, output_path=zipped)
        with zipfile.ZipFile(zipped) as archive:
            archive.extractall(folder)
        return onnx.load(os.path.join(folder, "__MODEL_PROTO.onnx"))


def _save(graph: Any, path: str, external: bool) -> int:
    """Save ``graph`` at ``path`` (tensors in :func:`data_file` if ``external``); its bytes."""
    import onnx

    if not external:
        onnx.save(graph, path)
        return os.path.getsize(path)
    if os.path.exists(data_file(path)):  # onnx appends to a data file that exists
        os.remove(data_file(path))
    onnx.save(
        graph,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=os.path.basename(data_file(path)),
    )
    return os.path.getsize(path) + os.path.getsize(data_file(path))


def write_onnx(
    model: keras.Model,
    path: str,
    signature: Signature,
    layers: dict[str, str],
    half: bool,
) -> int:
    """Write ``model`` (float32) as an ONNX file at ``path``, in float16 if ``half``.

    Args:
        model: The float32 Keras model.
        path: The ``.onnx`` file to write.
        signature: The served inputs (each an ONNX input of that name).
        layers: The model's layer paths -> class names (to name a layer ONNX cannot hold).
        half: Store the weights in float16 (inputs and outputs stay float32).

    Returns:
        The float32 file's size in bytes.

    Raises:
        ValueError: The model holds a layer ONNX cannot express (the message names it).
    """
    import onnx

    external = _weight_bytes(model) >= EXTERNAL_DATA_BYTES
    try:
        with _quiet():
            if external:
                graph = _convert_large(model, signature)
            else:
                model.export(
                    path, format="onnx", verbose=False, input_signature=tensor_specs(signature)
                )
                graph = onnx.load(path)
    except ValueError as exc:  # tf2onnx lost a graph input to an op it could not convert
        raise ValueError(
            f"kmp.export: tf2onnx could not convert {type(model).__name__} to ONNX "
            f"({exc}); it drops the part of the graph that holds an op ONNX lacks (a "
            "KerasHub cache update, XlaDynamicUpdateSlice, is one). " + _ADVICE
        ) from exc
    unknown = [
        (node.op_type, node.name)
        for node in graph.graph.node
        if node.domain not in _STANDARD_DOMAINS or not onnx.defs.has(node.op_type, node.domain)
    ]
    if unknown:
        raise unsupported_error("ONNX", unknown, layers, _ADVICE)
    float32_size = _save(graph, path, external) if external else os.path.getsize(path)
    if not half:
        return float32_size
    from onnx.external_data_helper import load_external_data_for_model
    from onnxconverter_common import float16

    with _quiet():
        # Every tensor typed first, so the pass retypes each one it makes float16 (typed
        # without its tensors when they are external: a graph over 2 GiB cannot be).
        if external:
            graph = onnx.load(path, load_external_data=False)
        graph = onnx.shape_inference.infer_shapes(graph)
        if external:
            load_external_data_for_model(graph, os.path.dirname(os.path.abspath(path)))
        _unshare_blocked_constants(graph, set(float16.DEFAULT_OP_BLOCK_LIST))
        graph = float16.convert_float_to_float16(graph, keep_io_types=True)
    _cast_as_typed(graph)
    _save(graph, path, external)
    return float32_size


class OnnxRunner(Runner):
    """One onnxruntime session on the CPU, opened once and run on any number of batches.

    ``kmp.export`` verifies the file with it; a server (bench/inference.py) keeps one.

    Attributes:
        input_names: The file's inputs.
        output_names: Its outputs (tf2onnx names them after the graph: ``Identity:0``).
        input_dtype: The inputs' dtypes onnxruntime reports (distinct ones, joined).
        output_dtype: The outputs' dtypes, the same way.
    """

    def __init__(self, path: str) -> None:
        """Open the ONNX file at ``path``.

        Args:
            path: The exported file.
        """
        import onnxruntime

        self._session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        given, outputs = self._session.get_inputs(), self._session.get_outputs()
        self._types = {i.name: _ONNX_DTYPES.get(i.type, i.type) for i in given}
        self.input_names: list[str] = [i.name for i in given]
        self.input_shapes = {
            i.name: tuple(d if isinstance(d, int) else None for d in i.shape) for i in given
        }
        self.output_names: list[str] = [o.name for o in outputs]
        self.input_dtype: str = dtypes(self._types.values())
        self.output_dtype: str = dtypes(_ONNX_DTYPES.get(o.type, o.type) for o in outputs)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The file's outputs on ``inputs`` (by name, cast to the file's dtypes).

        Args:
            inputs: A batch for each input, by name.

        Returns:
            The outputs, in :attr:`output_names` order.
        """
        feed = {}
        for name in self.input_names:
            dtype, value = self._types[name], inputs[name]
            known = dtype in _ONNX_DTYPES.values()
            feed[name] = value.astype(dtype, copy=False) if known else value
        return [np.asarray(r) for r in self._session.run(self.output_names, feed)]
