r"""kmp's reference training script: one file, one process or many, any dtype policy.

Run it through ``kmp launch`` (or the launch/ shell scripts)::

    kmp launch -np 2 launch/train.py --model digits_cnn --epochs 10
    kmp launch -np 2 launch/train.py --model resnet50 --steps-per-epoch 3 --epochs 1
    kmp launch -np 8 --hostfile hosts.txt launch/train.py --model resnet50 \\
        --dataset imagenet2012 --data-dir /data/tfds --image-size 224 --batch-size 64 \\
        --scale-lr --warmup-epochs 5 --compression fp16 --checkpoint-dir runs/r50

What it does, using what kmp offers:

1. ``kmp.distributed.init()``; ``kmp.enable(policy)`` (``KMP_POLICY`` wins, so
   ``kmp launch --policy`` sets it for every rank).
2. Resume: if ``--checkpoint-dir`` holds checkpoints, rank 0 finds the newest
   (``kmp.callbacks.latest_checkpoint``) and tells every rank; the model is
   loaded from it (weights, optimizer state, loss scale) and training goes on at
   the epoch after it. Ranks that cannot read the file build a fresh model and
   receive rank 0's state from the broadcast callback.
3. Otherwise the model is built (digits CNN, ``keras.applications.ResNet50``, or
   one of the workloads of ``launch/workloads.py``: the byte-level ``gpt``, KerasHub's
   ``gpt2-hub``, the MNIST-1D paper's ``mnist1d_cnn``), ``kmp.float32_outputs``
   keeps its outputs in float32, ``kmp.audit`` is printed by rank 0, and the
   optimizer is ``kmp.wrap_optimizer(...)``.
4. Input: ``kmp.data.load`` gives each rank its shard of the TFDS split,
   reshuffled per epoch, cast to the compute dtype on the host; the in-memory
   ``kmp_pytext`` and ``mnist1d`` come the same way from ``kmp.datasets.memory``.
5. ``model.fit`` with ``kmp.callbacks.default_callbacks``: broadcast from rank
   0, metric averaging, loss-scale monitor, LR warm-up, and atomic chief-only
   checkpoints every epoch.
6. The test accuracy over the whole test split (each rank evaluates its shard,
   counts are summed; for the language models the validation loss in nats per byte
   and bits per byte, and tokens/s), a check that every rank ends with identical trainable
   weights (BatchNormalization's moving statistics stay per rank),
   and the training throughput; ``--summary FILE`` writes them as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from kmp._names import MASTER_WEIGHTS  # the vocabulary only: nothing heavy


def _load_workloads():
    """Import ``launch/workloads.py`` beside this file (also when bench/ imports this one)."""
    path = Path(__file__).resolve().parent / "workloads.py"
    spec = importlib.util.spec_from_file_location("kmp_launch_workloads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workloads = _load_workloads()
MODELS = ("digits_cnn", "resnet50", *workloads.MODELS)
DEFAULT_DATASET = {
    "digits_cnn": "kmp_digits",
    "resnet50": "kmp_synthetic_images",
    "gpt": "kmp_pytext",
    "gpt2-hub": "kmp_pytext",
    "mnist1d_cnn": "mnist1d",
}
# Per rank. mnist1d_cnn: 50 per rank is the paper's batch of 100 on 2 ranks.
DEFAULT_BATCH = {"digits_cnn": 32, "resnet50": 8, "gpt": 16, "gpt2-hub": 16, "mnist1d_cnn": 50}
DEFAULT_LR = {"digits_cnn": 4e-3, "resnet50": 0.01, "gpt": 3e-3, "gpt2-hub": 3e-3}
DEFAULT_LR["mnist1d_cnn"] = 1e-2  # the paper's Adam rate
CONSTANT_LR = ("resnet50", "mnist1d_cnn")  # the others decay (cosine) by default
# Defaults sized for a run of about a minute on 2 CPU ranks (the paper's 8,000 steps of 100
# for mnist1d_cnn: 200 epochs of 4,000); any other model: 10 epochs of every full batch.
DEFAULT_EPOCHS = {"gpt": 4, "gpt2-hub": 4, "mnist1d_cnn": 200}
DEFAULT_STEPS = {"gpt": 50, "gpt2-hub": 50}
# Above this many parameters the weight check compares checksums, not full weights.
FULL_WEIGHT_CHECK_MAX_PARAMS = 2_000_000


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kmp reference training script (run it with `kmp launch`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", choices=MODELS, default="digits_cnn")
    p.add_argument(
        "--dataset",
        help="TFDS image-classification data set (default: kmp_digits for digits_cnn, "
        "the SYNTHETIC kmp_synthetic_images for resnet50), or an in-memory one: kmp_pytext "
        "(bytes, for gpt and gpt2-hub), mnist1d (for mnist1d_cnn)",
    )
    p.add_argument(
        "--text-dir",
        help="kmp_pytext: train on the text files of this folder (default: the Python "
        "standard library's sources, capped at 1 MiB)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=workloads.GPT_CONFIG["seq_len"],
        help="kmp_pytext: bytes per sequence",
    )
    p.add_argument("--data-dir", help="TFDS data directory (default: $KMP_DATA_DIR or kmp cache)")
    p.add_argument(
        "--policy",
        default="auto",
        help="auto, mixed_float16, mixed_bfloat16, float32 or bfloat16 (bfloat16 weights and "
        "optimizer states; KMP_POLICY overrides)",
    )
    p.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        default="auto",
        help="how updates reach 16-bit weights (kmp.wrap_optimizer's master_weights)",
    )
    p.add_argument("--batch-size", type=int, help="examples per batch on each rank")
    p.add_argument(
        "--epochs",
        type=int,
        help="total epochs, a resumed run included (default: 10; 4 for gpt, 200 for mnist1d_cnn)",
    )
    p.add_argument(
        "--steps-per-epoch", type=int, help="batches per epoch (default: all; 50 for gpt)"
    )
    p.add_argument("--lr", type=float, help="learning rate before --scale-lr")
    p.add_argument(
        "--lr-schedule",
        choices=("cosine", "constant"),
        help="cosine decay to 0 over the run, or constant (default: constant for resnet50 "
        "and mnist1d_cnn, cosine for the others)",
    )
    p.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument(
        "--bucket-bytes",
        type=int,
        help="reduce the gradients in buckets of this many bytes, last layer first "
        "(default: kmp's, one grouped allreduce; see docs/performance.md)",
    )
    p.add_argument(
        "--jit-gradients",
        action="store_true",
        help="compile forward and backward with XLA, the allreduce outside (kmp.xla)",
    )
    p.add_argument(
        "--scale-lr", action="store_true", help="multiply the learning rate by the rank count"
    )
    p.add_argument(
        "--warmup-epochs",
        type=float,
        default=0.0,
        help="raise the learning rate linearly over this many epochs (0: no warm-up)",
    )
    p.add_argument(
        "--checkpoint-dir", help="write a checkpoint per epoch here (rank 0) and resume from it"
    )
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--image-size", type=int, help="resize images (resnet50 default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--loss-scale-growth-interval",
        type=int,
        default=2000,
        help="finite steps before a dynamic loss scale doubles (float16 only)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="also measure the test accuracy (language models: the validation loss) every N "
        "epochs, on every rank's shard; the summary's eval_history holds the curve (0: only "
        "at the end)",
    )
    p.add_argument(
        "--stop-after-epochs",
        type=int,
        help="stop this run after N epochs as if preempted (to try out resuming)",
    )
    p.add_argument(
        "--summary",
        help="write the results as JSON to this file (rank 0); with {rank} in the name, every "
        "rank writes its own",
    )
    p.add_argument(
        "--inject-overflow",
        type=int,
        metavar="STEP",
        help="make training step STEP (0-based, counted over the run) overflow on one rank, "
        "to watch every rank skip it together",
    )
    p.add_argument(
        "--inject-overflow-rank",
        type=int,
        metavar="R",
        help="the rank whose batch overflows (default: the last rank)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="elastic training (run with `kmp launch --elastic`): go on when a worker dies or "
        "joins, from the last commit, each epoch's examples re-dealt to the ranks left",
    )
    p.add_argument(
        "--commit-every",
        type=int,
        default=10,
        metavar="N",
        help="with --elastic: commit the state every N batches (and at every epoch end)",
    )
    p.add_argument(
        "--verbose",
        default="auto",
        help="Keras fit verbosity on rank 0 (auto: progress bar on a terminal, else a line "
        "per epoch)",
    )
    args = p.parse_args(argv)
    args.dataset = args.dataset or DEFAULT_DATASET[args.model]
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH[args.model]
    if args.lr is None:
        args.lr = DEFAULT_LR[args.model]
    if args.lr_schedule is None:
        args.lr_schedule = "constant" if args.model in CONSTANT_LR else "cosine"
    if args.epochs is None:
        args.epochs = DEFAULT_EPOCHS.get(args.model, 10)
    if args.steps_per_epoch is None:
        args.steps_per_epoch = DEFAULT_STEPS.get(args.model)
    check_workload(p, args)
    if not args.lr > 0:
        p.error("--lr must be > 0")
    if args.image_size is None and args.model == "resnet50":
        args.image_size = 64
    if args.verbose == "auto":
        args.verbose = 1 if sys.stdout.isatty() else 2
    elif args.verbose in ("0", "1", "2"):
        args.verbose = int(args.verbose)
    else:
        p.error("--verbose must be auto, 0, 1 or 2")
    for name in ("batch_size", "epochs", "keep_checkpoints"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
        p.error("--steps-per-epoch must be >= 1")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        p.error("--bucket-bytes must be >= 1 (leave it out for one grouped allreduce)")
    if args.warmup_epochs < 0:
        p.error("--warmup-epochs must be >= 0")
    if args.inject_overflow is not None and args.inject_overflow < 0:
        p.error("--inject-overflow must be a step >= 0")
    if args.commit_every < 1:
        p.error("--commit-every must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0 (0: evaluate at the end only)")
    if args.eval_every and args.elastic:
        p.error("--eval-every evaluates on every rank at once; an elastic job cannot: drop it")
    if args.elastic and (args.steps_per_epoch is not None or args.stop_after_epochs is not None):
        p.error(
            "--elastic trains on whole epochs (the rank count may change mid-epoch): drop "
            "--steps-per-epoch and --stop-after-epochs"
        )
    return args


def check_workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the flag combinations the language models and in-memory data sets cannot run."""
    lm, text = args.model in workloads.LM_MODELS, args.dataset == "kmp_pytext"
    if lm != text:
        p.error(
            f"--model {args.model} and --dataset {args.dataset} do not fit: the language "
            "models (gpt, gpt2-hub) train on --dataset kmp_pytext, and only on it"
        )
    if args.text_dir is not None and not text:
        p.error("--text-dir is for --dataset kmp_pytext (a language model)")
    if args.seq_len < 1:
        p.error("--seq-len must be >= 1")
    if args.elastic and args.dataset in in_memory_names():
        p.error(f"--elastic reads TFDS data sets; {args.dataset} lives in memory: drop --elastic")
    if lm and args.inject_overflow is not None:
        p.error("--inject-overflow poisons float inputs; a language model's inputs are bytes")


