"""KerasState: a Keras 3 model's training state for Horovod's elastic runtime.

Horovod's own ``TensorFlowKerasState`` calls Keras 2 APIs; this one holds what a
Keras 3 job needs to go on after a worker failed or joined:

* every variable of the model and of its optimizer (iterations, learning rate,
  slots, accumulators, and the loss scale with its counters: skipped steps,
  the growth counter, the overflow streak);
* the position in the run: ``epoch``, ``batch`` (batches done in the epoch) and
  ``samples_done`` (examples of the epoch consumed by all ranks together);
* the epoch logs so far (``history``), the examples each epoch used when they
  are recorded (``examples``), and any picklable objects passed as keywords.

:meth:`commit` copies it to host memory and checks whether hosts changed,
:meth:`restore` rolls back to the last commit after a failure, and :meth:`sync`
sends rank 0's state to every rank after a reset. :func:`kmp.elastic.run` calls
them; :class:`kmp.elastic.CommitCallback` commits during ``fit``.
"""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from kmp import distributed
from kmp.callbacks._ranks import innermost_optimizer
from kmp.distributed.collectives import unique_variables

__all__ = ["KerasState"]

_COUNTERS = ("epoch", "batch", "samples_done")
_RESERVED = frozenset(
    {*_COUNTERS, "model", "history", "examples", "events", "commits", "resets", "lr_scale"}
)


