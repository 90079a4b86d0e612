"""The Keras models an export starts from: the caller's model in float32 and in 16 bits.

The reference is always the model in float32: a model that computes or stores anything in
16 bits (trained under ``mixed_float16``, or loaded in ``"bfloat16"``) is saved once to a
temporary ``.keras`` file with :func:`kmp.save_model` and loaded back with
:func:`kmp.load_model` in the policy needed (``"float32"`` for the reference, ``"float16"``
or ``"bfloat16"`` for a 16-bit SavedModel), so the layers ``kmp.keep_float32`` kept stay
float32 and the caller's model is never changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import keras

from kmp.layer_walk import walk

__all__ = ["ModelCopies", "computes_in_float32"]


def computes_in_float32(model: keras.Model) -> bool:
    """Whether every layer computes in float32 and every weight is float32.

    Args:
        model: A Keras model.

    Returns:
        True when nothing in it is 16-bit.
    """
    if any(str(w.dtype) != "float32" for w in model.weights):
        return False
    return all(
        getattr(v.layer, "compute_dtype", "float32") in ("float32", None)
        for v in walk(model, inputs=False)
    )


class ModelCopies:
    """The caller's model in other policies, from one temporary ``.keras`` file.

    Args:
        model: The caller's model (left untouched).
    """

    def __init__(self, model: keras.Model) -> None:
        self._model = model
        self._folder: str | None = None
        self._copies: dict[str, keras.Model] = {}

    def _saved(self) -> str:
        from kmp.saving import save_model

        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="kmp-export-")
            save_model(self._model, os.path.join(self._folder, "model.keras"))
        return os.path.join(self._folder, "model.keras")

    def in_policy(self, policy: str) -> keras.Model:
        """The model computing and storing its weights in ``policy``.

        The caller's own model is returned for ``"float32"`` when it is float32 already.

        Args:
            policy: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (any name
                :func:`kmp.load_model` takes).

        Returns:
            The model in that policy (loaded once, then reused).

        Raises:
            ValueError: The model could not be saved and loaded back.
        """
        if policy == "float32" and computes_in_float32(self._model):
            return self._model
        if policy not in self._copies:
            from kmp.saving import load_model

            try:
                self._copies[policy] = load_model(self._saved(), policy=policy)
            except Exception as exc:
                detail = (str(exc).strip().splitlines() or [""])[-1][:300]
                raise ValueError(
                    f"kmp.export needs {type(self._model).__name__} in {policy} and could not "
                    f"save it and load it back ({type(exc).__name__}: {detail}). Make the model "
                    "and its custom layers serializable (keras.saving."
                    "register_keras_serializable, get_config), or pass a model built in "
                    "float32 (for a 16-bit SavedModel, one that can be loaded back)."
                ) from exc
        return self._copies[policy]

    def close(self) -> None:
        """Remove the temporary file."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> ModelCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