def memory_datasets():
    """``kmp.datasets.memory``: the in-memory data sets (``kmp_pytext``, ``mnist1d``)."""
    from kmp.datasets import memory

    return memory


def in_memory_names() -> tuple[str, ...]:
    return tuple(memory_datasets().NAMES)


def data_options(args) -> dict:
    """The in-memory data set's own options (none for a TFDS data set)."""
    if args.dataset == "kmp_pytext":
        return {"seq_len": args.seq_len, "text_dir": args.text_dir}
    return {}


def data_spec(args, kmp):
    """The ``kmp.data.ShardSpec`` of the train split, TFDS or in memory."""
    if args.dataset in in_memory_names():
        return memory_datasets().shard_spec(
            args.dataset, "train", batch_size=args.batch_size, **data_options(args)
        )
    return kmp.data.shard_spec(
        args.dataset, "train", batch_size=args.batch_size, data_dir=args.data_dir
    )


def load_split(args, kmp, split: str, **kwargs):
    """This rank's part of ``split``: ``kmp.data.load`` or ``memory_datasets().load``."""
    if args.dataset in in_memory_names():
        kwargs.pop("image_size", None)
        ds = memory_datasets().load(args.dataset, split, **kwargs, **data_options(args))
        return workloads.model_inputs(args.model, ds)
    return kmp.data.load(args.dataset, split, data_dir=args.data_dir, **kwargs)


