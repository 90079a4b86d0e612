"""Loading a saved model in another precision: which policy each saved layer gets, once.

A ``.keras`` file stores each layer's dtype policy in its config (the ``"dtype"`` entry),
and Keras builds every layer with it: a model saved under ``mixed_float16`` computes in
float16 again whatever the global policy (keras #18979). :func:`plan_policies` decides,
from the saved config alone, the policy every layer config that carries one gets when
the model is loaded in a chosen precision; :func:`rewrite_config` gives the config with
those policies, which Keras then builds (variables created in the new variable dtype,
the saved weights cast once as they are assigned). Both are pure; :func:`kmp.load_model`
acts on them.

The rule: every layer takes the chosen policy, except

- the layers ``kmp.keep_float32`` kept (their paths, :mod:`kmp.layer_walk`'s, recorded
  by :func:`kmp.save_model`), and everything inside them: ``"float32"``;
- a quantized layer: its quantization mode, from the chosen policy
  (``"int8_from_bfloat16"``); from float32 when it is kept;
- a ``DTypePolicyMap`` (a KerasHub backbone quantized by paths): left as saved.

``InputLayer`` dtypes (the inputs' own dtype: ``int32`` token ids), the recorded dtypes
of a Functional graph's tensors and a layer's policy that is no float one (a tokenizer's
``int32``, a lookup's ``string``) are never touched. kmp's
float32 head (``Float32Output``) saves no dtype: it is float32 whatever the policy.
Layers a model creates in its constructor (a subclassed model's, a ``MultiHeadAttention``'s
projections) are not in the config: they follow the policy their parent passes them, or
the global policy, which :func:`kmp.load_model` sets to the chosen one while it builds.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from kmp._names import POLICY_NAMES

__all__ = ["plan_policies", "quantized_layers", "rewrite_config"]

# Serialized objects whose "dtype" is not a layer's policy, or that hold no layers.
_NOT_POLICIES = ("InputLayer", "__keras_tensor__")
# The serialized classes of a plain (not quantized) policy.
_PLAIN_POLICIES = ("DTypePolicy", "FloatDTypePolicy")


def _saved_policy(dtype: Any) -> tuple[str, str | None] | None:
    """``(policy name, quantization mode)`` of a saved ``"dtype"`` entry; None: not a policy.

    A ``DTypePolicyMap`` is not planned (None): it stays as saved.
    """
    if isinstance(dtype, str):  # files of Keras < 3.4 store the name; only mixed ones are sure
        return (dtype, None) if dtype.startswith("mixed_") and dtype in POLICY_NAMES else None
    if not isinstance(dtype, dict) or not isinstance(dtype.get("config"), dict):
        return None
    kind, config = dtype.get("class_name"), dtype["config"]
    if kind in _PLAIN_POLICIES and config.get("name") in POLICY_NAMES:
        return config["name"], None
    if isinstance(kind, str) and kind.startswith("Quantized") and "mode" in config:
        return str(config.get("source_name", "float32")), str(config["mode"])
    return None  # an int32 tokenizer's or a string lookup's dtype is no float policy


def _layer_configs(node: Any, prefix: str = "", root: bool = True) -> Iterator[tuple[str, dict]]:
    """Every layer config below ``node`` that carries a policy: ``(path, config)``.

    The root model's own config has the path ``""``; a layer's path is its enclosing
    layers' names and its own, joined by ``/`` (the walk's paths). A serialized object
    without a name (``Float32Outputs`` wrapping a model's config) stands in its content's
    place.
    """
    if isinstance(node, list):
        for item in node:
            yield from _layer_configs(item, prefix, root)
        return
    if not isinstance(node, dict):
        return
    config = node.get("config")
    if "class_name" not in node or not isinstance(config, dict):
        for value in node.values():
            yield from _layer_configs(value, prefix, root)
        return
    kind = str(node["class_name"])
    if kind in _NOT_POLICIES or "DTypePolicy" in kind:  # a policy holds no layers
        return
    name = config.get("name")
    inner, inner_root = prefix, root
    if isinstance(name, str):
        path = "" if root else f"{prefix}{name}"
        if _saved_policy(config.get("dtype")) is not None:
            yield path, config
        inner, inner_root = ("" if root else f"{path}/"), False
    for key, value in config.items():
        if key != "dtype":
            yield from _layer_configs(value, inner, inner_root)


def _is_kept(path: str, kept: tuple[str, ...]) -> bool:
    return any(path == k or path.startswith(f"{k}/") for k in kept)


def plan_policies(config: dict, policy: str, kept: Iterable[str] = ()) -> dict[str, str]:
    """Decide the policy of every layer config in a saved model's config.

    Args:
        config: The model's config, as ``config.json`` of a ``.keras`` archive holds it.
        policy: The concrete policy to load in (``"float32"``, ``"bfloat16"``,
            ``"float16"``, ``"mixed_float16"``, ``"mixed_bfloat16"``).
        kept: Paths of the layers kept in float32 (``TrainingState.kept_float32``).

    Returns:
        Path -> policy name, for every layer config that carries a policy (the root
        model's path is ``""``), in config order.
    """
    kept = tuple(kept)
    plan: dict[str, str] = {}
    for path, layer in _layer_configs(config):
        _, mode = _saved_policy(layer["dtype"])  # type: ignore[misc]
        base = "float32" if _is_kept(path, kept) else policy
        plan[path] = f"{mode}_from_{base}" if mode else base
    return plan


def rewrite_config(config: dict, plan: dict[str, str]) -> dict:
    """A copy of ``config`` with each planned layer config's ``"dtype"`` set to its policy.

    Args:
        config: The saved model's config.
        plan: What :func:`plan_policies` decided for it.

    Returns:
        The new config (``config`` itself is not changed).
    """
    config = copy.deepcopy(config)
    for path, layer in _layer_configs(config):
        if path in plan:
            layer["dtype"] = plan[path]
    return config


def quantized_layers(config: dict) -> list[str]:
    """The paths of the quantized layers in a saved model's config (``kmp.quantize``'s).

    Args:
        config: The model's config, as ``config.json`` of a ``.keras`` archive holds it.

    Returns:
        The paths, in config order; empty when no layer is quantized.
    """
    return [path for path, layer in _layer_configs(config) if _saved_policy(layer["dtype"])[1]]
