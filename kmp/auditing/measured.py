"""The audit's measured checks: run a clone of a layer in 16 bits and in float32.

A rule that lists classes is wrong as soon as a class upcasts internally (KerasHub's
RMSNormalization does) or a custom one does not. These checks measure instead:

- :meth:`MeasuredChecks.norm`: a clone of a normalisation layer, with the same config, dtype
  policy and weights, runs on a tiny input whose float16 statistics overflow
  (``x ~ 300``, so ``x**2 > 65504``) and lose precision (a large mean, a small variance),
  and is compared with the same clone under float32.
- :meth:`MeasuredChecks.attention_mask`: a clone of a MultiHeadAttention (subclasses included)
  runs with a mask; changing the masked keys and values must not change the output, and
  the output must be finite. Other attention layers get their Softmax sublayers measured.

The model and the global dtype policy are left as they were: clones are built under a
policy set for the moment and restored in ``finally``; a norm without a usable config
runs in place (inference mode), under float32 for the reference, its policy restored.
Results are cached per class, config and policy in the :class:`MeasuredChecks`, which live for
one audit.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from kmp.auditing.report import Measurement

__all__ = ["MeasuredChecks"]

_MAX_INPUT_ELEMENTS = 200_000
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
_TOLERANCE_ULPS = 4  # a norm that upcasts is off by its output rounding, a few ulps


@contextlib.contextmanager
def _global_policy(policy: Any) -> Iterator[None]:
    """Make ``policy`` the global policy while sublayers are created; restore it after."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def _clone(layer: keras.layers.Layer, policy: Any) -> keras.layers.Layer:
    config = dict(layer.get_config())
    config["dtype"] = policy
    with _global_policy(policy):
        return type(layer).from_config(config)


def _config_key(layer: keras.layers.Layer) -> str | None:
    try:
        config = dict(layer.get_config())
    except Exception:
        return None
    config.pop("name", None)
    return json.dumps(config, sort_keys=True, default=str)


def _axes(layer: keras.layers.Layer, rank: int) -> set[int]:
    axis = getattr(layer, "axis", -1)
    axes = axis if isinstance(axis, list | tuple) else [axis]
    try:
        return {int(a) % rank for a in axes}
    except (TypeError, ValueError):
        return {rank - 1}


def _input_shape(layer: keras.layers.Layer) -> tuple[int, ...] | None:
    """A small input shape the layer accepts: its feature axes kept, the others shrunk."""
    shape = None
    with contextlib.suppress(Exception):
        shape = tuple(layer.input.shape)
    if shape is None:
        shapes = getattr(layer, "_build_shapes_dict", None) or {}
        if len(shapes) == 1:
            shape = tuple(next(iter(shapes.values())))
    if shape is None:
        vectors = [w.shape for w in layer.weights if len(w.shape) == 1]
        if not vectors:
            return None
        shape = (None, 4, int(vectors[0][0]))
    rank = len(shape)
    if rank < 2:
        return None
    keep = _axes(layer, rank) - {0}
    small = []
    for i, size in enumerate(shape):
        if i == 0:
            small.append(2)
        elif i in keep:
            if size is None:
                return None
            small.append(int(size))
        else:
            small.append(min(int(size or 3), 3))
    return tuple(small) if math.prod(small) <= _MAX_INPUT_ELEMENTS else None


def _norm_input(shape: tuple[int, ...]) -> np.ndarray:
    """``300 + 2k``, k in -4..4 varying along every axis: exact in float16 and bfloat16."""
    index = np.indices(shape)
    k = sum((i + 1) * index[i] for i in range(len(shape))) % 9 - 4
    return (300.0 + 2.0 * k).astype("float32")


