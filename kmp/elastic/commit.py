"""CommitCallback: commit an elastic job's state every N batches and at every epoch end."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from kmp import distributed
from kmp._checks import check_bool, check_int
from kmp.callbacks._ranks import chief_print
from kmp.elastic.data import PAD, ShardPlan
from kmp.elastic.state import KerasState

__all__ = ["CommitCallback"]


class CommitCallback(keras.callbacks.Callback):
    """Advance a :class:`KerasState` with ``fit`` and commit it.

    After every batch the state's ``batch`` (and, given the ``plan`` of the
    data, ``samples_done``) moves on; every ``every`` batches and at the end of
    every epoch the state is committed, which also checks for new hosts. At the
    epoch end the epoch's logs join ``state.history`` and the position moves to
    the next epoch before the commit. Put it last among the callbacks: a commit
    can interrupt ``fit`` to reset the job, and callbacks after it would not see
    that epoch's end.

    Args:
        state: The state to advance and commit.
        every: Commit every this many batches (None: at epoch ends only).
        plan: The :class:`kmp.elastic.ShardPlan` the data of this ``fit``
            follows; it sets ``samples_done``.
        record_examples: Keep, per epoch, the ids of the examples every rank
            trained on in ``state.examples`` (gathered from all ranks at each
            commit, so steps rolled back are not counted). Needs ``plan``.
        verbose: 2 prints a line per commit on the chief.

    Raises:
        TypeError: ``state`` is not a KerasState, or a wrong type.
        ValueError: ``every`` < 1, or ``record_examples`` without a ``plan``.
    """

    def __init__(
        self,
        state: KerasState,
        every: int | None = None,
        *,
        plan: ShardPlan | None = None,
        record_examples: bool = False,
        verbose: int = 1,
    ):
        super().__init__()
        if not isinstance(state, KerasState):
            raise TypeError(f"CommitCallback needs a kmp.elastic.KerasState, got {state!r}.")
        if plan is not None and not isinstance(plan, ShardPlan):
            raise TypeError(f"plan must be a kmp.elastic.ShardPlan, got {plan!r}.")
        self.state = state
        self.every = None if every is None else check_int("every", every, minimum=1)
        self.plan = plan
        self.record_examples = check_bool("record_examples", record_examples)
        if record_examples and plan is None:
            raise ValueError("record_examples=True needs the plan the data follows (plan=...).")
        self.verbose = check_int("verbose", verbose, minimum=0, maximum=2)
        self._steps = 0
        self._pending: list[np.ndarray] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Move the position on; commit every ``every`` batches."""
        state = self.state
        if self.plan is not None:
            if self.record_examples:
                self._pending.append(self.plan.ids[self._steps])
            self._steps += 1
            state.samples_done = self.plan.position_after(self._steps)
        state.batch += 1
        if self.every is not None and state.batch % self.every == 0:
            self._gather_examples()
            self._commit()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Record the epoch's logs, move to the next epoch and commit."""
        state = self.state
        state.history.append({k: float(np.asarray(v)) for k, v in (logs or {}).items()})
        self._gather_examples()  # into this epoch, before the position moves on
        state.epoch, state.batch, state.samples_done = epoch + 1, 0, 0
        self._commit()

    def _gather_examples(self) -> None:
        if not self.record_examples:
            return
        mine = np.concatenate(self._pending) if self._pending else np.zeros(0, np.int64)
        self._pending = []
        everyone = np.asarray(distributed.allgather(mine.astype(np.int64)))
        used = [int(i) for i in everyone if i != PAD]
        self.state.examples.setdefault(self.state.epoch, []).extend(used)

    def _commit(self) -> None:
        state = self.state
        if self.verbose >= 2:
            chief_print(
                f"kmp.elastic: commit at epoch {state.epoch} batch {state.batch} "
                f"(samples {state.samples_done}, {distributed.size()} ranks)"
            )
        state.commit()

    def get_config(self) -> dict[str, Any]:
        """Return the settings (the state is not serialisable)."""
        return {"every": self.every, "record_examples": self.record_examples}
