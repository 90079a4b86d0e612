"""Keras 3 callbacks for loss-scaled, Horovod-distributed training.

Horovod's own Keras callbacks do not work with Keras 3 (its variables are not
``tf.Variable`` objects); these are built on :mod:`kmp.distributed` instead and work
in one process as well (every collective is then a no-op).

Order matters: Keras calls callbacks in list order with one shared ``logs``
dict, and appends its own ``History`` and ``ProgbarLogger`` after yours. Use
:func:`default_callbacks`, or keep this order by hand:

1. :class:`BroadcastInitialState`: all ranks start from rank 0's weights and
   optimizer state.
2. :class:`MetricAverage`: epoch-end metrics averaged across ranks, before any
   callback that reads them (EarlyStopping, ReduceLROnPlateau, checkpoints,
   loggers). Ranks that see the same numbers also take the same decisions, so
   no rank stops early while another waits in a collective.
3. :class:`LossScaleMonitor` and :class:`LearningRateWarmup`.
4. Writers, on the chief only: :class:`AtomicCheckpoint` (chief-only by
   itself) and ``chief_only(keras.callbacks.TensorBoard(...))``,
   ``chief_only(keras.callbacks.CSVLogger(...))``.

Pass ``verbose=kmp.callbacks.verbosity()`` to ``fit`` so that only the chief
prints progress bars::

    import kmp

    kmp.distributed.init()
    callbacks = kmp.callbacks.default_callbacks(
        warmup_epochs=3, checkpoint_dir="runs/ckpt", tensorboard_dir="runs/tb"
    )
    model.fit(ds, epochs=10, callbacks=callbacks, verbose=kmp.callbacks.verbosity())
"""

from kmp.callbacks._ranks import verbosity
from kmp.callbacks.broadcast import BroadcastInitialState
from kmp.callbacks.checkpoint import AtomicCheckpoint, latest_checkpoint
from kmp.callbacks.chief_only import ChiefOnly, chief_only
from kmp.callbacks.defaults import default_callbacks
from kmp.callbacks.metrics import MetricAverage
from kmp.callbacks.monitor import LossScaleMonitor
from kmp.callbacks.preemption import Preempted
from kmp.callbacks.warmup import LearningRateWarmup

# What a training script calls (tests/test_public_api.py pins it). ``latest_checkpoint``
# returns a kmp.callbacks.checkpoint.FoundCheckpoint (``.path``, ``.epoch``, ``.step``), which no
# script builds; the atomic write helper (``atomic_save``) stays in that module too.
__all__ = [
    "AtomicCheckpoint",
    "BroadcastInitialState",
    "ChiefOnly",
    "LearningRateWarmup",
    "LossScaleMonitor",
    "MetricAverage",
    "Preempted",
    "chief_only",
    "default_callbacks",
    "latest_checkpoint",
    "verbosity",
]
