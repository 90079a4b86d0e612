"""run: keep a training function going while Horovod's elastic driver changes the world.

Horovod's ``horovod.tensorflow.elastic.run`` turns a failed collective into a
reset only when TensorFlow's error names ``HorovodAllreduce``,
``HorovodAllgather`` or ``HorovodBroadcast``. kmp averages gradients with
``HorovodGroupedAllreduce``, so there a worker's death is swallowed and the
function returns None as if training had finished. :func:`run` is kmp's loop,
with the failure test of :func:`is_horovod_failure`:

1. ``state.sync()``: rank 0's state goes to every rank (skipped after a reset
   that only removed workers, where every rank holds the same commit).
2. Call the function. If it returns, that is the result.
3. A collective failed (a worker died): ``state.restore()`` rolls back to the
   last commit. The driver announced new hosts at a commit
   (``HostsUpdatedInterrupt``): nothing to roll back.
4. Reset: Horovod is shut down and started again (:func:`kmp.distributed.restart`,
   which also gives kmp the new rank and size), ``state.on_reset()`` re-scales
   the learning rate and drops the traced functions; back to 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from kmp import distributed

__all__ = ["is_horovod_failure", "run"]

T = TypeVar("T")

# Words in a TensorFlow error raised by a failed Horovod collective (the op names
# HorovodAllreduce / HorovodGroupedAllreduce / ..., a shut-down Horovod, a lost peer).
_FAILURE_WORDS = ("horovod", "gloo")


def is_horovod_failure(exc: BaseException) -> bool:
    """Return True when ``exc`` means a collective failed because the world changed.

    That is Horovod's ``HorovodInternalError``, or a TensorFlow op error whose
    message names Horovod or Gloo (any Horovod op: grouped allreduce, allgather,
    broadcast, ..., and "Horovod has been shut down"). Anything else, a bug in
    the training code included, is not a failure of the world and is re-raised.
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "HorovodInternalError" in names:
        return True
    if "OpError" not in names:  # tf.errors.OpError and its subclasses
        return False
    message = str(getattr(exc, "message", exc)).lower()
    return any(word in message for word in _FAILURE_WORDS)


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``func(state, ...)`` to go on through worker failures and new workers.

    ``func``'s first argument is a :class:`kmp.elastic.KerasState`; ``func``
    commits it (:class:`kmp.elastic.CommitCallback` does in ``fit``) and must
    start from what the state says (epoch, ``samples_done``), because after a
    reset it is called again from the last commit. Do not run a collective
    before ``func`` in the decorated call: a new worker syncs first.

    In a process that Horovod does not run (no launcher), ``func`` is simply
    called. A launched job must call ``kmp.distributed.init()`` first: the
    decorated call raises a ``RuntimeError`` that says so otherwise.

    Example::

        state = kmp.elastic.KerasState(model)

        @kmp.elastic.run
        def train(state):
            ...

        train(state)
    """
    if not callable(func):
        raise TypeError(f"kmp.elastic.run decorates a function, got {func!r}.")

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> T:
        for method in ("sync", "restore", "on_reset", "on_hosts_updated", "record"):
            if not callable(getattr(state, method, None)):
                raise TypeError(
                    f"The first argument of a kmp.elastic.run function must be a "
                    f"kmp.elastic.KerasState, got {type(state).__name__}."
                )
        distributed.engine()  # an elastic launch without kmp.distributed.init() stops here
        if not distributed.uses_horovod():
            return func(state, *args, **kwargs)
        from horovod.common.elastic import notification_manager
        from horovod.common.exceptions import HostsUpdatedInterrupt

        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    skip_sync = exc.skip_sync
                    state.record("hosts-updated", removed_only=bool(skip_sync))
                except Exception as exc:
                    if not is_horovod_failure(exc):
                        raise
                    state.record("failure", error=_first_line(exc))
                    state.restore()
                    state.record("restored")
                    skip_sync = False
                distributed.restart()
                state.on_reset()
                state.record("reset")
        finally:
            notification_manager.remove_listener(state)

    return wrapper


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", exc)).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
