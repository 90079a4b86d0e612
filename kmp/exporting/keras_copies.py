"""The Keras models an export starts from, and the inputs it is traced and verified with.

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
from typing import Any

import keras
import numpy as np

from kmp.layer_walk import walk

__all__ = ["ModelCopies", "computes_in_float32", "input_spec", "prepare_inputs"]


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


def _one(values: Any, what: str) -> Any:
    if isinstance(values, dict) or (isinstance(values, list | tuple) and len(values) != 1):
        raise ValueError(
            f"kmp.export handles models with one input and one output; this one has "
            f"{len(values)} {what}s. Wrap it in a model that takes (or returns) one tensor."
        )
    return values[0] if isinstance(values, list | tuple) else values


def input_spec(model: keras.Model, sample: Any) -> tuple[tuple[int | None, ...], str]:
    """The traced input's ``(shape, dtype)``: the model's own input, else the sample's.

    The batch axis is left free (None); the model's other free axes (a sequence length)
    too, when it has a defined input.

    Args:
        model: The float32 reference model.
        sample: The caller's sample, or None.

    Returns:
        ``(shape, dtype)``; float samples are traced as float32.

    Raises:
        ValueError: The model has several inputs, or neither defined inputs nor a sample.
    """
    inputs = getattr(model, "inputs", None)
    if inputs:
        tensor = _one(inputs, "input")
        return tuple(tensor.shape), str(tensor.dtype)
    if sample is None:
        raise ValueError(
            f"kmp.export cannot tell the input shape of {type(model).__name__} (it has no "
            "defined inputs): pass sample= (a batch of real inputs)."
        )
    array = prepare_inputs(sample, None)
    dtype = "float32" if np.issubdtype(array.dtype, np.floating) else str(array.dtype)
    return (None, *array.shape[1:]), dtype


def prepare_inputs(sample: Any, dtype: str | None) -> np.ndarray:
    """The sample as one NumPy array of the traced input's dtype (None: as it is).

    Args:
        sample: A NumPy array or tensor (or a one-element list or dict of one).
        dtype: The dtype to cast to, or None.

    Returns:
        The array.

    Raises:
        TypeError: ``sample`` is not array-like.
        ValueError: It is empty, or it is several arrays.
    """
    if isinstance(sample, dict) or (
        isinstance(sample, list | tuple) and all(hasattr(x, "shape") for x in sample)
    ):
        sample = _one(sample, "input")
    try:
        array = np.asarray(keras.ops.convert_to_numpy(sample))
    except Exception as exc:
        raise TypeError(
            f"kmp.export: sample must be an array of inputs (NumPy or a tensor); got "
            f"{type(sample).__name__}."
        ) from exc
    if array.ndim == 0 or array.shape[0] == 0:
        raise ValueError(
            f"kmp.export: sample must be a batch of at least one input; got shape {array.shape}."
        )
    return array if dtype is None else array.astype(dtype, copy=False)
