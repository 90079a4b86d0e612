"""Where the CUDA toolkit and NCCL are, for a Horovod build with NCCL.

:func:`find` looks for a system CUDA toolkit (``$HOROVOD_CUDA_HOME``,
``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``, the folder of ``nvcc`` on
the PATH) and for NCCL (``$HOROVOD_NCCL_HOME``, the toolkit, the system
folders, the ``nvidia-nccl-cu12`` wheel that ``tensorflow[and-cuda]`` brings).
:func:`build_env` turns what was found into Horovod's build variables.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sysconfig
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CudaToolkit", "build_env", "cuda_version", "describe_env", "find"]

# Where a system toolkit and a system NCCL (include folder, library folder) are looked for.
SYSTEM_HOMES = ("/usr/local/cuda",)
SYSTEM_NCCL = (("/usr/include", "/usr/lib/x86_64-linux-gnu"), ("/usr/include", "/usr/lib64"))


@dataclasses.dataclass(frozen=True)
class CudaToolkit:
    """A CUDA toolkit with NCCL that Horovod can be compiled against.

    Attributes:
        home: The toolkit's folder (holds ``bin/nvcc``, ``include/``, ``lib64/``).
        version: Its CUDA version, e.g. ``"12.9"``, or None when unknown.
        nccl_include: The folder of ``nccl.h``.
        nccl_lib: The folder of ``libnccl.so*``.
        nccl_source: ``"toolkit"``, ``"system"``, ``"HOROVOD_NCCL_HOME"`` or ``"wheel"``.
    """

    home: str
    version: str | None
    nccl_include: str
    nccl_lib: str
    nccl_source: str

    def describe(self) -> str:
        """One line for ``kmp install-horovod --dry-run``."""
        return (
            f"CUDA {self.version or '(unknown version)'} at {self.home}; NCCL from "
            f"{self.nccl_source} ({self.nccl_lib})"
        )


def cuda_version(home: str) -> str | None:
    """Read the CUDA version from ``home/include/cuda_runtime_api.h`` (``CUDART_VERSION``)."""
    try:
        text = (Path(home) / "include" / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if not match:
        return None
    number = int(match.group(1))
    return f"{number // 1000}.{number % 1000 // 10}"


def _toolkit_home(environ: Mapping[str, str]) -> str | None:
    candidates = [environ.get(k) for k in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")]
    candidates.extend(SYSTEM_HOMES)
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return home
    return None


def _has_nccl(include: Path, lib: Path) -> bool:
    return (include / "nccl.h").is_file() and any(lib.glob("libnccl.so*"))


def _nccl(environ: Mapping[str, str], home: str, site_packages: str) -> tuple[str, str, str] | None:
    options = []
    if environ.get("HOROVOD_NCCL_HOME"):
        base = Path(environ["HOROVOD_NCCL_HOME"])
        options += [(base / "include", base / "lib", "HOROVOD_NCCL_HOME")]
        options += [(base / "include", base / "lib64", "HOROVOD_NCCL_HOME")]
    options += [(Path(home) / "include", Path(home) / "lib64", "toolkit")]
    options += [(Path(i), Path(lib), "system") for i, lib in SYSTEM_NCCL]
    wheel = Path(site_packages) / "nvidia" / "nccl"
    options += [(wheel / "include", wheel / "lib", "wheel")]
    for include, lib, source in options:
        if _has_nccl(include, lib):
            return str(include), str(lib), source
    return None


def find(environ: Mapping[str, str], site_packages: str | None = None) -> CudaToolkit | None:
    """Return the CUDA toolkit and NCCL to build against, or None when either is missing.

    Args:
        environ: The environment (``CUDA_HOME``, ``HOROVOD_NCCL_HOME``, ``PATH``, ...).
        site_packages: The environment's site-packages (for the nvidia-* wheels);
            default: this interpreter's.
    """
    home = _toolkit_home(environ)
    if home is None:
        return None
    nccl = _nccl(environ, home, site_packages or sysconfig.get_paths()["purelib"])
    if nccl is None:
        return None
    return CudaToolkit(home, cuda_version(home), *nccl)


def describe_env(toolkit: CudaToolkit) -> dict[str, str]:
    """Return the CUDA build variables :func:`build_env` will set, without making anything."""
    return {
        "HOROVOD_CUDA_HOME": toolkit.home,
        "HOROVOD_NCCL_INCLUDE": toolkit.nccl_include,
        "HOROVOD_NCCL_LIB": toolkit.nccl_lib,
    }


def build_env(toolkit: CudaToolkit, workdir: Path) -> dict[str, str]:
    """Return Horovod's CUDA build variables, making a link folder where NCCL needs one.

    The nvidia-nccl wheel holds only ``libnccl.so.2``; the linker looks for
    ``libnccl.so``, so a folder under ``workdir`` gets that link.
    """
    env = describe_env(toolkit)
    lib = Path(toolkit.nccl_lib)
    if not (lib / "libnccl.so").exists():
        links = workdir / "nccl-lib"
        links.mkdir(parents=True, exist_ok=True)
        target = sorted(lib.glob("libnccl.so.*"))[0]
        link = links / "libnccl.so"
        if not link.exists():
            os.symlink(target, link)
        env["HOROVOD_NCCL_LIB"] = str(links)
    return env
