"""Which engine runs the collectives: the pure decision behind ``init(engine=...)``.

Two engines carry kmp's collectives across processes:

* ``"horovod"``: Horovod's TensorFlow collectives (the TensorFlow backend), under
  ``horovodrun``, ``mpirun`` or ``kmp launch``;
* ``"jax"``: JAX's distributed runtime with a Keras ``DataParallel``
  distribution (the JAX backend), under ``kmp launch --engine jax``.

``"auto"`` picks the engine of the Keras backend, unless the launcher named
one (``KMP_ENGINE``). :func:`choose_engine` decides and explains mismatches
before anything starts.
"""

from __future__ import annotations

from kmp._checks import check_choice
from kmp._names import ENGINE_CHOICES

__all__ = ["ENGINES", "choose_engine"]

ENGINES = ENGINE_CHOICES  # kept for kmp.distributed.ENGINES; the names live in kmp._names
_BACKEND_OF = {"horovod": "tensorflow", "jax": "jax"}


def choose_engine(requested: str, backend: str, launched_engine: str | None = None) -> str:
    """Return ``"horovod"`` or ``"jax"``: the engine for this process.

    Args:
        requested: ``"auto"``, ``"horovod"`` or ``"jax"`` (``init(engine=)``).
        backend: The Keras backend (``keras.backend.backend()``).
        launched_engine: The engine the launcher named (``KMP_ENGINE``), or None.

    Raises:
        TypeError: ``requested`` is not a string.
        ValueError: An unknown engine; an engine that contradicts the launcher's;
            or an engine whose Keras backend is not the one in use.
    """
    requested = check_choice("engine", requested, ENGINES, hint="'auto' follows the Keras backend.")
    if requested != "auto" and launched_engine not in (None, requested):
        raise ValueError(
            f"init(engine={requested!r}), but the job was launched with --engine "
            f"{launched_engine} (KMP_ENGINE={launched_engine}). Use engine='auto', or launch "
            f"with kmp launch --engine {requested}."
        )
    if requested != "auto":
        engine = requested
    else:
        engine = launched_engine or ("jax" if backend == "jax" else "horovod")
    need = _BACKEND_OF[engine]
    if backend != need:
        other = "jax" if engine == "horovod" else "horovod"
        raise ValueError(
            f"The {engine} engine runs on Keras's {need} backend, but KERAS_BACKEND is "
            f"{backend!r}. Set KERAS_BACKEND={need} (kmp launch --engine {engine} does), or use "
            f"the {other} engine (kmp launch --engine {other})."
        )
    return engine