class KerasState:
    """The state of a Keras 3 training job that survives workers coming and going.

    Args:
        model: A compiled Keras model; its optimizer is built here if it is not
            yet, so that its variables exist on every rank.
        epoch: The epoch to start at (e.g. after resuming from a checkpoint).
        batch: Batches of ``epoch`` already done.
        samples_done: Examples of ``epoch`` already consumed by all ranks.
        **objects: More picklable values to commit, restore and sync with the
            model, read and set as attributes (``state.best = 0.9``).

    Raises:
        TypeError: ``model`` is not a Keras model, or a counter is not an int.
        ValueError: The model has no optimizer, a counter is negative, or an
            object name is one the state uses itself.
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        epoch: int = 0,
        batch: int = 0,
        samples_done: int = 0,
        **objects: Any,
    ):
        from kmp._checks import check_int

        if not isinstance(model, keras.Model):
            raise TypeError(
                f"KerasState needs a keras.Model, got {type(model).__name__}. Pass the model "
                "you train with model.fit."
            )
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "KerasState needs a compiled model: call model.compile(optimizer=...) first."
            )
        taken = sorted(set(objects) & _RESERVED)
        if taken:
            raise ValueError(
                f"KerasState keeps {', '.join(taken)} itself; give your objects other names."
            )
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model = model
        self.epoch = check_int("epoch", epoch, minimum=0)
        self.batch = check_int("batch", batch, minimum=0)
        self.samples_done = check_int("samples_done", samples_done, minimum=0)
        self.history: list[dict[str, float]] = []
        self.examples: dict[int, list[int]] = {}
        self._object_names = tuple(objects)
        for name, value in objects.items():
            setattr(self, name, value)
        # Not committed: what happened to this process (commits, failures, resets).
        self.commits = 0
        self.resets = 0
        self.events: list[dict[str, Any]] = []
        self._variables = unique_variables([*model.variables, *optimizer.variables])
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._saved_values: list[np.ndarray] = []
        self._saved: dict[str, Any] = {}
        self.save()

    # ------------------------------------------------------------------ reading

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The model's optimizer."""
        return self.model.optimizer

    @property
    def lr_scale(self) -> float:
        """The factor ``scale_lr`` multiplied the learning rate by (1.0 without it)."""
        return float(getattr(self.optimizer, "lr_scale", 1.0))

    def snapshot(self) -> dict[str, Any]:
        """The position and the loss-scale state now, as plain numbers (for logs)."""
        opt = self.optimizer
        out: dict[str, Any] = {k: int(getattr(self, k)) for k in _COUNTERS}
        out["size"] = distributed.size()
        out["rank"] = distributed.rank()
        out["iterations"] = int(keras.ops.convert_to_numpy(opt.iterations))
        if hasattr(opt, "loss_scale"):
            out["loss_scale"] = float(opt.loss_scale)
        if hasattr(opt, "skipped_steps"):
            out["skipped_steps"] = int(opt.skipped_steps)
        return out

    def record(self, event: str, **details: Any) -> None:
        """Add an entry to :attr:`events` (kept by this process; never rolled back)."""
        self.events.append({"event": event, "time": time.time(), **self.snapshot(), **details})

    # ---------------------------------------------------------- commit / restore

    def _python_state(self) -> dict[str, Any]:
        names = (*_COUNTERS, "history", "examples", *self._object_names)
        state = {name: copy.deepcopy(getattr(self, name)) for name in names}
        state["lr_scale"] = self.lr_scale
        return state

    def _set_python_state(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)
        self._set_lr_scale(state.pop("lr_scale"))
        for name, value in state.items():
            setattr(self, name, value)

    def _set_lr_scale(self, factor: float) -> None:
        rescale = getattr(self.optimizer, "rescale_learning_rate", None)
        if rescale is not None:
            rescale(factor)

    def _values(self) -> list[np.ndarray]:
        return [np.array(keras.ops.convert_to_numpy(v)) for v in self._variables]

    def save(self) -> None:
        """Copy the state to host memory: the point :meth:`restore` returns to."""
        self._saved_values = self._values()
        self._saved = self._python_state()

    def restore(self) -> None:
        """Roll back to the last :meth:`save` (or commit), undoing what came after."""
        # The learning-rate factor first: its variable is then overwritten by the saved value.
        self._set_python_state(self._saved)
        for variable, value in zip(self._variables, self._saved_values, strict=True):
            variable.assign(value)

    def sync(self) -> None:
        """Give every rank rank 0's state (after a reset, and when a run starts).

        The values travel as one object, matched by position, not by variable
        name: a worker that joins may have loaded its model from a checkpoint,
        where Keras named the variables differently.

        Raises:
            ValueError: This rank's model or optimizer has variables of other
                shapes than rank 0's (a different model).
        """
        layout = [(tuple(v.shape), str(v.dtype)) for v in self._variables]
        # Only rank 0's values travel: the other ranks copy none of theirs.
        mine = self._values() if distributed.rank() == 0 else None
        python, root_layout, values = distributed.broadcast_object(
            (self._python_state(), layout, mine), root=0
        )
        if root_layout != layout:
            raise ValueError(
                f"This rank's model and optimizer have {len(layout)} variables that do not "
                f"match rank 0's {len(root_layout)} (shapes and dtypes in order). Build the "
                "same model, compiled with the same optimizer, on every rank."
            )
        self._set_python_state(python)
        for variable, value in zip(self._variables, values, strict=True):
            variable.assign(value)
        self.save()

    def commit(self) -> None:
        """Save the state, then check for host changes (on every rank at the same step).

        Raises:
            horovod.common.exceptions.HostsUpdatedInterrupt: The driver announced
                hosts added or removed; :func:`kmp.elastic.run` resets the job.
        """
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if the driver announced new hosts.

        A collective: rank 0's view of the notifications is broadcast, so every
        rank raises at the same step.
        """
        if not distributed.uses_horovod():
            return
        from horovod.common.exceptions import HostsUpdatedInterrupt
        from horovod.runner.elastic.worker import HostUpdateResult

        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last, update = timestamp, update | result
        prev, self._last_updated_timestamp, update = distributed.broadcast_object(
            (prev, last, update), root=0
        )
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    # ---------------------------------------------------------------- resetting

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Horovod's notification manager calls this when the driver changes the hosts."""
        self._host_messages.put((timestamp, update_res))

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Add functions to call after every reset (new world), before the state syncs."""
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"register_reset_callbacks: {callback!r} is not callable.")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Adapt to the new world: learning-rate factor, traced functions, then callbacks.

        A rate that ``scale_lr=True`` scaled by the old rank count is scaled by
        the new one, and the model's train, test and predict functions are
        traced again: they baked in the old world size (the gradient average,
        the single-rank shortcut, a schedule's factor).
        """
        self._host_messages = queue.Queue()
        self.resets += 1
        self._set_lr_scale(float(distributed.size()))
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, name):
                setattr(self.model, name, None)
        for callback in self._reset_callbacks:
            callback()

    def __repr__(self) -> str:
        inner = type(innermost_optimizer(self.optimizer)).__name__
        return (
            f"KerasState(model={self.model.name!r}, epoch={self.epoch}, batch={self.batch}, "
            f"samples_done={self.samples_done}, optimizer={inner})"
        )
