"""Support for code written before Keras 3: TF1 sessions and tf-keras (Keras 2).

* :mod:`kmp.compat.v1`: ``tf.compat.v1`` helpers for graph-mode Horovod scripts
  (``session_config``, ``session``, ``distributed_optimizer``).
* :mod:`kmp.compat.keras2`: the tf-keras path (``TF_USE_LEGACY_KERAS=1``) through
  Horovod's own Keras 2 layer (``wrap_optimizer``, ``set_global_policy``,
  ``is_legacy_keras``).

The submodules load lazily: ``import kmp.compat`` imports neither TensorFlow nor
tf-keras nor Horovod.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["keras2", "v1"]

if TYPE_CHECKING:  # pragma: no cover
    from kmp.compat import keras2, v1


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = importlib.import_module(f"kmp.compat.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kmp.compat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
