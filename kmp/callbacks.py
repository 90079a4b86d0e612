"""Keras 3 callbacks for loss-scaled, Horovod-distributed training.

Horovod's own Keras callbacks do not work with Keras 3 (its variables are not
``tf.Variable`` objects); these are built on :mod:`kmp.distributed` instead and work
in one process as well (every collective is then a no-op).

Order matters: Keras calls callbacks in list order with one shared ``logs``
dict, and appends its own ``History`` and ``ProgbarLogger`` after yours. Use
:func:`default_callbacks`, or keep this order by hand:

1. :class:`BroadcastInitialState`: all ranks start from rank 0's weights and
   optimizer state.
2. :class:`MetricAverage`: epoch-end metrics averaged across ranks, before any
   callback that reads them (EarlyStopping, ReduceLROnPlateau, checkpoints,
   loggers). Ranks that see the same numbers also take the same decisions, so
   no rank stops early while another waits in a collective.
3. :class:`LossScaleMonitor` and :class:`LearningRateWarmup`.
4. Writers, on the chief only: :class:`AtomicCheckpoint` (chief-only by
   itself) and ``chief_only(keras.callbacks.TensorBoard(...))``,
   ``chief_only(keras.callbacks.CSVLogger(...))``.

Pass ``verbose=kmp.callbacks.verbosity()`` to ``fit`` so that only the chief
prints progress bars::

    import kmp

    kmp.distributed.init()
    callbacks = kmp.callbacks.default_callbacks(
        warmup_epochs=3, checkpoint_dir="runs/ckpt", tensorboard_dir="runs/tb"
    )
    model.fit(ds, epochs=10, callbacks=callbacks, verbose=kmp.callbacks.verbosity())
"""

from __future__ import annotations

import math
import os
import re
import string
import uuid
import warnings
import zlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import keras
import numpy as np

__all__ = [
    "AtomicCheckpoint",
    "BroadcastInitialState",
    "Checkpoint",
    "ChiefOnly",
    "LearningRateWarmup",
    "LossScaleMonitor",
    "MetricAverage",
    "atomic_save",
    "chief_only",
    "default_callbacks",
    "latest_checkpoint",
    "verbosity",
]

DEFAULT_CHECKPOINT_NAME = "ckpt-{epoch:04d}.keras"
DEFAULT_WEIGHTS_NAME = "ckpt-{epoch:04d}.weights.h5"
_TMP_PREFIX = ".tmp-"


def _dist() -> ModuleType:
    """Return :mod:`kmp.distributed`, imported on first use (it is light; Horovod is lazy)."""
    from kmp import distributed

    return distributed


def _is_chief() -> bool:
    return bool(_dist().is_chief())


def _size() -> int:
    return int(_dist().size())


def _chief_print(message: str) -> None:
    if _is_chief():
        print(message, flush=True)


def _to_float(value: Any) -> float:
    """Convert a Keras variable, tensor, NumPy or Python scalar to a float."""
    if isinstance(value, keras.Variable):
        value = value.value
    return float(np.asarray(value))


def _model_optimizer(callback: keras.callbacks.Callback, what: str) -> keras.optimizers.Optimizer:
    model = callback.model
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            f"{what} needs a compiled model with an optimizer, but model.optimizer is None. "
            "Call model.compile(optimizer=...) before model.fit(...)."
        )
    return optimizer


def verbosity(chief: int | str = "auto") -> int | str:
    """Return the ``verbose`` value for ``model.fit``: ``chief`` on rank 0, 0 elsewhere.

    Args:
        chief: The verbosity to use on the chief (``"auto"``, 0, 1 or 2).

    Returns:
        ``chief`` on the chief rank (or in a single process), else 0, so that
        only one progress bar is printed.

    Raises:
        ValueError: ``chief`` is not one of ``"auto"``, 0, 1, 2.
    """
    if chief not in ("auto", 0, 1, 2) or isinstance(chief, bool):
        raise ValueError(
            f"verbosity(chief={chief!r}): use 'auto', 0, 1 or 2, as for model.fit(verbose=...)."
        )
    return chief if _is_chief() else 0


# --------------------------------------------------------------------------- broadcast


