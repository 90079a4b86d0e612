"""Keeping chosen layers of a model in float32: :func:`keep_float32`.

Under a mixed policy every layer computes in 16 bits. A layer whose values overflow
float16, or whose precision matters (what ``kmp.probe`` measures and ``kmp.audit``
suspects), can be moved back to float32 in place, with everything inside it, on any built
model: Sequential, Functional, subclassed or KerasHub. The layers and their paths are
those of :func:`kmp.layer_walk.walk`, the walk ``kmp.probe`` and ``kmp.audit`` take too.

A kept layer's policy is :class:`KeptFloat32`: float32, and the mark that it was kept. It
is saved in the layer's config, so it travels with the model itself: ``model.save``,
Keras's loader and :func:`kmp.load_model` in any policy keep it float32 and marked (a
layer whose config the file holds: Sequential and Functional models' layers; the layers a
subclassed or KerasHub model makes itself come back through :func:`kmp.save_model`'s
record, :func:`restore_kept`). A quantized layer keeps its quantized policy; the mark is
also an attribute (:data:`KEPT_MARK`), which a later ``model.quantize`` keeps.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import keras

from kmp._model_mixins import mixin_class, move_to, wrapped_config
from kmp._names import LOW_FLOATS
from kmp.layer_walk import walk

__all__ = ["KeepsFloat32", "KeptFloat32", "keep_float32"]

KEPT_MARK = "_kmp_keep_float32"  # True on a kept layer (kept across quantize(); not saved)


@keras.saving.register_keras_serializable(package="kmp", name="KeptFloat32")
class KeptFloat32(keras.DTypePolicy):
    """The policy of a layer :func:`keep_float32` kept: ``"float32"``, marked as kept.

    It computes and stores variables in float32 exactly as ``keras.DTypePolicy("float32")``
    does; its class is the mark ``kmp.audit`` reads and ``kmp.load_model`` keeps in any
    policy. Saved in the layer's config as ``"kmp>KeptFloat32"``: Keras's loader reads it
    once kmp's classes are registered (``import kmp.saving``; :func:`kmp.load_model`
    does it).

    Args:
        name: ``"float32"``, the only policy a kept layer has.

    Raises:
        ValueError: ``name`` is not ``"float32"``.
    """

    def __init__(self, name: str = "float32") -> None:
        if name != "float32":
            raise ValueError(
                f"KeptFloat32 is the float32 policy of a layer kmp.keep_float32 kept; got "
                f"{name!r}. Use keras.DTypePolicy({name!r}) for another policy."
            )
        super().__init__("float32")


def is_kept(layer: Any) -> bool:
    """Whether :func:`keep_float32` kept ``layer`` (its policy, or a quantized layer's mark)."""
    policy = getattr(layer, "dtype_policy", None)
    if isinstance(policy, KeptFloat32):
        return True
    return getattr(layer, KEPT_MARK, False) is True and layer.compute_dtype == "float32"


def _matches(selector: str | type, layer: Any, path: str) -> bool:
    if isinstance(selector, type):
        return isinstance(layer, selector)
    keys = (layer.name, layer.path or layer.name, path, type(layer).__name__)
    return any(k == selector or fnmatch.fnmatchcase(k, selector) for k in keys)


def _float32_policy(layer: Any) -> Any:
    """The kept policy of ``layer`` (quantization kept); None when it has it already.

    A plain float32 layer (pinned by its author) takes :class:`KeptFloat32` too: same
    numbers, and the mark.
    """
    mode = layer.quantization_mode
    if mode:
        if layer.compute_dtype not in LOW_FLOATS:
            return None
        return keras.dtype_policies.get(f"{mode}_from_float32")
    if isinstance(layer.dtype_policy, (KeptFloat32, keras.dtype_policies.DTypePolicyMap)):
        return None
    if layer.compute_dtype not in LOW_FLOATS and layer.compute_dtype != "float32":
        return None  # an int32 tokenizer, a string lookup: no float policy to keep
    return KeptFloat32()


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
        was_low = layer.compute_dtype in LOW_FLOATS
        if policy is not None:
            layer.dtype_policy = policy
        if reverse:
            layer.reverse_dtype = "float32"
        changed += [path] if was_low or reverse else []
        # The policy is the mark that is saved; the attribute outlives a later quantize().
        setattr(layer, KEPT_MARK, layer.compute_dtype == "float32")
    if plan and isinstance(model, keras.Model) and not isinstance(model, KeepsFloat32):
        move_to(model, mixin_class(KeepsFloat32, type(model), "_kmp_keeps_base", "KeepsFloat32"))
    if changed:  # ``model.outputs``, ``layer.output`` and fit's traced step say 16 bits
        _forget_old_dtypes([model, *(v.layer for v in visits)])
    return changed


def kept_paths(model: Any) -> list[str]:
    """The paths of the layers of ``model`` that :func:`keep_float32` kept, in walk order."""
    return [v.path for v in walk(model, inputs=False) if is_kept(v.layer)]


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


@keras.saving.register_keras_serializable(package="kmp", name="KeepsFloat32")
class KeepsFloat32:
    """Mixin for a model some of whose layers :func:`keep_float32` kept: it saves their paths.

    :func:`keep_float32` moves the model, in place, to ``KeepsFloat32[<its class>]``, a
    subclass of both (as :class:`kmp.layers.Float32Outputs` does): its class, layers,
    weights and methods stay; its config wraps the model's own with the kept paths, so
    ``model.save`` carries them and Keras's loader (once ``kmp.saving`` is imported) keeps
    those layers float32 and marked again (:func:`restore_kept`), also the layers a
    subclassed or KerasHub model makes itself. Never instantiate it directly.
    """

    # The model's own class, set on each subclass (its own name: a model may also be
    # kmp.layers.Float32Outputs, whose _kmp_base is another class).
    _kmp_keeps_base: type | None = None

    def get_config(self) -> dict:
        """The model's own config (``"model"``) and the kept layers' paths."""
        return {
            "model": wrapped_config(self._kmp_keeps_base, super().get_config()),  # type: ignore[misc]
            "kept_float32": kept_paths(self),
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> keras.Model:
        """The model of ``config["model"]``, its kept layers float32 and marked again."""
        model = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        restore_kept(model, config.get("kept_float32", ()))
        return model
