"""Choosing and setting the global Keras dtype policy.

``kmp.enable()`` is the entry point: it picks a policy (``"auto"`` follows the
hardware), sets it as Keras's global dtype policy and returns a frozen
:class:`PolicyChoice` that says what was chosen and why. The "auto" rule is the
pure function :func:`choose_policy`, so it can be checked for any described
machine. Only Keras APIs are used, so this works on every Keras 3 backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator

import keras

from kmp import hardware as _hw
from kmp._legacy_keras import is_legacy_keras, set_legacy_global_policy
from kmp._names import VALID_POLICIES, normalize_policy
from kmp.loss_scale import from_setting

__all__ = ["PolicyChoice", "choose_policy", "current_policy", "disable", "enable", "policy_scope"]

POLICY_ENV_VAR = "KMP_POLICY"

# Measured on this project's 2-core AVX-512 CPU (TF 2.21, Keras 3.15, small CNN):
_CPU_FLOAT16_SLOWDOWN = "about 8x"


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    """The dtype policy kmp set, and why.

    Attributes:
        name: Keras policy name, e.g. ``"mixed_bfloat16"``.
        compute_dtype: Dtype layers compute in.
        variable_dtype: Dtype of layer variables (the master weights).
        loss_scaling: True when the loss must be scaled (float16 compute).
        reason: Why this policy, in words.
    """

    name: str
    compute_dtype: str
    variable_dtype: str
    loss_scaling: bool
    reason: str

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return dataclasses.asdict(self)


def _choice(policy: keras.DTypePolicy, reason: str) -> PolicyChoice:
    return PolicyChoice(
        name=policy.name,
        compute_dtype=policy.compute_dtype,
        variable_dtype=policy.variable_dtype,
        loss_scaling=from_setting("dynamic", compute_dtype=policy.compute_dtype).scaling,
        reason=reason,
    )


def choose_policy(hw: _hw.Hardware, backend: str = "tensorflow") -> tuple[str, str]:
    """Return the policy name that "auto" picks for ``hw`` and Keras ``backend``, and why.

    The rule: bfloat16 where it is fast (NVIDIA compute capability >= 8.0, TPUs,
    CPUs with AVX512_BF16 or AMX under TensorFlow, whose oneDNN kernels use them);
    float16 on GPUs with tensor cores but no fast bfloat16 (compute capability 7.x);
    float32 elsewhere, a CPU on the JAX backend included (XLA:CPU trains slower under
    mixed_bfloat16 than under float32 on an AVX512_BF16 CPU, where TensorFlow gains;
    measured in docs/benchmarks.md). Never float16 on a CPU.

    Args:
        hw: The machine, e.g. ``kmp.hardware.detect()``.
        backend: The Keras backend the model will run on.

    Returns:
        ``(policy_name, reason)``.
    """
    if hw.tpu:
        return "mixed_bfloat16", "TPU: bfloat16 is the native matrix-unit dtype"
    if hw.gpus:
        gpu = min(hw.gpus, key=lambda g: g.compute_capability)  # the slowest decides
        cc = "{}.{}".format(*gpu.compute_capability)
        if gpu.fast_bfloat16:
            return (
                "mixed_bfloat16",
                f"{gpu.name} (compute capability {cc}) runs bfloat16 at float16 speed "
                "with float32's range: no loss scaling needed",
            )
        if gpu.has_tensor_cores:
            return (
                "mixed_float16",
                f"{gpu.name} (compute capability {cc}) has float16 tensor cores but no fast "
                "bfloat16: float16 with dynamic loss scaling",
            )
        return "float32", f"{gpu.name} (compute capability {cc}) has no tensor cores"
    if hw.cpu.fast_bfloat16 and backend == "jax":
        return (
            "float32",
            "CPU on the JAX backend: XLA:CPU runs bfloat16 matrix products slower than "
            "float32 (docs/benchmarks.md); TensorFlow's oneDNN kernels gain from them",
        )
    if hw.cpu.fast_bfloat16:
        flags = ", ".join(
            f for f, on in (("avx512_bf16", hw.cpu.avx512_bf16), ("AMX", hw.cpu.amx)) if on
        )
        return "mixed_bfloat16", f"CPU with {flags}: bfloat16 matrix instructions, no GPU"
    return "float32", "no GPU, TPU or CPU bfloat16 instructions: mixed precision would be slower"


def resolve_policy(policy: str | keras.DTypePolicy, hw: _hw.Hardware | None) -> PolicyChoice:
    """What ``policy`` (a name ``enable`` takes, or a ``keras.DTypePolicy``) means here.

    ``"auto"`` is :func:`choose_policy`'s choice for ``hw`` (detected when None).

    Raises:
        TypeError: ``policy`` is neither a string nor a ``keras.DTypePolicy``.
        ValueError: An unknown name (the message lists the valid ones).
    """
    if isinstance(policy, keras.DTypePolicy):
        return _choice(policy, "given as a Keras DTypePolicy")
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a name ({', '.join(VALID_POLICIES)}) or a keras.DTypePolicy, "
            f"not {type(policy).__name__}"
        )
    name = normalize_policy(policy)
    if name == "auto":
        hw = hw if hw is not None else _hw.detect()
        name, reason = choose_policy(hw, keras.backend.backend())
        return _choice(keras.DTypePolicy(name), f"auto: {reason}")
    return _choice(keras.DTypePolicy(name), "requested")


def _set_global(policy: str | keras.DTypePolicy) -> None:
    """Set Keras 3's global policy and, under ``TF_USE_LEGACY_KERAS=1``, tf-keras's too."""
    keras.config.set_dtype_policy(policy)
    if is_legacy_keras():
        set_legacy_global_policy(policy if isinstance(policy, str) else policy.name)


def enable(
    policy: str | keras.DTypePolicy = "auto", *, hardware: _hw.Hardware | None = None
) -> PolicyChoice:
    """Set Keras's global dtype policy; call it before building the model.

    The environment variable ``KMP_POLICY`` overrides ``policy`` so that a
    launcher can set one policy for every rank. With ``TF_USE_LEGACY_KERAS=1``
    and tf-keras installed, tf-keras's global policy is set as well (see
    :mod:`kmp.compat.keras2`). ``keras.backend.clear_session()`` resets the policy
    to float32: call ``enable`` after it.

    Layers take the global policy when they are created, so layers made before
    this call keep the policy they had: call it before building the model.
    ``kmp.audit(model)`` reports any layer whose policy differs from the global
    one (``policy-mismatch``); ``enable`` itself does not search for them, so
    its cost does not grow with the program's heap.

    Args:
        policy: ``"auto"`` (follow the hardware), ``"mixed_float16"``,
            ``"mixed_bfloat16"``, ``"float32"``, ``"bfloat16"`` (bfloat16 weights and
            optimizer states too: half their memory; :func:`kmp.wrap_optimizer`'s
            ``master_weights`` keeps their small updates), or a ``keras.DTypePolicy``.
        hardware: The machine to decide for; detected when None.

    Returns:
        The :class:`PolicyChoice` that was set.

    Raises:
        ValueError: ``policy`` (or ``KMP_POLICY``) is not a known policy name.

    Warns:
        UserWarning: A float16 policy on a machine with no GPU (it is several
            times slower there).
    """
    env = os.environ.get(POLICY_ENV_VAR)
    if env:
        choice = resolve_policy(env, hardware)
        choice = dataclasses.replace(
            choice, reason=f"{choice.reason} (from {POLICY_ENV_VAR}={env})"
        )
    else:
        choice = resolve_policy(policy, hardware)
    hw = hardware if hardware is not None else _hw.detect()
    if choice.compute_dtype == "float16" and not hw.gpus:
        warnings.warn(
            f"Policy {choice.name!r} computes in float16, but this machine has no GPU: "
            f"float16 on a CPU is {_CPU_FLOAT16_SLOWDOWN} slower than float32 (measured). "
            + (
                "Use 'mixed_bfloat16' (this CPU has bfloat16 instructions) or 'auto'."
                if hw.cpu.fast_bfloat16
                else "Use 'float32' or 'auto'."
            ),
            UserWarning,
            stacklevel=2,
        )
    _set_global(choice.name)
    return choice


def disable() -> PolicyChoice:
    """Go back to full float32 (Keras's default policy)."""
    _set_global("float32")
    return _choice(keras.DTypePolicy("float32"), "disabled: float32 everywhere")


def current_policy() -> PolicyChoice:
    """Return the global Keras dtype policy as a :class:`PolicyChoice`."""
    return _choice(keras.config.dtype_policy(), "the current global Keras dtype policy")


@contextlib.contextmanager
def policy_scope(
    policy: str | keras.DTypePolicy = "auto", *, hardware: _hw.Hardware | None = None
) -> Iterator[PolicyChoice]:
    """Set a policy for the duration of a ``with`` block, then restore the previous one.

    The previous policy is restored on exit, also when the block raises.

    Args:
        policy: As for :func:`enable`.
        hardware: As for :func:`enable`.

    Yields:
        The :class:`PolicyChoice` in force inside the block.
    """
    previous = keras.config.dtype_policy()
    try:
        yield enable(policy, hardware=hardware)
    finally:
        _set_global(previous)
