"""What Horovod build is in this Python environment, and what it was built against.

``kmp install-horovod`` writes a small record after it has verified a build:
the cache key, the TensorFlow it was compiled against, its build flags and the
size and time of Horovod's TensorFlow library. ``kmp doctor`` and the next
``kmp install-horovod`` read it: a record whose library no longer matches was
left by another build and is ignored.

The facts of a Python environment are read from its package metadata
(:func:`python_facts`); whether Horovod loads is asked of a child Python
(:func:`load_facts`), so a broken build cannot take the caller down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kmp.install import plan as ip
from kmp.versions import installed_tensorflow

__all__ = [
    "CONTROLLER_FLAGS",
    "PythonFacts",
    "built_flags",
    "is_current",
    "load_facts",
    "python_facts",
    "read",
    "record_path",
    "up_to_date",
    "verify",
    "write",
]

# What a build record says the library was built with (load_facts's keys of the same names).
CONTROLLER_FLAGS = ("gloo", "mpi", "nccl")

_LOAD_CODE = r"""
import json, os, sysconfig
out = {"loaded": False, "error": None, "tensorflow": None}
try:
    import horovod  # pure Python: a missing Horovod is found before TensorFlow's import
    import tensorflow as tf
    out["tensorflow"] = tf.__version__
    import horovod.tensorflow as hvd
    from horovod.tensorflow import mpi_ops  # the compiled TensorFlow ops
    lib = os.path.join(os.path.dirname(hvd.__file__),
                       "mpi_lib" + sysconfig.get_config_var("EXT_SUFFIX"))
    st = os.stat(lib)
    out.update(loaded=True, version=horovod.__version__, gloo=bool(hvd.gloo_built()),
               mpi=bool(hvd.mpi_built()), nccl=bool(hvd.nccl_built()),
               library={"path": lib, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print("KMP-LOAD " + json.dumps(out))
"""


@dataclasses.dataclass(frozen=True)
class PythonFacts:
    """The Python environment Horovod is built into.

    Attributes:
        python: Its interpreter.
        prefix: Its ``sys.prefix`` (where the record lives).
        tensorflow: The installed TensorFlow as ``"dist==version"``, or None.
        tensorflow_version: Its version, or None.
        mpicxx: OpenMPI's compiler wrapper, or None.
        compiler: A C++ compiler, or None.
    """

    python: str
    prefix: str
    tensorflow: str | None
    tensorflow_version: str | None
    mpicxx: str | None
    compiler: str | None


def python_facts() -> PythonFacts:
    """Read the facts of the running Python environment (no TensorFlow import)."""
    tf = installed_tensorflow()
    return PythonFacts(
        python=sys.executable,
        prefix=sys.prefix,
        tensorflow=f"{tf[0]}=={tf[1]}" if tf else None,
        tensorflow_version=tf[1] if tf else None,
        mpicxx=shutil.which("mpicxx"),
        compiler=shutil.which("c++") or shutil.which("g++"),
    )


def load_facts(python: str) -> dict:
    """Ask ``python`` whether Horovod's TensorFlow ops load, and what they were built with.

    Returns:
        ``{"loaded", "error", "tensorflow", "version", "gloo", "mpi", "nccl",
        "library"}`` (the build keys only when it loaded).
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run(
        [python, "-c", _LOAD_CODE], capture_output=True, text=True, env=env, timeout=600
    )
    for line in r.stdout.splitlines():
        if line.startswith("KMP-LOAD "):
            return json.loads(line[len("KMP-LOAD ") :])
    return {"loaded": False, "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}


def _launcher_version(python: str) -> str | None:
    """``horovodrun --version`` of the environment of ``python`` (None: it did not run)."""
    horovodrun = Path(python).parent / "horovodrun"
    if not horovodrun.exists():
        return None
    r = subprocess.run([str(horovodrun), "--version"], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else None


def verify(
    python: str, plan: ip.InstallPlan, *, check_launcher: bool = True
) -> tuple[list[str], dict]:
    """Check the Horovod installed for ``python`` against ``plan``.

    It loads the TensorFlow ops in a child process and reads the flags they were
    built with (Gloo, MPI, NCCL: what ``horovodrun --check-build`` reports, read
    once, where that command imports TensorFlow six times: 48 s measured); with
    ``check_launcher``, ``horovodrun --version`` must run and name the planned
    version.

    Returns:
        What is wrong (empty: it matches ``plan``), and :func:`load_facts`'s dict.
    """
    facts = load_facts(python)
    if not facts["loaded"]:
        return [
            f"Horovod's TensorFlow ops do not load ({facts['error']}); rebuild with "
            "kmp install-horovod --force"
        ], facts
    bad = []
    want = {"gloo": True, "mpi": plan.mpi, "nccl": plan.gpu_operations == "NCCL"}
    if facts["version"] != plan.horovod:
        bad.append(f"Horovod {facts['version']} is installed, not {plan.horovod}")
    for flag, wanted in want.items():
        if facts[flag] != wanted:
            bad.append(f"Horovod was built {'without' if wanted else 'with'} {flag.upper()}")
    if check_launcher:
        shown = _launcher_version(python)
        if shown is None:
            bad.append(
                "horovodrun --version did not run: reinstall with kmp install-horovod --force"
            )
        elif shown != plan.horovod:
            bad.append(
                f"horovodrun --version shows {shown!r}, not {plan.horovod}: reinstall with "
                "kmp install-horovod --force"
            )
    return bad, facts


def record_path(prefix: str | None = None) -> Path:
    """Return where the build record of the environment at ``prefix`` lives."""
    return Path(prefix or sys.prefix) / "share" / "kmp" / "horovod-build.json"


def write(key: str, plan: ip.InstallPlan, facts: PythonFacts, loaded: dict) -> Path:
    """Record the verified build (``loaded``: :func:`verify`'s load facts, nothing wrong)."""
    record = {
        "key": key,
        "horovod": plan.horovod,
        "tensorflow": facts.tensorflow,
        "plan": plan.summary(),
        "library": loaded.get("library"),
        # The controllers the verified library was built with: what horovodrun asks (and
        # kmp.launching.horovodrun answers from here, without importing TensorFlow).
        "built": {flag: bool(loaded.get(flag)) for flag in CONTROLLER_FLAGS},
    }
    path = record_path(facts.prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read(prefix: str | None = None) -> dict | None:
    """Return the environment's build record, or None when there is none."""
    try:
        return json.loads(record_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def built_flags(prefix: str | None = None) -> dict[str, bool] | None:
    """What the installed Horovod was built with (``gloo``, ``mpi``, ``nccl``), from its record.

    None when there is no record, it describes another library (not :func:`is_current`),
    or it predates these flags: then only loading Horovod can tell.
    """
    rec = read(prefix)
    built = (rec or {}).get("built")
    if not is_current(rec) or not isinstance(built, dict):
        return None
    if set(built) != set(CONTROLLER_FLAGS) or not all(isinstance(v, bool) for v in built.values()):
        return None
    return dict(built)


def is_current(record: dict | None) -> bool:
    """True when the record describes the Horovod library installed now."""
    lib = (record or {}).get("library") or {}
    try:
        st = os.stat(lib["path"])
    except (KeyError, OSError):
        return False
    return (st.st_size, st.st_mtime_ns) == (lib.get("size"), lib.get("mtime_ns"))


def up_to_date(key: str, plan: ip.InstallPlan, facts: PythonFacts) -> dict | None:
    """Return the load facts when the installed Horovod matches ``plan``, else None.

    A current record made under another key (another TensorFlow, other build
    variables) means a rebuild; a build without a record that loads with the
    planned flags is accepted (the caller records it).
    """
    record = read(facts.prefix)
    if record and is_current(record) and record.get("key") != key:
        return None
    bad, loaded = verify(facts.python, plan, check_launcher=False)
    return None if bad else loaded
