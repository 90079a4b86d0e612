"""What ``kmp doctor`` warns about: pure checks of the facts it gathered.

:func:`diagnose` reads the dict of :func:`kmp.install.stack_report.collect` and
returns one :class:`Finding` per problem, each with the command that fixes it.
It decides from the facts alone, so every warning is tested with described
machines (GPUs with a CPU-only TensorFlow, Horovod built against another
TensorFlow, ...).
"""

from __future__ import annotations

import dataclasses

from kmp.install.plan import TENSORFLOW_VERSION, tensorflow_requirement
from kmp.versions import untested

__all__ = ["Finding", "diagnose"]

_CUDA_TF = tensorflow_requirement("cuda")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem ``kmp doctor`` found.

    Attributes:
        code: A stable short name, e.g. ``"cpu-tensorflow-on-gpus"``.
        problem: What is wrong.
        fix: The command (or step) that fixes it.
    """

    code: str
    problem: str
    fix: str

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return dataclasses.asdict(self)


def _gpu_findings(n_gpus: int, tf: dict | None, hvd: dict) -> list[Finding]:
    found = []
    if tf is None:
        found.append(
            Finding(
                "no-tensorflow",
                f"{n_gpus} NVIDIA GPU(s), but TensorFlow is not installed",
                f"pip install '{_CUDA_TF}' && kmp install-horovod",
            )
        )
        return found
    cpu_only = tf.get("distribution") == "tensorflow-cpu" or tf.get("cuda") is False
    if cpu_only:
        found.append(
            Finding(
                "cpu-tensorflow-on-gpus",
                f"{n_gpus} NVIDIA GPU(s), but {tf.get('distribution')} {tf.get('version')} is "
                "CPU-only: the GPUs are never used",
                f"pip uninstall -y tensorflow-cpu && pip install '{_CUDA_TF}' && "
                "kmp install-horovod --force",
            )
        )
    elif not tf.get("gpus"):
        found.append(
            Finding(
                "tensorflow-sees-no-gpu",
                f"{n_gpus} NVIDIA GPU(s), but TensorFlow {tf.get('version')} (built with CUDA) "
                "sees none: its CUDA libraries or the driver do not load",
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES, then "
                f"pip install --force-reinstall '{_CUDA_TF}' (it brings the CUDA libraries "
                "TensorFlow loads)",
            )
        )
    if hvd.get("tensorflow_ops") and not hvd.get("nccl"):
        found.append(
            Finding(
                "horovod-without-nccl",
                f"{n_gpus} NVIDIA GPU(s), but Horovod was built without NCCL: GPU tensors are "
                "reduced through host memory",
                "kmp install-horovod --gpu nccl --force",
            )
        )
    return found


def _horovod_findings(tf: dict | None, hvd: dict) -> list[Finding]:
    if not hvd.get("installed"):
        return [Finding("no-horovod", "Horovod is not installed", "kmp install-horovod")]
    built = hvd.get("built_against")
    installed = f"{tf['distribution']}=={tf['version']}" if tf else None
    if built and installed and built != installed:
        state = "its ops fail to load" if not hvd.get("tensorflow_ops") else "it may fail"
        return [
            Finding(
                "horovod-tensorflow-mismatch",
                f"Horovod was built against {built}, but {installed} is installed: {state}",
                "kmp install-horovod --force",
            )
        ]
    if not hvd.get("tensorflow_ops"):
        error = hvd.get("error") or ""
        cause = (
            "it was built against a different TensorFlow"
            if "undefined symbol" in error or "symbol" in error
            else "the build is broken"
        )
        return [
            Finding(
                "horovod-does-not-load",
                f"Horovod is installed but its TensorFlow ops do not load ({cause}): {error}",
                "kmp install-horovod --force",
            )
        ]
    return []


def diagnose(info: dict) -> list[Finding]:
    """Return the problems in ``info`` (``kmp doctor``'s facts), each with its fix.

    The checks: NVIDIA GPUs with no or a CPU-only TensorFlow; a CUDA
    TensorFlow that sees no GPU; Horovod without NCCL on a GPU machine;
    Horovod missing, or built against another TensorFlow than the one
    installed (recorded by ``kmp install-horovod``, or seen as ops that fail
    to load); a Python, Keras, TensorFlow or JAX outside kmp's tested ranges
    (:func:`kmp.versions.untested`).
    """
    tf = info.get("tensorflow_build")
    hvd = info.get("horovod") or {}
    found = []
    n_gpus = len((info.get("hardware") or {}).get("gpus") or [])
    if n_gpus:
        found.extend(_gpu_findings(n_gpus, tf, hvd))
    elif tf is None:
        found.append(
            Finding(
                "no-tensorflow",
                "TensorFlow is not installed",
                f"pip install '{tensorflow_requirement('cpu', TENSORFLOW_VERSION)}'",
            )
        )
    found.extend(_horovod_findings(tf, hvd))
    versions = {
        "python": info.get("python"),
        "keras": (info.get("keras") or {}).get("version"),
        "tensorflow": info.get("tensorflow"),
        "jax": info.get("jax"),
    }
    found.extend(Finding("untested-version", *problem) for problem in untested(versions))
    return found
