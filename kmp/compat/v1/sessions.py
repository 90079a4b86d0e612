"""TF1 ``ConfigProto`` and sessions for Horovod scripts (see :mod:`kmp.compat.v1`).

Mixed precision for graphs: TensorFlow 2.21 still ships Grappler's automatic
mixed precision rewrite, switched on per session in the ``ConfigProto``
(``session_config(mixed_precision="float16")`` on NVIDIA GPUs, ``"bfloat16"`` on
CPUs with oneDNN).
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from kmp import _checks
from kmp import gpu as _gpu
from kmp._launcher_env import launcher_local_rank
from kmp._names import MIXED_POLICIES

__all__ = ["MIXED_PRECISION_REWRITES", "build_session_config", "session", "session_config"]

_v1 = tf.compat.v1

# session_config(mixed_precision=...) -> the RewriterConfig field it switches on.
MIXED_PRECISION_REWRITES: dict[str, str] = {
    "float16": "auto_mixed_precision",  # NVIDIA GPUs (compute capability >= 7.0)
    "bfloat16": "auto_mixed_precision_onednn_bfloat16",  # CPUs, needs oneDNN
}


# ------------------------------------------------------------------ ConfigProto


def _check_threads(name: str, value: Any) -> int | None:
    if value is None:
        return None
    return _checks.check_int(name, value, minimum=0, hint="0 lets TensorFlow choose; None too.")


def _check_mixed_precision(value: Any) -> str | None:
    if value is None:
        return None
    name = value.strip().lower() if isinstance(value, str) else value
    name = MIXED_POLICIES.get(name, name)
    if name not in MIXED_PRECISION_REWRITES:
        raise ValueError(
            f"mixed_precision={value!r} is not understood; use None, 'float16' (NVIDIA GPUs) or "
            "'bfloat16' (CPUs with oneDNN)."
        )
    return name


def build_session_config(
    allow_growth: bool = True,
    memory_fraction: float | None = None,
    visible_devices: _gpu.Visible | None = "local_rank",
    allow_soft_placement: bool = True,
    log_device_placement: bool = False,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    *,
    mixed_precision: str | None = None,
    n_gpus: int,
    local_rank: int | None,
) -> Any:
    """Build the ``ConfigProto`` of :func:`session_config` for a described machine.

    The pure part of :func:`session_config`: the GPU count and local rank are
    given instead of detected, so every decision can be checked without a GPU.

    Args:
        allow_growth: As for :func:`session_config`.
        memory_fraction: As for :func:`session_config`.
        visible_devices: As for :func:`session_config`.
        allow_soft_placement: As for :func:`session_config`.
        log_device_placement: As for :func:`session_config`.
        intra_op_threads: As for :func:`session_config`.
        inter_op_threads: As for :func:`session_config`.
        mixed_precision: As for :func:`session_config`.
        n_gpus: How many GPUs the process sees.
        local_rank: The Horovod local rank, or None in a single process.

    Returns:
        A ``tf.compat.v1.ConfigProto``.
    """
    allow_growth = _checks.check_bool("allow_growth", allow_growth)
    allow_soft_placement = _checks.check_bool("allow_soft_placement", allow_soft_placement)
    log_device_placement = _checks.check_bool("log_device_placement", log_device_placement)
    if memory_fraction is not None:
        _checks.check_number(
            "memory_fraction",
            memory_fraction,
            above=0,
            at_most=1,
            hint="It is a fraction of each GPU's memory, e.g. 0.9; None lets allow_growth decide.",
        )
    intra = _check_threads("intra_op_threads", intra_op_threads)
    inter = _check_threads("inter_op_threads", inter_op_threads)
    mp = _check_mixed_precision(mixed_precision)
    if visible_devices is None:
        indices: tuple[int, ...] = ()
    else:
        indices, _ = _gpu.resolve_visible(
            visible_devices, n_gpus, local_rank, what="visible_devices"
        )

    config = _v1.ConfigProto()
    config.allow_soft_placement = allow_soft_placement
    config.log_device_placement = log_device_placement
    config.gpu_options.allow_growth = allow_growth
    if memory_fraction is not None:
        config.gpu_options.per_process_gpu_memory_fraction = float(memory_fraction)
    # All GPUs are TF1's default: only a real subset is written down.
    if indices and len(indices) < n_gpus:
        config.gpu_options.visible_device_list = ",".join(str(i) for i in indices)
    if intra is not None:
        config.intra_op_parallelism_threads = intra
    if inter is not None:
        config.inter_op_parallelism_threads = inter
    if mp is not None:
        setattr(
            config.graph_options.rewrite_options,
            MIXED_PRECISION_REWRITES[mp],
            rewriter_config_pb2.RewriterConfig.ON,
        )
    return config


def _onednn_enabled() -> bool | None:
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - private module moved
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def session_config(
    allow_growth: bool = True,
    memory_fraction: float | None = None,
    visible_devices: _gpu.Visible | None = "local_rank",
    allow_soft_placement: bool = True,
    log_device_placement: bool = False,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    *,
    mixed_precision: str | None = None,
) -> Any:
    """Return the ``tf.compat.v1.ConfigProto`` a Horovod TF1 script needs.

    Replaces the hand-written ``config.gpu_options.allow_growth = True``,
    ``per_process_gpu_memory_fraction`` and
    ``visible_device_list = str(hvd.local_rank())`` lines.

    Args:
        allow_growth: ``gpu_options.allow_growth``: take GPU memory as needed.
        memory_fraction: ``gpu_options.per_process_gpu_memory_fraction``, in
            (0, 1]; None leaves TensorFlow's default.
        visible_devices: ``"local_rank"`` (default): under a launcher, the GPU
            whose index is this process's local rank; in a single process, all.
            ``"all"``, an index or a list of indices select GPUs explicitly;
            None leaves ``visible_device_list`` empty. Written to
            ``gpu_options.visible_device_list`` only when it picks a subset.
        allow_soft_placement: Fall back to the CPU for ops with no GPU kernel.
        log_device_placement: Log where each op runs.
        intra_op_threads: ``intra_op_parallelism_threads`` (None: TF's default).
        inter_op_threads: ``inter_op_parallelism_threads`` (None: TF's default).
        mixed_precision: None, ``"float16"`` (Grappler's automatic mixed precision
            rewrite for NVIDIA GPUs, ``rewrite_options.auto_mixed_precision``; use
            it with ``distributed_optimizer(..., loss_scale="dynamic")``) or
            ``"bfloat16"`` (``auto_mixed_precision_onednn_bfloat16``, CPUs with
            oneDNN: set ``TF_ENABLE_ONEDNN_OPTS=1`` before importing TensorFlow).

    Returns:
        A ``tf.compat.v1.ConfigProto``.

    Raises:
        ValueError: ``memory_fraction`` outside (0, 1], a GPU index beyond the GPUs
            present, a local rank with no GPU of its own, negative thread counts,
            or an unknown ``mixed_precision``.
        RuntimeError: ``mixed_precision="bfloat16"`` while TensorFlow runs without
            oneDNN (the rewrite would silently do nothing).

    Warns:
        UserWarning: ``mixed_precision="float16"`` with no GPU: the rewrite only
            converts GPU ops, so the graph stays float32.
        RuntimeWarning: More ranks on this host than GPUs: this rank shares GPU
            ``local_rank % n_gpus`` (kmp.gpu's rule; memory growth is then on).
    """
    physical = tf.config.list_physical_devices("GPU")
    needs_rank = (
        isinstance(visible_devices, str) and visible_devices.strip().lower() == "local_rank"
    )
    local_rank = launcher_local_rank() if needs_rank and physical else None
    shared = False
    if local_rank is not None:  # kmp.gpu's rule for more ranks than GPUs, and its warning
        plan = _gpu.plan_gpus(physical, visible="local_rank", local_rank=local_rank)
        shared = plan.shared
        if shared:
            message = _gpu.shared_gpu_message(local_rank, len(physical), plan.visible[0])
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    config = build_session_config(
        allow_growth or (shared and memory_fraction is None),
        memory_fraction,
        visible_devices,
        allow_soft_placement,
        log_device_placement,
        intra_op_threads,
        inter_op_threads,
        mixed_precision=mixed_precision,
        n_gpus=len(physical),
        local_rank=local_rank,
    )
    mp = _check_mixed_precision(mixed_precision)
    if mp == "bfloat16" and _onednn_enabled() is False:
        raise RuntimeError(
            "mixed_precision='bfloat16' uses Grappler's oneDNN bfloat16 rewrite, but this "
            "TensorFlow runs without oneDNN, so the graph would silently stay float32. Set "
            "TF_ENABLE_ONEDNN_OPTS=1 in the environment before TensorFlow is imported, or use "
            "mixed_precision=None."
        )
    if mp == "float16" and not physical:
        warnings.warn(
            "mixed_precision='float16' turns on Grappler's float16 rewrite, which only converts "
            "ops placed on NVIDIA GPUs (compute capability >= 7.0); this process sees no GPU, so "
            "the graph stays float32 here (loss scaling still runs).",
            UserWarning,
            stacklevel=2,
        )
    return config


def session(
    config: Any | None = None,
    *,
    graph: Any | None = None,
    target: str = "",
    **config_kwargs: Any,
) -> Any:
    """Return a ``tf.compat.v1.Session`` built from kmp's config.

    Args:
        config: A ``ConfigProto``; None builds one with :func:`session_config`.
        graph: The graph to run (default: the default graph).
        target: The execution engine to connect to (``""``: in-process).
        **config_kwargs: Arguments for :func:`session_config` when ``config`` is None.

    Returns:
        A ``tf.compat.v1.Session`` (use it in a ``with`` block).

    Raises:
        TypeError: Both ``config`` and ``session_config`` arguments were given,
            or ``config`` is not a ``ConfigProto``.
    """
    if config is None:
        config = session_config(**config_kwargs)
    elif config_kwargs:
        raise TypeError(
            f"Pass either config= or session_config arguments ({', '.join(config_kwargs)}), "
            "not both: build the config with kmp.compat.v1.session_config(...) and pass it."
        )
    elif not isinstance(config, _v1.ConfigProto):
        raise TypeError(
            f"config must be a tf.compat.v1.ConfigProto (see kmp.compat.v1.session_config), "
            f"not {type(config).__name__}."
        )
    return _v1.Session(target=target, graph=graph, config=config)
