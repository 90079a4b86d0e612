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

- the layers ``kmp.keep_float32`` kept (their saved policy is ``KeptFloat32``, or their
  paths were recorded by :func:`kmp.save_model`), and everything inside them:
  ``"float32"``;
- the layers their author pinned: saved with the ``"float32"`` policy in a model that
  trained in 16 bits (:func:`computes_in_16_bits`), such as a
  ``LayerNormalization(dtype="float32")`` or a final ``Activation("softmax",
  dtype="float32")`` in a ``mixed_float16`` model: kept as saved;
- a quantized layer: its quantization mode, from the policy decided above
  (``"int8_from_bfloat16"``; from float32 when it is kept or pinned);
- a ``DTypePolicyMap`` (a KerasHub backbone quantized by paths): left as saved.

``keep_pinned=False`` gives the kept and pinned layers the chosen policy too. Either way
the outputs stay float32 where the saved model's were (:func:`outputs_were_float32`;
:func:`kmp.load_model` adds kmp's float32 head where a load would change them).

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
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from kmp._names import POLICY_NAMES

__all__ = [
    "computes_in_16_bits",
    "forget_kept",
    "outputs_were_float32",
    "plan_policies",
    "quantized_layers",
    "rewrite_config",
]

# Serialized objects whose "dtype" is not a layer's policy, or that hold no layers.
_NOT_POLICIES = ("InputLayer", "__keras_tensor__")
# The serialized classes of a plain (not quantized) policy.
_PLAIN_POLICIES = ("DTypePolicy", "FloatDTypePolicy")
# How kmp.float32_layers.KeptFloat32 (a kept layer's policy) is saved.
_KEPT_POLICY = "kmp>KeptFloat32"
# kmp.float32_layers.KeepsFloat32, the model wrapper saving the kept paths.
_KEEPS = "kmp>KeepsFloat32"
# kmp.layers.Float32Outputs, the model wrapper casting its outputs to float32.
_FLOAT32_OUTPUTS = "kmp>Float32Outputs"
# kmp's float32 head: saves no dtype, computes in float32.
_HEAD = "Float32Output"


class _Saved(NamedTuple):
    name: str  # the float policy (a quantized one's source)
    mode: str | None  # the quantization mode
    kept: bool  # kmp.keep_float32's policy


def _saved_policy(dtype: Any) -> _Saved | None:
    """The policy a saved ``"dtype"`` entry holds; None: not a float policy.

    A ``DTypePolicyMap`` is not planned (None): it stays as saved.
    """
    if isinstance(dtype, str):  # files of Keras < 3.4 store the name; only mixed ones are sure
        sure = dtype.startswith("mixed_") and dtype in POLICY_NAMES
        return _Saved(dtype, None, False) if sure else None
    if not isinstance(dtype, dict) or not isinstance(dtype.get("config"), dict):
        return None
    kind, config = dtype.get("class_name"), dtype["config"]
    if dtype.get("registered_name") == _KEPT_POLICY:
        return _Saved("float32", None, True)
    if kind in _PLAIN_POLICIES and config.get("name") in POLICY_NAMES:
        return _Saved(config["name"], None, False)
    if isinstance(kind, str) and kind.startswith("Quantized") and "mode" in config:
        return _Saved(str(config.get("source_name", "float32")), str(config["mode"]), False)
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


def _low(name: str) -> bool:
    return name != "float32"


def computes_in_16_bits(config: dict) -> bool:
    """Whether the saved model trained in 16 bits (mixed or pure), from its config alone.

    The model's own saved policy where it has one (Sequential, subclassed and KerasHub
    models); else (Functional) the policy most of its layers were saved with, a tie
    counting as 16 bits.
    """
    layers = [(path, _saved_policy(layer["dtype"])) for path, layer in _layer_configs(config)]
    root = next((saved for path, saved in layers if path == ""), None)
    if root is not None:
        return _low(root.name)
    counts = Counter(_low(saved.name) for _, saved in layers)
    return counts[True] > 0 and counts[True] >= counts[False]


