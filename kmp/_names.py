"""kmp's vocabularies: every accepted name, and its canonical form, in one place.

Engine names, policy names, loss-scale settings, master-weight modes, gradient compressions,
sparse-gradient strategies and reduction ops are
read here by every path (Keras 3, the JAX engine, TF1 graphs, tf-keras), so a
name accepted by one is accepted by all, and every error lists the same
choices. This module imports nothing from kmp and nothing heavy.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPRESSIONS",
    "ENGINE_CHOICES",
    "ENGINE_NAMES",
    "LOSS_SCALE_KINDS",
    "LOSS_SCALE_MODES",
    "LOW_FLOATS",
    "MASTER_WEIGHTS",
    "MIXED_POLICIES",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_MARKER_ENV",
    "POLICY_NAMES",
    "PURE_POLICIES",
    "REDUCE_OPS",
    "SPARSE_GRADIENTS",
    "VALID_POLICIES",
    "compute_dtype_of",
    "normalize_compression",
    "normalize_policy",
    "normalize_reduce_op",
]

# ------------------------------------------------------------------------ engines

# The engines that run kmp's collectives: Horovod (TensorFlow backend) and JAX's own
# multi-process runtime (JAX backend). What `kmp launch --engine` and KMP_ENGINE take.
ENGINE_NAMES: tuple[str, ...] = ("horovod", "jax")
# What kmp.distributed.init(engine=) takes: "auto" follows the launcher, then the Keras backend.
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINE_NAMES)

# ----------------------------------------------------------------------- policies

# What kmp.enable() takes: "auto", the Keras mixed and full-precision policies, and
# "bfloat16" (bfloat16 weights too: half the memory of weights and optimizer states, with
# the updates compensated by kmp.wrap_optimizer's ``master_weights``).
VALID_POLICIES: tuple[str, ...] = ("auto", "mixed_float16", "mixed_bfloat16", "float32", "bfloat16")
# The policies whose variables are 16-bit (no float32 master weights). "float16" is accepted by
# name for users who know what they ask for; "bfloat16" is the supported one.
PURE_POLICIES: tuple[str, ...] = ("float16", "bfloat16")
# Every concrete policy name (what "auto" resolves to, and what tf-keras accepts).
POLICY_NAMES: tuple[str, ...] = ("float32", "mixed_float16", "mixed_bfloat16", *PURE_POLICIES)
# The 16-bit float dtypes: what "low precision" means everywhere in kmp (a layer computing
# in one, a variable stored in one).
LOW_FLOATS: tuple[str, ...] = ("float16", "bfloat16")
# Mixed policy -> the 16-bit dtype it computes in.
MIXED_POLICIES: dict[str, str] = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def normalize_policy(name: Any, *, allow_auto: bool = True) -> str:
    """Return the canonical policy name for ``name`` (stripped, lower case).

    Args:
        name: A policy name such as ``"mixed_bfloat16"``.
        allow_auto: Accept ``"auto"`` (False where it must be resolved first).

    Returns:
        The canonical name.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a known policy name.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"A dtype policy name must be a string such as 'mixed_bfloat16', not "
            f"{type(name).__name__} {name!r}."
        )
    key = name.strip().lower()
    known = (("auto",) if allow_auto else ()) + POLICY_NAMES
    if key not in known:
        hint = "" if allow_auto else " (resolve 'auto' with kmp.enable() first)"
        raise ValueError(f"Unknown dtype policy {name!r}. Valid names: {', '.join(known)}{hint}.")
    return key


def compute_dtype_of(name: str) -> str:
    """Return the compute dtype of a concrete policy name (``"mixed_float16"`` -> ``"float16"``)."""
    key = normalize_policy(name, allow_auto=False)
    return MIXED_POLICIES.get(key, key)


# ------------------------------------------------------------------- loss scaling

# The string values ``loss_scale=`` takes; a positive number means a static scale.
LOSS_SCALE_MODES: tuple[str, ...] = ("dynamic", "force_dynamic")
# What a loss-scale setting resolves to once the policy is known.
LOSS_SCALE_KINDS: tuple[str, ...] = ("none", "static", "dynamic")