class BroadcastInitialState(keras.callbacks.Callback):
    """Copy the model's weights and optimizer state from ``root`` to all ranks.

    Runs at the start of every ``fit``: ranks that built their models from
    different random seeds, or where only the chief restored a checkpoint,
    start the first step identical. The optimizer's variables are built first
    when Keras has not built them yet (Keras 3 creates them lazily), so that
    slots such as Adam's moments, the iteration count and the loss scale are
    broadcast as well. In a single process it only builds the optimizer.

    Args:
        root: Rank whose state is copied to the others.
    """

    def __init__(self, root: int = 0):
        super().__init__()
        if isinstance(root, bool) or not isinstance(root, int | np.integer) or root < 0:
            raise ValueError(
                f"BroadcastInitialState(root={root!r}): root must be a rank, an int >= 0."
            )
        self.root = int(root)

    def state_variables(self) -> list[keras.Variable]:
        """Return the variables broadcast: the model's weights, then the optimizer's.

        Builds the optimizer on the model's trainable variables if needed.
        """
        model = self.model
        optimizer = _model_optimizer(self, "BroadcastInitialState")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables: list[keras.Variable] = []
        seen: set[int] = set()
        for v in [*model.weights, *optimizer.variables]:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        return variables

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Broadcast the state from ``root``."""
        variables = self.state_variables()
        size = _size()
        if size == 1:
            return
        if self.root >= size:
            raise ValueError(
                f"BroadcastInitialState(root={self.root}) but only {size} ranks run: "
                f"use a root between 0 and {size - 1}."
            )
        _dist().broadcast_variables(variables, root=self.root)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {"root": self.root}


# --------------------------------------------------------------------------- metric averaging


class MetricAverage(keras.callbacks.Callback):
    """Average the epoch-end metrics over all ranks.

    Each rank computes its metrics on its own shard of the data; at the end of
    every epoch this replaces every numeric entry of ``logs`` (``loss``,
    ``val_loss``, ...) with its mean over the ranks (one allreduce), so that
    every rank, and the chief's logs, report global metrics. Put it before any
    callback that reads the epoch logs. Batch-level logs stay per rank.

    All ranks must log the same metric names; a mismatch raises on every rank
    instead of hanging.
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Replace the numeric entries of ``logs`` with their mean over ranks."""
        if not logs or _size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        dist = _dist()
        signature = zlib.crc32("\0".join(keys).encode())
        local = np.array([len(keys), signature], dtype=np.int64)
        gathered = np.asarray(dist.allgather(local)).reshape(-1, 2)
        if not (gathered == gathered[0]).all():
            raise ValueError(
                f"MetricAverage: the ranks log different metrics at the end of epoch {epoch + 1} "
                f"(this rank: {keys}). Give every rank the same callbacks, metrics and "
                "validation data so that their logs have the same keys."
            )
        if not keys:
            return
        values = np.array([_to_float(logs[k]) for k in keys], dtype=np.float64)
        averaged = np.asarray(dist.allreduce(values, op="average"), dtype=np.float64)
        for k, v in zip(keys, averaged.tolist(), strict=True):
            logs[k] = v

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments (none)."""
        return {}


def _is_number(value: Any) -> bool:
    if isinstance(value, bool | str | bytes) or value is None:
        return False
    try:
        return np.asarray(value).size == 1 and np.issubdtype(np.asarray(value).dtype, np.number)
    except Exception:  # anything that is not array-like is not a metric
        return False


# --------------------------------------------------------------------------- LR warm-up


