"""default_callbacks: kmp's callbacks in the order they must run."""

from __future__ import annotations

import os
from collections.abc import Sequence

import keras

from kmp._checks import check_bool
from kmp.callbacks.broadcast import BroadcastInitialState
from kmp.callbacks.checkpoint import AtomicCheckpoint
from kmp.callbacks.chief_only import chief_only
from kmp.callbacks.metrics import MetricAverage
from kmp.callbacks.monitor import LossScaleMonitor
from kmp.callbacks.warmup import LearningRateWarmup

__all__ = ["default_callbacks"]


def default_callbacks(
    *,
    broadcast: bool = True,
    average_metrics: bool = True,
    loss_scale_monitor: bool = True,
    warmup_epochs: float | None = None,
    target_lr: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    keep: int | None = 3,
    checkpoint_every_steps: int | None = None,
    save_weights_only: bool = False,
    data_seed: int | None = None,
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
        checkpoint_every_steps: Also checkpoint every this many steps, inside the
            epoch (``AtomicCheckpoint(save_every_steps=...)``); it also catches
            SIGTERM and SIGUSR1 and stops with a checkpoint.
        save_weights_only: Checkpoint weights only.
        data_seed: The data pipeline's shuffle seed, recorded in each checkpoint.
        tensorboard_dir: Add a chief-only ``keras.callbacks.TensorBoard``.
        csv_path: Add a chief-only ``keras.callbacks.CSVLogger``.
        extra: More callbacks, run after the kmp ones and before the writers.
        verbose: Passed to the monitor, the warm-up and the checkpoint.

    Returns:
        The list to pass to ``model.fit(callbacks=...)``.

    Raises:
        TypeError: A flag is not a bool, or ``extra`` holds something that is
            not a Keras callback instance.
        ValueError: An argument of a callback is out of range (see each callback).
    """
    for name, flag in (
        ("broadcast", broadcast),
        ("average_metrics", average_metrics),
        ("loss_scale_monitor", loss_scale_monitor),
    ):
        check_bool(f"default_callbacks({name})", flag)
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
                checkpoint_dir,
                keep=keep,
                save_every_steps=checkpoint_every_steps,
                save_weights_only=save_weights_only,
                verbose=verbose,
                data_seed=data_seed,
            )
        )
    if tensorboard_dir is not None:
        callbacks.append(chief_only(keras.callbacks.TensorBoard(os.fspath(tensorboard_dir))))
    if csv_path is not None:
        callbacks.append(chief_only(keras.callbacks.CSVLogger(os.fspath(csv_path), append=True)))
    return callbacks
