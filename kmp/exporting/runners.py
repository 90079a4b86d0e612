"""The exported file in its own runtime: :func:`open_runner`.

Each format has one runner (``SavedModelRunner``, ``OnnxRunner``, ``LiteRTRunner``, in
its route's module, each a :class:`kmp.exporting.signature.Runner`), opened once and run
on any number of batches, inputs by served name. ``kmp.export`` verifies with them, the
benchmarks time them, and :mod:`kmp.exporting.generation` decodes with them.
"""

from __future__ import annotations

import os

from kmp.exporting.signature import Runner

__all__ = ["format_of", "open_runner"]

# A file's suffix -> its format (a folder is a SavedModel).
_BY_SUFFIX = {".onnx": "onnx", ".tflite": "litert"}


def format_of(path: str | os.PathLike) -> str:
    """The export format of ``path``: ``"onnx"``, ``"litert"``, or ``"saved_model"`` (a folder).

    Args:
        path: An exported file or SavedModel folder.

    Returns:
        The format's name.

    Raises:
        ValueError: ``path`` is a file of no export format.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1]
    if suffix in _BY_SUFFIX:
        return _BY_SUFFIX[suffix]
    if os.path.isdir(path) or not suffix:
        return "saved_model"
    raise ValueError(
        f"kmp.exporting: {path!r} is not an exported model; pass a SavedModel folder, a "
        ".onnx or a .tflite file."
    )


def open_runner(
    path: str | os.PathLike, format: str | None = None, num_threads: int | None = None
) -> Runner:
    """Open an exported file (or SavedModel folder) in its own runtime.

    Args:
        path: What :func:`kmp.export` wrote.
        format: ``"saved_model"``, ``"onnx"`` or ``"litert"``; None: from ``path``
            (:func:`format_of`).
        num_threads: LiteRT's interpreter threads (None: LiteRT's default); the other
            runtimes choose their own.

    Returns:
        The format's :class:`Runner`.

    Raises:
        ValueError: ``path`` is of no export format.
    """
    fmt, path = format or format_of(path), os.fspath(path)
    if fmt == "onnx":
        from kmp.exporting.onnx_route import OnnxRunner

        return OnnxRunner(path)
    if fmt == "litert":
        from kmp.exporting.litert_route import LiteRTRunner

        return LiteRTRunner(path, num_threads=num_threads)
    from kmp.exporting.saved_model_route import SavedModelRunner

    return SavedModelRunner(path)
