"""What to install for this machine: the pure decision behind set-up and ``kmp install-horovod``.

:func:`plan_install` turns the hardware facts (:class:`kmp.hardware.Hardware`)
and the user's choices into an :class:`InstallPlan`: which TensorFlow wheel,
which Horovod build variables, whether MPI is built in, and which source fixes
Horovod 0.28.1 needs against that TensorFlow. Nothing here touches the machine, so
plans for described hardware are tested directly; :mod:`kmp.install.build`
acts on a plan and ``launch/setup.sh`` follows it.

This module and :mod:`kmp.hardware` use the standard library only: set-up
runs them before anything is installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping

from kmp.hardware import Hardware

__all__ = [
    "BUILD_REQUIREMENTS",
    "DEVICES",
    "GPU_OPERATIONS",
    "HOROVOD_VERSION",
    "SOURCE_FIXES",
    "TENSORFLOW_CUDA_MAJOR",
    "TENSORFLOW_VERSION",
    "XLA_OPS_LINE",
    "InstallPlan",
    "cache_key",
    "choose_device",
    "device_override",
    "fix_source",
    "patch_cmakelists",
    "patch_gpu_stream",
    "plan_install",
    "source_fixes",
    "tensorflow_requirement",
]

HOROVOD_VERSION = "0.28.1"
# The one pin of TensorFlow for the default environment; the wheel follows the device.
TENSORFLOW_VERSION = "2.21.0"
DEVICES = ("cpu", "cuda")
GPU_OPERATIONS = ("nccl", "none")
# What Horovod's build (without isolation) and its run time need in the environment.
BUILD_REQUIREMENTS = (
    "setuptools>=68",
    "wheel",
    "cmake>=3.13,<4",
    "packaging",
    "cloudpickle",
    "psutil",
    "pyyaml",
)
# The line of horovod/tensorflow/CMakeLists.txt that the TensorFlow >= 2.19 fix removes.
XLA_OPS_LINE = 'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")'
XLA_FIX = (
    "horovod/tensorflow/CMakeLists.txt: drop xla_mpi_ops.cc from TF_SOURCES (it does not "
    "compile against TensorFlow >= 2.19; it only registers Horovod's XLA ops)"
)
GPU_STREAM_FIX = (
    "horovod/tensorflow/mpi_ops.cc: take the CUDA stream from "
    "Stream::platform_specific_handle() (TensorFlow >= 2.19 no longer exports "
    "stream_executor::gpu::AsGpuStreamValue; the GPU build's ops would not load)"
)
# Source fix -> (file in the source distribution, what it does).
SOURCE_FIXES = {
    "xla-ops": ("horovod/tensorflow/CMakeLists.txt", XLA_FIX),
    "gpu-stream": ("horovod/tensorflow/mpi_ops.cc", GPU_STREAM_FIX),
}
# The CUDA major version of the tensorflow[and-cuda] wheels (nvidia-*-cu12).
TENSORFLOW_CUDA_MAJOR = 12


@dataclasses.dataclass(frozen=True)
class InstallPlan:
    """What set-up installs and how Horovod is built.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        reason: Why this device was chosen.
        tensorflow: The TensorFlow requirement, e.g. ``"tensorflow-cpu==2.21.0"``.
        tensorflow_version: The TensorFlow version Horovod is built against.
        horovod: The Horovod version built from its source distribution.
        gpu_operations: ``"NCCL"`` or None (no GPU collectives).
        mpi: Build MPI in (Gloo is always built).
        fixes: The source fixes to apply (keys of :data:`SOURCE_FIXES`).
        build_env: The fixed Horovod build variables (CUDA locations are added
            when the build runs, by :mod:`kmp.install.cuda`).
        system_packages: Debian packages the plan relies on (informational).
    """

    device: str
    reason: str
    tensorflow: str
    tensorflow_version: str
    horovod: str
    gpu_operations: str | None
    mpi: bool
    fixes: tuple[str, ...]
    build_env: Mapping[str, str]
    system_packages: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line of the decisions (``launch/setup.sh``'s stamp includes it)."""
        return (
            f"device={self.device} tensorflow={self.tensorflow} horovod={self.horovod} "
            f"gpu_operations={self.gpu_operations or 'none'} mpi={'yes' if self.mpi else 'no'}"
        )

    def to_dict(self) -> dict:
        """Return a JSON-ready dict (``kmp install-horovod --dry-run --json``)."""
        out = dataclasses.asdict(self)
        out["build_env"] = dict(self.build_env)
        out["system_packages"] = list(self.system_packages)
        out["fixes"] = {fix: SOURCE_FIXES[fix][1] for fix in self.fixes}
        out["build_requirements"] = list(BUILD_REQUIREMENTS)
        return out