def plan_policies(
    config: dict, policy: str, kept: Iterable[str] = (), keep_pinned: bool = True
) -> dict[str, str]:
    """Decide the policy of every layer config in a saved model's config.

    Args:
        config: The model's config, as ``config.json`` of a ``.keras`` archive holds it.
        policy: The concrete policy to load in (``"float32"``, ``"bfloat16"``,
            ``"float16"``, ``"mixed_float16"``, ``"mixed_bfloat16"``).
        kept: Paths of the layers kept in float32 (``TrainingState.kept_float32``).
        keep_pinned: Keep the kept and pinned layers in float32 (the module's rule);
            False gives them ``policy`` too.

    Returns:
        Path -> policy name, for every layer config that carries a policy (the root
        model's path is ``""``), in config order. A layer kept as saved maps to its
        saved policy's name (:func:`rewrite_config` then leaves its entry, mark included).
    """
    kept = tuple(kept)
    pins = keep_pinned and computes_in_16_bits(config)
    plan: dict[str, str] = {}
    for path, layer in _layer_configs(config):
        saved = _saved_policy(layer["dtype"])
        assert saved is not None  # _layer_configs yields policies only
        if keep_pinned and (saved.kept or _is_kept(path, kept)):
            base = "float32"
        elif pins and path and saved.name == "float32":
            base = "float32"  # pinned by its author
        else:
            base = policy
        plan[path] = f"{saved.mode}_from_{base}" if saved.mode else base
    return plan


def outputs_were_float32(config: dict) -> bool | None:
    """Whether the saved model's outputs were float32, from its config; None: unknown.

    A Functional or Sequential model's are its output layers' (kmp's head, a layer saved
    in float32); another model's (subclassed, KerasHub) follow its own policy, or kmp's
    ``Float32Outputs`` wrapper.

    Args:
        config: The model's serialized config (``config.json``: ``class_name``, ``config``).
    """
    kind = config.get("class_name")
    inner = config.get("config", {})
    if config.get("registered_name") == _FLOAT32_OUTPUTS:
        return True
    if config.get("registered_name") == _KEEPS:  # the model inside keeps its outputs
        return outputs_were_float32(inner.get("model", {}))
    layers = {
        layer.get("config", {}).get("name"): layer
        for layer in inner.get("layers", [])
        if isinstance(layer, dict)
    }
    if kind == "Sequential" and inner.get("layers"):
        names = [inner["layers"][-1].get("config", {}).get("name")]
    elif kind == "Functional" or "output_layers" in inner:
        outputs = inner.get("output_layers", [])
        if isinstance(outputs, dict):  # outputs by name: {"label": ["label", 0, 0], ...}
            outputs = list(outputs.values())
        names = (
            [outputs[0]]
            if outputs and isinstance(outputs[0], str)
            else [o[0] for o in outputs if isinstance(o, list) and o]
        )
    else:
        saved = _saved_policy(inner.get("dtype"))
        return None if saved is None else not _low(saved.name) or saved.kept
    found = [layers.get(name) for name in names]
    if not found or any(layer is None for layer in found):
        return None
    return all(_outputs_float32(layer) for layer in found)


def _outputs_float32(layer: dict) -> bool:
    if layer.get("class_name") == _HEAD or layer.get("registered_name") == f"kmp>{_HEAD}":
        return True
    saved = _saved_policy(layer.get("config", {}).get("dtype"))
    return saved is not None and not saved.mode and not _low(saved.name)


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
        saved = _saved_policy(layer["dtype"])
        as_saved = saved is not None and not saved.mode and plan.get(path) == saved.name
        if path in plan and not as_saved:  # kept as saved: its entry stays (the mark too)
            layer["dtype"] = plan[path]
    return config


def forget_kept(config: dict) -> dict:
    """A copy of ``config`` whose ``KeepsFloat32`` wrappers keep no layer on load.

    For ``keep_pinned=False``: the wrapper's recorded paths would otherwise move the
    layers a model makes itself back to float32 as it loads.
    """

    def forget(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                forget(item)
        elif isinstance(node, dict):
            if node.get("registered_name") == _KEEPS and isinstance(node.get("config"), dict):
                node["config"]["kept_float32"] = []
            for value in node.values():
                forget(value)

    config = copy.deepcopy(config)
    forget(config)
    return config


def quantized_layers(config: dict) -> list[str]:
    """The paths of the quantized layers in a saved model's config (``kmp.quantize``'s).

    Args:
        config: The model's config, as ``config.json`` of a ``.keras`` archive holds it.

    Returns:
        The paths, in config order; empty when no layer is quantized.
    """
    return [path for path, layer in _layer_configs(config) if _saved_policy(layer["dtype"]).mode]
