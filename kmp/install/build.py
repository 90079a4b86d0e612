"""Building Horovod 0.28.1 into a Python environment: the machinery of ``kmp install-horovod``.

Horovod ships only as a source distribution, and it does not compile against
TensorFlow >= 2.19 as released. :func:`install` follows a plan of
:mod:`kmp.install.plan` (NCCL on NVIDIA GPUs, MPI when OpenMPI is present, the
source fixes): it reuses a cached wheel or downloads, fixes and compiles the
source (:func:`build_wheel`), installs the wheel and verifies it
(:func:`kmp.install.record.verify`: a load of Horovod's TensorFlow ops, their
build flags, and ``horovodrun --version``), then records the build.

The built wheel is cached under ``$KMP_CACHE_DIR`` (default ``~/.cache/kmp``),
keyed by Horovod, TensorFlow, Python and the build variables (:func:`wheel_key`),
so another environment on the same machine installs it in seconds. The compile
(about 9 minutes on a fresh machine) reports its progress every 30 s
(:mod:`kmp.install.progress`) and keeps its full log in
``$KMP_CACHE_DIR/logs/`` (:func:`build_log`), whose path it prints.

Standard library only: set-up imports this before anything is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from kmp._files import atomic_write
from kmp.install import cuda, progress, record
from kmp.install import plan as ip

__all__ = [
    "build_log",
    "build_wheel",
    "cache_root",
    "cached_wheel",
    "format_plan",
    "install",
    "install_wheel",
    "log",
    "problems",
    "store_wheel",
    "wheel_key",
]


def log(message: str) -> None:
    """Print one ``[install-horovod]`` progress line on standard error."""
    print(f"[install-horovod] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the wheel cache


def cache_root(environ: Mapping[str, str]) -> Path:
    """Return the wheel cache folder: ``$KMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/kmp``."""
    if environ.get("KMP_CACHE_DIR"):
        return Path(environ["KMP_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kmp"


def wheel_key(
    plan: ip.InstallPlan, facts: record.PythonFacts, toolkit: cuda.CudaToolkit | None
) -> str:
    """The cache key of the wheel ``plan`` builds here (:func:`kmp.install.plan.cache_key`)."""
    return ip.cache_key(
        plan,
        tensorflow=facts.tensorflow or plan.tensorflow,
        python_tag=f"cp{sys.version_info[0]}{sys.version_info[1]}",
        platform_tag=sysconfig.get_platform(),
        cuda_version=toolkit.version if toolkit is not None else None,
    )


def cached_wheel(root: Path, key: str) -> Path | None:
    """Return the wheel cached under ``key``, or None."""
    folder = root / "wheels" / key
    wheels = sorted(folder.glob("horovod-*.whl")) if folder.is_dir() else []
    return wheels[0] if wheels else None


def store_wheel(root: Path, key: str, wheel: Path) -> Path:
    """Copy ``wheel`` into the cache under ``key`` atomically; return its cached path."""
    target = root / "wheels" / key / wheel.name
    atomic_write(target, lambda tmp: shutil.copyfile(wheel, tmp))  # the whole wheel or none
    return target


def build_log(root: Path, key: str) -> Path:
    """Where the compile of the wheel under ``key`` keeps its full log."""
    return root / "logs" / f"horovod-build-{key}.log"


# ------------------------------------------------------------------ building


def _pip(python: str, *args: str, what: str, log_file: Path, env: Mapping[str, str] | None = None):
    argv = [python, "-m", "pip", *args, "--disable-pip-version-check"]
    return progress.run_logged(argv, log_file, what=what, env=env, report=log)


def _fail_with_log(log_file: Path, what: str) -> RuntimeError:
    text = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
    errors = [line for line in text if "error" in line.lower()][:30]
    for line in [*errors, "...", *text[-40:]]:
        print(line, file=sys.stderr)
    return RuntimeError(f"{what} failed; the full log is {log_file}")


def build_wheel(
    plan: ip.InstallPlan,
    python: str,
    workdir: Path,
    toolkit: cuda.CudaToolkit | None,
    *,
    log_file: Path | None = None,
) -> Path:
    """Download, fix and compile Horovod into a wheel under ``workdir``; return the wheel.

    Every step's output goes to ``log_file`` (``workdir/build.log`` when None),
    started afresh; the compile reports its progress every 30 s.
    """
    log_file = log_file or workdir / "build.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.unlink(missing_ok=True)
    log(f"the build's full log: {log_file}")
    log(f"installing the build requirements ({', '.join(ip.BUILD_REQUIREMENTS)})")
    what = "installing the build requirements"
    if _pip(python, "install", "-q", *ip.BUILD_REQUIREMENTS, what=what, log_file=log_file):
        raise _fail_with_log(log_file, "installing Horovod's build requirements")
    log(f"fetching the horovod=={plan.horovod} source distribution")
    fetched = _pip(
        python,
        *("download", "-q", "--no-binary", ":all:", "--no-deps", "-d", str(workdir)),
        f"horovod=={plan.horovod}",
        what=f"fetching horovod=={plan.horovod}",
        log_file=log_file,
    )
    if fetched:
        raise _fail_with_log(log_file, f"downloading horovod=={plan.horovod}")
    with tarfile.open(workdir / f"horovod-{plan.horovod}.tar.gz") as tar:
        tar.extractall(workdir, filter="data")
    src = workdir / f"horovod-{plan.horovod}"
    for fix in plan.fixes:
        path = src / ip.SOURCE_FIXES[fix][0]
        path.write_text(ip.fix_source(fix, path.read_text()))
        log(f"source fix {fix}: {ip.SOURCE_FIXES[fix][0]}")
    env = dict(os.environ)
    env.update(plan.build_env)
    if toolkit is not None:
        env.update(cuda.build_env(toolkit, workdir / "cuda-links", os.environ))
        # Horovod tries the nvcc on the PATH before HOROVOD_CUDA_HOME's: put the chosen first.
        env["PATH"] = os.pathsep.join([str(Path(toolkit.home) / "bin"), env.get("PATH", "")])
    env["MAKEFLAGS"] = f"-j{os.cpu_count() or 1}"
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])  # cmake
    flags = " ".join(f"{k}={v}" for k, v in sorted(plan.build_env.items()))
    log(
        f"compiling Horovod ({flags}); about 9 minutes on a fresh machine, progress every "
        f"{progress.HEARTBEAT_S:.0f} s"
    )
    wheels = workdir / "wheels"
    built = _pip(
        python,
        *("wheel", "-v", "--no-build-isolation", "--no-deps", "--no-cache-dir"),
        *("-w", str(wheels), str(src)),
        what="compiling Horovod",
        log_file=log_file,
        env=env,
    )
    found = sorted(wheels.glob("horovod-*.whl"))
    if built or not found:
        raise _fail_with_log(log_file, "compiling Horovod")
    return found[0]


def install_wheel(python: str, wheel: Path) -> None:
    """Install ``wheel`` (Horovod only; its run-time requirements are already there)."""
    argv = [python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)]
    if subprocess.run([*argv, "--disable-pip-version-check"], check=False).returncode:
        raise RuntimeError(f"pip could not install {wheel}")


def problems(
    plan: ip.InstallPlan, facts: record.PythonFacts, toolkit: cuda.CudaToolkit | None
) -> list[str]:
    """Return what stops the plan from building here, each with what to do (pure)."""
    found = []
    if facts.tensorflow is None:
        found.append(
            f"no TensorFlow in {facts.python}: install it first "
            f"(pip install '{plan.tensorflow}'), then run kmp install-horovod again"
        )
    elif plan.gpu_operations and facts.tensorflow.startswith("tensorflow-cpu"):
        found.append(
            f"{facts.tensorflow} is CPU-only, but the plan builds NCCL for GPUs: run pip "
            f"uninstall -y tensorflow-cpu && pip install '{plan.tensorflow}' (or pass --gpu none)"
        )
    if plan.mpi and not facts.mpicxx:
        found.append(
            "--mpi, but OpenMPI's mpicxx is not on the PATH: apt-get install openmpi-bin "
            "libopenmpi-dev (or pass --no-mpi)"
        )
    if not facts.compiler:
        found.append("no C++ compiler (c++, g++) on the PATH: apt-get install g++")
    if plan.gpu_operations and toolkit is None:
        found.append(
            f"NCCL needs a CUDA toolkit (nvcc) and NCCL: {cuda.missing(os.environ)}. "
            "Or pass --gpu none for a build without GPU collectives"
        )
    return found


def format_plan(
    plan: ip.InstallPlan,
    facts: record.PythonFacts,
    key: str,
    wheel: Path | None,
    toolkit: cuda.CudaToolkit | None,
    found: list[str],
) -> str:
    """Render the plan as the text ``kmp install-horovod --dry-run`` prints."""
    env = dict(plan.build_env)
    if plan.gpu_operations:
        env.update(
            cuda.describe_env(toolkit)
            if toolkit is not None
            else {"HOROVOD_CUDA_HOME": "<a CUDA toolkit; none found here>"}
        )
    lines = [
        f"device              {plan.device} ({plan.reason})",
        f"TensorFlow          {plan.tensorflow}  (installed here: {facts.tensorflow or 'none'})",
        f"Horovod             {plan.horovod}, built from its source distribution with pip wheel "
        "--no-build-isolation --no-deps",
        f"build requirements  {' '.join(ip.BUILD_REQUIREMENTS)}",
        "build variables",
        *(f"    {k}={v}" for k, v in sorted(env.items())),
        *(
            [f"source fix          {ip.SOURCE_FIXES[f][1]}" for f in plan.fixes]
            or ["source fix          none (TensorFlow < 2.19)"]
        ),
        f"system packages     {' '.join(plan.system_packages) or 'none'}",
        f"CUDA toolkit        {toolkit.describe() if toolkit is not None else 'NOT FOUND'}"
        if plan.gpu_operations
        else "CUDA toolkit        not used (CPU build)",
        f"wheel cache         {wheel if wheel else 'no cached wheel; it will be compiled'}",
        f"cache key           {key}",
        "verify              import horovod.tensorflow.mpi_ops (its flags); horovodrun --version",
    ]
    for warning in cuda.warnings(toolkit) if toolkit is not None else []:
        lines.append(f"note: {warning}")
    if found:
        lines.append("before it can build:")
        lines.extend(f"  - {p}" for p in found)
    return "\n".join(lines)


# ------------------------------------------------------------------ the whole install


def install(
    plan: ip.InstallPlan,
    facts: record.PythonFacts,
    toolkit: cuda.CudaToolkit | None,
    key: str,
    *,
    root: Path,
    wheel: Path | None,
    force: bool = False,
    no_cache: bool = False,
) -> int:
    """Build (or take ``wheel`` from the cache), install, verify and record; return the status.

    Nothing is done when the installed Horovod already matches the plan (unless
    ``force``). Only a verified build is cached (never with ``no_cache``); a cached
    wheel that fails verification is removed. Errors are printed; the status is 1.
    """
    loaded = None if force else record.up_to_date(key, plan, facts)
    if loaded is not None:
        record.write(key, plan, facts, loaded)
        log(f"Horovod {plan.horovod} is installed and matches the plan ({plan.summary()})")
        return 0
    for warning in cuda.warnings(toolkit) if toolkit is not None else []:
        log(f"note: {warning}")
    t0 = time.monotonic()
    try:
        if wheel is not None:
            log(f"installing the cached wheel {wheel}")
            install_wheel(facts.python, wheel)
            bad, loaded = record.verify(facts.python, plan)
            if bad:  # never offer a wheel that failed once again
                wheel.unlink(missing_ok=True)
                bad.append(f"the cached wheel {wheel} was removed: run again to rebuild it")
        else:
            with tempfile.TemporaryDirectory(prefix="kmp-horovod-") as tmp:
                log_file = build_log(root, key)
                built = build_wheel(plan, facts.python, Path(tmp), toolkit, log_file=log_file)
                install_wheel(facts.python, built)
                bad, loaded = record.verify(facts.python, plan)
                if not bad and not no_cache:  # only a verified build is cached
                    store_wheel(root, key, built)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"kmp install-horovod: {exc}", file=sys.stderr)
        return 1
    if bad:
        for p in bad:
            print(f"kmp install-horovod: {p}", file=sys.stderr)
        return 1
    record.write(key, plan, facts, loaded)
    how = "installed from the cache" if wheel is not None else "built"
    log(f"Horovod {plan.horovod} {how} and verified in {time.monotonic() - t0:.0f} s")
    return 0
