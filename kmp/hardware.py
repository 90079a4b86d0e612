"""Facts about the machine, as plain data: no decisions are made here.

:func:`detect` reads the CPU model and flags from ``/proc/cpuinfo`` and the
NVIDIA GPUs from ``nvidia-smi`` (falling back to TensorFlow's device details
when TensorFlow is already imported). Policy code takes a :class:`Hardware`
value, so it can be tested with described machines such as
``Hardware(gpus=(GPU("A100", (8, 0)),))``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import shutil
import subprocess
import sys

__all__ = ["CPU", "GPU", "Hardware", "detect"]


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU.

    Attributes:
        name: Product name, e.g. ``"NVIDIA H200"``.
        compute_capability: ``(major, minor)``, e.g. ``(9, 0)``.
        memory_mib: Total memory in MiB, or None when unknown.
    """

    name: str
    compute_capability: tuple[int, int]
    memory_mib: int | None = None

    @property
    def has_tensor_cores(self) -> bool:
        """True from Volta (7.0) on: float16 matrix units."""
        return self.compute_capability >= (7, 0)

    @property
    def fast_bfloat16(self) -> bool:
        """True from Ampere (8.0) on: bfloat16 at float16 speed."""
        return self.compute_capability >= (8, 0)


@dataclasses.dataclass(frozen=True)
class CPU:
    """The host CPU.

    Attributes:
        model: Model name from /proc/cpuinfo (or the platform), e.g. ``"AMD EPYC 9654"``.
        cores: Logical cores visible to this process.
        avx512_bf16: Has AVX512_BF16 (bfloat16 dot products).
        amx: Has Intel AMX tiles with bfloat16 (``amx_bf16``).
        avx512_fp16: Has AVX512_FP16 (native float16 arithmetic).
    """

    model: str = "unknown"
    cores: int = 1
    avx512_bf16: bool = False
    amx: bool = False
    avx512_fp16: bool = False

    @property
    def fast_bfloat16(self) -> bool:
        """True when the CPU has bfloat16 instructions (AVX512_BF16 or AMX)."""
        return self.avx512_bf16 or self.amx


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What kmp knows about the machine.

    Attributes:
        cpu: The host CPU.
        gpus: NVIDIA GPUs visible to this process.
        tpu: True when a TPU is attached.
    """

    cpu: CPU = dataclasses.field(default_factory=CPU)
    gpus: tuple[GPU, ...] = ()
    tpu: bool = False

    def to_dict(self) -> dict:
        """Return a JSON-ready dict (the ``hardware`` part of ``kmp doctor --json``)."""
        return {
            "cpu": {
                "model": self.cpu.model,
                "cores": self.cpu.cores,
                "avx512_bf16": self.cpu.avx512_bf16,
                "amx": self.cpu.amx,
                "avx512_fp16": self.cpu.avx512_fp16,
            },
            "gpus": [
                {
                    "name": g.name,
                    "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                    "memory_mib": g.memory_mib,
                }
                for g in self.gpus
            ],
            "tpu": self.tpu,
        }


def parse_cpuinfo(text: str, cores: int | None = None) -> CPU:
    """Build a :class:`CPU` from the text of ``/proc/cpuinfo``."""
    model = "unknown"
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return CPU(
        model=model,
        cores=cores if cores is not None else (os.cpu_count() or 1),
        avx512_bf16="avx512_bf16" in flags,
        amx="amx_bf16" in flags,
        avx512_fp16="avx512_fp16" in flags,
    )


def parse_nvidia_smi(text: str) -> tuple[GPU, ...]:
    """Parse the output of ``nvidia-smi``.

    Args:
        text: Output of ``nvidia-smi --query-gpu=name,compute_cap,memory.total
            --format=csv,noheader,nounits``.

    Returns:
        One :class:`GPU` per parseable line.
    """
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            major, minor = (int(x) for x in parts[1].split(".")[:2])
        except ValueError:
            continue
        memory = (
            int(float(parts[2])) if len(parts) > 2 and parts[2].replace(".", "").isdigit() else None
        )
        gpus.append(GPU(parts[0], (major, minor), memory))
    return tuple(gpus)


def _visible_filter(gpus: tuple[GPU, ...]) -> tuple[GPU, ...]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    picked = []
    for item in visible.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < len(gpus):
            picked.append(gpus[int(item)])
    return tuple(picked)


def _detect_gpus() -> tuple[GPU, ...]:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            return _visible_filter(parse_nvidia_smi(out))
        except (OSError, subprocess.SubprocessError):
            pass
    tf = sys.modules.get("tensorflow")
    if tf is not None:  # only when already imported: detection must stay cheap
        gpus = []
        for dev in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(dev)
            cc = details.get("compute_capability") or (0, 0)
            gpus.append(GPU(details.get("device_name", dev.name), tuple(cc)))
        return tuple(gpus)
    return ()


def _detect_tpu() -> bool:
    return bool(os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR")) or os.path.exists(
        "/dev/accel0"
    )


def _detect_cpu() -> CPU:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return parse_cpuinfo(f.read(), cores)
    except OSError:
        return CPU(model=platform.processor() or platform.machine(), cores=cores or 1)


@functools.lru_cache(maxsize=1)
def detect() -> Hardware:
    """Return the facts about this machine (cached for the process)."""
    return Hardware(cpu=_detect_cpu(), gpus=_detect_gpus(), tpu=_detect_tpu())
