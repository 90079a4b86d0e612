"""fit: Keras ``model.fit`` epoch by epoch under :func:`kmp.elastic.run`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from kmp import distributed
from kmp._checks import check_bool, check_int
from kmp.callbacks._ranks import verbosity
from kmp.elastic.commit import CommitCallback
from kmp.elastic.data import ElasticData
from kmp.elastic.run import run
from kmp.elastic.state import KerasState

__all__ = ["fit"]


def fit(
    state: KerasState,
    data: ElasticData,
    *,
    epochs: int,
    commit_every: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    record_examples: bool = False,
    verbose: int | str = "auto",
) -> list[dict[str, float]]:
    """Train ``state.model`` on ``data`` up to ``epochs``, going on through resets.

    Each epoch (or the rest of one, after a reset) is one ``model.fit`` over
    the examples the epoch has left, dealt to the ranks running now
    (:meth:`ElasticData.plan`). A :class:`CommitCallback` goes last: it commits
    every ``commit_every`` batches and at the epoch end. After a failure the
    job resumes from the last commit, with the new number of ranks.

    Args:
        state: The job's state; training starts at ``state.epoch`` and
            ``state.samples_done``.
        data: The training data.
        epochs: The epoch to train up to (as ``model.fit(epochs=)``).
        commit_every: Commit every this many batches as well (None: epoch ends only).
        callbacks: More callbacks, run before the commit (kmp's
            :class:`~kmp.callbacks.MetricAverage`, checkpoints, ...; a
            :class:`~kmp.callbacks.BroadcastInitialState` is not needed: the
            state syncs).
        record_examples: Record the ids of the examples each epoch used in
            ``state.examples``.
        verbose: ``fit``'s verbosity on the chief (0 elsewhere); 2 also prints
            each commit.

    Returns:
        ``state.history``: one dict of (rank-averaged, with MetricAverage) logs
        per epoch trained, this run and earlier ones.

    Raises:
        TypeError: ``state`` or ``data`` of the wrong type, or a callback that
            is not a Keras callback.
        ValueError: ``epochs`` < 1 or ``commit_every`` < 1.
    """
    if not isinstance(state, KerasState):
        raise TypeError(f"kmp.elastic.fit needs a kmp.elastic.KerasState, got {state!r}.")
    if not isinstance(data, ElasticData):
        raise TypeError(
            f"kmp.elastic.fit needs a kmp.elastic.ElasticData, got {type(data).__name__}; build "
            "one with ElasticData(features, labels, batch_size=...) or ElasticData.from_tfds(...)."
        )
    epochs = check_int("epochs", epochs, minimum=1)
    if commit_every is not None:
        commit_every = check_int("commit_every", commit_every, minimum=1)
    check_bool("record_examples", record_examples)
    callbacks = list(callbacks)
    for cb in callbacks:
        if not isinstance(cb, keras.callbacks.Callback):
            raise TypeError(f"kmp.elastic.fit(callbacks=...): {cb!r} is not a Keras callback.")
    verbosity(verbose)  # checks the value; the chief is decided per fit (it can change)
    return run(_epochs)(state, data, epochs, commit_every, callbacks, record_examples, verbose)


def _epochs(
    state: KerasState,
    data: ElasticData,
    epochs: int,
    commit_every: int | None,
    callbacks: list,
    record_examples: bool,
    verbose: Any,
) -> list[dict[str, float]]:
    state.record("start")
    while state.epoch < epochs:
        plan = data.plan(
            epoch=state.epoch,
            start=state.samples_done,
            rank=distributed.rank(),
            size=distributed.size(),
        )
        commit = CommitCallback(
            state,
            commit_every,
            plan=plan,
            record_examples=record_examples,
            verbose=2 if verbose == 2 else 1,
        )
        if plan.steps == 0:
            # A commit fell on the epoch's last step and a reset came before its end: only
            # the end is left (its logs were lost with the failed fit).
            commit.on_epoch_end(state.epoch, {})
            continue
        state.model.fit(
            data.dataset(plan),
            initial_epoch=state.epoch,
            epochs=state.epoch + 1,
            steps_per_epoch=plan.steps,
            callbacks=[*callbacks, commit],
            verbose=verbosity(verbose),
        )
    state.record("finished")
    return state.history
