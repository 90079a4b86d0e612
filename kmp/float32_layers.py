"""Keeping chosen layers of a model in float32: :func:`keep_float32`.

Under a mixed policy every layer computes in 16 bits. A layer whose values overflow
float16, or whose precision matters (what ``kmp.probe`` measures and ``kmp.audit``
suspects), can be moved back to float32 in place, with everything inside it, on any built
model: Sequential, Functional, subclassed or KerasHub. The layers and their paths are
those of :func:`kmp.layer_walk.walk`, the walk ``kmp.probe`` and ``kmp.audit`` take too.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import keras

from kmp._names import LOW_FLOATS
from kmp.layer_walk import walk

__all__ = ["keep_float32"]

KEPT_MARK = "_kmp_keep_float32"  # True on the layers keep_float32 kept; the audit reads it


def _matches(selector: str | type, layer: Any, path: str) -> bool:
    if isinstance(selector, type):
        return isinstance(layer, selector)
    keys = (layer.name, layer.path or layer.name, path, type(layer).__name__)
    return any(k == selector or fnmatch.fnmatchcase(k, selector) for k in keys)


def _float32_policy(layer: Any) -> Any:
    """The policy moving ``layer`` to float32 (quantization kept); None when it is not 16-bit."""
    if layer.compute_dtype not in LOW_FLOATS:
        return None
    mode = layer.quantization_mode
    return keras.dtype_policies.get(f"{mode}_from_float32" if mode else "float32")


def _forget_old_dtypes(models: list) -> None:
    """Drop traced train/predict functions; update the dtypes Functional graphs recorded."""
    from kmp._keras_internals import compute_output_spec

    for model in (m for m in models if isinstance(m, keras.Model)):
        model.train_function = model.test_function = model.predict_function = None
        nodes = getattr(getattr(model, "_functional", None) or model, "_nodes_by_depth", {})
        try:  # each node traced again on placeholders: no node is added
            for n in [x for depth in sorted(nodes, reverse=True) for x in nodes[depth]]:
                if not n.is_input and n.operation is not None:
                    spec = compute_output_spec(n.operation, *n.arguments.args, **n.arguments.kwargs)
                    for tensor, new in zip(n.outputs, keras.tree.flatten(spec), strict=True):
                        tensor._dtype = keras.backend.standardize_dtype(new.dtype)
        except Exception:  # this graph keeps its old dtypes: call() is right anyway
            continue


def keep_float32(model: keras.Model, *selectors: str | type) -> list[str]:
    """Make the selected layers of a built model, sublayers included, compute in float32.

    In place: each matched layer and every layer inside it (a ``MultiHeadAttention``'s
    projections and softmax) computing in float16/bfloat16 gets the ``"float32"`` policy
    (quantized: its mode from float32); a tied ``ReversibleEmbedding``'s 16-bit
    ``reverse_dtype`` becomes float32. ``kmp.audit`` reports their cost as info only. Saved,
    a Sequential or Functional model keeps them (each layer's config); a subclassed or
    KerasHub one does too when saved with :func:`kmp.save_model` and loaded with
    :func:`kmp.load_model` (the file records the kept paths, :func:`kept_paths`).

    Args:
        model: A built Keras model (Sequential, Functional, subclassed, KerasHub) or layer.
        *selectors: Layer classes (``isinstance``), or strings matched, exactly or as
            ``fnmatch`` patterns, against each layer's name, path (as ``kmp.audit`` and
            ``kmp.probe`` show it, or Keras's ``layer.path``) and class name:
            ``"block*_attention"``, ``"Softmax"``.

    Returns:
        The paths (:mod:`kmp.layer_walk`'s, as ``kmp.audit`` shows them) of the layers
        changed, in walk order; layers already computing in float32 are not listed.

    Raises:
        TypeError: ``model`` is not a Keras layer, or a selector no string or layer class.
        ValueError: An unbuilt model, or a selector matching no layer (nothing changes).
            No selector at all changes nothing and returns ``[]``.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"keep_float32 expects a Keras model, got {type(model).__name__}.")
    for s in selectors:
        if not isinstance(s, str) and not (isinstance(s, type) and issubclass(s, keras.Layer)):
            raise TypeError(
                f"keep_float32 takes layer names, paths, glob patterns or Keras layer classes, "
                f"got {s!r} (a list goes as separate arguments: keep_float32(model, *names))."
            )
    if not selectors:  # kmp.keep_float32(model, *report.keep_float32) with nothing to keep
        return []
    if not model.built:
        raise ValueError(f"{model.name!r} is not built: call it on a batch or build it first.")
    visits = list(walk(model, inputs=False))
    chosen: set[int] = set()
    for s in selectors:
        hits = [v.layer for v in visits if _matches(s, v.layer, v.path)]
        if not hits:
            raise ValueError(
                f"{getattr(s, '__name__', s)!r} matches no layer of {model.name!r} (names, paths "
                "and class names; glob patterns such as 'block*_attention' are accepted). Its "
                f"layers: {', '.join(v.path for v in visits[:10]) or 'none'}"
                f"{f', ... ({len(visits)} in all)' * (len(visits) > 10)}."
            )
        chosen.update(id(y) for x in hits for y in x._flatten_layers(include_self=True))
    return _keep([v for v in visits if id(v.layer) in chosen], model, visits)


def _keep(kept: list, model: Any, visits: list) -> list[str]:
    """Move the ``kept`` visits' layers to float32 and mark them; the paths that changed.

    ``visits`` are all of ``model``'s: their traced dtypes are dropped when anything changed.
    """
    # Every new policy is decided before anything changes.
    plan = [(v.layer, v.path, _float32_policy(v.layer)) for v in kept]
    changed = []
    for layer, path, policy in plan:
        reverse = getattr(layer, "reverse_dtype", None) in LOW_FLOATS
        if policy is not None:
            layer.dtype_policy = policy
        if reverse:
            layer.reverse_dtype = "float32"
        changed += [path] if policy is not None or reverse else []
        setattr(layer, KEPT_MARK, layer.compute_dtype == "float32")
    if changed:  # ``model.outputs``, ``layer.output`` and fit's traced step say 16 bits
        _forget_old_dtypes([model, *(v.layer for v in visits)])
    return changed


def kept_paths(model: Any) -> list[str]:
    """The paths of the layers of ``model`` that :func:`keep_float32` kept, in walk order."""
    return [v.path for v in walk(model, inputs=False) if getattr(v.layer, KEPT_MARK, False) is True]


def restore_kept(model: Any, paths: Any) -> tuple[list[str], list[str]]:
    """Keep the layers at ``paths`` (:func:`kept_paths` of the saved model) in float32 again.

    Each gets the float32 policy where it computes in 16 bits (a tied
    ``ReversibleEmbedding``'s 16-bit ``reverse_dtype`` too) and the audit's mark. A layer
    that its model built with 16-bit variables (under a pure 16-bit policy, a layer the
    saved config does not hold) keeps them: only its compute dtype changes.

    Returns:
        The paths not found in ``model`` (another architecture), and those of the kept
        layers whose own variables are 16-bit, for the caller to report.
    """
    wanted = set(paths)
    if not wanted:
        return [], []
    every = list(walk(model, inputs=False))
    visits = [v for v in every if v.path in wanted]
    _keep(visits, model, every)
    low = [v.path for v in visits if any(w.dtype in LOW_FLOATS for w in v.layer.weights)]
    return sorted(wanted - {v.path for v in visits}), low
