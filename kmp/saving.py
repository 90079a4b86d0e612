"""Loading models that use kmp's layers and optimizer."""

from __future__ import annotations

import os
from typing import Any

import keras

__all__ = ["load_model"]


def load_model(path: str | os.PathLike, **kwargs: Any) -> keras.Model:
    """Load a ``.keras`` model saved with kmp's layers or optimizer in it.

    ``kmp.layers.Float32Output`` and kmp's optimizer are registered with Keras
    when their modules are imported; ``import kmp`` is lazy, so a fresh process
    calling ``keras.saving.load_model`` directly may not know them yet. This
    imports both, then calls ``keras.saving.load_model(path, **kwargs)``.

    Args:
        path: A file written by ``model.save("model.keras")``.
        **kwargs: Passed to ``keras.saving.load_model`` (e.g. ``compile=False``).

    Returns:
        The model, with its optimizer state (loss scale included) when compiled.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"No saved model at {os.fspath(path)!r}.")
    import kmp.layers  # registers Float32Output
    import kmp.optimizer  # noqa: F401  (registers the wrapped optimizer)

    return keras.saving.load_model(path, **kwargs)