# ----------------------------------------------------------------------- models


def build_model(name: str, input_shape: tuple, num_classes: int, input_dtype: str):
    """Return the (uncompiled) model; its input takes the dtype the data arrives in."""
    import keras

    if name in workloads.MODELS:
        return workloads.build(name, input_shape, num_classes, input_dtype)
    inputs = keras.Input(shape=input_shape, dtype=input_dtype, name="images")
    if name == "digits_cnn":
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D(2)(x)
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(128, activation="relu")(x)
        x = keras.layers.Dropout(0.25)(x)
        outputs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(x)
        return keras.Model(inputs, outputs, name="digits_cnn")
    if name == "resnet50":
        if input_shape[-1] != 3 or min(input_shape[:2]) < 32:
            raise SystemExit(
                f"resnet50 needs RGB images of at least 32x32, got {input_shape}: pick an RGB "
                "data set or pass --image-size 64."
            )
        return keras.applications.ResNet50(
            weights=None, input_tensor=inputs, classes=num_classes, name="resnet50"
        )
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def learning_rate(args, steps_per_epoch: int, size: int):
    """A float rate (constant schedule) or a cosine decay over the whole run.

    With ``--lr-schedule cosine`` a warm-up is part of the schedule (from ``lr / size``
    to ``lr``, before ``--scale-lr`` multiplies it all by ``size``); with a constant
    rate, kmp's LearningRateWarmup callback does it.
    """
    import keras

    if args.lr_schedule == "constant":
        return args.lr
    total = args.epochs * steps_per_epoch
    warm = min(int(args.warmup_epochs * steps_per_epoch), total - 1)
    if warm <= 0:
        return keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=total)
    return keras.optimizers.schedules.CosineDecay(
        args.lr / size, decay_steps=total - warm, warmup_target=args.lr, warmup_steps=warm
    )