def device_override(environ: Mapping[str, str]) -> str | None:
    """Return ``KMP_DEVICE`` from ``environ`` (``cpu`` or ``cuda``), or None when unset.

    Raises:
        ValueError: ``KMP_DEVICE`` is set to anything else.
    """
    value = environ.get("KMP_DEVICE", "").strip()
    if not value:
        return None
    if value.lower() not in DEVICES:
        raise ValueError(
            f"KMP_DEVICE must be one of {', '.join(DEVICES)}; got {value!r}. Unset it to "
            "follow the hardware (NVIDIA GPUs found by nvidia-smi mean cuda)."
        )
    return value.lower()


def choose_device(hw: Hardware, override: str | None = None) -> tuple[str, str]:
    """Return ``(device, reason)``: ``cuda`` when NVIDIA GPUs are present, else ``cpu``.

    Args:
        hw: The machine's facts.
        override: ``"cpu"`` or ``"cuda"`` (``KMP_DEVICE``), or None to follow ``hw``.
    """
    if override is not None:
        if override not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {override!r}.")
        return override, f"KMP_DEVICE={override}"
    if hw.gpus:
        names = sorted({g.name for g in hw.gpus})
        return "cuda", f"{len(hw.gpus)} NVIDIA GPU(s) found ({', '.join(names)})"
    return "cpu", "no NVIDIA GPU found (nvidia-smi)"


def tensorflow_requirement(device: str, version: str = TENSORFLOW_VERSION) -> str:
    """Return the TensorFlow wheel for ``device``: CUDA wheels on ``cuda``, CPU-only on ``cpu``."""
    if device == "cuda":
        return f"tensorflow[and-cuda]=={version}"
    return f"tensorflow-cpu=={version}"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


def source_fixes(tensorflow_version: str, *, gpu: bool) -> tuple[str, ...]:
    """Return the fixes Horovod 0.28.1's sources need against this TensorFlow.

    From TensorFlow 2.19 on, ``xla_mpi_ops.cc`` does not compile (``"xla-ops"``)
    and, in a GPU build, ``mpi_ops.cc`` calls a function TensorFlow no longer
    exports (``"gpu-stream"``). Both were found against 2.21.
    """
    if _version_tuple(tensorflow_version) < (2, 19):
        return ()
    return ("xla-ops", "gpu-stream") if gpu else ("xla-ops",)


def _capabilities(hw: Hardware) -> list[tuple[int, int]]:
    return [g.compute_capability for g in hw.gpus if g.compute_capability >= (3, 0)]


def plan_install(
    hw: Hardware,
    *,
    device: str | None = None,
    gpu: str | None = None,
    mpi: bool | None = None,
    mpi_available: bool = False,
    tensorflow_version: str = TENSORFLOW_VERSION,
) -> InstallPlan:
    """Decide what to install and how to build Horovod.

    Args:
        hw: The machine's facts.
        device: ``"cpu"`` or ``"cuda"`` to override the detection (``KMP_DEVICE``).
        gpu: ``"nccl"`` or ``"none"``: Horovod's GPU collectives; None follows
            the device (NCCL on ``cuda``).
        mpi: Build MPI in; None builds it exactly when OpenMPI is present.
        mpi_available: OpenMPI's ``mpicxx`` is on the PATH.
        tensorflow_version: The TensorFlow Horovod is built against (the one
            installed, or the pinned one before it is).

    Returns:
        The plan.

    Raises:
        ValueError: A choice is not one of the known values.
    """
    chosen, reason = choose_device(hw, device)
    if gpu is not None and gpu not in GPU_OPERATIONS:
        raise ValueError(f"gpu must be one of {', '.join(GPU_OPERATIONS)}; got {gpu!r}.")
    gpu = gpu or ("nccl" if chosen == "cuda" else "none")
    with_mpi = mpi_available if mpi is None else bool(mpi)
    env = {
        "HOROVOD_WITH_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_PYTORCH": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITH_MPI" if with_mpi else "HOROVOD_WITHOUT_MPI": "1",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    if gpu == "nccl":
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        env["HOROVOD_NCCL_LINK"] = "SHARED"
        capabilities = sorted({major * 10 + minor for major, minor in _capabilities(hw)})
        if capabilities:  # kernels for these GPUs only (default: every one nvcc knows)
            env["HOROVOD_BUILD_CUDA_CC_LIST"] = ",".join(str(c) for c in capabilities)
    packages = ("openmpi-bin", "libopenmpi-dev") if with_mpi else ()
    return InstallPlan(
        device=chosen,
        reason=reason,
        tensorflow=tensorflow_requirement(chosen),
        tensorflow_version=tensorflow_version,
        horovod=HOROVOD_VERSION,
        gpu_operations="NCCL" if gpu == "nccl" else None,
        mpi=with_mpi,
        fixes=source_fixes(tensorflow_version, gpu=gpu == "nccl"),
        build_env=env,
        system_packages=packages,
    )


def patch_cmakelists(text: str) -> str:
    """Return horovod/tensorflow/CMakeLists.txt without the xla_mpi_ops.cc source.

    Raises:
        ValueError: The line is not there (the Horovod sources are not 0.28.1's).
    """
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if "xla_mpi_ops.cc" not in line]
    if len(kept) == len(lines):
        raise ValueError(
            "horovod/tensorflow/CMakeLists.txt has no xla_mpi_ops.cc line to remove: these are "
            f"not Horovod {HOROVOD_VERSION}'s sources. Build Horovod {HOROVOD_VERSION}."
        )
    return "".join(kept)


