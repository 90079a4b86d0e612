"""ChiefOnly and chief_only: run a Keras callback on the chief (rank 0) only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from kmp.callbacks._ranks import is_chief

__all__ = ["ChiefOnly", "chief_only"]

# Every Keras hook, forwarded to the wrapped callback on the chief only.
_HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    "on_train_begin",
    "on_train_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
)
# The hooks whose defaults let Keras dispatch batch ends asynchronously.
_BATCH_END_HOOKS = (
    "on_batch_end",
    "on_train_batch_end",
    "on_test_batch_end",
    "on_predict_batch_end",
)


def _forwarder(name: str) -> Callable[..., None]:
    """Make the hook ``name`` that calls the wrapped callback's on the chief only."""

    def hook(self: ChiefOnly, *args: Any, **kwargs: Any) -> None:
        if is_chief():
            getattr(self.callback, name)(*args, **kwargs)

    hook.__name__ = name
    hook.__doc__ = f"Forward ``{name}`` to the wrapped callback on the chief only."
    return hook


class ChiefOnly(keras.callbacks.Callback):
    """Run a callback on the chief (rank 0) only.

    For callbacks that write files or print: ``ModelCheckpoint``,
    ``TensorBoard``, ``CSVLogger``. On other ranks every
    hook, ``set_model`` included, does nothing. The rank is checked at each
    call, so the wrapper can be made before ``kmp.distributed.init()``.

    Do not wrap callbacks that change training (EarlyStopping,
    ReduceLROnPlateau, LearningRateScheduler): every rank must take the same
    decisions, so run those on all ranks after :class:`MetricAverage`.
    ``BackupAndRestore`` is refused: it restores as well as writes, and a backup
    restored on the chief alone would leave the other ranks at the start (use
    :class:`kmp.callbacks.AtomicCheckpoint`, or one ``backup_dir`` per rank).

    Wrap a ``ProgbarLogger`` with :func:`chief_only`, which returns a wrapper
    that Keras still recognises as the progress bar (``ChiefOnly`` itself
    refuses one, since Keras would then add a second bar).

    Args:
        callback: The Keras callback to gate.

    Raises:
        TypeError: ``callback`` is not a Keras callback instance, is
            ``History``, or is a ``ProgbarLogger`` passed to ``ChiefOnly``
            directly instead of to :func:`chief_only`.
    """

    def __init__(self, callback: keras.callbacks.Callback):
        super().__init__()
        if isinstance(callback, type):
            raise TypeError(
                f"ChiefOnly got the class {callback.__name__}, not an instance: "
                f"write ChiefOnly({callback.__name__}(...))."
            )
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                f"ChiefOnly expects a keras.callbacks.Callback instance, got "
                f"{type(callback).__name__}. Wrap a Keras callback, e.g. "
                "ChiefOnly(keras.callbacks.CSVLogger('log.csv'))."
            )
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise TypeError(
                "ChiefOnly(BackupAndRestore(...)): BackupAndRestore restores as well as "
                "writes, and restored on the chief alone the other ranks would start over "
                "and drift apart. Use kmp.callbacks.AtomicCheckpoint (every rank resumes, "
                "also mid-epoch; see docs/checkpoints.md), or give every rank its own folder: "
                "BackupAndRestore(backup_dir=f'backup/rank{kmp.distributed.rank()}')."
            )
        if isinstance(callback, keras.callbacks.History):
            raise TypeError(
                "ChiefOnly(History()): History only records logs in memory and fit() returns "
                "it, so it must run on every rank; do not wrap it."
            )
        if isinstance(callback, keras.callbacks.ProgbarLogger) and not isinstance(
            self, keras.callbacks.ProgbarLogger
        ):
            raise TypeError(
                "ChiefOnly(ProgbarLogger()): Keras would not see this wrapper as the progress "
                "bar and would add a second one. Use "
                "kmp.callbacks.chief_only(keras.callbacks.ProgbarLogger()), or drop the "
                "callback and pass verbose=kmp.callbacks.verbosity() to fit()."
            )
        self.callback = callback
        # Keep Keras's async batch-end dispatch when the wrapped callback allows it.
        self.async_safe = bool(getattr(callback, "async_safe", False)) or all(
            getattr(getattr(callback, h), "_is_default", False) for h in _BATCH_END_HOOKS
        )

    def set_params(self, params: dict) -> None:
        """Store the params and pass them on (no side effects)."""
        super().set_params(params)
        self.callback.set_params(params)

    def set_model(self, model: keras.Model) -> None:
        """Store the model; pass it on on the chief only."""
        super().set_model(model)
        if is_chief():
            self.callback.set_model(model)

    def __repr__(self) -> str:
        return f"ChiefOnly({self.callback!r})"


for _name in _HOOKS:
    setattr(ChiefOnly, _name, _forwarder(_name))
del _name


class _ChiefOnlyProgbar(ChiefOnly, keras.callbacks.ProgbarLogger):
    """A gated ProgbarLogger that Keras still recognises, so it adds no second bar."""


def chief_only(callback: keras.callbacks.Callback) -> ChiefOnly:
    """Wrap ``callback`` so that it runs on the chief (rank 0) only (see :class:`ChiefOnly`).

    A wrapped ``ProgbarLogger`` is still a ``ProgbarLogger``, so Keras counts
    it as the progress bar and ``fit`` adds no second one.
    ``verbose=kmp.callbacks.verbosity()`` in ``fit`` is the simpler way to
    keep progress bars on the chief.

    Args:
        callback: A ``keras.callbacks.Callback`` instance.

    Returns:
        The gated callback: a :class:`ChiefOnly`, which for a ``ProgbarLogger``
        is also a ``keras.callbacks.ProgbarLogger``.

    Raises:
        TypeError: ``callback`` is not a Keras callback instance, or is ``History``.
    """
    if isinstance(callback, keras.callbacks.ProgbarLogger):
        return _ChiefOnlyProgbar(callback)
    return ChiefOnly(callback)