def make_optimizer(args, kmp, steps_per_epoch: int, size: int):
    import keras

    lr = learning_rate(args, steps_per_epoch, size)
    if args.model == "resnet50":
        base = keras.optimizers.SGD(lr, momentum=0.9)
    else:
        base = keras.optimizers.Adam(lr)
    return kmp.wrap_optimizer(
        base,
        compression=None if args.compression == "none" else args.compression,
        scale_lr=args.scale_lr,
        growth_interval=args.loss_scale_growth_interval,
        master_weights=args.master_weights,
        rounding_seed=args.seed,
        **({} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}),
    )


# ---------------------------------------------------------------------- helpers


def log(*parts) -> None:
    import kmp

    if kmp.distributed.is_chief():
        print(*parts, flush=True)


def loss_scale_of(model) -> tuple[float | None, int | None]:
    opt = model.optimizer
    scale = getattr(opt, "loss_scale", None)
    skipped = getattr(opt, "skipped_steps", None)
    return (None if scale is None else float(scale), None if skipped is None else int(skipped))


def state_bytes_per_param(model) -> float:
    """Bytes of the weights and the optimizer's variables per trainable parameter."""
    import numpy as np

    from kmp.master_weights import state_bytes

    params = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    return state_bytes(model) / max(params, 1)


