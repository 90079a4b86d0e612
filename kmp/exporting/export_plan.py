"""What an export will do, decided before anything is written: :func:`plan_export`.

A pure function of the arguments (and of facts passed in: the Keras backend, whether
the path exists), so every choice is testable without TensorFlow converting anything:

=============  =========================  =====================================  =============
format         precision                  how the file is written                runs in
=============  =========================  =====================================  =============
saved_model    float32, float16,          the model loaded in that policy         TensorFlow
               bfloat16                   (kmp.load_model), saved as a
                                          ``tf.Module`` (under JAX: Keras's
                                          ``ExportArchive``, through jax2tf)
onnx           float32, float16           ``model.export(format="onnx")``         onnxruntime
                                          (tf2onnx), then onnxconverter-common's
                                          float16 pass with float32 inputs and
                                          outputs
litert         float32, float16           ``model.export(format="litert")`` with  LiteRT
                                          TFLite builtin ops only, float16 by     (ai-edge-litert)
                                          the converter's post-training pass
=============  =========================  =====================================  =============

ONNX Runtime's CPU kernels and LiteRT have no bfloat16 weights, so ``bfloat16`` is a
SavedModel precision only. Under Keras's JAX backend only the SavedModel is written
(:data:`ENGINES`); for ONNX and LiteRT the model is saved and exported in a
TensorFlow-backend process (the error says how).
"""

from __future__ import annotations

import dataclasses
import os

from kmp._checks import check_bool

__all__ = [
    "ENGINES",
    "FORMATS",
    "PRECISIONS",
    "ExportPlan",
    "check_engine",
    "plan_export",
]

