"""Checkpoint files: their names, the position each holds, and finding the newest.

A checkpoint's name says where training stood when it was written: ``epoch``, the
epochs completed, and ``step``, the batches of the next epoch already done (0 at an
epoch's end). Epoch-end checkpoints are named ``ckpt-{epoch:04d}.keras``; checkpoints
written inside an epoch (``AtomicCheckpoint(save_every_steps=...)``, on a signal) add
the step: ``ckpt-{epoch:04d}-step-{step:06d}.keras``. Positions order checkpoints:
``(2, 0)`` (two epochs done) before ``(2, 13)`` (13 batches into the third) before
``(3, 0)``.

The decisions here are pure (names in, names out); :mod:`kmp.callbacks.checkpoint`
writes and removes the files.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kmp._files import atomic_write

__all__ = [
    "DEFAULT_CHECKPOINT_NAME",
    "DEFAULT_STEP_CHECKPOINT_NAME",
    "DEFAULT_STEP_WEIGHTS_NAME",
    "DEFAULT_WEIGHTS_NAME",
    "FoundCheckpoint",
    "atomic_save",
    "checked_filepath",
    "checkpoint_path",
    "checkpoints",
    "latest_checkpoint",
    "step_template",
    "template_fields",
    "template_regex",
]

# File names used when AtomicCheckpoint is given a directory.
DEFAULT_CHECKPOINT_NAME = "ckpt-{epoch:04d}.keras"
DEFAULT_WEIGHTS_NAME = "ckpt-{epoch:04d}.weights.h5"
DEFAULT_STEP_CHECKPOINT_NAME = "ckpt-{epoch:04d}-step-{step:06d}.keras"
DEFAULT_STEP_WEIGHTS_NAME = "ckpt-{epoch:04d}-step-{step:06d}.weights.h5"
_DEFAULTS = (
    DEFAULT_CHECKPOINT_NAME,
    DEFAULT_WEIGHTS_NAME,
    DEFAULT_STEP_CHECKPOINT_NAME,
    DEFAULT_STEP_WEIGHTS_NAME,
)
# Temporary files start with this (atomic_write's default); the finders skip them.
TMP_PREFIX = ".tmp-"
_SUFFIXES = (".weights.h5", ".keras", ".h5")


class FoundCheckpoint(NamedTuple):
    """What :func:`latest_checkpoint` found: a file and its position (not a callback).

    Attributes:
        path: The file, or None when there is none.
        epoch: Epochs completed when it was written (``initial_epoch`` to
            resume with), 0 when there is none.
        step: Batches of the next epoch already done when it was written (0 at
            an epoch's end): :class:`~kmp.callbacks.AtomicCheckpoint` skips them
            when training resumes from it.
    """

    path: str | None
    epoch: int
    step: int = 0


def template_fields(template: str) -> list[str]:
    """Return the names of the fields of a file-name template, in order."""
    return [field for _lit, field, _spec, _conv in string.Formatter().parse(template) if field]


def template_regex(template: str) -> re.Pattern[str]:
    """Turn a template such as ``ckpt-{epoch:04d}-step-{step:06d}.keras`` into a regex."""
    parts = []
    seen: set[str] = set()
    for literal, field, _spec, _conv in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field in ("epoch", "step") and field not in seen:
            parts.append(rf"(?P<{field}>\d+)")
            seen.add(field)
        elif field in ("epoch", "step"):
            parts.append(r"\d+")
        else:
            parts.append(r".+?")
    if "epoch" not in seen:
        raise ValueError(
            f"Checkpoint name {template!r} has no {{epoch}} field, so checkpoints cannot be "
            "told apart by epoch: include it, e.g. 'ckpt-{epoch:04d}.keras'."
        )
    return re.compile("".join(parts))


def step_template(template: str) -> str:
    """The name of the checkpoints written inside an epoch, from the epoch-end name.

    A template with a ``{step}`` field serves both; otherwise ``-step-{step:06d}``
    goes before the extension (``ckpt-{epoch:04d}.keras`` gives
    :data:`DEFAULT_STEP_CHECKPOINT_NAME`).

    Raises:
        ValueError: The template names epoch-log fields (``{val_loss}``, ...),
            which a checkpoint inside an epoch does not have.
    """
    others = sorted(set(template_fields(template)) - {"epoch", "step"})
    if others:
        raise ValueError(
            f"Checkpoint name {template!r} uses the epoch logs ({', '.join(others)}), which "
            "a checkpoint written inside an epoch (save_every_steps, save_every_seconds, a "
            "signal) does not have: use a name with only {epoch} and {step}, or a folder."
        )
    if "step" in template_fields(template):
        return template
    for suffix in _SUFFIXES:
        if template.endswith(suffix):
            return template[: -len(suffix)] + "-step-{step:06d}" + suffix
    return template + "-step-{step:06d}"


def checked_filepath(filepath: str, save_weights_only: bool) -> str:
    """AtomicCheckpoint's file-name template: a folder gets the default names.

    Raises:
        ValueError: The name does not end as the format needs (``.keras``, or
            ``.weights.h5`` with ``save_weights_only``).
    """
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
    return filepath


def checkpoint_path(template: str, epoch: int, step: int, logs: dict) -> str:
    """The file name of the checkpoint of ``(epoch, step)``, with the epoch ``logs``.

    Raises:
        ValueError: The template names something else than those.
    """
    try:
        return template.format(epoch=epoch, step=step, **logs)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"AtomicCheckpoint: cannot format {template!r} with epoch, step and the logs "
            f"{sorted(logs)} ({exc!r}); use only those names in the template."
        ) from exc


def checkpoints(directory: str, templates: Iterable[str]) -> list[tuple[int, int, str]]:
    """Return ``(epoch, step, path)`` of the files in ``directory`` named by ``templates``.

    Sorted by position (then path); temporary files and other files are left out.
    """
    patterns = [template_regex(os.path.basename(t)) for t in templates]
    found = set()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(directory, name)
        for pattern in patterns:
            m = pattern.fullmatch(name)
            if m and os.path.isfile(path):
                step = int(m.groupdict().get("step") or 0)
                found.add((int(m.group("epoch")), step, path))
                break
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike, template: str | None = None) -> FoundCheckpoint:
    """Find the newest checkpoint in ``directory``, to resume training from it.

    Args:
        directory: Where :class:`~kmp.callbacks.AtomicCheckpoint` writes.
        template: The file-name template it uses (and its step names, see
            :func:`step_template`). Default: kmp's default names
            (``ckpt-{epoch:04d}.keras``, ``ckpt-{epoch:04d}-step-{step:06d}.keras``
            and their ``.weights.h5`` twins).

    Returns:
        ``FoundCheckpoint(path, epoch, step)`` of the furthest position, or
        ``FoundCheckpoint(None, 0, 0)`` when there is none. ``epoch`` is the
        number of completed epochs: pass it to ``fit(initial_epoch=...)``; a
        ``step`` above 0 is skipped by ``AtomicCheckpoint`` in that epoch.

    Raises:
        ValueError: ``template`` has no ``{epoch}`` field.

    Example::

        ckpt = kmp.callbacks.latest_checkpoint("runs/ckpt")
        if ckpt.path:
            model = kmp.load_model(ckpt.path)
        model.fit(ds, epochs=10, initial_epoch=ckpt.epoch, callbacks=...)
    """
    directory = os.fspath(directory)
    if template is None:
        templates: list[str] = list(_DEFAULTS)
    else:
        templates = [template]
        if not (set(template_fields(template)) - {"epoch", "step"}):
            templates.append(step_template(template))
    found = checkpoints(directory, templates)
    if not found:
        return FoundCheckpoint(None, 0, 0)
    epoch, step, path = found[-1]
    return FoundCheckpoint(path, epoch, step)


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
    return atomic_write(path, save, temp_prefix=TMP_PREFIX)
