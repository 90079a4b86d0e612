"""``kmp.load_model(path, policy=...)``: loading a saved model to serve in another precision.

It acts on :mod:`kmp.load_precision`'s pure decisions: the saved config's policies are
rewritten as :func:`~kmp.load_precision.plan_policies` plans, in a temporary copy of the
archive, which Keras loads uncompiled under that global policy (the layers a model makes
itself follow it). Where the saved model's outputs were float32 and the loaded ones would
not be (``keep_pinned=False``, or a float32 model served in 16 bits), kmp's float32 head
is added (:func:`kmp.layers.float32_outputs`), so a served model's outputs keep their
dtype. :mod:`kmp.saving` calls it; docs/serving.md is the guide.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from typing import Any

import keras

from kmp._names import LOW_FLOATS, POLICY_NAMES, VALID_POLICIES
from kmp.layers import float32_outputs, has_float32_outputs
from kmp.load_precision import forget_kept, outputs_were_float32, plan_policies, rewrite_config

__all__ = ["load_in", "policy_name"]


def policy_name(policy: Any) -> str:
    """The concrete policy ``load_model(policy=...)`` loads in ("auto": this machine's).

    Raises:
        TypeError: ``policy`` is neither a name nor a ``keras.DTypePolicy``.
        ValueError: Not a policy kmp loads in.
    """
    from kmp.policy import resolve_policy

    if not isinstance(policy, str | keras.DTypePolicy):
        raise TypeError(
            f"kmp.load_model(policy=...) takes a policy name ({', '.join(VALID_POLICIES)}) "
            f"or a keras.DTypePolicy, not {type(policy).__name__} {policy!r}."
        )
    name = resolve_policy(policy, None).name
    if name not in POLICY_NAMES:
        raise ValueError(
            f"kmp.load_model(policy={name!r}): load in one of {', '.join(VALID_POLICIES)}; "
            "a quantized layer keeps its own mode, from the policy chosen."
        )
    return name


def _copy_with_config(source: str, target: str, config: dict) -> None:
    """Copy the archive ``source`` to ``target`` with ``config`` as its ``config.json``."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            entry = zipfile.ZipInfo(info.filename, info.date_time)
            entry.compress_type = info.compress_type
            if info.filename == "config.json":
                new.writestr(entry, json.dumps(config))
                continue
            with old.open(info) as reading, new.open(entry, "w") as writing:
                shutil.copyfileobj(reading, writing, 1 << 20)


def _low_outputs(model: keras.Model) -> bool:
    """Whether the loaded model's outputs are (or, not yet traced, may be) 16-bit."""
    if has_float32_outputs(model):
        return False
    try:
        outputs = model.outputs  # a Functional or Sequential graph's
    except (AttributeError, ValueError):
        outputs = None
    if outputs:
        return any(keras.backend.standardize_dtype(t.dtype) in LOW_FLOATS for t in outputs)
    return model.compute_dtype in LOW_FLOATS  # a subclassed model: its own policy


def load_in(
    path: str, config: dict, policy: str, kept: Any, kwargs: dict, keep_pinned: bool = True
) -> keras.Model:
    """Load the ``.keras`` file at ``path`` with its layers in ``policy``, uncompiled.

    Args:
        path: The archive.
        config: Its ``config.json``, read.
        policy: A concrete policy name (:func:`policy_name`).
        kept: The paths ``kmp.save_model`` recorded as kept in float32.
        kwargs: ``keras.saving.load_model``'s other arguments.
        keep_pinned: Keep kept and pinned layers float32 (:mod:`kmp.load_precision`).

    Raises:
        ValueError: ``compile=True`` was asked.
    """
    if kwargs.get("compile", False):
        raise ValueError(
            f"kmp.load_model({path!r}, policy={policy!r}, compile=True): a model loaded in "
            "another precision comes back uncompiled (the saved optimizer's state, loss scale "
            "included, belongs to the precision it trained in). Resume training with "
            "kmp.load_model(path), or compile the served model yourself."
        )
    plan = plan_policies(config, policy, kept, keep_pinned=keep_pinned)
    rewritten = rewrite_config(config if keep_pinned else forget_kept(config), plan)
    previous = keras.config.dtype_policy()
    with tempfile.TemporaryDirectory(prefix="kmp-load-") as folder:
        copy = os.path.join(folder, "model.keras")
        _copy_with_config(path, copy, rewritten)
        keras.config.set_dtype_policy(policy)  # layers the config does not hold follow it
        try:
            model = keras.saving.load_model(copy, **{**kwargs, "compile": False})
        finally:
            keras.config.set_dtype_policy(previous)
    if outputs_were_float32(config) and _low_outputs(model):
        model = float32_outputs(model)  # the served outputs keep the saved dtype
    return model
