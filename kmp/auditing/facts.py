"""Each visited layer's facts and table row, read without ever failing on a layer.

The layers come from :func:`kmp.layer_walk.walk` (a nested model's own visit is left out:
its layers have their rows). Whatever cannot be read is ``"?"`` or a ``problem``, for the
rules to report as unknown.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from kmp._names import LOW_FLOATS
from kmp.auditing.measured import MeasuredChecks
from kmp.auditing.report import UNKNOWN, LayerFacts, LayerRow
from kmp.float32_layers import is_kept
from kmp.layer_walk import Visit
from kmp.layers import Float32Output, activation_name

__all__ = ["consumer_map", "layer_facts", "layer_row", "model_output_layers"]

_ATTENTION_CLASSES: tuple[type, ...] = tuple(
    c
    for c in (
        getattr(keras.layers, "MultiHeadAttention", None),
        getattr(keras.layers, "GroupQueryAttention", None),
        getattr(keras.layers, "Attention", None),
        getattr(keras.layers, "AdditiveAttention", None),
    )
    if c is not None
)


def _safe(read: Any, default: Any = UNKNOWN) -> Any:
    try:
        return read()
    except Exception:
        return default


def _compute(layer: Any) -> str:
    return str(_safe(lambda: layer.compute_dtype))


def _output_dtype(layer: keras.layers.Layer) -> str:
    if isinstance(layer, Float32Output):
        return "float32"
    try:
        tensors = keras.tree.flatten(layer.output)
    except Exception:
        return UNKNOWN
    return ",".join(sorted({str(t.dtype) for t in tensors})) if tensors else UNKNOWN


def _params(layer: keras.layers.Layer) -> int:
    return int(_safe(lambda: sum(int(keras.ops.size(v)) for v in layer.weights), 0))


def layer_row(v: Visit) -> LayerRow:
    """The table row of a visited layer; ``"?"`` where a dtype cannot be read."""
    layer = v.layer
    variables = _safe(lambda: sorted({str(w.dtype) for w in layer.weights}), None)
    return LayerRow(
        v.path,
        type(layer).__name__,
        _compute(layer),
        UNKNOWN if variables is None else (",".join(variables) or "-"),
        _output_dtype(layer),
        _params(layer),
        _safe(lambda: is_kept(layer), False),
    )


def model_output_layers(outputs: list) -> set[int]:
    """Ids of the layers (innermost, through nested models) producing ``outputs``."""
    ids: set[int] = set()
    for t in outputs:
        layer = _safe(lambda t=t: t._keras_history.operation, None)
        while isinstance(layer, keras.Model) and getattr(layer, "outputs", None):
            layer = _safe(lambda m=layer: keras.tree.flatten(m.outputs)[0]._keras_history.operation)
        ids.add(id(layer))
    return ids


def _kinds(layer: keras.layers.Layer, activation: str | None) -> frozenset[str]:
    name = type(layer).__name__
    kinds = set()
    if isinstance(layer, keras.layers.InputLayer):
        kinds.add("input")
    if isinstance(layer, Float32Output):
        kinds.add("head")
    if isinstance(layer, keras.Model):
        kinds.add("model")
    if name.endswith(("Normalization", "Norm")) and "head" not in kinds:
        kinds.add("norm")
    if isinstance(layer, _ATTENTION_CLASSES) or "Attention" in name:
        kinds.add("attention")
    if isinstance(layer, keras.layers.Softmax) or activation in ("softmax", "log_softmax"):
        kinds.add("softmax")
    if isinstance(layer, keras.layers.Embedding) or name.endswith("Embedding"):
        kinds.add("embedding")
    if type(layer).__module__.startswith("keras.src."):
        kinds.add("keras")
    return frozenset(kinds)


def _relevant(layer: Any) -> bool:
    return not isinstance(layer, keras.layers.InputLayer | Float32Output)


def _graph_neighbours(layer: keras.layers.Layer, consumers: dict[int, list]) -> tuple[list, list]:
    producers = []
    for node in _safe(lambda: layer._inbound_nodes, []) or []:
        producers.extend(p.operation for p in (getattr(node, "parent_nodes", None) or []))
    return producers, consumers.get(id(layer), [])


def consumer_map(visits: list[Visit]) -> dict[int, list]:
    """Who consumes each layer's output, from the symbolic graph where there is one."""
    consumers: dict[int, list] = {}
    for v in visits:
        for node in _safe(lambda v=v: v.layer._inbound_nodes, []) or []:
            for parent in getattr(node, "parent_nodes", None) or []:
                consumers.setdefault(id(parent.operation), []).append(v.layer)
    return consumers


def layer_facts(
    v: Visit, consumers: dict[int, list], output_ids: set[int], checks: MeasuredChecks
) -> LayerFacts:
    """Everything the rules need about one visited layer, measured checks included."""
    layer = v.layer
    compute = _compute(layer)
    try:
        activation = activation_name(getattr(layer, "activation", None))
    except Exception:
        activation = "unknown:activation"
    kinds = _kinds(layer, activation)
    producers, users = _graph_neighbours(layer, consumers)
    if not producers and not users:  # inside another layer: the siblings next to it
        i = next((k for k, s in enumerate(v.siblings) if s is layer), 0)
        producers = [s for s in v.siblings[max(i - 1, 0) : i] if _relevant(s)]
        users = [s for s in v.siblings[i + 1 : i + 2] if _relevant(s)]
    neighbours = tuple(_compute(n) for n in (*producers, *users) if _relevant(n))
    subs = _safe(lambda: list(layer._flatten_layers(include_self=False, recursive=True)), [])
    softmaxes = tuple(_compute(s) for s in subs if isinstance(s, keras.layers.Softmax))
    facts = LayerFacts(
        path=v.path,
        class_name=type(layer).__name__,
        compute=compute,
        policy=str(_safe(lambda: layer.dtype_policy.name)),
        variable_dtypes=tuple(_safe(lambda: sorted({str(w.dtype) for w in layer.weights}), ())),
        params=_params(layer),
        activation=activation,
        kinds=kinds,
        makes_output=id(layer) in output_ids,
        neighbour_computes=neighbours,
        consumer_computes=tuple(_compute(n) for n in users if _relevant(n)),
        softmax_computes=softmaxes,
        in_float32_parent=any(_compute(p) == "float32" for p in v.parents),
        parent_policy=str(_safe(lambda: v.parents[-1].dtype_policy.name)) if v.parents else None,
        kept_float32=compute == "float32" and is_kept(layer),
        problem=None if compute != UNKNOWN else "its compute dtype cannot be read",
    )
    inside_attention = any("attention" in _kinds(p, None) for p in v.parents)
    if compute in LOW_FLOATS and "norm" in kinds:
        facts = dataclasses.replace(facts, norm_check=checks.norm(layer))
    is_softmax_layer = isinstance(layer, keras.layers.Softmax) and not facts.makes_output
    low = compute in LOW_FLOATS or any(s in LOW_FLOATS for s in softmaxes)
    if low and not inside_attention and ("attention" in kinds or is_softmax_layer):
        facts = dataclasses.replace(facts, mask_check=checks.attention_mask(layer))
    if inside_attention and "softmax" in kinds:  # reported once, on the attention layer
        facts = dataclasses.replace(facts, kinds=kinds - {"softmax"})
    return facts