def _numpy(x: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")), dtype=np.float64)


def _call(layer: keras.layers.Layer, *args: Any, **kwargs: Any) -> Any:
    try:
        takes_training = "training" in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        takes_training = False
    if takes_training:
        kwargs["training"] = True  # batch statistics, not moving averages
    return layer(*args, **kwargs)


def _copy_weights(source: keras.layers.Layer, *targets: keras.layers.Layer) -> bool:
    values = source.get_weights()
    shapes = [tuple(v.shape) for v in values]
    if not all([tuple(w.shape) for w in t.weights] == shapes for t in targets):
        return False
    for t in targets:
        t.set_weights(values)
    return True


def _failure(what: str, exc: BaseException) -> Measurement:
    text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return Measurement("unknown", f"{what} could not run: {type(exc).__name__}: {text}")


def _compare(y_low: np.ndarray, y_ref: np.ndarray, dtype: str, where: str) -> Measurement:
    """Compare a 16-bit output with the float32 one, relative to the output's size."""
    if y_low.shape != y_ref.shape or not np.all(np.isfinite(y_ref)):
        return Measurement("unknown", "the float32 run gave no finite reference output")
    scale = max(float(np.max(np.abs(y_ref))), 1.0)
    if not np.all(np.isfinite(y_low)):
        return Measurement("bad", f"non-finite {dtype} output {where}", math.inf)
    error = float(np.max(np.abs(y_low - y_ref))) / scale
    tolerance = _TOLERANCE_ULPS * _EPS.get(dtype, 2.0**-10)
    status = "ok" if error <= tolerance else "bad"
    return Measurement(
        status,
        f"relative error {error:.2g} against float32 {where} (tolerance {tolerance:.2g})",
        error,
    )


class MeasuredChecks:
    """Runs the measured checks for one audit; caches results per class, config and policy."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Measurement] = {}

    def _cached(self, key: tuple | None, measure: Any) -> Measurement:
        if key is None or None in key:
            return measure()
        if key not in self._cache:
            self._cache[key] = measure()
        return self._cache[key]

    def norm(self, layer: keras.layers.Layer) -> Measurement:
        """Measure whether a 16-bit normalisation layer matches float32 on a hard input.

        Args:
            layer: A built normalisation layer computing in float16 or bfloat16.

        Returns:
            ``ok`` when the 16-bit output is within a few output ulps of float32's,
            ``bad`` (with the error) otherwise, ``unknown`` when it cannot be measured.
        """
        shape = _input_shape(layer)
        if shape is None:
            return Measurement("unknown", "the check does not know an input shape for it")
        key = ("norm", type(layer), _config_key(layer), layer.dtype_policy.name, shape)
        return self._cached(key, lambda: self._measure_norm(layer, shape))

    def _measure_norm(self, layer: keras.layers.Layer, shape: tuple[int, ...]) -> Measurement:
        dtype = layer.compute_dtype
        x = _norm_input(shape)
        try:
            low = _clone(layer, layer.dtype_policy)
            ref = _clone(layer, "float32")
        except Exception:
            return self._measure_norm_in_place(layer, x)
        try:
            low.build(shape)
            ref.build(shape)
            if not _copy_weights(layer, low, ref):
                _copy_weights(low, ref)
            y_low = _numpy(_call(low, keras.ops.cast(x, dtype)))
            y_ref = _numpy(_call(ref, keras.ops.convert_to_tensor(x)))
        except Exception as exc:
            return _failure("the normalisation check", exc)
        return _compare(y_low, y_ref, dtype, f"on inputs 300 +- 8 of shape {shape}")

    def _measure_norm_in_place(self, layer: keras.layers.Layer, x: np.ndarray) -> Measurement:
        """Run the layer itself (inference mode), then under float32; restore its policy."""
        dtype, policy = layer.compute_dtype, layer.dtype_policy
        try:
            y_low = _numpy(layer(keras.ops.cast(x, dtype)))
            try:
                layer.dtype_policy = "float32"
                y_ref = _numpy(layer(keras.ops.convert_to_tensor(x)))
            finally:
                layer.dtype_policy = policy
        except Exception as exc:
            return _failure("the normalisation check (run in place, no config to clone)", exc)
        where = f"on inputs 300 +- 8 of shape {x.shape} (the layer itself, no config to clone)"
        return _compare(y_low, y_ref, dtype, where)

    def attention_mask(self, layer: keras.layers.Layer) -> Measurement:
        """Measure whether a 16-bit attention layer's mask holds.

        Args:
            layer: A MultiHeadAttention (or subclass), a Softmax, or another attention
                layer whose Softmax sublayers are measured.

        Returns:
            ``ok`` when masked positions get no weight and the output is finite, ``bad``
            otherwise, ``unknown`` when the check cannot call the layer.
        """
        key = ("mask", type(layer), _config_key(layer), layer.dtype_policy.name)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            return self._cached(key, lambda: self._measure_mha(layer))
        if isinstance(layer, keras.layers.Softmax):
            return self._cached(key, lambda: self._measure_softmax(layer))
        softmaxes = [s for s in _sublayers(layer) if isinstance(s, keras.layers.Softmax)]
        if not softmaxes:
            return Measurement(
                "unknown",
                f"not measured: the check cannot call a {type(layer).__name__} and it has no "
                "Softmax sublayer to measure",
            )
        results = [self.attention_mask(s) for s in softmaxes]
        bad = [r for r in results if r.status != "ok"]
        if bad:
            return bad[0]
        return Measurement(
            "ok",
            f"its Softmax sublayer masks correctly ({results[0].detail}); a mask applied "
            f"outside it by {type(layer).__name__} is not measured",
        )

    def _measure_softmax(self, layer: keras.layers.Softmax) -> Measurement:
        rng = np.random.default_rng(0)
        scores = rng.normal(0.0, 4.0, (1, 2, 4, 4)).astype("float32")
        mask = np.ones((1, 2, 4, 4), dtype=bool)
        mask[..., 3] = False
        try:
            clone = _clone(layer, layer.dtype_policy)
            out = _numpy(clone(keras.ops.cast(scores, layer.compute_dtype), mask=mask))
        except Exception as exc:
            return _failure("the softmax mask check", exc)
        leak = float(np.max(np.abs(out[..., 3]))) if np.all(np.isfinite(out)) else math.inf
        return _mask_verdict(leak, "masked softmax weight")

    def _measure_mha(self, layer: keras.layers.MultiHeadAttention) -> Measurement:
        try:
            dq = int(layer._query_dense.kernel.shape[0])
            dv = int(layer._value_dense.kernel.shape[0])
        except AttributeError:
            dq = dv = 8
        rng = np.random.default_rng(0)
        query = rng.normal(0.0, 1.0, (1, 4, dq)).astype("float32")
        value = rng.normal(0.0, 1.0, (1, 4, dv)).astype("float32")
        changed = value.copy()
        changed[:, 3, :] = 50.0  # the masked key and value
        mask = np.ones((1, 4, 4), dtype=bool)
        mask[:, :, 3] = False
        dtype = layer.compute_dtype
        try:
            clone = _clone(layer, layer.dtype_policy)
            clone.build((1, 4, dq), (1, 4, dv))
            _copy_weights(layer, clone)
            outs = [
                _numpy(
                    clone(
                        keras.ops.cast(query, dtype), keras.ops.cast(v, dtype), attention_mask=mask
                    )
                )
                for v in (value, changed)
            ]
        except Exception as exc:
            return _failure("the attention mask check", exc)
        finite = all(np.all(np.isfinite(o)) for o in outs)
        leak = float(np.max(np.abs(outs[0] - outs[1]))) if finite else math.inf
        return _mask_verdict(leak, "output change when only masked keys/values change")


def _mask_verdict(leak: float, what: str) -> Measurement:
    if math.isinf(leak):
        return Measurement("bad", "non-finite output with a mask", math.inf)
    if leak > 1e-2:
        return Measurement("bad", f"{what} {leak:.2g}: masked positions still count", leak)
    return Measurement("ok", f"{what} {leak:.2g}, output finite", leak)


def _sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    try:
        return list(layer._flatten_layers(include_self=False, recursive=True))
    except Exception:
        return []
