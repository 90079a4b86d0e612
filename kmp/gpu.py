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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "LOCAL_RANK_VARS",
    "GPUConfig",
    "GPUConfigurationError",
    "configure_gpus",
    "launcher_local_rank",
    "plan_gpus",
    "resolve_visible",
]

# Environment variables through which launchers announce the local rank, in the
# order they are checked: horovodrun, Open MPI, MPICH / Intel MPI, SLURM srun.
LOCAL_RANK_VARS: tuple[str, ...] = (
    "HOROVOD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
)

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
    """

    physical: tuple[str, ...]
    visible: tuple[int, ...]
    memory_growth: bool
    memory_limit_mb: int | None
    local_rank: int | None
    reason: str

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["physical"] = list(self.physical)
        d["visible"] = list(self.visible)
        return d


# ------------------------------------------------------------------ local rank


def launcher_local_rank(environ: dict[str, str] | None = None) -> int | None:
    """Return the local rank a launcher announced in the environment, or None.

    This works before ``hvd.init()``: ``horovodrun`` sets ``HOROVOD_LOCAL_RANK``,
    ``mpirun`` (Open MPI) ``OMPI_COMM_WORLD_LOCAL_RANK``, MPICH
    ``MPI_LOCALRANKID`` and ``srun`` ``SLURM_LOCALID``.

    Args:
        environ: Environment to read (default ``os.environ``).

    Returns:
        The local rank, or None when no launcher variable is set.

    Raises:
        ValueError: A launcher variable is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    for var in LOCAL_RANK_VARS:
        value = env.get(var)
        if value is None or value == "":
            continue
        try:
            rank = int(value)
        except ValueError:
            rank = -1
        if rank < 0:
            raise ValueError(
                f"The launcher variable {var}={value!r} is not a local rank (a non-negative "
                "integer); unset it, or pass visible= an explicit GPU index."
            )
        return rank
    return None


def _current_local_rank() -> int | None:
    """The launcher's local rank, else kmp.distributed's if it already runs Horovod, else None."""
    rank = launcher_local_rank()
    if rank is not None:
        return rank
    try:
        from kmp import distributed
    except ImportError:  # pragma: no cover - kmp.distributed ships with kmp
        return None
    # Only ask when Horovod already runs: asking would otherwise start it.
    if distributed.is_initialized() and distributed.size() > 1:
        return int(distributed.local_rank())
    return None


# ------------------------------------------------------------------ planning


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_visible(
    visible: Visible, n_gpus: int, local_rank: int | None, *, what: str = "visible"
) -> tuple[tuple[int, ...], str]:
    """Turn a ``visible`` argument into GPU indices, checking them against ``n_gpus``.

    Shared by :func:`configure_gpus` and :func:`kmp.compat.v1.session_config`.

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
            no GPU behind it, or a local rank with no GPU of its own.
        TypeError: ``visible`` is neither a name, an int nor a list of ints.
    """
    if isinstance(visible, str):
        name = visible.strip().lower()
        if name == "all":
            return tuple(range(n_gpus)), "all GPUs requested"
        if name != "local_rank":
            raise ValueError(
                f"{what}={visible!r} is not understood; use 'local_rank' (one GPU per Horovod "
                "local rank), 'all', a GPU index or a list of GPU indices."
            )
        if n_gpus == 0:
            return (), "no GPU found: nothing to configure"
        if local_rank is None:
            return tuple(range(n_gpus)), "single process (no launcher local rank): all GPUs"
        if local_rank >= n_gpus:
            raise ValueError(
                f"This process has local rank {local_rank}, but this host shows only {n_gpus} "
                f"GPU(s) (indices 0..{n_gpus - 1}): start at most {n_gpus} process(es) per host "
                f"(e.g. horovodrun -H host:{n_gpus}), or pass {what}= an explicit index to share "
                "a GPU on purpose."
            )
        return (local_rank,), f"Horovod local rank {local_rank}"
    if _is_index(visible):
        indices: list[int] = [visible]  # type: ignore[list-item]
    elif isinstance(visible, Sequence) and all(_is_index(i) for i in visible):
        indices = list(visible)
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
    return tuple(indices), f"GPU(s) {', '.join(map(str, indices))} requested"


def _check_memory(memory_growth: bool | None, memory_limit_mb: Any) -> tuple[bool, int | None]:
    if memory_limit_mb is not None:
        if (
            not isinstance(memory_limit_mb, int | float)
            or isinstance(memory_limit_mb, bool)
            or not memory_limit_mb > 0
        ):
            raise ValueError(
                f"memory_limit_mb must be a positive number of MiB (e.g. 8192), not "
                f"{memory_limit_mb!r}; pass None for no limit."
            )
        if memory_growth:
            raise ValueError(
                "memory_growth=True and memory_limit_mb cannot both be set: TensorFlow cannot grow "
                "memory on a GPU that has a fixed memory limit. Pass memory_limit_mb alone (it "
                "turns growth off) or memory_growth=True alone."
            )
        return False, int(memory_limit_mb)
    if memory_growth is None:
        return True, None
    if not isinstance(memory_growth, bool):
        raise TypeError(f"memory_growth must be True, False or None, not {memory_growth!r}.")
    return memory_growth, None


def plan_gpus(
    physical_gpus: Sequence[Any],
    *,
    memory_growth: bool | None = None,
    memory_limit_mb: int | None = None,
    visible: Visible = "local_rank",
    local_rank: int | None = None,
) -> GPUConfig:
    """Decide, without touching TensorFlow, how :func:`configure_gpus` sets up ``physical_gpus``.

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
    indices, reason = resolve_visible(visible, len(names), local_rank)
    if not indices:
        growth, limit = False, None
    return GPUConfig(
        physical=names,
        visible=indices,
        memory_growth=growth,
        memory_limit_mb=limit,
        local_rank=local_rank,
        reason=reason,
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

    Returns:
        A :class:`GPUConfig` saying what was done; with no GPU, ``visible`` is
        empty and nothing was changed.

    Raises:
        ValueError: A GPU index beyond the GPUs present, a local rank with no GPU
            of its own, a non-positive ``memory_limit_mb``, or
            ``memory_growth=True`` together with ``memory_limit_mb``.
        TypeError: ``visible`` or ``memory_growth`` of the wrong type.
        GPUConfigurationError: TensorFlow already initialised its GPUs (a
            ``RuntimeError``); call this before any op runs.
    """
    import tensorflow as tf

    physical = tf.config.list_physical_devices("GPU")
    needs_rank = isinstance(visible, str) and visible.strip().lower() == "local_rank"
    local_rank = _current_local_rank() if needs_rank and physical else None
    plan = plan_gpus(
        physical,
        memory_growth=memory_growth,
        memory_limit_mb=memory_limit_mb,
        visible=visible,
        local_rank=local_rank,
    )
    _apply(plan, physical, tf.config)
    return plan