def weights_max_diff(variables, kmp) -> float:
    """Largest difference between any rank's ``variables`` and rank 0's (0.0: identical)."""
    import numpy as np

    values = [np.asarray(v.numpy(), dtype=np.float64).ravel() for v in variables]
    if not values:
        return 0.0
    size = kmp.distributed.size()
    if sum(v.size for v in values) <= FULL_WEIGHT_CHECK_MAX_PARAMS:
        flat = np.concatenate(values)
        gathered = np.asarray(kmp.distributed.allgather(flat)).reshape(size, -1)
        return float(np.max(np.abs(gathered - gathered[0]))) if size > 1 else 0.0
    # Large models: exact byte checksums per variable; any difference shows as a mismatch.
    sums = np.array([zlib.crc32(v.tobytes()) for v in values], dtype=np.int64)
    gathered = np.asarray(kmp.distributed.allgather(sums)).reshape(size, -1)
    return 0.0 if (gathered == gathered[0]).all() else math.inf


def evaluate(model, args, kmp) -> dict:
    """The test accuracy, or a language model's validation loss (nats and bits per byte)."""
    if args.model in workloads.LM_MODELS:
        ds = (
            memory_datasets()
            .load(args.dataset, "validation", batch_size=None, shuffle=False, **data_options(args))
            .batch(64)
        )
        return workloads.lm_metrics(model, args.model, ds, kmp)
    return {"test_accuracy": test_accuracy(model, args, kmp)}


def result_line(metrics: dict, summary: dict) -> str:
    """Rank 0's closing line: the quality figure, the weight check and the throughput."""
    if "val_loss_nats" in metrics:
        quality = (
            f"validation loss {metrics['val_loss_nats']:.4f} nats/byte "
            f"({metrics['val_bits_per_byte']:.4f} bits/byte)"
        )
    else:
        quality = f"test accuracy {metrics['test_accuracy']:.4f}"
    diff = summary["weights_max_diff"]
    rate = summary["images_per_sec"]
    if rate is not None and summary["tokens_per_sec"] is not None:
        speed = f"{summary['tokens_per_sec']:.0f} tokens/s"
    else:
        speed = "no training" if rate is None else f"{rate:.0f} images/s"
    same = "identical" if diff == 0 else f"DIFFER (max {diff:g})"
    return f"{quality} | ranks' weights {same} | {speed}"


def test_accuracy(model, args, kmp) -> float:
    """Accuracy over the whole test split: each rank scores its shard, counts are summed."""
    import numpy as np

    ds = load_split(
        args, kmp, "test", batch_size=None, shuffle=False, image_size=args.image_size
    ).batch(256)
    correct = total = 0
    for images, labels in ds:
        predicted = np.argmax(np.asarray(model(images, training=False)), axis=-1)
        correct += int((predicted == labels.numpy()).sum())
        total += int(labels.shape[0])
    counts = kmp.distributed.allreduce(np.array([correct, total], dtype=np.float64), op="sum")
    correct, total = (float(c) for c in np.asarray(counts))
    return correct / total


def throughput_callback(batch_size: int, kmp):
    import keras

    class Throughput(keras.callbacks.Callback):
        """Images per second over all ranks, per epoch."""

        def __init__(self):
            super().__init__()
            self.per_epoch: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start, self._steps = time.perf_counter(), 0

        def on_train_batch_end(self, batch, logs=None):
            self._steps += 1

        def on_epoch_end(self, epoch, logs=None):
            elapsed = time.perf_counter() - self._start
            # The rank count now: an elastic job may have shrunk or grown since the start.
            images = self._steps * batch_size * kmp.distributed.size()
            self.per_epoch.append(images / elapsed)

    return Throughput()


