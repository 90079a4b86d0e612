"""Checkpoints: atomic writes, the newest N kept, and finding the latest to resume from."""

from __future__ import annotations

import math
import os
import re
import string
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from kmp import distributed, rank_weights
from kmp._checks import check_bool, check_choice, check_int
from kmp._files import atomic_write
from kmp.callbacks._ranks import is_chief, to_float
from kmp.saving import save_model
from kmp.training_state import gather_seed_states

__all__ = ["AtomicCheckpoint", "FoundCheckpoint", "atomic_save", "latest_checkpoint"]

# File names used when AtomicCheckpoint is given a directory.
DEFAULT_CHECKPOINT_NAME = "ckpt-{epoch:04d}.keras"
DEFAULT_WEIGHTS_NAME = "ckpt-{epoch:04d}.weights.h5"
# Temporary files start with this (atomic_write's default); latest_checkpoint skips them.
_TMP_PREFIX = ".tmp-"


class FoundCheckpoint(NamedTuple):
    """What :func:`latest_checkpoint` found: a file and its epoch (not a callback).

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


def latest_checkpoint(directory: str | os.PathLike, template: str | None = None) -> FoundCheckpoint:
    """Find the newest checkpoint in ``directory``, to resume training from it.

    Args:
        directory: Where :class:`AtomicCheckpoint` writes.
        template: The file-name template it uses. Default: kmp's default
            names, ``ckpt-{epoch:04d}.keras`` and ``ckpt-{epoch:04d}.weights.h5``.

    Returns:
        ``FoundCheckpoint(path, epoch)`` of the highest epoch, or
        ``FoundCheckpoint(None, 0)`` when there is none. ``epoch`` is the number
        of completed epochs: pass it to ``fit(initial_epoch=...)``.

    Raises:
        ValueError: ``template`` has no ``{epoch}`` field.

    Example::

        ckpt = kmp.callbacks.latest_checkpoint("runs/ckpt")
        if ckpt.path:
            model = keras.saving.load_model(ckpt.path)
        model.fit(ds, epochs=10, initial_epoch=ckpt.epoch, callbacks=...)
    """
    directory = os.fspath(directory)
    default = [DEFAULT_CHECKPOINT_NAME, DEFAULT_WEIGHTS_NAME]
    templates = default if template is None else [template]
    found = [c for t in templates for c in _checkpoints(directory, t)]
    if not found:
        return FoundCheckpoint(None, 0)
    epoch, path = max(found)
    return FoundCheckpoint(path, epoch)


def atomic_save(path: str | os.PathLike, save: Callable[[str], Any]) -> str:
    """Write a file atomically: ``save(tmp)`` in the same directory, then ``os.replace``.

    Readers see the old file or the complete new one, never a partial one; if
    ``save`` fails, the temporary file is removed and the error re-raised. The
    file and its directory are ``fsync``-ed (:func:`kmp._files.atomic_write`,
    kmp's one atomic write).

    Args:
        path: The final file. Its name ends the temporary name too, so
            extension checks (``.keras``, ``.weights.h5``) still pass.
        save: Writes a complete file at the path it is given.

    Returns:
        ``path`` as a string.
    """
    return atomic_write(path, save, temp_prefix=_TMP_PREFIX)


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
            training state (``.keras`` through :func:`kmp.saving.save_model`: the
            optimizer with every variable, the random generators' states, the
            epoch and a manifest; :func:`kmp.load_model` restores all of it).
        keep: Keep only the newest ``keep`` checkpoints of this name pattern
            (None keeps all). Needs an ``{epoch}`` field in the name.
        save_freq: Save every ``save_freq`` epochs.
        verbose: 1 (or 2) prints a line per checkpoint written.
        data_seed: The data pipeline's shuffle seed (``kmp.data.load(seed=...)``),
            recorded in the checkpoint so a resume can check it reads the same order.

    Raises:
        TypeError: An argument has the wrong type (e.g. ``keep="3"``).
        ValueError: An argument is out of range or unknown (e.g. ``keep=0``,
            ``mode="up"``), the file name has the wrong extension, or ``keep``
            is given for a name without an ``{epoch}`` field.
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
    ):
        super().__init__()
        filepath = os.fspath(filepath)
        save_best_only = check_bool("AtomicCheckpoint(save_best_only)", save_best_only)
        save_weights_only = check_bool("AtomicCheckpoint(save_weights_only)", save_weights_only)
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
        if not isinstance(monitor, str):
            raise TypeError(
                f"`AtomicCheckpoint(monitor)` must be a metric name; got {monitor!r}. "
                "Pass a key of the epoch logs, e.g. 'val_loss'."
            )
        mode = check_choice(
            "AtomicCheckpoint(mode)",
            mode,
            ("auto", "min", "max"),
            hint="Use 'min' for losses, 'max' for accuracies, or 'auto' to pick by the name.",
        )
        if keep is not None:
            keep = check_int(
                "AtomicCheckpoint(keep)",
                keep,
                minimum=1,
                hint="Pass how many checkpoints to keep, or None to keep all.",
            )
        save_freq = check_int(
            "AtomicCheckpoint(save_freq)",
            save_freq,
            minimum=1,
            hint="Pass a number of epochs, e.g. 1 to save after every epoch.",
        )
        verbose = check_int(
            "AtomicCheckpoint(verbose)",
            verbose,
            minimum=0,
            maximum=2,
            hint="Use 0 (silent) or 1 (print a line per checkpoint written).",
        )
        if keep is not None:
            _template_regex(os.path.basename(filepath))  # raises without an {epoch} field
        if mode == "auto":
            name = monitor.lower()
            mode = "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"
        self.filepath = filepath
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
        self.best = -math.inf if mode == "max" else math.inf
        self.last_saved: str | None = None
        self.saved: list[str] = []  # every file this callback wrote (on the chief only)

    @property
    def directory(self) -> str:
        """The directory checkpoints are written to."""
        return os.path.dirname(os.path.abspath(self.filepath))

    def latest(self) -> FoundCheckpoint:
        """Return the newest checkpoint of this callback's name pattern.

        See :func:`latest_checkpoint`.
        """
        return latest_checkpoint(self.directory, os.path.basename(self.filepath))

    def _improved(self, current: float) -> bool:
        return current > self.best if self.mode == "max" else current < self.best

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Save a checkpoint on the chief when due (and improved with ``save_best_only``)."""
        if (epoch + 1) % self.save_freq:
            return
        # Every rank's dropout state and its own non-trainable weights, gathered on every
        # rank (collectives) before the chief alone decides and writes.
        seeds = per_rank = None
        if not self.save_weights_only:
            seeds = gather_seed_states(self.model)
            per_rank = rank_weights.gather(self.model)  # e.g. BatchNorm's moving statistics
        if not is_chief():
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
            current = to_float(current)
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
            with distributed.alone():  # the chief saves without the other processes
                atomic_save(path, self.model.save_weights)
        else:
            with distributed.alone():  # the model, its optimizer and the training state
                save_model(
                    self.model,
                    path,
                    epoch=epoch + 1,
                    data_seed=self.data_seed,
                    rank_seed_states=seeds,
                    rank_weights=per_rank,
                    temp_prefix=_TMP_PREFIX,
                )
        self.last_saved = path
        self.saved.append(path)
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
            "data_seed": self.data_seed,
        }
