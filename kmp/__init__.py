"""kmp: Keras-first mixed-precision training with Horovod distribution.

Call :func:`kmp.enable` before building a Keras model, keep the outputs in
float32 with :func:`kmp.float32_outputs`, check the model with :func:`kmp.audit`
and wrap the optimizer once with :func:`kmp.wrap_optimizer`::

    import kmp
    kmp.enable()                       # "auto": follows the hardware
    model = kmp.float32_outputs(build_model())
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam()), ...)

Names are imported lazily, so ``import kmp`` loads neither Horovod nor
TensorFlow Datasets.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from kmp._version import __version__
from kmp.versions import warn_if_untested as _warn_if_untested

# Public name -> module that defines it: the whole top-level face (tests/test_public_api.py
# pins it, so growing it is a decision).
_EXPORTS: dict[str, str] = {
    "enable": "kmp.policy",
    "disable": "kmp.policy",
    "current_policy": "kmp.policy",
    "policy_scope": "kmp.policy",
    "float32_outputs": "kmp.layers",
    "keep_float32": "kmp.float32_layers",
    "audit": "kmp.auditing",
    "probe": "kmp.probing",
    "wrap_optimizer": "kmp._dispatch",
    "OptimizerSettings": "kmp.optimizer_settings",
    "LossScale": "kmp.loss_scale",
    "save_model": "kmp.saving",
    "load_model": "kmp.saving",
    "export": "kmp.exporting",
    "quantize": "kmp.quantizing",
    "configure_gpus": "kmp.gpu",
}
# Namespaces reachable as attributes (``kmp.distributed.init()``), each with its own face.
_NAMESPACES: tuple[str, ...] = (
    "callbacks",
    "compat",
    "data",
    "datasets",
    "distributed",
    "elastic",
    "hardware",
    "layers",
    "loss_scale",
    "versions",
    "xla",
)

__all__ = ["__version__", *_EXPORTS]

if _TYPE_CHECKING:  # pragma: no cover  (static analysers see the lazy names)
    from kmp import (  # noqa: F401
        callbacks,
        compat,
        data,
        datasets,
        distributed,
        elastic,
        hardware,
        layers,
        loss_scale,
        versions,
        xla,
    )
    from kmp._dispatch import wrap_optimizer  # noqa: F401
    from kmp.auditing import audit  # noqa: F401
    from kmp.exporting import export  # noqa: F401
    from kmp.float32_layers import keep_float32  # noqa: F401
    from kmp.gpu import configure_gpus  # noqa: F401
    from kmp.layers import float32_outputs  # noqa: F401
    from kmp.loss_scale import LossScale  # noqa: F401
    from kmp.optimizer_settings import OptimizerSettings  # noqa: F401
    from kmp.policy import current_policy, disable, enable, policy_scope  # noqa: F401
    from kmp.probing import probe  # noqa: F401
    from kmp.quantizing import quantize  # noqa: F401
    from kmp.saving import load_model, save_model  # noqa: F401


def __getattr__(name: str) -> _Any:
    if name in _NAMESPACES:
        module = _importlib.import_module(f"kmp.{name}")
        globals()[name] = module
        return module
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kmp' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_NAMESPACES))


# An installed Python, Keras, TensorFlow or JAX outside the tested ranges: a warning that
# names them and the fix (kmp.versions.UntestedVersionWarning; no import of any of them).
_warn_if_untested()