_STREAM_DECLARATION = (
    "// Forward declaration of AsGpuStreamValue\n"
    "namespace stream_executor {\n"
    "namespace gpu {\n"
    "GpuStreamHandle AsGpuStreamValue(Stream* stream);\n"
    "} // namespace stream_executor\n"
    "} // namespace gpu\n"
)
_STREAM_INCLUDE_END = "#endif // TENSORFLOW_VERSION >= 2011000000\n#endif // HAVE_GPU\n"
_STREAM_HELPER = (
    "#endif // TENSORFLOW_VERSION >= 2011000000\n"
    "// kmp: TensorFlow >= 2.19 does not export stream_executor::gpu::AsGpuStreamValue;\n"
    "// the stream's platform handle is the same CUDA (or HIP) stream.\n"
    "static inline GpuStreamHandle KmpGpuStream(stream_executor::Stream* stream) {\n"
    "  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);\n"
    "}\n"
    "#endif // HAVE_GPU\n"
)
_STREAM_CALL = "stream_executor::gpu::AsGpuStreamValue("


def patch_gpu_stream(text: str) -> str:
    """Return horovod/tensorflow/mpi_ops.cc with its GPU streams taken from the stream handle.

    Raises:
        ValueError: The code to change is not there (not Horovod 0.28.1's sources).
    """
    if _STREAM_DECLARATION not in text or _STREAM_INCLUDE_END not in text:
        raise ValueError(
            "horovod/tensorflow/mpi_ops.cc does not declare AsGpuStreamValue as Horovod "
            f"{HOROVOD_VERSION} does: these are not its sources. Build Horovod {HOROVOD_VERSION}."
        )
    text = text.replace(_STREAM_DECLARATION, "", 1)
    text = text.replace(_STREAM_INCLUDE_END, _STREAM_HELPER, 1)
    return text.replace(_STREAM_CALL, "KmpGpuStream(")


def fix_source(fix: str, text: str) -> str:
    """Apply the source fix ``fix`` (a key of :data:`SOURCE_FIXES`) to its file's text."""
    transforms = {"xla-ops": patch_cmakelists, "gpu-stream": patch_gpu_stream}
    return transforms[fix](text)


def cache_key(
    plan: InstallPlan,
    *,
    tensorflow: str,
    python_tag: str,
    platform_tag: str,
    cuda_version: str | None = None,
) -> str:
    """Return the key of a built Horovod wheel: what makes two builds interchangeable.

    Args:
        plan: The plan the wheel was built from (its build variables and fix).
        tensorflow: The TensorFlow distribution and version built against,
            e.g. ``"tensorflow-cpu==2.21.0"``.
        python_tag: e.g. ``"cp311"``.
        platform_tag: e.g. ``"linux-x86_64"``.
        cuda_version: The CUDA toolkit version of a GPU build.
    """
    fields = {
        "horovod": plan.horovod,
        "tensorflow": tensorflow,
        "python": python_tag,
        "platform": platform_tag,
        "build_env": dict(sorted(plan.build_env.items())),
        "fixes": list(plan.fixes),
        "cuda": cuda_version,
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return f"horovod-{plan.horovod}-{python_tag}-{digest}"
