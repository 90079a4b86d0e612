"""How an update reaches a 16-bit weight: the master-weights rule, once.

A bfloat16 weight has 8 significant bits: an update below half its spacing (about
``2**-9`` of the weight) rounds away, so with bfloat16 weights and optimizer states
(half the memory of float32 master weights) plain training stops learning once its
updates are small. kmp offers three ways to keep them, chosen per weight by
:func:`update_mode` from ``kmp.wrap_optimizer(master_weights=...)`` and the weight's
dtype:

* ``"kahan"``: a 16-bit compensation buffer per weight holds what the last rounding
  lost, and is added to the next update (:func:`compensated_add`). Two bytes more per
  weight; deterministic.
* ``"stochastic"``: the exact sum is rounded up or down at random, with the probability
  that makes the rounding unbiased (:func:`stochastic_round`). No extra memory. The
  random bits are a hash of the seed, the optimizer step, the weight's index and the
  element's position (:func:`random_bits`), so every rank draws the same bits and a run
  is reproducible from its seed.
* ``"none"``: round to nearest, as Keras does (lossy; kept for comparison).

:mod:`kmp.compensated` also rounds the optimizer's bfloat16 slots stochastically under
``"kahan"`` and ``"stochastic"`` (:func:`stochastic_round`, with their own indices).

The arithmetic is float32 and written with ``keras.ops``, so the stateful path, the
stateless (JAX) path and both engines share it. Float32 weights are always updated
exactly and need none of this.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from kmp import _checks
from kmp._keras_internals import bitcast
from kmp._names import LOW_FLOATS, MASTER_WEIGHTS

__all__ = [
    "compensated_add",
    "keyed_random_bits",
    "random_bits",
    "rounding_key",
    "state_bytes",
    "stochastic_round",
]

DEFAULT_MASTER_WEIGHTS = "auto"
DEFAULT_ROUNDING_SEED = 0
EXACT = "exact"  # what update_mode says for a float32 (or wider) weight


def check_master_weights(value: Any) -> str:
    """Return the canonical ``master_weights`` setting, one of :data:`MASTER_WEIGHTS`.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not a known mode.
    """
    return _checks.check_choice(
        "master_weights",
        value,
        MASTER_WEIGHTS,
        hint="'auto' compensates 16-bit weights with 'kahan' and leaves float32 ones exact.",
    )


def update_mode(setting: str, dtype: str) -> str:
    """How a weight of ``dtype`` takes its updates under ``setting`` (pure).

    Args:
        setting: A canonical ``master_weights`` setting.
        dtype: The weight's dtype name.

    Returns:
        ``"exact"`` for a float32 (or wider) weight, whatever the setting; otherwise
        ``"kahan"``, ``"stochastic"`` or ``"none"``.

    Raises:
        ValueError: ``"float32"`` for a 16-bit weight (its policy has no float32 master
            weights), or ``"stochastic"`` for a float16 weight.
    """
    if dtype not in LOW_FLOATS:
        return EXACT
    if setting == "float32":
        raise ValueError(
            f"master_weights='float32' needs float32 weights, but this one is {dtype}: its "
            "policy keeps no float32 copy. Use a mixed policy (kmp.enable('mixed_bfloat16')) "
            "for float32 master weights, or master_weights='kahan' (the default for 16-bit "
            "weights) or 'stochastic' to keep the 16-bit weights and their memory saving."
        )
    if setting == "stochastic" and dtype != "bfloat16":
        raise ValueError(
            f"master_weights='stochastic' rounds to bfloat16, but this weight is {dtype}; "
            "use master_weights='kahan' for float16 weights."
        )
    return "kahan" if setting == "auto" else setting


def compensated_add(weight: Any, compensation: Any, delta: Any) -> tuple[Any, Any]:
    """Kahan summation of ``delta`` into a 16-bit ``weight`` with a 16-bit ``compensation``.

    The exact sum ``weight + delta + compensation`` is formed in float32, rounded to the
    weight's dtype, and what the rounding lost becomes the new compensation.

    Args:
        weight: The weight's current value (16-bit).
        compensation: What earlier roundings lost (same shape and dtype).
        delta: The update to add (any float dtype; subtract by passing its negative).

    Returns:
        ``(new_weight, new_compensation)`` in the weight's dtype.
    """
    dtype = keras.backend.standardize_dtype(weight.dtype)
    exact = ops.add(
        ops.cast(weight, "float32"),
        ops.add(ops.cast(delta, "float32"), ops.cast(compensation, "float32")),
    )
    rounded = ops.cast(exact, dtype)
    return rounded, ops.cast(ops.subtract(exact, ops.cast(rounded, "float32")), dtype)


def state_bytes(model: Any) -> int:
    """Bytes held by a compiled model's weights and its optimizer's variables.

    What the master-weights modes change: 12 bytes per parameter for float32 weights with
    Adam, 8 with bfloat16 weights and Kahan buffers, 6 without buffers.
    """
    import numpy as np

    def nbytes(v: Any) -> int:
        dtype = keras.backend.standardize_dtype(v.dtype)
        size = 2 if dtype in LOW_FLOATS else np.dtype(dtype).itemsize
        return int(np.prod(v.shape)) * size

    optimizer = getattr(model, "optimizer", None)
    return sum(nbytes(v) for v in [*model.weights, *(optimizer.variables if optimizer else [])])


def _as_int32(value: int) -> int:
    """An unsigned 32-bit constant as the int32 with the same bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_right(h: Any, bits: int) -> Any:
    """Logical right shift of int32 bit patterns (``right_shift`` on int32 is arithmetic)."""
    return ops.bitwise_and(ops.right_shift(h, bits), (1 << (32 - bits)) - 1)


