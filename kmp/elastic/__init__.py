"""Elastic training for Keras 3 on Horovod's elastic driver: workers may die or join.

Horovod's elastic mode (``horovodrun --min-np A --max-np B`` with host
discovery) keeps a job going when a worker dies or a host is added, but its
Keras state and callbacks are written for Keras 2. This package is the Keras 3
side:

* :class:`KerasState`: the model's and optimizer's variables (loss scale and its
  counters included), the epoch, batch and data position, the epoch logs;
  ``commit`` / ``restore`` / ``sync``.
* :func:`run`: the loop that restores the last commit after a failure, restarts
  Horovod with the new world, re-scales the learning rate and syncs.
* :class:`CommitCallback`: commits every N batches and at every epoch end.
* :class:`ElasticData` and :func:`plan_shard`: each epoch's examples dealt to
  the ranks running now, so that no example is dropped or seen twice after a
  resize.
* :func:`fit`: all of it around ``model.fit``.

Example (run it with ``kmp launch --elastic --min-np 2 --max-np 4 --hostfile hosts``)::

    import kmp

    kmp.distributed.init()
    kmp.enable()
    model = build_model()
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), scale_lr=True),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    state = kmp.elastic.KerasState(model)
    data = kmp.elastic.ElasticData.from_tfds("kmp_digits", batch_size=32)
    kmp.elastic.fit(state, data, epochs=10, commit_every=20,
                    callbacks=[kmp.callbacks.MetricAverage(),
                               kmp.callbacks.AtomicCheckpoint("runs/ckpt")])
"""

from kmp.elastic.commit import CommitCallback
from kmp.elastic.data import ElasticData, ShardPlan, plan_shard
from kmp.elastic.fit import fit
from kmp.elastic.run import run
from kmp.elastic.state import KerasState

__all__ = [
    "CommitCallback",
    "ElasticData",
    "KerasState",
    "ShardPlan",
    "fit",
    "plan_shard",
    "run",
]