# Format -> the precisions its file can hold.
FORMATS: dict[str, tuple[str, ...]] = {
    "saved_model": ("float32", "float16", "bfloat16"),
    "onnx": ("float32", "float16"),
    "litert": ("float32", "float16"),
}
PRECISIONS: tuple[str, ...] = ("float32", "float16", "bfloat16")
# Other names accepted for a format (Keras's own, and the file's older name).
_FORMAT_ALIASES: dict[str, str] = {"tf_saved_model": "saved_model", "tflite": "litert"}
# The file name each single-file format needs.
_SUFFIXES: dict[str, str] = {"onnx": ".onnx", "litert": ".tflite"}
_FILE_SUFFIXES = (".onnx", ".tflite", ".keras", ".h5")
# How to install the converters and runtimes (requirements-serve.txt pins them).
# Format -> (module, what it is for): imported before anything is written.
_CONVERTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "saved_model": (("tensorflow", "writing and running a SavedModel"),),
    "onnx": (
        ("tensorflow", "tracing the model for tf2onnx"),
        ("tf2onnx", "converting to ONNX"),
        ("onnx", "reading and writing ONNX files"),
    ),
    "litert": (("tensorflow", "the TFLite converter"),),
}
_RUNTIMES: dict[str, tuple[str, str]] = {
    "saved_model": ("tensorflow", "TensorFlow"),
    "onnx": ("onnxruntime", "onnxruntime"),
    "litert": ("ai_edge_litert.interpreter", "LiteRT"),
}


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What :func:`kmp.export` does for one call.

    Attributes:
        format: ``"saved_model"``, ``"onnx"`` or ``"litert"``.
        precision: The weights' dtype in the file.
        path: Where the file (or the SavedModel folder) goes.
        replaces: Whether an existing file or folder at ``path`` is replaced (only
            once the new one is written and verified).
        keras_policy: The policy the Keras model is loaded in before it is written
            (``"float32"``: the converter changes the weights' dtype, if any does).
        half_pass: The converter's float16 pass: ``"onnxconverter_common"``,
            ``"tflite_float16"``, or None.
        runtime: The runtime that verifies the file (``"TensorFlow"``,
            ``"onnxruntime"``, ``"LiteRT"``).
        modules: The modules it needs, each with what for (``(module, purpose)``);
            the runtime's is among them when the export is verified.
        free_lengths: Whether the inputs' free axes other than the batch (a sequence
            length) stay free in the file. Under JAX they are fixed to the sample's:
            jax2tf's shape polymorphism cannot prove that a free length fits a KerasHub
            model's position table, and refuses to convert.
    """

    format: str
    precision: str
    path: str
    replaces: bool
    keras_policy: str
    half_pass: str | None
    runtime: str
    modules: tuple[tuple[str, str], ...]
    free_lengths: bool = True


def _choice(name: str, value: object, options: tuple[str, ...], aliases: dict[str, str]) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"kmp.export: {name} must be a string, one of {', '.join(map(repr, options))}; "
            f"got {type(value).__name__} {value!r}."
        )
    key = value.strip().lower()
    key = aliases.get(key, key)
    if key not in options:
        raise ValueError(
            f"kmp.export: unknown {name} {value!r}. Pass one of {', '.join(map(repr, options))}."
        )
    return key


def _check_path(path: str, fmt: str, exists: bool, overwrite: bool) -> None:
    if not path:
        raise ValueError("kmp.export: path is empty; pass where the export should go.")
    suffix = _SUFFIXES.get(fmt)
    if suffix is not None and not path.endswith(suffix):
        base = os.path.splitext(path)[0] or "model"
        raise ValueError(
            f"kmp.export: a {fmt} export is one file whose name ends with {suffix!r}; "
            f"got path={path!r}. Pass e.g. path={base + suffix!r}."
        )
    if suffix is None and path.endswith(_FILE_SUFFIXES):
        raise ValueError(
            f"kmp.export: a SavedModel is a folder, but path={path!r} names a "
            f"{os.path.splitext(path)[1]} file. Pass a folder name such as "
            f"{os.path.splitext(path)[0]!r}."
        )
    if exists and not overwrite:
        raise ValueError(
            f"kmp.export: {path!r} already exists. Pass another path, or overwrite=True to "
            "replace it (it is replaced only once the new export is written and verified)."
        )


# The Keras backends kmp exports from -> the formats each can write itself.
ENGINES: dict[str, tuple[str, ...]] = {
    "tensorflow": tuple(FORMATS),
    "jax": ("saved_model",),  # Keras's jax2tf route; ONNX and LiteRT: the bridge below
}


def check_engine(backend: str, fmt: str) -> None:
    """Refuse a format the Keras backend cannot write, saying how to get the file anyway.

    Args:
        backend: The Keras backend in use.
        fmt: The format asked for.

    Raises:
        RuntimeError: The backend cannot write ``fmt`` (the message gives the bridge: the
            model saved here and exported in a TensorFlow-backend process).
    """
    if fmt in ENGINES.get(backend, ()):
        return
    able = [name for name, formats in ENGINES.items() if fmt in formats]
    raise RuntimeError(
        f"kmp.export writes {fmt} files under the {' or '.join(able)} backend; Keras's "
        f"backend here is {backend!r}. Save the model (kmp.save_model(model, "
        "'model.keras')) and export it in a process started with KERAS_BACKEND=tensorflow: "
        "kmp.export(kmp.load_model('model.keras'), ...); the weights are the same."
        + (" Under JAX, format='saved_model' is written here." if backend == "jax" else "")
    )


def plan_export(
    format: str,
    precision: str,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    verify: bool = True,
    backend: str = "tensorflow",
    exists: bool = False,
) -> ExportPlan:
    """Decide how to export, or say what is wrong with the request.

    Args:
        format: ``"saved_model"`` (or ``"tf_saved_model"``), ``"onnx"``, ``"litert"``
            (or ``"tflite"``).
        precision: ``"float32"``, ``"float16"``, or ``"bfloat16"`` (SavedModel only).
        path: Where the export goes: a folder for a SavedModel, a ``.onnx`` or
            ``.tflite`` file otherwise.
        overwrite: Whether an existing ``path`` may be replaced.
        verify: Whether the file is run in its runtime afterwards (its module is then
            needed).
        backend: The Keras backend in use (``keras.backend.backend()``).
        exists: Whether ``path`` exists now.

    Returns:
        The :class:`ExportPlan`.

    Raises:
        TypeError: ``format``, ``precision`` or ``path`` has the wrong type.
        ValueError: An unknown format or precision; a precision the format cannot hold
            (the message names the formats that can); a path that does not suit the
            format, or that exists without ``overwrite=True``.
        RuntimeError: The Keras backend cannot write the format (:func:`check_engine`:
            JAX writes SavedModels; TensorFlow every format).
    """
    fmt = _choice("format", format, tuple(FORMATS), _FORMAT_ALIASES)
    prec = _choice("precision", precision, PRECISIONS, {})
    if prec not in FORMATS[fmt]:
        able = [f for f, precisions in FORMATS.items() if prec in precisions]
        raise ValueError(
            f"kmp.export: format={fmt!r} has no {prec} weights (it holds "
            f"{', '.join(FORMATS[fmt])}). {prec} is held by format="
            f"{' or '.join(map(repr, able))}; for a half-size {fmt} file pass "
            "precision='float16'."
        )
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"kmp.export: path must be a str or os.PathLike; got {path!r}.")
    path = os.fspath(path)
    overwrite = check_bool("overwrite", overwrite)
    verify = check_bool("verify", verify)
    _check_path(path, fmt, exists, overwrite)
    check_engine(backend, fmt)
    half_pass = None
    if prec == "float16" and fmt == "onnx":
        half_pass = "onnxconverter_common"
    elif prec == "float16" and fmt == "litert":
        half_pass = "tflite_float16"
    modules = _CONVERTERS[fmt]
    if half_pass == "onnxconverter_common":
        modules += (("onnxconverter_common", "the float16 pass over the ONNX file"),)
    module, runtime = _RUNTIMES[fmt]
    if verify and module not in {m for m, _ in modules}:
        modules += ((module, f"running the {fmt} file to verify it"),)
    return ExportPlan(
        format=fmt,
        precision=prec,
        path=path,
        replaces=exists,
        keras_policy=prec if fmt == "saved_model" else "float32",
        half_pass=half_pass,
        runtime=runtime,
        modules=modules,
        free_lengths=backend != "jax",
    )
