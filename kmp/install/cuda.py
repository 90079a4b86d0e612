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
import glob
import os
import re
import shutil
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from kmp.install.plan import TENSORFLOW_CUDA_MAJOR

__all__ = [
    "CudaToolkit",
    "build_env",
    "cuda_version",
    "describe_env",
    "find",
    "find_parts",
    "missing",
    "warnings",
]

# From site-packages/horovod/tensorflow/ (Horovod's library) to the nvidia-nccl wheel's.
_WHEEL_NCCL_RPATH = "$ORIGIN/../../nvidia/nccl/lib"
# Where a system toolkit and a system NCCL (include folder, library folder) are looked for.
SYSTEM_HOMES = ("/usr/local/cuda", "/usr/local/cuda-*")
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
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for pattern in SYSTEM_HOMES:
        candidates.extend(sorted(glob.glob(pattern), reverse=True))  # cuda, then cuda-13.0, ...
    for home in candidates:
        # A toolkit has the compiler and the run-time headers (a wrapper script's folder has not).
        if home and (Path(home) / "bin" / "nvcc").is_file() and cuda_version(home):
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


def find_parts(
    environ: Mapping[str, str], site_packages: str | None = None
) -> tuple[str | None, tuple[str, str, str] | None]:
    """Return ``(toolkit home, (nccl include, nccl lib, source))``, None for what is missing."""
    home = _toolkit_home(environ)
    site = site_packages or sysconfig.get_paths()["purelib"]
    return home, _nccl(environ, home or "/nonexistent", site)


def find(environ: Mapping[str, str], site_packages: str | None = None) -> CudaToolkit | None:
    """Return the CUDA toolkit and NCCL to build against, or None when either is missing.

    Args:
        environ: The environment (``CUDA_HOME``, ``HOROVOD_NCCL_HOME``, ``PATH``, ...).
        site_packages: The environment's site-packages (for the nvidia-* wheels);
            default: this interpreter's.
    """
    home, nccl = find_parts(environ, site_packages)
    if home is None or nccl is None:
        return None
    return CudaToolkit(home, cuda_version(home), *nccl)


def missing(environ: Mapping[str, str], site_packages: str | None = None) -> str:
    """Say what :func:`find` did not find, and where it looked."""
    home, nccl = find_parts(environ, site_packages)
    parts = []
    if home is None:
        parts.append(
            "no CUDA toolkit with nvcc (looked in $HOROVOD_CUDA_HOME, $CUDA_HOME, $CUDA_PATH, "
            "the nvcc on the PATH, /usr/local/cuda*; the tensorflow[and-cuda] wheels bring no "
            "nvcc): install a CUDA 12 toolkit and set CUDA_HOME"
        )
    else:
        parts.append(f"CUDA {cuda_version(home)} toolkit at {home}")
    if nccl is None:
        parts.append(
            "no NCCL (looked in $HOROVOD_NCCL_HOME, the toolkit, /usr/include and "
            "/usr/lib*, the nvidia-nccl-cu12 wheel that tensorflow[and-cuda] brings)"
        )
    return "; ".join(parts)


def describe_env(toolkit: CudaToolkit) -> dict[str, str]:
    """Return the CUDA build variables :func:`build_env` will set, without making anything."""
    env = {
        "HOROVOD_CUDA_HOME": toolkit.home,
        "HOROVOD_NCCL_INCLUDE": toolkit.nccl_include,
        "HOROVOD_NCCL_LIB": toolkit.nccl_lib,
    }
    if toolkit.nccl_source == "wheel":
        env["LDFLAGS"] = f"-Wl,-rpath,{_WHEEL_NCCL_RPATH}"
    return env


def warnings(toolkit: CudaToolkit) -> list[str]:
    """Return what is risky about building against ``toolkit`` (empty: nothing)."""
    major = int(toolkit.version.split(".")[0]) if toolkit.version else None
    if major is None or major == TENSORFLOW_CUDA_MAJOR:
        return []
    return [
        f"the CUDA toolkit is {toolkit.version}, TensorFlow's wheels use CUDA "
        f"{TENSORFLOW_CUDA_MAJOR}: Horovod gets its own static CUDA {major} run time, which "
        f"needs an NVIDIA driver for CUDA {major}. A CUDA {TENSORFLOW_CUDA_MAJOR} toolkit "
        "(CUDA_HOME=...) avoids this"
    ]


def build_env(
    toolkit: CudaToolkit, workdir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Return Horovod's CUDA build variables, making a link folder where NCCL needs one.

    The nvidia-nccl wheel holds only ``libnccl.so.2``; the linker looks for
    ``libnccl.so``, so a folder under ``workdir`` gets that link. A library
    linked against the wheel finds it at run time through a relative run path
    (``$ORIGIN``), so the wheel works in any environment with that NCCL wheel.
    """
    env = describe_env(toolkit)
    if toolkit.nccl_source == "wheel":
        flags = (environ or {}).get("LDFLAGS", "")
        env["LDFLAGS"] = f"{flags} -Wl,-rpath,{_WHEEL_NCCL_RPATH}".strip()
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
