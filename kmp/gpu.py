"""TF2 GPU configuration: which GPUs this process uses, and how it takes memory.

:func:`configure_gpus` is the TF2 (``tf.config``) equivalent of the TF1
``ConfigProto`` lines every Horovod script used to carry
(``gpu_options.allow_growth``, ``per_process_gpu_memory_fraction``,
``visible_device_list = str(hvd.local_rank())``; see :mod:`kmp.compat.v1` for
those). Call it once, first thing, before TensorFlow runs any op or builds a
model::

    import kmp
    kmp.configure_gpus()          # one GPU per Horovod local rank, memory growth on
    model = build_model()

On a machine without GPUs it does nothing and says so in the returned
:class:`GPUConfig`. The decisions are made by :func:`plan_gpus`, a pure
function of the physical device list, so they can be checked without a GPU.

One rule covers a host that runs more ranks than it has GPUs (``-np 2`` on a
one-GPU machine): the ranks without a GPU of their own share GPU
``local_rank % n_gpus`` with memory growth on, the plan says so
(:attr:`GPUConfig.shared`), and :func:`configure_gpus` warns.
:func:`kmp.distributed.init` calls :func:`configure_gpus` with Horovod's local
rank, so it follows the same rule, and :func:`resolve_visible` picks the same
GPU for :func:`kmp.compat.v1.session_config`.

The launcher's environment is read by :mod:`kmp._launcher_env`; this module
does not import :mod:`kmp.distributed`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from kmp._checks import NOT_GIVEN, check_bool, check_int, check_number, given, is_int
from kmp._launcher_env import launcher_local_rank

__all__ = ["GPUConfig", "GPUConfigurationError", "configure_gpus"]

Visible = str | int | Sequence[int]


class GPUConfigurationError(RuntimeError):
    """TensorFlow had already initialised its GPUs, so they can no longer be configured."""


@dataclasses.dataclass(frozen=True)
class GPUConfig:
    """What :func:`configure_gpus` did (or, from :func:`plan_gpus`, would do).

    Attributes:
        physical: Names of the GPUs TensorFlow found, e.g. ``("/physical_device:GPU:0",)``.
        visible: Indices (into ``physical``) of the GPUs this process uses.
        memory_growth: True when memory growth was turned on for the visible GPUs.
        memory_limit_mb: The per-GPU memory cap in MiB, or None.
        local_rank: The local rank that chose the GPU, or None when it did not matter.
        reason: Why these GPUs, in words.
        shared: True when the local rank has no GPU of its own (more ranks on the
            host than GPUs) and shares GPU ``local_rank % n_gpus`` with another rank.
    """

    physical: tuple[str, ...]
    visible: tuple[int, ...]
    memory_growth: bool
    memory_limit_mb: int | None
    local_rank: int | None
    reason: str
    shared: bool = False

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["physical"] = list(self.physical)
        d["visible"] = list(self.visible)
        return d


# ------------------------------------------------------------------ local rank


def _current_local_rank() -> int | None:
    """The local rank the launcher announced (see :func:`launcher_local_rank`), or None."""
    return launcher_local_rank()


def _check_local_rank(local_rank: Any) -> int | None:
    if local_rank is None:
        return None
    return check_int(
        "local_rank",
        local_rank,
        minimum=0,
        hint="Pass this process's rank on its host (hvd.local_rank()), or None for a single "
        "process.",
    )


def shared_gpu_message(
    local_rank: int | None, n_gpus: int, index: int, memory_limit_mb: int | None = None
) -> str:
    """The warning for a local rank that shares GPU ``index`` (more ranks than GPUs)."""
    memory = (
        "with memory growth on"
        if memory_limit_mb is None
        else f"capped at {memory_limit_mb} MiB per process"
    )
    return (
        f"Local rank {local_rank} has no GPU of its own (this host shows {n_gpus}): it shares "
        f"GPU {index} with another rank, {memory}, which is slower and can run "
        f"out of memory. Start at most {n_gpus} process(es) per host (e.g. horovodrun -H "
        f"host:{n_gpus}), or pass visible= an explicit GPU index (kmp.configure_gpus("
        "visible=...), right after kmp.distributed.init() and before any TensorFlow op) to "
        "choose yourself."
    )


# ------------------------------------------------------------------ planning


def _resolve(
    visible: Visible, n_gpus: int, local_rank: int | None, what: str
) -> tuple[tuple[int, ...], str, bool]:
    """:func:`resolve_visible`, plus whether the local rank shares a GPU."""
    n_gpus = check_int("n_gpus", n_gpus, minimum=0)
    local_rank = _check_local_rank(local_rank)
    if isinstance(visible, str):
        name = visible.strip().lower()
        if name == "all":
            return tuple(range(n_gpus)), "all GPUs requested", False
        if name != "local_rank":
            raise ValueError(
                f"{what}={visible!r} is not understood; use 'local_rank' (one GPU per Horovod "
                "local rank), 'all', a GPU index or a list of GPU indices."
            )
        if n_gpus == 0:
            return (), "no GPU found: nothing to configure", False
        if local_rank is None:
            return tuple(range(n_gpus)), "single process (no launcher local rank): all GPUs", False
        if local_rank >= n_gpus:
            index = local_rank % n_gpus
            return (
                (index,),
                f"Horovod local rank {local_rank} has no GPU of its own (this host shows "
                f"{n_gpus}): shares GPU {index} with another rank",
                True,
            )
        return (local_rank,), f"Horovod local rank {local_rank}", False
    if is_int(visible):
        indices = [int(visible)]  # type: ignore[arg-type]
    elif isinstance(visible, Sequence) and all(is_int(i) for i in visible):
        indices = [int(i) for i in visible]
    else:
        raise TypeError(
            f"{what} must be 'local_rank', 'all', an int or a list of ints, not {visible!r}."
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"{what}={visible!r} names a GPU more than once; list each index once.")
    bad = [i for i in indices if i < 0 or i >= n_gpus]
    if bad:
        seen = f"indices 0..{n_gpus - 1}" if n_gpus else "none"
        raise ValueError(
            f"{what}={visible!r} asks for GPU {bad[0]}, but this process sees {n_gpus} GPU(s) "
            f"({seen}). Check CUDA_VISIBLE_DEVICES and `nvidia-smi`, or pass {what}='all'."
        )
    return tuple(indices), f"GPU(s) {', '.join(map(str, indices))} requested", False


def resolve_visible(
    visible: Visible, n_gpus: int, local_rank: int | None, *, what: str = "visible"
) -> tuple[tuple[int, ...], str]:
    """Turn a ``visible`` argument into GPU indices, checking them against ``n_gpus``.

    Shared by :func:`configure_gpus` and :func:`kmp.compat.v1.session_config`.
    A pure decision: it never warns. With ``"local_rank"`` and a local rank that
    has no GPU of its own (more ranks on the host than GPUs), the rank shares GPU
    ``local_rank % n_gpus`` and ``reason`` says so; :func:`plan_gpus` reports the
    same as :attr:`GPUConfig.shared`.

    Args:
        visible: ``"local_rank"`` (the GPU of this process's Horovod local rank
            under a launcher, else all GPUs), ``"all"``, one index or a list of indices.
        n_gpus: How many GPUs this process can see.
        local_rank: The local rank, or None when not launched as several processes.
        what: The argument's name, for error messages.

    Returns:
        ``(indices, reason)``; ``indices`` is empty when there is no GPU.

    Raises:
        ValueError: An unknown name, a negative or repeated index, an index with
            no GPU behind it, or a negative ``n_gpus`` or ``local_rank``.
        TypeError: ``visible`` is neither a name, an int nor a list of ints, or
            ``n_gpus`` / ``local_rank`` is not an integer.
    """
    indices, reason, _ = _resolve(visible, n_gpus, local_rank, what)
    return indices, reason


def _check_memory(memory_growth: Any, memory_limit_mb: Any) -> tuple[bool, int | None]:
    if memory_growth is not None:
        check_bool(
            "memory_growth",
            memory_growth,
            hint="Pass None for the default (on unless memory_limit_mb is set).",
        )
    if memory_limit_mb is None:
        return memory_growth is not False, None
    limit = check_number(
        "memory_limit_mb",
        memory_limit_mb,
        at_least=1,
        hint="Pass a number of MiB such as 8192, or None for no limit.",
    )
    if memory_growth:
        raise ValueError(
            "memory_growth=True and memory_limit_mb cannot both be set: TensorFlow cannot grow "
            "memory on a GPU that has a fixed memory limit. Pass memory_limit_mb alone (it "
            "turns growth off) or memory_growth=True alone."
        )
    return False, int(limit)


def plan_gpus(
    physical_gpus: Sequence[Any],
    *,
    memory_growth: bool | None = None,
    memory_limit_mb: int | None = None,
    visible: Visible = "local_rank",
    local_rank: int | None = None,
) -> GPUConfig:
    """Decide, without touching TensorFlow, how :func:`configure_gpus` sets up ``physical_gpus``.

    A local rank without a GPU of its own gets a plan with ``shared=True``: GPU
    ``local_rank % n_gpus``, with memory growth on (even if ``memory_growth=False``
    was asked for, as two processes cannot each take a whole GPU) unless
    ``memory_limit_mb`` caps it.

    Args:
        physical_gpus: ``tf.config.list_physical_devices("GPU")`` (anything with a ``name``).
        memory_growth: As for :func:`configure_gpus`.
        memory_limit_mb: As for :func:`configure_gpus`.
        visible: As for :func:`configure_gpus`.
        local_rank: This process's local rank, or None in a single process.

    Returns:
        The :class:`GPUConfig` to apply.

    Raises:
        ValueError: Bad arguments (see :func:`configure_gpus`).
        TypeError: Arguments of the wrong type.
    """
    growth, limit = _check_memory(memory_growth, memory_limit_mb)
    names = tuple(getattr(d, "name", str(d)) for d in physical_gpus)
    indices, reason, shared = _resolve(visible, len(names), local_rank, "visible")
    if not indices:
        growth, limit = False, None
    elif shared and limit is None:
        growth = True
    return GPUConfig(
        physical=names,
        visible=indices,
        memory_growth=growth,
        memory_limit_mb=limit,
        local_rank=_check_local_rank(local_rank),
        reason=reason,
        shared=shared,
    )


def _apply(plan: GPUConfig, physical_gpus: Sequence[Any], tf_config: Any) -> None:
    """Make the calls on ``tf_config`` (``tf.config`` or a stand-in) that realise ``plan``."""
    if not plan.visible:
        return
    chosen = [physical_gpus[i] for i in plan.visible]
    try:
        tf_config.set_visible_devices(chosen, "GPU")  # a no-op when unchanged
        for dev in chosen:
            if plan.memory_limit_mb is not None:
                tf_config.set_logical_device_configuration(
                    dev, [tf_config.LogicalDeviceConfiguration(memory_limit=plan.memory_limit_mb)]
                )
            elif plan.memory_growth:
                tf_config.experimental.set_memory_growth(dev, True)
    except RuntimeError as exc:
        raise GPUConfigurationError(
            f"TensorFlow has already initialised its GPUs, so they can no longer be configured "
            f"({exc}). Call kmp.configure_gpus() (or kmp.distributed.init(), which calls it) "
            "at the very top of the script, before any TensorFlow op runs or any model, tensor "
            "or dataset is built."
        ) from exc
    except ValueError as exc:  # e.g. growth asked for on a GPU an earlier call capped
        raise ValueError(
            f"TensorFlow refused the GPU settings ({exc}). A GPU keeps the memory limit of an "
            "earlier configure_gpus(memory_limit_mb=...) call in this process: use the same "
            "memory settings in every call."
        ) from exc


# ------------------------------------------------------------------ public


def configure_gpus(
    memory_growth: bool | None = None,
    memory_limit_mb: int | None = None,
    visible: Visible = "local_rank",
    *,
    local_rank: int | None = NOT_GIVEN,
) -> GPUConfig:
    """Choose this process's GPUs and how they allocate memory, through ``tf.config``.

    The TF2 equivalent of the TF1 ``ConfigProto`` settings; call it before any
    TensorFlow op runs. Calling it again with the same settings is harmless.

    Args:
        memory_growth: Let TensorFlow grow GPU memory as needed instead of taking
            it all at start-up (TF1: ``gpu_options.allow_growth``). None means
            True unless ``memory_limit_mb`` is given.
        memory_limit_mb: Cap each visible GPU at this many MiB (TF1:
            ``per_process_gpu_memory_fraction``, but absolute). Exclusive with
            memory growth.
        visible: ``"local_rank"`` (default): under ``horovodrun``/``mpirun``,
            only the GPU whose index is this process's local rank (TF1:
            ``visible_device_list = str(hvd.local_rank())``); in a single process,
            all GPUs. ``"all"``, one index, or a list of indices select GPUs
            explicitly.
        local_rank: This process's rank on its host, for ``visible="local_rank"``.
            Not passed: the local rank the launcher announced in the environment
            (``HOROVOD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ...), if any.
            None: a single process (all GPUs).

    Returns:
        A :class:`GPUConfig` saying what was done; with no GPU, ``visible`` is
        empty and nothing was changed.

    Raises:
        ValueError: A GPU index beyond the GPUs present, a memory limit below
            1 MiB, ``memory_growth=True`` together with ``memory_limit_mb``, a
            negative ``local_rank``, or a launcher local-rank variable that is
            not a non-negative integer.
        TypeError: ``visible``, ``memory_growth``, ``memory_limit_mb`` or
            ``local_rank`` of the wrong type.
        GPUConfigurationError: TensorFlow already initialised its GPUs (a
            ``RuntimeError``); call this before any op runs.

    Warns:
        RuntimeWarning: The local rank has no GPU of its own (more ranks on this
            host than GPUs), so it shares GPU ``local_rank % n_gpus`` with memory
            growth on (or under ``memory_limit_mb``); the message says how to avoid it.
    """
    import tensorflow as tf

    physical = tf.config.list_physical_devices("GPU")
    if given(local_rank):
        rank = _check_local_rank(local_rank)
    else:
        needs_rank = isinstance(visible, str) and visible.strip().lower() == "local_rank"
        rank = _current_local_rank() if needs_rank and physical else None
    plan = plan_gpus(
        physical,
        memory_growth=memory_growth,
        memory_limit_mb=memory_limit_mb,
        visible=visible,
        local_rank=rank,
    )
    _apply(plan, physical, tf.config)
    if plan.shared:
        warnings.warn(
            shared_gpu_message(
                plan.local_rank, len(plan.physical), plan.visible[0], plan.memory_limit_mb
            ),
            RuntimeWarning,
            stacklevel=2,
        )
    return plan