def skip_recorder(kmp):
    """A callback that lists the steps (0-based, over the run) the optimizer skipped."""
    import keras

    class SkipRecorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps: list[int] = []
            self._seen = 0
            self._step = 0

        def on_train_begin(self, logs=None):
            self._seen = int(getattr(self.model.optimizer, "skipped_steps", 0) or 0)

        def on_train_batch_end(self, batch, logs=None):
            now = int(getattr(self.model.optimizer, "skipped_steps", 0) or 0)
            if now > self._seen:
                self.steps.append(self._step)
            self._seen, self._step = now, self._step + 1

    return SkipRecorder()


def elastic_data(args, kmp, compute_dtype: str, overflow_rank: int):
    """The split in memory, dealt to the ranks epoch by epoch (``--elastic``).

    ``--inject-overflow STEP`` poisons step STEP of the first epoch's first plan
    on the overflow rank of the world that starts the job.
    """

    def transform(ds, plan):
        fresh = plan.epoch == 0 and plan.start == 0
        if args.inject_overflow is not None and fresh and plan.rank == overflow_rank:
            print(f"rank {plan.rank}: step {args.inject_overflow} will overflow", flush=True)
            return inject_overflow(ds, args.inject_overflow)
        return ds

    return kmp.elastic.ElasticData.from_tfds(
        args.dataset,
        "train",
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        image_size=args.image_size,
        dtype=compute_dtype,
        seed=args.seed,
        transform=transform,
    )


def inject_overflow(dataset, step: int):
    """Make batch ``step`` of ``dataset`` all inf: its gradients overflow on this rank only."""
    import tensorflow as tf

    def poison(i, batch):
        x, *rest = batch
        bad = tf.fill(tf.shape(x), tf.constant(float("inf"), x.dtype))
        return (tf.where(tf.equal(i, step), bad, x), *rest)

    return dataset.enumerate().map(poison)


def stop_after(epochs: int):
    import keras

    class StopAfter(keras.callbacks.Callback):
        """End fit() after ``epochs`` epochs of this run, on every rank alike."""

        def __init__(self):
            super().__init__()
            self.done = 0

        def on_epoch_end(self, epoch, logs=None):
            self.done += 1
            if self.done >= epochs:
                self.model.stop_training = True

    return StopAfter()