def _mix(h: Any) -> Any:
    """MurmurHash3's 32-bit finaliser on int32 bit patterns (multiplication wraps)."""
    h = ops.bitwise_xor(h, _shift_right(h, 16))
    h = ops.multiply(h, _as_int32(0x85EBCA6B))
    h = ops.bitwise_xor(h, _shift_right(h, 13))
    h = ops.multiply(h, _as_int32(0xC2B2AE35))
    return ops.bitwise_xor(h, _shift_right(h, 16))


def rounding_key(seed: int, index: int) -> int:
    """The key of weight ``index``'s random bits in a run seeded ``seed`` (an int32 value).

    Args:
        seed: The run's rounding seed.
        index: The weight's position among the optimizer's variables.
    """
    return _as_int32(seed * 0x9E3779B1 + index * 0x7FEB352D)


def keyed_random_bits(shape: tuple[int, ...], key: Any, step: Any) -> Any:
    """:func:`random_bits` from a :func:`rounding_key` (an int, or an int32 tensor).

    Args:
        shape: The weight's shape.
        key: ``rounding_key(seed, index)``.
        step: The optimizer step (a scalar tensor or int).
    """
    key = _mix(ops.add(ops.multiply(ops.cast(step, "int32"), _as_int32(0x27D4EB2F)), key))
    size = 1
    for d in shape:
        size *= int(d)
    counter = ops.reshape(ops.arange(size, dtype="int32"), shape)
    h = _mix(ops.bitwise_xor(ops.multiply(counter, _as_int32(0x9E3779B1)), key))
    return _shift_right(h, 16)


def random_bits(shape: tuple[int, ...], seed: int, step: Any, index: int) -> Any:
    """16 random bits per element, a pure function of its arguments (int32 in ``[0, 2**16)``).

    Counter-based: the same ``(seed, step, index)`` gives the same bits on every rank,
    backend and run; a new step gives new bits.

    Args:
        shape: The weight's shape.
        seed: The run's rounding seed.
        step: The optimizer step (a scalar tensor or int).
        index: The weight's position among the optimizer's variables.
    """
    return keyed_random_bits(shape, rounding_key(seed, index), step)


def stochastic_round(exact: Any, bits: Any) -> Any:
    """Round float32 ``exact`` to bfloat16 up or down at random, without bias.

    bfloat16 is float32 without its 16 low bits. Adding 16 uniform random bits to
    them and truncating rounds away from zero with probability (dropped bits) /
    2**16, so the expected result is ``exact`` itself.

    Args:
        exact: Float32 values.
        bits: Int32 values in ``[0, 2**16)`` of the same shape (:func:`random_bits`).

    Returns:
        The bfloat16 values.
    """
    pattern = bitcast(ops.cast(exact, "float32"), "int32")
    truncated = ops.bitwise_and(ops.add(pattern, bits), _as_int32(0xFFFF0000))
    return ops.cast(bitcast(truncated, "float32"), "bfloat16")