# ------------------------------------------------------------------ master weights

# How an update reaches a 16-bit (float16/bfloat16) weight; kmp.master_weights holds the
# rule. "auto": "kahan" for 16-bit weights, exact float32 for float32 ones. "float32": the
# weights are float32 (a mixed policy); 16-bit weights are refused. "kahan": a 16-bit
# compensation buffer per weight carries the update's lost low bits to the next step.
# "stochastic": bfloat16 weights rounded stochastically (unbiased, no extra memory).
# "none": plain round-to-nearest (small updates are lost).
MASTER_WEIGHTS: tuple[str, ...] = ("auto", "float32", "kahan", "stochastic", "none")

# -------------------------------------------------------------------- compression

# Accepted compression names -> canonical name (None means no compression).
COMPRESSIONS: dict[str | None, str | None] = {
    None: None,
    "none": None,
    "fp16": "fp16",
    "float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}
# Horovod's built-in Compression classes, by class name -> kmp's name.
_HOROVOD_COMPRESSORS: dict[str, str | None] = {"NoneCompressor": None, "FP16Compressor": "fp16"}


def normalize_compression(compression: Any) -> str | None:
    """Return the canonical compression name: None, ``"fp16"`` or ``"bf16"``.

    Horovod's own ``hvd.Compression.none`` and ``hvd.Compression.fp16`` are
    accepted too, for code that passes them.

    Raises:
        TypeError: ``compression`` is neither a name, None, nor a Horovod compressor.
        ValueError: ``compression`` is an unknown name.
    """
    if compression is not None and not isinstance(compression, str):
        cls_name = getattr(compression, "__name__", type(compression).__name__)
        if cls_name in _HOROVOD_COMPRESSORS:
            return _HOROVOD_COMPRESSORS[cls_name]
        raise TypeError(
            f"compression must be None, 'fp16' or 'bf16' (or Horovod's hvd.Compression.none / "
            f".fp16), not {type(compression).__name__} {compression!r}."
        )
    key = compression.strip().lower() if isinstance(compression, str) else compression
    if key not in COMPRESSIONS:
        raise ValueError(
            f"Unknown compression {compression!r}. Use None (send gradients as they are), "
            "'fp16' (send float16, half the bytes) or 'bf16' (send bfloat16, half the bytes)."
        )
    return COMPRESSIONS[key]


# --------------------------------------------------------------- sparse gradients

# How a sparse gradient (``tf.IndexedSlices``, from ``Embedding`` or ``gather``) travels
# between ranks: "dense" scatters it into a dense tensor that is allreduced with the
# others (in buckets, compressed); "gather" allgathers its rows and their indices, as
# Horovod's own optimizer does. kmp.distributed.sparse checks the setting and holds
# the default.
SPARSE_GRADIENTS: tuple[str, ...] = ("dense", "gather")

# ---------------------------------------------------------------------- reduction

REDUCE_OPS: tuple[str, ...] = ("average", "sum", "min", "max", "product")


def normalize_reduce_op(op: Any) -> str:
    """Return the canonical reduction name, one of :data:`REDUCE_OPS`.

    Raises:
        TypeError: ``op`` is not a string.
        ValueError: ``op`` is not a known reduction.
    """
    if not isinstance(op, str):
        raise TypeError(f"A reduction op must be a name ({', '.join(REDUCE_OPS)}), not {op!r}.")
    name = op.strip().lower()
    if name not in REDUCE_OPS:
        raise ValueError(f"Unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}.")
    return name


# ---------------------------------------------------------------------- preemption

# The exit status of a rank that stopped on a scheduler's signal after its checkpoint
# (kmp.callbacks.Preempted): EX_TEMPFAIL of sysexits.h, "run me again". `kmp launch`
# passes it on, and inside a SLURM batch job requeues the job on it.
PREEMPTED_EXIT_CODE = 75
# A file kmp launch names for the ranks: the chief writes its preemption checkpoint's path
# there. srun stops the other ranks when the first leaves with 75 (--kill-on-bad-exit), so
# its own status can read "killed"; the file still says "preempted".
PREEMPTED_MARKER_ENV = "KMP_PREEMPTED_MARKER"
