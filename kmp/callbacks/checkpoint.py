"""AtomicCheckpoint: the whole training state, at epoch ends, every N steps and on a signal.

Names and finding the newest are :mod:`kmp.callbacks.checkpoint_files`'s; resuming
inside an epoch is :mod:`kmp.callbacks.resume`'s; catching a scheduler's signal and the
ranks' agreement is :mod:`kmp.callbacks.preemption`'s. This callback decides when to
write and writes.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import keras

from kmp import distributed, rank_weights
from kmp._checks import check_bool, check_int
from kmp.callbacks import preemption
from kmp.callbacks._ranks import is_chief, to_float
from kmp.callbacks.async_write import AsyncWriter, snapshot
from kmp.callbacks.checkpoint_files import (
    TMP_PREFIX,
    FoundCheckpoint,
    atomic_save,
    checked_filepath,
    checkpoint_path,
    checkpoints,
    latest_checkpoint,
    template_regex,
)
from kmp.callbacks.checkpoint_schedule import (
    DEFAULT_AGREE_EVERY_SECONDS,
    AgreementCadence,
    InEpochSchedule,
    checked_counts,
    monitor_mode,
)
from kmp.callbacks.preemption import DEFAULT_SIGNALS, Preempted, SignalCatcher, agree
from kmp.callbacks.resume import StepSkipper, plan_skip
from kmp.saving import load_model, save_model
from kmp.training_state import LOADED_STATE, capture, gather_seed_states, loaded_state

__all__ = ["AtomicCheckpoint", "FoundCheckpoint", "atomic_save", "latest_checkpoint"]


class AtomicCheckpoint(keras.callbacks.Callback):
    """Save the whole training state atomically: at epoch ends, every N steps, on a signal.

    Every rank's random state and differing non-trainable weights are gathered
    (collectives), then the chief alone writes to a temporary file moved into place
    with ``os.replace``: a crash or a full disk never leaves a half-written checkpoint.

    Inside an epoch (``save_every_steps``, ``save_every_seconds``, a signal) the
    checkpoint records the batches of the epoch done. A model loaded from it with
    :func:`kmp.load_model` and trained with ``fit(initial_epoch=ckpt.epoch)`` goes on at
    the next batch: this callback skips the batches done (read and dropped, nothing
    computed), so the run ends as one that never stopped, given the same data in the
    same order (docs/checkpoints.md).

    During ``fit`` the ``signals`` (SIGTERM, SIGUSR1: a time limit, a preemption) no
    longer end the process at once: every rank finishes its step, the ranks agree on
    it, one checkpoint is written and :class:`~kmp.callbacks.preemption.Preempted` is
    raised (``SystemExit`` 75: run again to resume). A handler installed before is
    chained; the same signal twice ends the process as it would without kmp.

    Args:
        filepath: A directory (files are then named ``ckpt-{epoch:04d}.keras`` and,
            inside an epoch, ``ckpt-{epoch:04d}-step-{step:06d}.keras``, or
            ``.weights.h5`` with ``save_weights_only``), or a file-name template
            formatted with ``epoch`` (epochs completed), ``step`` (batches of the
            next epoch done) and, at epoch ends, the epoch logs, e.g.
            ``"runs/ckpt/{epoch:03d}-{val_loss:.3f}.keras"``.
        monitor: Metric compared with ``save_best_only``.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (max for accuracy/AUC-like names).
        save_best_only: Save only when ``monitor`` improved (epoch ends only).
        save_weights_only: Save weights (``.weights.h5``) rather than the whole
            training state (``.keras`` through :func:`kmp.saving.save_model`: the
            optimizer with every variable, the random generators' states, the
            position and a manifest; :func:`kmp.load_model` restores all of it).
        keep: Keep only the newest ``keep`` checkpoints of this name pattern,
            epoch-end and step ones counted together (None keeps all). Needs an
            ``{epoch}`` field in the name.
        save_freq: Save every ``save_freq`` epochs.
        verbose: 1 (or 2) prints a line per checkpoint written.
        data_seed: The data pipeline's shuffle seed (``kmp.data.load(seed=...)``),
            recorded in the checkpoint; a resume inside an epoch with another
            seed is refused.
        save_every_steps: Also save every this many training steps (counted
            across epochs), inside the epoch. None: not by steps.
        save_every_seconds: Also save when this many seconds passed since the
            last checkpoint (the chief's clock, when the ranks next agree). None:
            not by time. Give one of the two.
        signals: The signals that stop training with a checkpoint (names such
            as ``"SIGTERM"``, ``"SIGUSR1"``, ``"SIGINT"``); ``()`` or None turns
            signal handling off. A name with epoch logs or without ``{epoch}``
            (``"best.keras"``) cannot hold a position: signals are then not caught
            (with a warning when they were asked for).
        resume_inside_epoch: Skip the batches a loaded checkpoint had done in its
            epoch (False: train that epoch again from its first batch).
        agree_every_seconds: With several ranks, how often (about, in steps from
            the step time) they agree whether one caught a signal: a signal is
            answered within this time plus a step and the write. One small
            all-reduce after every step (0) cost the GPT 14 % on 2 CPU ranks.
        async_write: Write checkpoints in a background thread: the step only copies
            the variables to host memory (:mod:`kmp.callbacks.async_write`; costs a
            second copy of the model and optimizer in host memory). The first
            checkpoint and a signal's are written at once.

    Raises:
        TypeError: An argument has the wrong type (e.g. ``keep="3"``).
        ValueError: An argument is out of range or unknown (e.g. ``keep=0``,
            ``mode="up"``, ``save_every_steps=0``, both ``save_every_steps`` and
            ``save_every_seconds``, an unknown signal), the file name has the
            wrong extension, or a name without an ``{epoch}`` field where one is
            needed.
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
        data_seed: int | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        signals: Sequence[str] | None = DEFAULT_SIGNALS,
        resume_inside_epoch: bool = True,
        agree_every_seconds: float = DEFAULT_AGREE_EVERY_SECONDS,
        async_write: bool = False,
    ):
        super().__init__()
        filepath = os.fspath(filepath)
        save_best_only = check_bool("AtomicCheckpoint(save_best_only)", save_best_only)
        save_weights_only = check_bool("AtomicCheckpoint(save_weights_only)", save_weights_only)
        filepath = checked_filepath(filepath, save_weights_only)
        mode = monitor_mode(monitor, mode)
        keep, save_freq, verbose = checked_counts(keep, save_freq, verbose)
        schedule = InEpochSchedule.from_arguments(
            filepath,
            every_steps=save_every_steps,
            every_seconds=save_every_seconds,
            signals=signals,
            save_best_only=save_best_only,
            agree_every_seconds=agree_every_seconds,
        )
        resume_inside_epoch = check_bool(
            "AtomicCheckpoint(resume_inside_epoch)", resume_inside_epoch
        )
        async_write = check_bool("AtomicCheckpoint(async_write)", async_write)
        if async_write and save_weights_only:
            raise ValueError(
                "AtomicCheckpoint(async_write=True) writes the whole training state; it "
                "cannot be combined with save_weights_only=True."
            )
        if keep is not None:
            template_regex(os.path.basename(filepath))  # raises without an {epoch} field
        self.filepath = filepath
        self.schedule = schedule
        self.step_filepath = schedule.step_filepath
        self.monitor = monitor
        self.mode = mode
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.keep = keep
        self.save_freq = save_freq
        self.verbose = verbose
        if data_seed is not None:
            data_seed = check_int("AtomicCheckpoint(data_seed)", data_seed, minimum=0)
        self.data_seed = data_seed
        self.save_every_steps = schedule.every_steps
        self.save_every_seconds = schedule.every_seconds
        self.signals = schedule.signals
        self.resume_inside_epoch = resume_inside_epoch
        self.async_write = async_write
        self._writer: AsyncWriter | None = None
        self.best = -math.inf if mode == "max" else math.inf
        self.last_saved: str | None = None
        self.saved: list[str] = []  # every file this callback wrote (on the chief only)
        self.skipped_steps = 0  # batches skipped on the last resume inside an epoch
        self.signal_seconds: float | None = None  # from the signal to its checkpoint
        self._catcher = SignalCatcher(schedule.signals, active=preemption.inside_fit)
        self._skipper: StepSkipper | None = None
        self._skip_epoch = -1
        self._first_epoch = True
        self._epoch = 0
        self._steps = 0  # training steps of this fit (skipped batches not counted)
        self._last_save = 0.0

    @property
    def directory(self) -> str:
        """The directory checkpoints are written to."""
        return os.path.dirname(os.path.abspath(self.filepath))

    def _templates(self) -> list[str]:
        names = [os.path.basename(self.filepath)]
        if self.step_filepath and self.step_filepath != self.filepath:
            names.append(os.path.basename(self.step_filepath))
        return names

    def latest(self) -> FoundCheckpoint:
        """Return the newest checkpoint of this callback's name patterns.

        See :func:`latest_checkpoint`.
        """
        found = checkpoints(self.directory, self._templates())
        if not found:
            return FoundCheckpoint(None, 0, 0)
        epoch, step, path = found[-1]
        return FoundCheckpoint(path, epoch, step)

    def _improved(self, current: float) -> bool:
        return current > self.best if self.mode == "max" else current < self.best

    # ------------------------------------------------------------------ fit's life

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Catch the signals; start the clocks and the step count."""
        self._first_epoch = True
        self._steps = 0
        self.skipped_steps = 0
        self._skip_epoch = -1
        self._last_save = time.monotonic()
        self._cadence = AgreementCadence(self.schedule.agree_every_seconds)
        self._catcher.caught = self._catcher.caught_at = None
        self._catcher.install()
        # The position a loaded model holds is claimed here, before any epoch begins
        # (resume.warn_unclaimed tells a fit without this callback that it is not resumed).
        self._resuming = loaded_state(self.model)
        setattr(self.model, LOADED_STATE, None)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Put the signal handlers and the train function back."""
        self._release()

    def _release(self, *, checkpointed: bool = False) -> None:
        if self._writer is not None:
            self._writer.wait()  # no write is left behind
        self._catcher.remove(checkpointed=checkpointed)
        if self._skipper is not None:
            self._skipper.remove()
            self._skipper = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """At the first epoch of a resumed run, skip the batches its checkpoint had done."""
        self._epoch = epoch
        if not self._first_epoch:
            return
        self._first_epoch = False
        saved, self._resuming = self._resuming, None
        if saved is None or not self.resume_inside_epoch:
            return
        try:
            skip = plan_skip(
                saved,
                first_epoch=epoch,
                steps_per_epoch=self.params.get("steps") if self.params else None,
                world_size=distributed.size(),
                data_seed=self.data_seed,
            )
        except ValueError:
            self._release()
            raise
        self.skipped_steps = skip
        self._skip_epoch = epoch
        if skip:
            self._skipper = StepSkipper(self.model, skip)
            self._skipper.install()
            if self.verbose and is_chief():
                print(
                    f"Epoch {epoch + 1}: resuming after batch {skip} (skipping the batches "
                    "its checkpoint had done)",
                    flush=True,
                )

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Save inside the epoch when due, and stop every rank together on a signal."""
        if self._epoch == self._skip_epoch and batch < self.skipped_steps:
            return  # a skipped batch: nothing trained
        self._steps += 1
        done = batch + 1
        steps = self.params.get("steps") if self.params else None
        now = time.monotonic()
        due = self.schedule.due(self._steps, now - self._last_save)
        signalled = self._catcher.number()
        if distributed.size() > 1 and self.schedule.needs_agreement:
            if self._cadence.due(self._steps):  # every rank meets after the same step
                got = agree([signalled, float(due), self._cadence.proposal(self._steps, now)])
                signalled, due = self._catcher.agreed(got[0]), bool(got[1])
                self._cadence.agreed(self._steps, got[2], now)
            else:  # between meetings no rank acts alone (steps count the same everywhere)
                signalled, due = 0, due and self.schedule.every_seconds is None
        at_epoch_end = steps is not None and done >= steps
        if signalled:
            if at_epoch_end:
                return  # on_epoch_end writes the epoch's checkpoint and stops
            path = self._save(self._epoch, done, {}, background=False)
            self._preempted(path, self._epoch, done)
        if due and not at_epoch_end:
            self._save(self._epoch, done, {})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Save a checkpoint on the chief when due (and improved with ``save_best_only``)."""
        signalled = self._catcher.number()
        if distributed.size() > 1 and self.signals:
            signalled = self._catcher.agreed(agree([signalled])[0])
        due = not (epoch + 1) % self.save_freq
        if not due and not signalled:
            return
        best_only = due and self.save_best_only
        path = self._save(epoch + 1, 0, logs or {}, best_only=best_only, background=not signalled)
        if signalled:
            self._preempted(path, epoch + 1, 0)

    def _preempted(self, path: str | None, epoch: int, step: int) -> None:
        """After a signal's checkpoint: every rank waits for it, then all leave fit."""
        distributed.barrier()  # no rank exits (and has its launcher stop the chief) mid-write
        name = self._catcher.caught or "signal"
        if self._catcher.caught_at is not None:
            self.signal_seconds = time.monotonic() - self._catcher.caught_at
        self._release(checkpointed=True)  # a later SIGTERM (a peer left first): still 75
        if is_chief():
            preemption.mark_preempted(path)
            seconds = ""
            if self.signal_seconds is not None:
                seconds = f" {self.signal_seconds:.2f} s after it"
            print(
                f"kmp: {name} during epoch {epoch + (1 if step else 0)}: checkpoint "
                f"{path} written{seconds}; stopping (exit status 75, run again to resume)",
                flush=True,
            )
        raise Preempted(name, path if is_chief() else None, epoch, step)

    def _save(
        self, epoch: int, step: int, logs: dict, *, best_only: bool = False, background: bool = True
    ) -> str | None:
        """Write the checkpoint of position ``(epoch, step)``; return its path on the chief."""
        # Every rank's dropout state and its own non-trainable weights, gathered on every
        # rank (collectives) before the chief alone decides and writes.
        seeds = per_rank = None
        if not self.save_weights_only:
            seeds = gather_seed_states(self.model)
            per_rank = rank_weights.gather(self.model)  # e.g. BatchNorm's moving statistics
        self._last_save = time.monotonic()
        if not is_chief():
            return None
        if best_only:
            current = logs.get(self.monitor)
            if current is None:
                warnings.warn(
                    f"AtomicCheckpoint: no {self.monitor!r} in the logs (have: {sorted(logs)}); "
                    "not saving. Pass monitor= one of those, or give fit() validation data.",
                    stacklevel=3,
                )
                return None
            current = to_float(current)
            if not self._improved(current):
                return None
            self.best = current
        path = checkpoint_path(
            self.filepath if step == 0 else self.step_filepath, epoch, step, logs
        )
        steps = self.params.get("steps") if self.params else None
        state = capture(
            self.model,
            epoch=epoch,
            step=step,
            steps_per_epoch=steps,
            data_seed=self.data_seed,
            rank_seed_states=seeds,
        )
        where = f"Epoch {epoch}" if step == 0 else f"Epoch {epoch + 1}, step {step}"

        def write(model: keras.Model) -> str:
            with distributed.alone():  # the chief writes without the other processes
                if self.save_weights_only:
                    atomic_save(path, model.save_weights)
                else:  # the model, its optimizer and the training state
                    save_model(
                        model, path, rank_weights=per_rank, temp_prefix=TMP_PREFIX, state=state
                    )
            if self.verbose:
                print(f"{where}: checkpoint written to {path}", flush=True)
            self._prune()
            return path

        writer = self._async_writer(background)
        if writer is None or not writer.has_twin:
            if self._writer is not None:
                self._writer.wait()
            write(self.model)
            if writer is not None:
                with distributed.alone():
                    writer.adopt(path)  # the copy later checkpoints are written from
        else:
            if self.verbose and writer.busy():
                print(f"{where}: waiting for the checkpoint being written", flush=True)
            writer.submit(snapshot(self.model), write)
        self.last_saved = path
        self.saved.append(path)
        return path

    def _async_writer(self, background: bool) -> AsyncWriter | None:
        """The background writer when this checkpoint may be written in the background."""
        if not (self.async_write and background):
            return None
        if self._writer is None:
            self._writer = AsyncWriter(lambda path: load_model(path))
        return self._writer

    def _prune(self) -> None:
        if self.keep is not None:
            old = checkpoints(self.directory, self._templates())
            for _epoch, _step, stale in old[: max(0, len(old) - self.keep)]:
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
            "data_seed": self.data_seed,
            "save_every_steps": self.save_every_steps,
            "save_every_seconds": self.save_every_seconds,
            "signals": self.signals,
            "resume_inside_epoch": self.resume_inside_epoch,
            "agree_every_seconds": self.schedule.agree_every_seconds,
            "async_write": self.async_write,
        }
