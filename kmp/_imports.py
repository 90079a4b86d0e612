"""Lazy imports of optional packages, with errors that say how to install them.

``import kmp`` must stay light: Horovod, TensorFlow Datasets, scikit-learn and
matplotlib are imported only when a feature needs them, through the helpers
here, so that a missing package fails at the point of use with an ImportError
naming the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINTS", "SERVE_INSTALL", "is_available", "optional_import"]

# Module name -> how to install it.
INSTALL_HINTS: dict[str, str] = {
    "horovod": (
        "Horovod 0.28.1 must be compiled against your TensorFlow: run `kmp install-horovod` "
        "(it builds it against the TensorFlow in this environment, with NCCL on NVIDIA GPUs "
        "and the TensorFlow >= 2.19 source fix, and checks the result; `--dry-run` shows the "
        "plan), or `bash launch/setup.sh` in a kmp checkout"
    ),
    "tensorflow": "pip install 'kmp[tensorflow]'  (or: pip install tensorflow-cpu==2.21.0)",
    "tensorflow_datasets": "pip install 'kmp[datasets]'",
    "sklearn": "pip install 'kmp[datasets]'  (scikit-learn ships the bundled digits data)",
    "matplotlib": "pip install 'kmp[notebooks]'",
    "tf_keras": "pip install tf-keras==2.21.0  (and set TF_USE_LEGACY_KERAS=1)",
    "jax": "pip install 'kmp[jax]'",
}
# The export formats' converters and runtimes (kmp.export): one install for all of them.
SERVE_INSTALL = 'pip install -r requirements-serve.txt  (or: pip install "kmp[serve]")'
for _module in ("tf2onnx", "onnx", "onnxruntime", "onnxconverter_common", "ai_edge_litert"):
    INSTALL_HINTS[_module] = SERVE_INSTALL


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def optional_import(name: str, *, feature: str | None = None) -> ModuleType:
    """Import ``name`` or raise an ImportError that says how to install it.

    Args:
        name: Dotted module name, e.g. ``"horovod.tensorflow"``.
        feature: What the caller needs it for, used in the error message.

    Returns:
        The imported module.

    Raises:
        ImportError: The module (or its top-level package) is not installed or
            fails to load; the message names the install command.
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(_top(name), f"pip install {_top(name)}")
        what = f" for {feature}" if feature else ""
        raise ImportError(
            f"kmp needs `{name}`{what}, but it could not be imported ({exc}). "
            f"Install it with: {hint}"
        ) from exc


def is_available(name: str) -> bool:
    """Return True if ``name`` can be imported, without raising."""
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
