"""Checkpoints written off the training step: a copy at the step boundary, the rest in a thread.

``AtomicCheckpoint(async_write=True)``: at the step boundary the chief copies every
variable of the model and its optimizer to host memory (:func:`snapshot`) and records
the training state (:func:`kmp.training_state.capture`: position, random states,
manifest); training then goes on. A background thread puts the copy into a twin of
the model, kept for this purpose (loaded once from the first checkpoint, so it has the
same class, layers and optimizer), and writes the twin with :func:`kmp.saving.save_model`,
atomically as always: serialising, writing and ``fsync`` are off the step. A crash
mid-write leaves the previous checkpoint.

One write is in flight at a time: a checkpoint due while one is being written waits
for it (said in the log with ``verbose``). :meth:`AsyncWriter.wait` is called before
any synchronous write, at the end of ``fit`` and before a preempted job exits, so no
write is lost. An error in the thread is raised on the training thread at the next
checkpoint or at ``wait``.

Cost: host memory for a second copy of the model's and the optimizer's variables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

__all__ = ["AsyncWriter", "snapshot"]


def _variables(model: keras.Model) -> list[Any]:
    """Every variable of ``model``, then of its optimizer, in their order.

    The order, not the paths: a model loaded from a file has the same layers and
    optimizer built the same way, but Keras numbers their names afresh.
    """
    optimizer = getattr(model, "optimizer", None)
    return [*model.variables, *([] if optimizer is None else optimizer.variables)]


def snapshot(model: keras.Model) -> list[np.ndarray]:
    """Copy every variable of ``model`` and its optimizer to host memory.

    ``keras.ops.convert_to_numpy`` copies already (``np.array`` of the value), once.
    """
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in _variables(model)]


class AsyncWriter:
    """Writes checkpoints of one model from a background thread, one at a time.

    Args:
        load_twin: Loads the twin model from a checkpoint path (``kmp.load_model``
            with the policy of the model being trained).
    """

    def __init__(self, load_twin: Callable[[str], keras.Model]):
        self._load_twin = load_twin
        self._twin: keras.Model | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.waited_s = 0.0  # time the training thread waited for a write in flight
        self.written: list[str] = []

    @property
    def has_twin(self) -> bool:
        """Whether the twin exists (after the first, synchronous, checkpoint)."""
        return self._twin is not None

    def adopt(self, path: str) -> None:
        """Load the twin from ``path``, a checkpoint just written synchronously."""
        self._twin = self._load_twin(path)

    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Wait for the write in flight; raise its error if it failed. Return the seconds waited."""
        started = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        waited = time.monotonic() - started
        self.waited_s += waited
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"kmp: a checkpoint written in the background failed: {error!r}")
        return waited

    def submit(self, values: dict[str, np.ndarray], write: Callable[[keras.Model], str]) -> None:
        """Write ``values`` (from :func:`snapshot`) through ``write(twin)`` in the background.

        Waits for a write in flight first. Raises ValueError when the twin's variables
        are not the snapshot's (another architecture): nothing is written then.
        """
        if self._twin is None:
            raise RuntimeError("AsyncWriter.submit before adopt(): no twin model yet.")
        self.wait()
        targets = _variables(self._twin)
        kinds = [(tuple(v.shape), str(v.dtype)) for v in targets]
        if kinds != [(a.shape, str(a.dtype)) for a in values]:
            raise ValueError(
                f"The model's copy for background writes has {len(targets)} variables that do "
                f"not match the model's {len(values)} in shape and dtype: pass "
                "AtomicCheckpoint(async_write=False)."
            )
        twin = self._twin

        def run() -> None:
            try:
                for variable, value in zip(targets, values, strict=True):
                    variable.assign(value)
                self.written.append(write(twin))
            except BaseException as exc:  # handed to the training thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="kmp-checkpoint", daemon=True)
        self._thread.start()
