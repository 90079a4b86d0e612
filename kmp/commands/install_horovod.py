"""``kmp install-horovod``: build Horovod 0.28.1 into this Python environment and check it.

Horovod ships only as a source distribution, and it does not compile against
TensorFlow >= 2.19 as released. This command builds it against the TensorFlow
installed in the running Python environment, following the plan of
:mod:`kmp.commands.install_plan` (NCCL on NVIDIA GPUs, MPI when OpenMPI is
present, the xla_mpi_ops.cc fix), then verifies the result with
``horovodrun --check-build`` and a load of Horovod's TensorFlow ops.

The built wheel is cached under ``$KMP_CACHE_DIR`` (default
``~/.cache/kmp``), keyed by Horovod, TensorFlow, Python and the build
variables, so another environment on the same machine installs it in seconds.
Run again with nothing changed, the command only checks the installed build.

``launch/setup.sh`` calls it; ``--dry-run`` prints the plan and does nothing.
Only the standard library is imported at module level: set-up runs
``--summary`` before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kmp.commands import build_record, cuda_toolkit
from kmp.commands import install_plan as ip

__all__ = ["configure", "main", "run"]


def _log(message: str) -> None:
    print(f"[install-horovod] {message}", file=sys.stderr, flush=True)


def cache_root(environ: Mapping[str, str]) -> Path:
    """Return the wheel cache folder: ``$KMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/kmp``."""
    if environ.get("KMP_CACHE_DIR"):
        return Path(environ["KMP_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kmp"


def cached_wheel(root: Path, key: str) -> Path | None:
    """Return the wheel cached under ``key``, or None."""
    folder = root / "wheels" / key
    wheels = sorted(folder.glob("horovod-*.whl")) if folder.is_dir() else []
    return wheels[0] if wheels else None


def store_wheel(root: Path, key: str, wheel: Path) -> Path:
    """Copy ``wheel`` into the cache under ``key`` atomically; return its cached path."""
    folder = root / "wheels" / key
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / wheel.name
    tmp = folder / f".{wheel.name}.{os.getpid()}.tmp"
    shutil.copyfile(wheel, tmp)
    os.replace(tmp, target)  # a reader sees the whole wheel or none
    return target


def _tags() -> tuple[str, str]:
    return f"cp{sys.version_info[0]}{sys.version_info[1]}", sysconfig.get_platform()


def _pip(python: str, *args: str, env: Mapping[str, str] | None = None, log: Path | None = None):
    argv = [python, "-m", "pip", *args, "--disable-pip-version-check"]
    if log is None:
        return subprocess.run(argv, env=None if env is None else dict(env), check=False)
    with open(log, "ab") as out:
        return subprocess.run(
            argv, env=None if env is None else dict(env), stdout=out, stderr=out, check=False
        )


def _fail_with_log(log: Path, what: str) -> RuntimeError:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in text if "error" in line.lower()][:30]
    for line in [*errors, "...", *text[-40:]]:
        print(line, file=sys.stderr)
    return RuntimeError(f"{what} failed; the full log is {log}")


def build_wheel(
    plan: ip.InstallPlan, python: str, workdir: Path, cuda: cuda_toolkit.CudaToolkit | None
) -> Path:
    """Download, fix and compile Horovod into a wheel under ``workdir``; return the wheel."""
    log = workdir / "build.log"
    _log(f"installing the build requirements ({', '.join(ip.BUILD_REQUIREMENTS)})")
    if _pip(python, "install", "-q", *ip.BUILD_REQUIREMENTS, log=log).returncode:
        raise _fail_with_log(log, "installing Horovod's build requirements")
    _log(f"fetching the horovod=={plan.horovod} source distribution")
    fetched = _pip(
        python,
        "download",
        "-q",
        "--no-binary",
        ":all:",
        "--no-deps",
        "-d",
        str(workdir),
        f"horovod=={plan.horovod}",
        log=log,
    )
    if fetched.returncode:
        raise _fail_with_log(log, f"downloading horovod=={plan.horovod}")
    with tarfile.open(workdir / f"horovod-{plan.horovod}.tar.gz") as tar:
        tar.extractall(workdir, filter="data")
    src = workdir / f"horovod-{plan.horovod}"
    for fix in plan.fixes:
        path = src / ip.SOURCE_FIXES[fix][0]
        path.write_text(ip.fix_source(fix, path.read_text()))
        _log(f"source fix {fix}: {ip.SOURCE_FIXES[fix][0]}")
    env = dict(os.environ)
    env.update(plan.build_env)
    if cuda is not None:
        env.update(cuda_toolkit.build_env(cuda, workdir / "cuda-links", os.environ))
        # Horovod tries the nvcc on the PATH before HOROVOD_CUDA_HOME's: put the chosen first.
        env["PATH"] = os.pathsep.join([str(Path(cuda.home) / "bin"), env.get("PATH", "")])
    env["MAKEFLAGS"] = f"-j{os.cpu_count() or 1}"
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])  # cmake
    flags = " ".join(f"{k}={v}" for k, v in sorted(plan.build_env.items()))
    _log(f"compiling Horovod ({flags}); this takes a few minutes")
    wheels = workdir / "wheels"
    built = _pip(
        python,
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "--no-cache-dir",
        "-w",
        str(wheels),
        str(src),
        env=env,
        log=log,
    )
    found = sorted(wheels.glob("horovod-*.whl"))
    if built.returncode or not found:
        raise _fail_with_log(log, "compiling Horovod")
    return found[0]


def install_wheel(python: str, wheel: Path) -> None:
    """Install ``wheel`` (Horovod only; its run-time requirements are already there)."""
    r = _pip(python, "install", "-q", "--no-deps", "--force-reinstall", str(wheel))
    if r.returncode:
        raise RuntimeError(f"pip could not install {wheel}")


def problems(plan: ip.InstallPlan, facts: build_record.PythonFacts, cuda) -> list[str]:
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
    if plan.gpu_operations and cuda is None:
        found.append(
            f"NCCL needs a CUDA toolkit (nvcc) and NCCL: {cuda_toolkit.missing(os.environ)}. "
            "Or pass --gpu none for a build without GPU collectives"
        )
    return found


def format_plan(plan: ip.InstallPlan, facts, key: str, wheel: Path | None, cuda, found) -> str:
    """Render the plan as the text ``--dry-run`` prints."""
    env = dict(plan.build_env)
    if plan.gpu_operations:
        env.update(
            cuda_toolkit.describe_env(cuda)
            if cuda is not None
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
        f"CUDA toolkit        {cuda.describe() if cuda is not None else 'NOT FOUND'}"
        if plan.gpu_operations
        else "CUDA toolkit        not used (CPU build)",
        f"wheel cache         {wheel if wheel else 'no cached wheel; it will be compiled'}",
        f"cache key           {key}",
        "verify              horovodrun --check-build; import horovod.tensorflow.mpi_ops",
    ]
    for warning in cuda_toolkit.warnings(cuda) if cuda is not None else []:
        lines.append(f"note: {warning}")
    if found:
        lines.append("before it can build:")
        lines.extend(f"  - {p}" for p in found)
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp install-horovod``'s arguments."""
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (packages, variables, patch) only"
    )
    parser.add_argument(
        "--gpu",
        choices=ip.GPU_OPERATIONS,
        default=None,
        help="Horovod's GPU collectives (default: nccl with NVIDIA GPUs or KMP_DEVICE=cuda)",
    )
    mpi = parser.add_mutually_exclusive_group()
    mpi.add_argument("--mpi", dest="mpi", action="store_true", default=None, help="build MPI in")
    mpi.add_argument("--no-mpi", dest="mpi", action="store_false", help="build without MPI")
    parser.add_argument(
        "--force",
        action="store_true",
        help="reinstall even if the installed Horovod matches (from the cache if it has it)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="compile, neither using nor filling the cache"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    parser.add_argument(
        "--summary", action="store_true", help="print the plan's one-line summary only"
    )


