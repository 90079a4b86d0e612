"""One process of a peer comparison: the same model, batch and data, trained one peer's way.

    python bench/peer_worker.py --peer kmp --model digits_cnn --out DIR [--batch 64] [--epochs 8]
        [--steps 12] [--bucket-bytes N | --one-bucket] [--compression fp16]
        [--workers HOST:PORT,...] [--threads 1]

Started by ``bench/peers.py`` and ``bench/transformer.py`` (under ``horovodrun``,
which for every peer is only the process starter: each rank reads its rank and size
from the launcher's environment; only the Horovod peers call ``hvd.init``; the kmp
peer on the JAX backend is started by ``kmp launch --engine jax`` instead). Peers:

* ``independent``: plain Keras ``model.fit`` with no communication at all; run
  on every rank at once, their sum is the limit of the machine or cluster.
* ``kmp``: ``kmp.wrap_optimizer(SGD, scale_lr=True)`` in ``model.fit`` (the
  bucket size and compression as given).
* ``hvd_tape``: Horovod's own TensorFlow API, ``hvd.DistributedGradientTape`` in
  a plain ``tf.function`` step (Keras 3 SGD applies the averaged gradients).
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` with Keras 3
  ``model.fit``; ``--workers`` gives every worker's address (rank order).

``digits_cnn`` trains on the real digits that scikit-learn ships (each rank its
shard, reshuffled every epoch) and reports the test accuracy; other models (the
token models ``gpt`` and ``embed_lm`` too) get one synthetic batch repeated
(throughput only). On JAX every peer compiles the whole step
(``kmp.xla.step_jit_compile``). The first epoch traces and is
not timed. Each rank writes ``rankR.json``: images/s of every timed epoch, the
accuracy, and a checksum of the weights (equal on every rank of a synchronised
peer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kmp._names import SPARSE_GRADIENTS  # noqa: E402  (the vocabulary only: nothing heavy)

PEERS = ("independent", "kmp", "hvd_tape", "mwms")
LEARNING_RATE = 0.05  # per rank of 64 images; scaled by the number of ranks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", required=True, choices=PEERS)
    p.add_argument("--model", default="digits_cnn")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64, help="images per rank and step")
    p.add_argument("--epochs", type=int, default=8, help="epochs; the first is not timed")
    p.add_argument("--steps", type=int, default=12, help="steps per epoch (synthetic data)")
    p.add_argument("--bucket-bytes", type=int, default=None)
    p.add_argument("--one-bucket", action="store_true", help="kmp: bucket_bytes=None")
    p.add_argument("--compression", default=None, choices=("fp16", "bf16"))
    p.add_argument(
        "--sparse-gradients", default=None, choices=SPARSE_GRADIENTS, help="kmp (default: kmp's)"
    )
    p.add_argument("--workers", default="", help="mwms: HOST:PORT of every worker, rank order")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    p.add_argument(
        "--inter-threads",
        type=int,
        default=2,
        help="inter-op threads: 2 lets an allreduce start while the next op computes",
    )
    p.add_argument(
        "--jit",
        default="off",
        choices=("on", "off"),
        help="XLA: jit_compile for independent, kmp.xla.jit_gradients for kmp",
    )
    return p.parse_args(argv)


def launcher_rank() -> tuple[int, int]:
    """(rank, size) as the launcher (horovodrun or kmp launch) announced them; (0, 1) alone."""
    from kmp._launcher_env import launched_rank, launched_world_size

    return launched_rank() or 0, launched_world_size() or 1


# ---------------------------------------------------------------------- data


def digits(rank: int, size: int):
    """Train shard of this rank and the whole test split, images in [0, 1]."""
    from kmp.datasets.digits import load_arrays, split_indices

    images, labels = load_arrays()
    images = (images.reshape(-1, 8, 8, 1) / 16.0).astype("float32")
    labels = labels.astype("int32")
    train, test = split_indices(labels)
    mine = train[rank::size]
    return (images[mine], labels[mine]), (images[test], labels[test])


def dataset(args: argparse.Namespace, rank: int, size: int, batch: int):
    """(tf.data of this rank, steps per epoch, test arrays or None)."""
    import models
    import tensorflow as tf

    if args.model == "digits_cnn":
        (x, y), test = digits(rank, size)
        steps = len(x) // batch  # the same on every rank: shards differ by one at most
        data = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=rank, reshuffle_each_iteration=True)
            .batch(batch, drop_remainder=True)
            .take(steps)
            .repeat()
            .prefetch(2)
        )
        return data, steps, test
    x, y = models.batch(args.model, batch, seed=rank)
    return tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2), args.steps, None


# ---------------------------------------------------------------------- peers


class EpochTimer:
    """Wall time of every epoch (a Keras callback, or called by hand)."""

    def __init__(self):
        self.times: list[float] = []
        self._t0 = 0.0

    def begin(self, *_):
        """Start timing an epoch."""
        self._t0 = time.perf_counter()

    def end(self, *_):
        """Stop timing it."""
        self.times.append(time.perf_counter() - self._t0)

    def callback(self):
        """The same, as a Keras callback."""
        import keras

        return keras.callbacks.LambdaCallback(on_epoch_begin=self.begin, on_epoch_end=self.end)


def _compile(model, optimizer, jit: bool = False) -> None:
    """Compile as every peer does; on JAX always with XLA (kmp.xla.step_jit_compile)."""
    import kmp

    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit or kmp.xla.step_jit_compile(),
    )


def run_independent(args, rank, size, timer) -> object:
    import keras
    import models

    data, steps, _ = dataset(args, rank, size, args.batch)
    model = models.build(args.model)
    _compile(model, keras.optimizers.SGD(LEARNING_RATE * size), jit=args.jit == "on")
    model.fit(
        data, epochs=args.epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer.callback()]
    )
    return model


def run_kmp(args, rank, size, timer) -> object:
    import keras
    import models

    import kmp

    kmp.distributed.init()
    data, steps, _ = dataset(args, rank, size, args.batch)
    model = models.build(args.model)
    kwargs = {"compression": args.compression}
    if args.sparse_gradients:
        kwargs["sparse_gradients"] = args.sparse_gradients
    if args.one_bucket or args.bucket_bytes is not None:
        kwargs["bucket_bytes"] = None if args.one_bucket else args.bucket_bytes
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(LEARNING_RATE), scale_lr=True, **kwargs)
    _compile(model, opt)
    if args.jit == "on":  # XLA for forward and backward, the allreduce outside it
        kmp.xla.jit_gradients(model)
    kmp.distributed.broadcast_variables(model.variables)
    model.fit(
        data, epochs=args.epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer.callback()]
    )
    return model


def run_hvd_tape(args, rank, size, timer) -> object:
    import horovod.tensorflow as hvd
    import keras
    import models
    import tensorflow as tf

    hvd.init()
    data, steps, _ = dataset(args, rank, size, args.batch)
    model = models.build(args.model)
    opt = keras.optimizers.SGD(LEARNING_RATE * hvd.size())
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        # Horovod's tape needs the tf.Variables behind Keras 3's variables.
        grads = tape.gradient(loss, [v.value for v in model.trainable_variables])
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    opt.build(model.trainable_variables)
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    it = iter(data)
    for _ in range(args.epochs):
        timer.begin()
        for _ in range(steps):
            loss = step(*next(it))
        float(loss)
        timer.end()
    return model


def _patch_keras_for_mwms(model, strategy, example) -> None:
    """The two changes Keras 3.15's fit needs to run under MultiWorkerMirroredStrategy.

    Unpatched, ``fit`` fails in ``_maybe_symbolic_build`` (``strategy.reduce`` of a
    batch of PerReplica values: "Attempt to convert a value (PerReplica...") and
    then in ``reduce_per_replica`` (a MEAN over axis 0 of scalar logs: "Invalid
    reduction dimension 0 for input with 0 dimensions", tensorflow#72388). Both are
    private Keras internals: this is what it takes to time the peer, not a fix.
    """
    import keras.src.backend.tensorflow.trainer as trainer
    import tensorflow as tf

    trainer.reduce_per_replica = lambda values, strategy, reduction="auto": tf.nest.map_structure(
        lambda v: strategy.reduce("MEAN", v, axis=None), values
    )

    def build(iterator=None, data_batch=None):
        with strategy.scope():
            model._symbolic_build(data_batch=example)

    model._maybe_symbolic_build = build


def run_mwms(args, rank, size, timer) -> object:
    import keras
    import models
    import tensorflow as tf

    workers = [w for w in args.workers.split(",") if w]
    if len(workers) != size:
        raise SystemExit(f"--workers names {len(workers)} workers for {size} ranks")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # The whole data at the global batch; the strategy gives each worker its part.
    data, steps, _ = dataset(args, 0, 1, args.batch * size)
    with strategy.scope():
        model = models.build(args.model)
        _compile(model, keras.optimizers.SGD(LEARNING_RATE * size))
    if os.environ.get("KMP_BENCH_MWMS_UNPATCHED") != "1":
        x, y = next(iter(data))
        _patch_keras_for_mwms(model, strategy, (x[:1], y[:1]))
    model.fit(
        data, epochs=args.epochs, steps_per_epoch=steps, verbose=0, callbacks=[timer.callback()]
    )
    return model


RUNNERS = {
    "independent": run_independent,
    "kmp": run_kmp,
    "hvd_tape": run_hvd_tape,
    "mwms": run_mwms,
}


def checksum(model) -> str:
    """A digest of every weight: equal on ranks that hold the same model."""
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(w.tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_threads)
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)  # every peer starts from the same weights
    rank, size = launcher_rank()
    if args.peer == "independent":
        rank_for_data, size_for_data = 0, 1  # every process trains alone, on all the data
    else:
        rank_for_data, size_for_data = rank, size
    timer = EpochTimer()
    t0 = time.perf_counter()
    model = RUNNERS[args.peer](args, rank_for_data, size_for_data, timer)
    wall = time.perf_counter() - t0
    if args.peer == "mwms":
        _, steps, test = dataset(args, 0, 1, args.batch * size)
    else:
        _, steps, test = dataset(args, rank_for_data, size_for_data, args.batch)
    per_rank_images = steps * args.batch
    timed = timer.times[1:] or timer.times
    result = {
        "peer": args.peer,
        "rank": rank,
        "size": size,
        "model": args.model,
        "batch_per_rank": args.batch,
        "steps_per_epoch": steps,
        "epoch_seconds": [round(t, 4) for t in timer.times],
        "images_per_s": [round(per_rank_images / t, 2) for t in timed],
        "wall_seconds": round(wall, 2),
        "checksum": checksum(model),
    }
    if test is not None:
        # A direct call, not predict(): under MWMS predict is a collective op too.
        probs = np.asarray(model(test[0], training=False))
        result["accuracy"] = float((probs.argmax(-1) == test[1]).mean())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
