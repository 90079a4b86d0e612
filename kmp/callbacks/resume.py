"""Resuming inside an epoch: whether a loaded position fits this ``fit``, and skipping to it.

A checkpoint written inside an epoch (``AtomicCheckpoint(save_every_steps=...)``, or on
a signal) records ``epoch`` (epochs completed) and ``step`` (batches of the next epoch
done). :func:`kmp.load_model` hands that position to the model it loads; when ``fit``
starts that epoch, :class:`~kmp.callbacks.AtomicCheckpoint` skips the ``step`` batches
that were already trained on, so the run goes on at the next batch and ends as one that
never stopped would.

How a batch is skipped, on either backend: Keras's loop still counts it (callbacks see
the same batch numbers as in the uninterrupted run), but the model's train function is
not called: the batch is taken from the data and dropped. Nothing is computed, no
random number is drawn and the optimizer does not move. So the data given to ``fit``
must be the whole interrupted epoch, in the same order (docs/checkpoints.md says which
sources give that).

:func:`plan_skip` decides (pure); :class:`StepSkipper` acts on the model.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from kmp.training_state import LOADED_STATE, loaded_state

__all__ = ["StepSkipper", "plan_skip", "warn_unclaimed"]


def plan_skip(
    saved: Any,
    *,
    first_epoch: int,
    steps_per_epoch: int | None,
    world_size: int,
    data_seed: int | None,
) -> int:
    """Return how many batches of ``first_epoch`` to skip to resume from ``saved``.

    Args:
        saved: The loaded checkpoint's ``TrainingState`` (``epoch``, ``step``,
            ``steps_per_epoch``, ``world_size``, ``data_seed``).
        first_epoch: The epoch ``fit`` starts with (its ``initial_epoch``).
        steps_per_epoch: Batches per epoch of this ``fit`` (None: unknown).
        world_size: Processes of this job.
        data_seed: This run's data seed, when the checkpoint callback was given it.

    Returns:
        The number of batches to skip: 0 when the checkpoint was written at an
        epoch's end.

    Raises:
        ValueError: The position does not mean the same examples here: ``fit``
            starts another epoch, or the epoch has another number of batches,
            processes or data seed than when it was written. The message says
            what to change.
    """
    step = int(getattr(saved, "step", 0) or 0)
    if step == 0:
        return 0
    epoch = int(saved.epoch)
    where = f"The checkpoint was written {step} batch(es) into epoch {epoch + 1}"
    restart = (
        "or, to train that epoch again from its first batch, pass "
        "AtomicCheckpoint(resume_inside_epoch=False)."
    )
    if first_epoch != epoch:
        raise ValueError(
            f"{where} ({epoch} epoch(s) done), but fit starts at epoch {first_epoch + 1}: "
            f"pass fit(initial_epoch={epoch}) (kmp.callbacks.latest_checkpoint(...).epoch), "
            + restart
        )
    saved_steps = getattr(saved, "steps_per_epoch", None)
    if steps_per_epoch is not None and saved_steps is not None and saved_steps != steps_per_epoch:
        raise ValueError(
            f"{where} of {saved_steps} batches, but this fit's epoch has {steps_per_epoch}: "
            "another batch size or data set, so batch "
            f"{step + 1} holds other examples. Resume with the batch size and data it was "
            "written with, " + restart
        )
    if steps_per_epoch is not None and step >= steps_per_epoch:
        raise ValueError(
            f"{where}, but this fit's epoch has only {steps_per_epoch} batches: resume with "
            "the data it was written with, " + restart
        )
    saved_world = int(getattr(saved, "world_size", 1) or 1)
    if saved_world != world_size:
        raise ValueError(
            f"{where} by {saved_world} process(es); this job has {world_size}, so each "
            "process's next batch holds other examples. Resume with "
            f"{saved_world} process(es) to go on inside the epoch, " + restart
        )
    saved_seed = getattr(saved, "data_seed", None)
    if data_seed is not None and saved_seed is not None and saved_seed != data_seed:
        raise ValueError(
            f"{where} with data seed {saved_seed}; this run's is {data_seed}, so the "
            f"epoch's order differs. Resume with seed {saved_seed}, " + restart
        )
    return step


def warn_unclaimed(model: keras.Model) -> None:
    """Warn when ``model`` holds a position inside an epoch that no AtomicCheckpoint claimed.

    Called by kmp's other callbacks as an epoch begins: without an
    :class:`~kmp.callbacks.AtomicCheckpoint` in ``fit``, the batches the checkpoint
    had done are trained again. The position is then dropped (warned once).
    """
    saved = loaded_state(model)
    if saved is None:
        return
    setattr(model, LOADED_STATE, None)
    if saved.step:
        warnings.warn(
            f"This model was loaded from a checkpoint written {saved.step} batch(es) into "
            f"epoch {saved.epoch + 1}, but no kmp.callbacks.AtomicCheckpoint in this fit "
            "skips them: they are trained again, and the run will not match one that never "
            "stopped. Add AtomicCheckpoint(...) to the callbacks (with "
            f"fit(initial_epoch={saved.epoch})).",
            UserWarning,
            stacklevel=3,
        )


def _take(source: Any, count: int) -> None:
    """Take ``count`` batches from a Keras train function's iterator argument, and drop them."""
    if not hasattr(source, "__next__"):
        return  # a Keras whose loop hands the train function a batch it already took
    for _ in range(count):
        next(source)  # StopIteration (and TensorFlow's OutOfRange) end the epoch, as in Keras


class StepSkipper:
    """Skip the next ``steps`` calls of ``model.train_function``, dropping their batches.

    Installed at the start of the resumed epoch (after ``fit`` made its train
    function), it puts the train function back by itself once the batches are
    skipped, and :meth:`remove` does so at any time.

    Args:
        model: The model ``fit`` trains.
        steps: Batches to skip (a multiple of ``model.steps_per_execution``).
    """

    def __init__(self, model: keras.Model, steps: int):
        self.model = model
        self.left = int(steps)
        self.skipped = 0
        self._original: Any = None

    def install(self) -> None:
        """Wrap the model's train function."""
        original = self.model.train_function
        if original is None or self.left <= 0:
            return
        self._original = original
        per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)

        def skipping(*args: Any) -> Any:
            if self.left <= 0:
                self.remove()
                return original(*args)
            source = args[-1]  # TensorFlow: (iterator,); JAX: (state, iterator)
            self.left -= per_call
            self.skipped += per_call
            if self.left <= 0:
                self.remove()
            try:
                _take(source, per_call)
            except Exception as exc:  # TensorFlow's OutOfRangeError: the data ran out
                if type(exc).__name__ == "OutOfRangeError":
                    raise StopIteration from exc
                raise
            return ({}, args[0]) if len(args) == 2 else {}

        self.model.train_function = skipping

    def remove(self) -> None:
        """Put the model's own train function back."""
        if self._original is not None:
            self.model.train_function = self._original
            self._original = None