# ------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import keras

    import kmp

    world = kmp.distributed.init()
    choice = kmp.enable(args.policy)
    keras.utils.set_random_seed(args.seed)
    log(
        f"kmp train: {args.model} on {args.dataset}, {world.size} rank(s), "
        f"policy {choice.name} ({choice.reason})"
    )

    spec = data_spec(args, kmp)
    steps = args.steps_per_epoch or spec.steps_per_epoch
    if steps > spec.steps_per_epoch:
        raise SystemExit(
            f"--steps-per-epoch {steps} > {spec.steps_per_epoch}, the full batches of "
            f"{args.batch_size} per rank in {args.dataset!r}: lower it or the batch size."
        )
    image_shape = spec.image_shape
    if args.image_size:
        image_shape = (args.image_size, args.image_size, image_shape[-1])

    # Resume from the newest checkpoint, if there is one (rank 0 decides for all).
    found = (None, 0)
    if args.checkpoint_dir and (world.rank == 0 or args.elastic):
        found = tuple(kmp.callbacks.latest_checkpoint(args.checkpoint_dir))
    if args.elastic:
        # No collective before the elastic run: a worker that joins a running job would meet
        # the others' state sync. Every rank looks itself; the sync then gives rank 0's state.
        path, initial_epoch = found
    else:
        path, initial_epoch = kmp.distributed.broadcast_object(found, root=0)
    if path and os.path.exists(path):
        model = kmp.load_model(path)  # registers kmp's layer and optimizer classes first
        model.jit_compile = kmp.xla.step_jit_compile()  # this backend's, not the saver's
        log(f"resumed from {path}: epoch {initial_epoch}, loss scale {loss_scale_of(model)[0]}")
    else:
        model = build_model(args.model, image_shape, spec.num_classes, choice.compute_dtype)
        model = kmp.float32_outputs(model)
        model.compile(
            optimizer=make_optimizer(args, kmp, steps, world.size),
            **workloads.compile_args(args.model, args.elastic),
            jit_compile=kmp.xla.step_jit_compile(),
        )
        if path:
            print(f"rank {world.rank}: cannot read {path}; taking rank 0's state", flush=True)
    if args.jit_gradients:
        model.jit_compile = False  # a loaded model keeps its own setting otherwise
        kmp.xla.jit_gradients(model)
    if world.rank == 0:
        print(kmp.audit(model).summary(max_rows=40), flush=True)  # ResNet-50: short
    if not model.optimizer.built:  # a loaded optimizer is built, with its state
        model.optimizer.build(model.trainable_variables)
    scale_start, _ = loss_scale_of(model)
    iterations_start = int(model.optimizer.iterations.numpy())

    epochs_left = max(args.epochs - initial_epoch, 0)
    history: dict[str, list] = {}
    skips = skip_recorder(kmp)
    rate = throughput_callback(args.batch_size, kmp)
    curve = workloads.evaluate_every(lambda: evaluate(model, args, kmp), args.eval_every, steps)
    elastic: dict = {}
    final_epoch = initial_epoch
    overflow_rank = args.inject_overflow_rank
    if overflow_rank is None:
        overflow_rank = world.size - 1
    if not 0 <= overflow_rank < world.size:
        raise SystemExit(
            f"--inject-overflow-rank {overflow_rank}: this job has ranks 0..{world.size - 1}."
        )
    callbacks = kmp.callbacks.default_callbacks(
        # An elastic state syncs from rank 0 at the start and after every reset.
        broadcast=not args.elastic,
        # A cosine schedule has its warm-up built in; a constant rate uses the callback.
        warmup_epochs=(args.warmup_epochs or None) if args.lr_schedule == "constant" else None,
        checkpoint_dir=args.checkpoint_dir,
        keep=args.keep_checkpoints,
        extra=[rate, skips, curve]
        + ([stop_after(args.stop_after_epochs)] if args.stop_after_epochs else []),
        verbose=1,
    )
    if epochs_left and args.elastic:
        state = kmp.elastic.KerasState(model, epoch=initial_epoch)
        data = elastic_data(args, kmp, choice.compute_dtype, overflow_rank)
        kmp.elastic.fit(
            state,
            data,
            epochs=args.epochs,
            commit_every=args.commit_every,
            callbacks=callbacks,
            record_examples=True,
            verbose=args.verbose,
        )
        world = kmp.distributed.world()  # the world that finished, not the one that started
        keys = state.history[-1] if state.history else {}
        runs = state.history  # this run's epochs (the state starts empty)
        history = {k: [h[k] for h in runs if k in h] for k in keys}
        final_epoch = state.epoch  # a rank that joined got the run's position in the sync
        elastic = {
            "events": state.events,
            "commits": state.commits,
            "resets": state.resets,
            "examples": {str(e): ids for e, ids in state.examples.items()},
            "num_examples": data.num_examples,
        }
    elif epochs_left:
        train = load_split(
            args,
            kmp,
            "train",
            batch_size=args.batch_size,
            seed=args.seed,
            epoch=initial_epoch,
            epochs=epochs_left,
            steps_per_epoch=steps,
            image_size=args.image_size,
        )
        if args.inject_overflow is not None and world.rank == overflow_rank:
            train = inject_overflow(train, args.inject_overflow)
            print(f"rank {world.rank}: step {args.inject_overflow} will overflow", flush=True)
        result = model.fit(
            train,
            epochs=args.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps,
            shuffle=False,  # kmp.data already reshuffles every epoch
            callbacks=callbacks,
            verbose=kmp.callbacks.verbosity(args.verbose),
        )
        history = {k: [float(v) for v in vals] for k, vals in result.history.items()}
        final_epoch = initial_epoch + len(history.get("loss", []))
    else:
        log(f"nothing to train: {initial_epoch} of {args.epochs} epochs already done")

    metrics = evaluate(model, args, kmp)
    # Trainable weights must be bit-identical on every rank. Non-trainable state such as
    # BatchNormalization's moving statistics follows each rank's own batches (Horovod does
    # not average it), so it is reported apart.
    max_diff = weights_max_diff(model.trainable_weights, kmp)
    stats_diff = weights_max_diff(model.non_trainable_weights, kmp)
    scale_end, skipped = loss_scale_of(model)
    saved = [cb.saved for cb in callbacks if isinstance(cb, kmp.callbacks.AtomicCheckpoint)]
    checkpoints_written = saved[0] if saved else []  # empty on ranks that were never rank 0
    measured = rate.per_epoch[1:] or rate.per_epoch  # the first epoch includes tracing
    summary = {
        "model": args.model,
        "dataset": args.dataset,
        "policy": choice.name,
        "policy_reason": choice.reason,
        "master_weights": model.optimizer.master_weights,
        "state_bytes_per_param": state_bytes_per_param(model),
        "ranks": world.size,
        "engine": world.engine,
        "jit_compile": bool(model.jit_compile),  # the whole step under XLA (JAX: kmp.xla)
        "batch_size_per_rank": args.batch_size,
        "steps_per_epoch": steps,
        "resumed_from": path,
        "initial_epoch": initial_epoch,
        "epochs_run": len(history.get("loss", [])),
        "final_epoch": final_epoch,
        "iterations_start": iterations_start,
        "iterations_end": int(model.optimizer.iterations.numpy()),
        "loss_scale_start": scale_start,
        "loss_scale_end": scale_end,
        "skipped_steps": skipped,
        "skipped_at": skips.steps,  # steps of this run (0-based) the optimizer skipped
        "history": history,
        # With --eval-every: [{"epoch", "step", and evaluate's figures}], one per evaluation.
        "eval_history": curve.points,
        "final_loss": history["loss"][-1] if history.get("loss") else None,
        "test_accuracy": metrics.get("test_accuracy"),
        **metrics,
        "weights_max_diff": max_diff,
        "non_trainable_max_diff": stats_diff,
        "bucket_bytes": model.optimizer.bucket_bytes,
        # How often the XLA-compiled forward and backward pass was traced (None: no XLA).
        "xla_traces": (
            model.train_step.xla_function.experimental_get_tracing_count()
            if args.jit_gradients
            else None
        ),
        "images_per_sec": sum(measured) / len(measured) if measured else None,
        # Language models: bytes predicted per second, over all ranks (sequences x seq_len).
        "tokens_per_sec": (
            sum(measured) / len(measured) * spec.image_shape[0]
            if measured and args.model in workloads.LM_MODELS
            else None
        ),
        # Where this rank ran, and what it wrote (a per-rank --summary shows every rank's).
        "rank": world.rank,
        "hostname": socket.gethostname(),
        "local_rank": world.local_rank,
        "local_size": world.local_size,
        "cross_rank": world.cross_rank,
        "cross_size": world.cross_size,
        "checkpoints_written": checkpoints_written,
        "elastic": elastic,
    }
    log(result_line(metrics, summary))
    per_rank = args.summary and "{rank}" in args.summary
    if args.summary and (per_rank or world.rank == 0):
        out = Path(args.summary.replace("{rank}", str(world.rank)))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