def _plan(args: argparse.Namespace, facts: build_record.PythonFacts) -> ip.InstallPlan:
    from kmp import hardware

    device = ip.device_override(os.environ)
    hw = hardware.detect() if device is None else hardware.Hardware()
    return ip.plan_install(
        hw,
        device=device,
        gpu=args.gpu,
        mpi=args.mpi,
        mpi_available=bool(facts.mpicxx),
        tensorflow_version=facts.tensorflow_version or ip.TENSORFLOW_VERSION,
    )


def run(args: argparse.Namespace) -> int:
    """Plan, then (unless ``--dry-run``) build or reuse a wheel, install and verify it."""
    facts = build_record.python_facts()
    try:
        plan = _plan(args, facts)
    except ValueError as exc:
        print(f"kmp install-horovod: {exc}", file=sys.stderr)
        return 2
    if args.summary:
        print(plan.summary())
        return 0
    cuda = cuda_toolkit.find(os.environ) if plan.gpu_operations else None
    python_tag, platform_tag = _tags()
    key = ip.cache_key(
        plan,
        tensorflow=facts.tensorflow or plan.tensorflow,
        python_tag=python_tag,
        platform_tag=platform_tag,
        cuda_version=cuda.version if cuda is not None else None,
    )
    root = cache_root(os.environ)
    wheel = None if args.no_cache else cached_wheel(root, key)
    found = problems(plan, facts, cuda)
    if args.dry_run:
        if args.json:
            out = {**plan.to_dict(), "cache_key": key, "problems": found}
            print(json.dumps({**out, "cached_wheel": str(wheel) if wheel else None}, indent=2))
        else:
            print(format_plan(plan, facts, key, wheel, cuda, found))
        return 0
    if found:
        for p in found:
            print(f"kmp install-horovod: {p}", file=sys.stderr)
        return 1
    loaded = None if args.force else build_record.up_to_date(key, plan, facts)
    if loaded is not None:
        build_record.write(key, plan, facts, loaded)
        _log(f"Horovod {plan.horovod} is installed and matches the plan ({plan.summary()})")
        return 0
    for warning in cuda_toolkit.warnings(cuda) if cuda is not None else []:
        _log(f"note: {warning}")
    t0 = time.monotonic()
    try:
        if wheel is not None:
            _log(f"installing the cached wheel {wheel}")
            install_wheel(facts.python, wheel)
            bad, loaded = build_record.verify(facts.python, plan)
            if bad:  # never offer a wheel that failed once again
                wheel.unlink(missing_ok=True)
                bad.append(f"the cached wheel {wheel} was removed: run again to rebuild it")
        else:
            with tempfile.TemporaryDirectory(prefix="kmp-horovod-") as tmp:
                built = build_wheel(plan, facts.python, Path(tmp), cuda)
                install_wheel(facts.python, built)
                bad, loaded = build_record.verify(facts.python, plan)
                if not bad and not args.no_cache:  # only a verified build is cached
                    store_wheel(root, key, built)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"kmp install-horovod: {exc}", file=sys.stderr)
        return 1
    if bad:
        for p in bad:
            print(f"kmp install-horovod: {p}", file=sys.stderr)
        return 1
    build_record.write(key, plan, facts, loaded)
    how = "installed from the cache" if wheel is not None else "built"
    _log(f"Horovod {plan.horovod} {how} and verified in {time.monotonic() - t0:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kmp.commands.install_horovod``."""
    parser = argparse.ArgumentParser(
        prog="kmp install-horovod", description=__doc__.splitlines()[0]
    )
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
