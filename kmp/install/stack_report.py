"""What ``kmp doctor`` reports: versions, Horovod build facts, hardware, what "auto" picks.

:func:`collect` gathers the facts (TensorFlow and Horovod are imported here, so
a broken build is reported, not fatal) and :func:`format_report` renders them.
``kmp doctor --json`` prints :func:`collect`'s object, with these stable keys:

* ``kmp``, ``python``, ``platform``: versions / platform string;
* ``tensorflow``, ``tensorflow_datasets``, ``jax``, ``tf_keras``: version or null;
* ``keras``: ``{"version", "backend"}``;
* ``tensorflow_build``: ``{"distribution", "version", "cuda", "gpus", "error"}`` (the
  wheel, whether it is built with CUDA, how many GPUs it sees), or null without TensorFlow;
* ``horovod``: ``{"installed", "version", "tensorflow_ops", "gloo", "mpi", "nccl",
  "built_against", "error", "install"}`` (``error`` and ``install`` are null when Horovod
  loads; ``built_against`` is the TensorFlow ``kmp install-horovod`` built it against);
* ``hardware``: :meth:`kmp.hardware.Hardware.to_dict`;
* ``policy``: ``{"auto", "reason"}``, the policy ``kmp.enable("auto")`` picks here;
* ``warnings``: ``[{"code", "problem", "fix"}]`` from :func:`kmp.install.checks.diagnose`.
"""

from __future__ import annotations

import platform

from kmp.versions import installed_distribution, installed_tensorflow

__all__ = ["collect", "format_report"]


def _version(dist: str) -> str | None:
    found = installed_distribution(dist)
    return None if found is None else found[1]


def _tensorflow_facts() -> dict | None:
    found = installed_tensorflow()
    if found is None:
        return None
    facts: dict = {"distribution": found[0], "version": found[1], "cuda": None, "gpus": 0}
    facts["error"] = None
    try:
        import tensorflow as tf

        facts["cuda"] = bool(tf.test.is_built_with_cuda())
        facts["gpus"] = len(tf.config.list_physical_devices("GPU"))
    except Exception as exc:  # a broken TensorFlow is reported, not fatal
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def _horovod_facts() -> dict:
    from kmp._imports import INSTALL_HINTS
    from kmp.install import record

    found = record.read()
    facts: dict = {
        "installed": False,
        "version": _version("horovod"),
        "tensorflow_ops": False,
        "gloo": False,
        "mpi": False,
        "nccl": False,
        "built_against": found.get("tensorflow") if record.is_current(found) else None,
        "error": None,
        "install": None,
    }
    if facts["version"] is None:
        facts["error"] = "horovod is not installed"
        facts["install"] = INSTALL_HINTS["horovod"]
        return facts
    facts["installed"] = True
    try:
        import horovod.tensorflow as hvd
        from horovod.tensorflow import mpi_ops  # noqa: F401  (loads the compiled TF ops)
    except Exception as exc:  # a broken build raises all sorts (ImportError, NotFoundError)
        facts["error"] = f"horovod.tensorflow does not load: {exc}"
        facts["install"] = INSTALL_HINTS["horovod"]
        return facts
    facts["tensorflow_ops"] = True
    facts["gloo"] = bool(hvd.gloo_built())
    facts["mpi"] = bool(hvd.mpi_built())
    facts["nccl"] = bool(hvd.nccl_built())
    return facts


def collect() -> dict:
    """Gather everything ``kmp doctor`` reports, as a JSON-ready dict."""
    import keras

    from kmp import hardware
    from kmp._version import __version__
    from kmp.install.checks import diagnose
    from kmp.policy import choose_policy

    hw = hardware.detect()
    auto, reason = choose_policy(hw, keras.backend.backend())
    tf_build = _tensorflow_facts()  # the one reader of which TensorFlow wheel is installed
    info = {
        "kmp": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tensorflow": tf_build["version"] if tf_build else None,
        "tensorflow_build": tf_build,
        "keras": {"version": keras.__version__, "backend": keras.backend.backend()},
        "horovod": _horovod_facts(),
        "tensorflow_datasets": _version("tensorflow-datasets"),
        "jax": _version("jax"),
        "tf_keras": _version("tf-keras"),
        "hardware": hw.to_dict(),
        "policy": {"auto": auto, "reason": reason},
    }
    info["warnings"] = [f.to_dict() for f in diagnose(info)]
    return info


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _tf_detail(info: dict) -> str:
    tf = info.get("tensorflow_build")
    if not tf:
        return ""
    cuda = "unknown" if tf["cuda"] is None else _yes(tf["cuda"])
    return f"  ({tf['distribution']}, CUDA: {cuda}, GPUs seen: {tf['gpus']})"


def format_report(info: dict) -> str:
    """Render :func:`collect`'s dict as text."""
    hvd = info["horovod"]
    hw = info["hardware"]
    lines = [
        f"kmp                 {info['kmp']}",
        f"Python              {info['python']}  ({info['platform']})",
        f"TensorFlow          {info['tensorflow'] or 'not installed'}{_tf_detail(info)}",
        f"Keras               {info['keras']['version']}  (backend: {info['keras']['backend']})",
        f"tensorflow-datasets {info['tensorflow_datasets'] or 'not installed'}",
        f"JAX                 {info['jax'] or 'not installed'}",
    ]
    if hvd["tensorflow_ops"]:
        lines.append(
            f"Horovod             {hvd['version']}  (TensorFlow ops: yes, "
            f"Gloo: {_yes(hvd['gloo'])}, MPI: {_yes(hvd['mpi'])}, NCCL: {_yes(hvd['nccl'])})"
        )
    else:
        lines.append(f"Horovod             NOT usable: {hvd['error']}")
        lines.append(f"                    install: {hvd['install']}")
    cpu = hw["cpu"]
    lines.append(
        f"CPU                 {cpu['model']}, {cpu['cores']} cores  (avx512_bf16: "
        f"{_yes(cpu['avx512_bf16'])}, AMX: {_yes(cpu['amx'])}, avx512_fp16: "
        f"{_yes(cpu['avx512_fp16'])})"
    )
    if hw["gpus"]:
        for i, g in enumerate(hw["gpus"]):
            mem = f", {g['memory_mib']} MiB" if g["memory_mib"] else ""
            lines.append(
                f"GPU {i:<16}{g['name']} (compute capability {g['compute_capability']}{mem})"
            )
    else:
        lines.append("GPU                 none")
    lines.append(f"TPU                 {_yes(hw['tpu'])}")
    lines.append(f"auto policy         {info['policy']['auto']}: {info['policy']['reason']}")
    warnings = info.get("warnings") or []
    lines.append(f"warnings            {len(warnings) or 'none'}")
    for w in warnings:
        lines.append(f"  WARNING: {w['problem']}")
        lines.append(f"      fix: {w['fix']}")
    return "\n".join(lines)