def _innermost(optimizer: Any) -> Any:
    seen = set()
    while getattr(optimizer, "inner_optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.inner_optimizer
    return optimizer


class LearningRateWarmup(keras.callbacks.Callback):
    """Raise the learning rate linearly over the first epochs, batch by batch.

    With N ranks the effective batch is N times larger and the learning rate
    usually N times larger too (``kmp.wrap_optimizer(..., scale_lr=True)``).
    Starting at that rate can diverge; Goyal et al. (2017, "Accurate, Large
    Minibatch SGD") start at the single-rank rate and raise it linearly to the
    target over the first epochs. At batch ``b`` of epoch ``e`` the rate is::

        start_lr + (target_lr - start_lr) * (e + b / steps_per_epoch) / warmup_epochs

    and ``target_lr`` from ``warmup_epochs`` on. Afterwards the callback does
    not touch the rate again, so other schedulers can take over.

    The optimizer must have a float learning rate: a
    ``keras.optimizers.schedules.LearningRateSchedule`` cannot be set from a
    callback (put the warm-up into the schedule instead, e.g.
    ``keras.optimizers.schedules.CosineDecay(..., warmup_target=..., warmup_steps=...)``).

    Args:
        warmup_epochs: Length of the warm-up in epochs (> 0; may be fractional).
        target_lr: Rate reached at the end of the warm-up. Default: the
            optimizer's rate when training starts. Pass it explicitly when
            resuming a run that stopped during the warm-up.
        start_lr: Rate of the first batch. Default: ``target_lr / size()``
            (the single-rank rate); in one process that is ``target_lr`` and
            the warm-up changes nothing unless ``start_lr`` is given.
        steps_per_epoch: Batches per epoch. Default: taken from ``fit``; needed
            when the dataset's length is unknown.
        verbose: 1 prints the start and the end of the warm-up on the chief.
    """

    def __init__(
        self,
        warmup_epochs: float = 5,
        *,
        target_lr: float | None = None,
        start_lr: float | None = None,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        if (
            isinstance(warmup_epochs, bool)
            or not isinstance(warmup_epochs, int | float)
            or not math.isfinite(warmup_epochs)
            or warmup_epochs <= 0
        ):
            raise ValueError(
                f"LearningRateWarmup(warmup_epochs={warmup_epochs!r}): use a number of epochs "
                "> 0, e.g. 5 (to train without warm-up, leave the callback out)."
            )
        for name, value, minimum in (("target_lr", target_lr, 0.0), ("start_lr", start_lr, 0.0)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"LearningRateWarmup({name}={value!r}): use a float learning rate, "
                    "e.g. 0.1, or None for the default."
                )
            if not math.isfinite(value) or value < minimum or (name == "target_lr" and value == 0):
                raise ValueError(
                    f"LearningRateWarmup({name}={value!r}): use a finite rate "
                    f"{'> 0' if name == 'target_lr' else '>= 0'}."
                )
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool)
            or not isinstance(steps_per_epoch, int | np.integer)
            or steps_per_epoch <= 0
        ):
            raise ValueError(
                f"LearningRateWarmup(steps_per_epoch={steps_per_epoch!r}): use an int > 0 "
                "or None to take it from fit()."
            )
        self.warmup_epochs = float(warmup_epochs)
        self.target_lr = None if target_lr is None else float(target_lr)
        self.start_lr = None if start_lr is None else float(start_lr)
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.verbose = verbose
        self._target: float | None = None
        self._start: float | None = None
        self._steps: int | None = None
        self._epoch = 0
        self._warming = False
        self._done = False

    def lr_at(self, epoch: int, batch: int) -> float:
        """Return the warm-up rate for batch ``batch`` of epoch ``epoch`` (both 0-based).

        Only valid once training has started (the start and target are resolved then).
        """
        if self._target is None or self._start is None or self._steps is None:
            raise RuntimeError("LearningRateWarmup.lr_at() is available once training started.")
        progress = (epoch + batch / self._steps) / self.warmup_epochs
        if progress >= 1.0:
            return self._target
        return self._start + (self._target - self._start) * progress

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resolve the start and target rates and the epoch length."""
        optimizer = _model_optimizer(self, "LearningRateWarmup")
        inner = _innermost(optimizer)
        raw = getattr(inner, "_learning_rate", None)
        if isinstance(raw, keras.optimizers.schedules.LearningRateSchedule) or (
            callable(raw) and not isinstance(raw, keras.Variable)
        ):
            raise TypeError(
                f"LearningRateWarmup needs a float learning rate, but the optimizer uses "
                f"{type(raw).__name__}, whose rate cannot be set from a callback. Either create "
                "the optimizer with a float learning_rate, or leave this callback out and put "
                "the warm-up into the schedule (e.g. keras.optimizers.schedules.CosineDecay("
                "..., warmup_target=..., warmup_steps=...))."
            )
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup does not know how many batches an epoch has (the dataset's "
                "length is unknown): pass steps_per_epoch= to LearningRateWarmup (and to fit)."
            )
        self._steps = int(steps)
        self._done = False
        if self._target is None:
            self._target = (
                self.target_lr if self.target_lr is not None else _to_float(optimizer.learning_rate)
            )
            self._start = self.start_lr if self.start_lr is not None else self._target / _size()
            if self.verbose:
                _chief_print(
                    f"LearningRateWarmup: learning rate from {self._start:.6g} to "
                    f"{self._target:.6g} over {self.warmup_epochs:g} epochs"
                )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Remember the epoch; end a warm-up that stopped short of its last batch."""
        self._epoch = epoch
        if epoch >= self.warmup_epochs and self._warming:
            self._finish(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Set the rate of this batch while warming up."""
        if self._done or self._epoch >= self.warmup_epochs:
            return
        if (self._epoch + batch / self._steps) >= self.warmup_epochs:
            self._finish(self._epoch)
            return
        self._warming = True
        self.model.optimizer.learning_rate = self.lr_at(self._epoch, batch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Add ``learning_rate`` to the epoch logs."""
        if logs is not None:
            logs["learning_rate"] = _to_float(self.model.optimizer.learning_rate)

    def _finish(self, epoch: int) -> None:
        self.model.optimizer.learning_rate = self._target
        self._warming = False
        self._done = True
        if self.verbose:
            _chief_print(
                f"Epoch {epoch + 1}: learning-rate warm-up done, learning rate {self._target:.6g}"
            )

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {
            "warmup_epochs": self.warmup_epochs,
            "target_lr": self.target_lr,
            "start_lr": self.start_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "verbose": self.verbose,
        }


# --------------------------------------------------------------------------- loss-scale monitor


def _scaling_off(optimizer: Any) -> bool:
    """True for a kmp optimizer that neither scales the loss nor can skip a step.

    ``kmp.wrap_optimizer`` under a float32 or bfloat16 policy resolves
    ``loss_scale="dynamic"`` to ``"none"`` (as does an explicit ``loss_scale=None``):
    its scale is a constant 1.0 and, without gradient accumulation, no step is ever
    skipped, so there is nothing to report.
    """
    mode = getattr(optimizer, "loss_scale_mode", None)
    return mode == "none" and getattr(optimizer, "backward_passes_per_step", 1) == 1


def _kmp_style(optimizer: Any) -> bool:
    """True for an optimizer exposing ``loss_scale`` and ``skipped_steps`` as kmp's does."""
    return hasattr(optimizer, "skipped_steps") and hasattr(optimizer, "loss_scale")


def _find_scaler(optimizer: Any) -> Any | None:
    """Return the optimizer that holds the loss scale: ``optimizer`` or one it wraps.

    That is a kmp-style optimizer or a ``keras.optimizers.LossScaleOptimizer``,
    found along the ``inner_optimizer`` chain; None when there is none.
    """
    seen: set[int] = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if _kmp_style(opt) or isinstance(opt, keras.optimizers.LossScaleOptimizer):
            return opt
        opt = getattr(opt, "inner_optimizer", None)
    return None


def _read_loss_scale(scaler: Any | None) -> tuple[float | None, int | None]:
    """Read ``(loss_scale, skipped_steps)`` from what :func:`_find_scaler` returned.

    A kmp optimizer exposes both; a plain ``keras.optimizers.LossScaleOptimizer``
    only its ``dynamic_scale`` (skipped steps are then None, counted by the caller).
    ``(None, None)`` when nothing scales the loss.
    """
    if scaler is None or _scaling_off(scaler):
        return None, None
    if _kmp_style(scaler):
        scale, skipped = scaler.loss_scale, scaler.skipped_steps
        if scale is None:  # a kmp optimizer with loss scaling turned off
            return None, None
        return _to_float(scale), None if skipped is None else int(_to_float(skipped))
    scale = getattr(scaler, "dynamic_scale", None) if scaler.built else None
    return _to_float(scaler.initial_scale if scale is None else scale), None


class LossScaleMonitor(keras.callbacks.Callback):
    """Put the loss scale and the count of skipped steps into the Keras logs.

    After every batch and epoch, ``logs["loss_scale"]`` and
    ``logs["skipped_steps"]`` (steps skipped so far because of inf/nan
    gradients) are added, so the progress bar, ``History``, ``CSVLogger`` and
    ``TensorBoard`` show them. When the count of skipped steps rises, the chief
    prints ``overflow: step skipped, loss scale lowered to X``.

    The scale is read from the model's optimizer: ``loss_scale`` and
    ``skipped_steps`` of a ``kmp.wrap_optimizer`` optimizer, or the
    ``dynamic_scale`` of a plain ``keras.optimizers.LossScaleOptimizer`` (whose
    skipped steps are counted here from the halvings of the scale). Without
    loss scaling nothing is logged; with ``verbose``, a note says so once, except
    for a ``kmp.wrap_optimizer`` optimizer without scaling (float32 and bfloat16
    policies need none, or ``loss_scale=None`` was passed), which stays silent.

    Args:
        verbose: 1 prints overflows on the chief; 0 only logs.
        batch_logs: Also read the scale after every batch (one small read per
            batch). False reads it at epoch end only, so overflows are reported
            once per epoch.
    """

    def __init__(self, verbose: int = 1, batch_logs: bool = True):
        super().__init__()
        if verbose not in (0, 1, 2) or isinstance(verbose, bool):
            raise ValueError(f"LossScaleMonitor(verbose={verbose!r}): use 0, 1 or 2.")
        self.verbose = verbose
        self.batch_logs = bool(batch_logs)
        self._last_scale: float | None = None
        self._last_skipped: int | None = None
        self._counted_skips = 0
        self._warned = False

    def current(self) -> tuple[float | None, int | None]:
        """Return ``(loss_scale, skipped_steps)`` now, or ``(None, None)`` without scaling."""
        scale, skipped = _read_loss_scale(_find_scaler(self._optimizer()))
        if scale is None:
            return None, None
        if skipped is None:  # plain Keras LossScaleOptimizer: count halvings
            if self._last_scale is not None and scale < self._last_scale:
                self._counted_skips += max(1, round(math.log2(self._last_scale / scale)))
            skipped = self._counted_skips
        return scale, skipped

    def _optimizer(self) -> keras.optimizers.Optimizer:
        return _model_optimizer(self, "LossScaleMonitor")

    def _update(self, logs: dict | None) -> None:
        scale, skipped = self.current()
        if scale is None:
            if not self._warned:  # decided once: nothing to report this training
                self._warned = True
                # Silent when kmp.wrap_optimizer chose no scaling (float32/bfloat16).
                if self.verbose and not _scaling_off(_find_scaler(self._optimizer())):
                    _chief_print(
                        "LossScaleMonitor: the optimizer does not scale the loss (nothing to "
                        "report); use kmp.wrap_optimizer under a float16 policy to get loss "
                        "scaling."
                    )
            return
        if self._last_skipped is not None and skipped > self._last_skipped and self.verbose:
            new = skipped - self._last_skipped
            steps = "step skipped" if new == 1 else f"{new} steps skipped"
            _chief_print(f"overflow: {steps}, loss scale lowered to {scale:g}")
        self._last_scale, self._last_skipped = scale, skipped
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Read the starting scale, so the first overflow is detected."""
        self._update(None)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Add the scale and skipped steps to the batch logs."""
        if self.batch_logs:
            self._update(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Add the scale and skipped steps to the epoch logs."""
        self._update(logs)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {"verbose": self.verbose, "batch_logs": self.batch_logs}


# --------------------------------------------------------------------------- chief-only wrapper

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
_BATCH_END_HOOKS = (
    "on_batch_end",
    "on_train_batch_end",
    "on_test_batch_end",
    "on_predict_batch_end",
)


def _forwarder(name: str) -> Callable[..., None]:
    def hook(self: ChiefOnly, *args: Any, **kwargs: Any) -> None:
        if _is_chief():
            getattr(self.callback, name)(*args, **kwargs)

    hook.__name__ = name
    hook.__doc__ = f"Forward ``{name}`` to the wrapped callback on the chief only."
    return hook


class ChiefOnly(keras.callbacks.Callback):
    """Run a callback on the chief (rank 0) only.

    For callbacks that write files or print: ``ModelCheckpoint``,
    ``TensorBoard``, ``CSVLogger``, ``ProgbarLogger``, ``BackupAndRestore``.
    On other ranks every hook, ``set_model`` included, does nothing. The rank is
    checked at each call, so the wrapper can be made before
    ``kmp.distributed.init()``.

    Do not wrap callbacks that change training (EarlyStopping,
    ReduceLROnPlateau, LearningRateScheduler): every rank must take the same
    decisions, so run those on all ranks after :class:`MetricAverage`.

    Args:
        callback: The Keras callback to gate.
    """

    def __new__(cls, callback: Any = None, *args: Any, **kwargs: Any) -> ChiefOnly:
        """Make a gated ProgbarLogger still a ProgbarLogger, so fit() adds no second bar."""
        if cls is ChiefOnly and isinstance(callback, keras.callbacks.ProgbarLogger):
            cls = _ChiefOnlyProgbar
        return super().__new__(cls)

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
        if isinstance(callback, keras.callbacks.History):
            raise TypeError(
                "ChiefOnly(History()): History only records logs in memory and fit() returns "
                "it, so it must run on every rank; do not wrap it."
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
        if _is_chief():
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

    A wrapped ``ProgbarLogger`` still counts as the progress bar for Keras, so
    ``fit`` adds no second one. ``verbose=kmp.callbacks.verbosity()`` in
    ``fit`` is the simpler way to keep progress bars on the chief.

    Args:
        callback: A ``keras.callbacks.Callback`` instance.

    Returns:
        The gated callback.

    Raises:
        TypeError: ``callback`` is not a Keras callback instance, or is ``History``.
    """
    return ChiefOnly(callback)


# --------------------------------------------------------------------------- checkpoints


class Checkpoint(NamedTuple):
    """A checkpoint found by :func:`latest_checkpoint`.

    Attributes:
        path: The file, or None when there is none.
        epoch: Epochs completed when it was written (``initial_epoch`` to
            resume with), 0 when there is none.
    """

    path: str | None
    epoch: int


def _template_regex(template: str) -> re.Pattern[str]:
    """Turn a file-name template such as ``ckpt-{epoch:04d}.keras`` into a regex."""
    parts = []
    has_epoch = False
    for literal, field, _spec, _conv in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field == "epoch" and not has_epoch:
            parts.append(r"(?P<epoch>\d+)")
            has_epoch = True
        elif field == "epoch":
            parts.append(r"\d+")
        else:
            parts.append(r".+?")
    if not has_epoch:
        raise ValueError(
            f"Checkpoint name {template!r} has no {{epoch}} field, so checkpoints cannot be "
            "told apart by epoch: include it, e.g. 'ckpt-{epoch:04d}.keras'."
        )
    return re.compile("".join(parts))


def _checkpoints(directory: str, template: str) -> list[tuple[int, str]]:
    """Return ``(epoch, path)`` of the files in ``directory`` named by ``template``, by epoch."""
    pattern = _template_regex(os.path.basename(template))
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(_TMP_PREFIX):
            continue
        m = pattern.fullmatch(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(path):
            found.append((int(m.group("epoch")), path))
    found.sort()
    return found


def latest_checkpoint(directory: str | os.PathLike, template: str | None = None) -> Checkpoint:
    """Find the newest checkpoint in ``directory``, to resume training from it.

    Args:
        directory: Where :class:`AtomicCheckpoint` writes.
        template: The file-name template it uses. Default: kmp's default
            names, ``ckpt-{epoch:04d}.keras`` and ``ckpt-{epoch:04d}.weights.h5``.

    Returns:
        ``Checkpoint(path, epoch)`` of the highest epoch, or ``Checkpoint(None, 0)``
        when there is none. ``epoch`` is the number of completed epochs: pass
        it to ``fit(initial_epoch=...)``.

    Raises:
        ValueError: ``template`` has no ``{epoch}`` field.

    Example::

        ckpt = kmp.callbacks.latest_checkpoint("runs/ckpt")
        if ckpt.path:
            model = keras.saving.load_model(ckpt.path)
        model.fit(ds, epochs=10, initial_epoch=ckpt.epoch, callbacks=...)
    """
    directory = os.fspath(directory)
    templates = (
        [template]
        if template is not None
        else [
            DEFAULT_CHECKPOINT_NAME,
            DEFAULT_WEIGHTS_NAME,
        ]
    )
    found = [c for t in templates for c in _checkpoints(directory, t)]
    if not found:
        return Checkpoint(None, 0)
    epoch, path = max(found)
    return Checkpoint(path, epoch)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(path: str | os.PathLike, save: Callable[[str], Any]) -> str:
    """Write a file atomically: ``save(tmp)`` in the same directory, then ``os.replace``.

    Readers see the old file or the complete new one, never a partial one; if
    ``save`` fails, the temporary file is removed and the error re-raised.

    Args:
        path: The final file. Its name ends the temporary name too, so
            extension checks (``.keras``, ``.weights.h5``) still pass.
        save: Writes a complete file at the path it is given.

    Returns:
        ``path`` as a string.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex[:12]}-{os.path.basename(path)}")
    try:
        save(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)
    return path


class AtomicCheckpoint(keras.callbacks.Callback):
    """Save the model at epoch ends, on the chief only, atomically, keeping the newest N.

    Each checkpoint is written to a temporary file in the target directory and
    moved into place with ``os.replace``: a crash or a full disk never leaves a
    half-written checkpoint for :func:`latest_checkpoint` to find.

    Args:
        filepath: A directory (files are then named ``ckpt-{epoch:04d}.keras``,
            or ``.weights.h5`` with ``save_weights_only``), or a file-name
            template formatted with ``epoch`` (1-based) and the epoch logs,
            e.g. ``"runs/ckpt/{epoch:03d}-{val_loss:.3f}.keras"``.
        monitor: Metric compared with ``save_best_only``.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (max for accuracy/AUC-like names).
        save_best_only: Save only when ``monitor`` improved.
        save_weights_only: Save weights (``.weights.h5``) rather than the whole
            model (``.keras``, optimizer and loss-scale state included).
        keep: Keep only the newest ``keep`` checkpoints of this name pattern
            (None keeps all). Needs an ``{epoch}`` field in the name.
        save_freq: Save every ``save_freq`` epochs.
        verbose: 1 prints a line per checkpoint written.
    """

    def __init__(
        self,
        filepath: str | os.PathLike,
        *,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        save_weights_only: bool = False,
        keep: int | None = None,
        save_freq: int = 1,
        verbose: int = 0,
    ):
        super().__init__()
        filepath = os.fspath(filepath)
        suffix = ".weights.h5" if save_weights_only else ".keras"
        if "{" not in filepath and not filepath.endswith((".keras", ".h5")):
            filepath = os.path.join(
                filepath, DEFAULT_WEIGHTS_NAME if save_weights_only else DEFAULT_CHECKPOINT_NAME
            )
        if not filepath.endswith(suffix):
            raise ValueError(
                f"AtomicCheckpoint(filepath={filepath!r}, save_weights_only={save_weights_only}): "
                f"the file name must end with {suffix!r} (Keras 3 picks the format from it)."
            )
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"AtomicCheckpoint(mode={mode!r}): use 'auto', 'min' or 'max'.")
        if keep is not None and (
            isinstance(keep, bool) or not isinstance(keep, int | np.integer) or keep < 1
        ):
            raise ValueError(
                f"AtomicCheckpoint(keep={keep!r}): use an int >= 1, or None to keep all."
            )
        if (
            isinstance(save_freq, bool)
            or not isinstance(save_freq, int | np.integer)
            or (save_freq < 1)
        ):
            raise ValueError(
                f"AtomicCheckpoint(save_freq={save_freq!r}): use a number of epochs >= 1."
            )
        if keep is not None:
            _template_regex(os.path.basename(filepath))  # raises without an {epoch} field
        if mode == "auto":
            name = monitor.lower()
            mode = "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"
        self.filepath = filepath
        self.monitor = monitor
        self.mode = mode
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        self.keep = None if keep is None else int(keep)
        self.save_freq = int(save_freq)
        self.verbose = verbose
        self.best = -math.inf if mode == "max" else math.inf
        self.last_saved: str | None = None

    @property
    def directory(self) -> str:
        """The directory checkpoints are written to."""
        return os.path.dirname(os.path.abspath(self.filepath))

    def latest(self) -> Checkpoint:
        """Return the newest checkpoint of this callback's name pattern.

        See :func:`latest_checkpoint`.
        """
        return latest_checkpoint(self.directory, os.path.basename(self.filepath))

    def _improved(self, current: float) -> bool:
        return current > self.best if self.mode == "max" else current < self.best

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Save a checkpoint on the chief when due (and improved with ``save_best_only``)."""
        if not _is_chief() or (epoch + 1) % self.save_freq:
            return
        logs = logs or {}
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"AtomicCheckpoint: no {self.monitor!r} in the logs (have: {sorted(logs)}); "
                    "not saving. Pass monitor= one of those, or give fit() validation data.",
                    stacklevel=2,
                )
                return
            current = _to_float(current)
            if not self._improved(current):
                return
            self.best = current
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"AtomicCheckpoint: cannot format {self.filepath!r} with epoch and the logs "
                f"{sorted(logs)} ({exc!r}); use only those names in the template."
            ) from exc
        if self.save_weights_only:
            atomic_save(path, self.model.save_weights)
        else:
            atomic_save(path, self.model.save)
        self.last_saved = path
        if self.verbose:
            print(f"Epoch {epoch + 1}: checkpoint written to {path}", flush=True)
        if self.keep is not None:
            old = _checkpoints(self.directory, os.path.basename(self.filepath))
            for _epoch, stale in old[: max(0, len(old) - self.keep)]:
                os.remove(stale)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {
            "filepath": self.filepath,
            "monitor": self.monitor,
            "mode": self.mode,
            "save_best_only": self.save_best_only,
            "save_weights_only": self.save_weights_only,
            "keep": self.keep,
            "save_freq": self.save_freq,
            "verbose": self.verbose,
        }


# --------------------------------------------------------------------------- defaults


def default_callbacks(
    *,
    broadcast: bool = True,
    average_metrics: bool = True,
    loss_scale_monitor: bool = True,
    warmup_epochs: float | None = None,
    target_lr: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    keep: int | None = 3,
    save_weights_only: bool = False,
    tensorboard_dir: str | os.PathLike | None = None,
    csv_path: str | os.PathLike | None = None,
    extra: Sequence[keras.callbacks.Callback] = (),
    verbose: int = 1,
) -> list[keras.callbacks.Callback]:
    """Return kmp's callbacks in the order they must run.

    Order: broadcast, metric averaging, loss-scale monitor, warm-up, ``extra``
    (e.g. EarlyStopping, which then sees averaged metrics on every rank), then
    the chief-only writers (checkpoint, TensorBoard, CSV log). Keras appends its
    ``History`` and progress bar after these, so they show the averaged metrics
    and the loss scale.

    Args:
        broadcast: Add :class:`BroadcastInitialState`.
        average_metrics: Add :class:`MetricAverage`.
        loss_scale_monitor: Add :class:`LossScaleMonitor`.
        warmup_epochs: Add :class:`LearningRateWarmup` over this many epochs.
        target_lr: Its ``target_lr`` (default: the optimizer's rate).
        checkpoint_dir: Add :class:`AtomicCheckpoint` writing there.
        keep: Checkpoints kept.
        save_weights_only: Checkpoint weights only.
        tensorboard_dir: Add a chief-only ``keras.callbacks.TensorBoard``.
        csv_path: Add a chief-only ``keras.callbacks.CSVLogger``.
        extra: More callbacks, run after the kmp ones and before the writers.
        verbose: Passed to the monitor, the warm-up and the checkpoint.

    Returns:
        The list to pass to ``model.fit(callbacks=...)``.
    """
    callbacks: list[keras.callbacks.Callback] = []
    if broadcast:
        callbacks.append(BroadcastInitialState())
    if average_metrics:
        callbacks.append(MetricAverage())
    if loss_scale_monitor:
        callbacks.append(LossScaleMonitor(verbose=verbose))
    if warmup_epochs is not None:
        callbacks.append(LearningRateWarmup(warmup_epochs, target_lr=target_lr, verbose=verbose))
    for cb in extra:
        if not isinstance(cb, keras.callbacks.Callback):
            raise TypeError(
                f"default_callbacks(extra=...): {cb!r} is not a keras.callbacks.Callback instance."
            )
        callbacks.append(cb)
    if checkpoint_dir is not None:
        callbacks.append(
            AtomicCheckpoint(
                checkpoint_dir, keep=keep, save_weights_only=save_weights_only, verbose=verbose
            )
        )
    if tensorboard_dir is not None:
        callbacks.append(chief_only(keras.callbacks.TensorBoard(os.fspath(tensorboard_dir))))
    if csv_path is not None:
        callbacks.append(chief_only(keras.callbacks.CSVLogger(os.fspath(csv_path), append=True)))
    return callbacks
