r"""kmp's reference training script: one file, one process or many, any dtype policy.

Run it through ``kmp launch`` (or the launch/ shell scripts)::

    kmp launch -np 2 launch/train.py --model digits_cnn --epochs 10
    kmp launch -np 2 launch/train.py --model resnet50 --steps-per-epoch 3 --epochs 1
    kmp launch -np 8 --hostfile hosts.txt launch/train.py --model resnet50 \\
        --dataset imagenet2012 --data-dir /data/tfds --image-size 224 --batch-size 64 \\
        --scale-lr --warmup-epochs 5 --compression fp16 --checkpoint-dir runs/r50

What it does, using what kmp offers, one named step each:

1. ``start``: ``kmp.distributed.init()``; ``kmp.enable(policy)`` (``KMP_POLICY``
   wins, so ``kmp launch --policy`` sets it for every rank).
2. ``find_checkpoint``, ``resume_or_build``: if ``--checkpoint-dir`` holds
   checkpoints, rank 0 finds the newest (``kmp.callbacks.latest_checkpoint``) and
   tells every rank; the model is loaded from it (weights, optimizer state, loss
   scale) and training goes on at the epoch after it. Ranks that cannot read the
   file build a fresh model and receive rank 0's state from the broadcast callback.
3. Otherwise (``resume_or_build``) the model is built (digits CNN,
   ``keras.applications.ResNet50``, or one of the workloads of
   ``launch/workloads.py``: the byte-level ``gpt``, KerasHub's ``gpt2-hub``, the
   MNIST-1D paper's ``mnist1d_cnn``), ``kmp.float32_outputs`` keeps its outputs in
   float32, ``kmp.audit`` is printed by rank 0, and the optimizer is
   ``kmp.wrap_optimizer(...)``.
4. Input (``load_split``): ``kmp.data.load`` gives each rank its shard of the TFDS
   split, reshuffled per epoch, cast to the compute dtype on the host; the in-memory
   ``kmp_pytext`` and ``mnist1d`` come the same way from ``kmp.datasets.memory``.
5. ``train_fit`` (``model.fit``; ``--elastic``: ``train_elastic``, ``kmp.elastic.fit``)
   with ``kmp.callbacks.default_callbacks`` (``make_callbacks``): broadcast from rank
   0, metric averaging, loss-scale monitor, LR warm-up, and atomic chief-only
   checkpoints every epoch.
6. ``summarize``, ``write_summary``: the test accuracy over the whole test split
   (each rank evaluates its shard, counts are summed; for the language models the
   validation loss in nats per byte and bits per byte, and tokens/s), a check that
   every rank ends with identical trainable weights (BatchNormalization's moving
   statistics stay per rank), and the training throughput; ``--summary FILE``
   writes them as JSON (rank 0).

``main`` is those steps in order. The flags and their checks are in ``train_options.py``;
the data (each rank's split, the elastic split, the evaluation) in ``train_data.py``;
what a run measures and injects (throughput, skipped steps, the weight check, the test
driver's ``--inject-overflow`` and ``--stop-after-epochs``) in ``train_measure.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kmp and TensorFlow are imported in start(), once the flags are checked
    import argparse
    import types

    from kmp.data import ShardSpec
    from kmp.distributed import World
    from kmp.policy import PolicyChoice

# The siblings (workloads.py, train_options.py, train_measure.py) import by name: a script's
# folder is on sys.path when it runs, and bench/ imports this file by its path.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads
from train_data import data_spec, elastic_data, evaluate, load_split
from train_measure import (
    inject_overflow,
    loss_scale_of,
    result_line,
    skip_recorder,
    state_bytes_per_param,
    stop_after,
    throughput_callback,
    weights_max_diff,
)
from train_options import (
    MODELS,
    parse_args,
)

from kmp._launcher_env import quiet_env
from kmp.commands import tensorflow_notices_dropped

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
        **({"underflow_threshold": None} if args.loss_scale_rule == "keras" else {}),
        master_weights=args.master_weights,
        rounding_seed=args.seed,
        **({} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}),
    )


# ---------------------------------------------------------------------- helpers


def log(*parts) -> None:
    import kmp

    if kmp.distributed.is_chief():
        print(*parts, flush=True)


# ------------------------------------------------------------------------- main


@dataclass
class Run:
    """What main's steps share: the flags, kmp, the world, the policy chosen, the data's shape."""

    args: argparse.Namespace
    kmp: types.ModuleType
    world: World
    choice: PolicyChoice
    spec: ShardSpec
    steps: int
    overflow_rank: int


@dataclass
class Trained:
    """What training left: the per-epoch history, where it ended, the elastic record."""

    history: dict = field(default_factory=dict)
    final_epoch: int = 0
    elastic: dict = field(default_factory=dict)


def start(args) -> Run:
    """Start the world, set the policy and the seed; check the steps and the overflow rank."""
    os.environ.update(quiet_env())  # TensorFlow's log level, unless the user set one
    with tensorflow_notices_dropped():  # the notices TensorFlow prints before that level applies
        import keras

        import kmp

        # TensorFlow now, on the JAX engine too: keras.utils.set_random_seed (below) and TFDS
        # import it there anyway.
        if importlib.util.find_spec("tensorflow"):
            import tensorflow  # noqa: F401

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
    overflow_rank = args.inject_overflow_rank
    if overflow_rank is None:
        overflow_rank = world.size - 1
    if not 0 <= overflow_rank < world.size:
        raise SystemExit(
            f"--inject-overflow-rank {overflow_rank}: this job has ranks 0..{world.size - 1}."
        )
    return Run(args, kmp, world, choice, spec, steps, overflow_rank)


def find_checkpoint(run: Run) -> tuple[str | None, int]:
    """The newest checkpoint and its epoch (rank 0 decides for all; elastic ranks look alone)."""
    args, kmp = run.args, run.kmp
    found = (None, 0)
    if args.checkpoint_dir and (run.world.rank == 0 or args.elastic):
        # (path, epoch); a checkpoint inside an epoch also holds its step, which the model
        # kmp.load_model returns carries, and AtomicCheckpoint skips.
        found = tuple(kmp.callbacks.latest_checkpoint(args.checkpoint_dir))[:2]
    if args.elastic:
        # No collective before the elastic run: a worker that joins a running job would meet
        # the others' state sync. Every rank looks itself; the sync then gives rank 0's state.
        return found
    return kmp.distributed.broadcast_object(found, root=0)


def resume_or_build(run: Run, path: str | None, initial_epoch: int):
    """The model: loaded from ``path`` when this rank can read it, else built and compiled."""
    args, kmp = run.args, run.kmp
    if path and os.path.exists(path):
        model = kmp.load_model(path)  # the whole training state, on any model
        saved_seed = kmp.saving.read_state(path).data_seed if path.endswith(".keras") else None
        if saved_seed is not None and saved_seed != args.seed:
            log(
                f"warning: {path} was trained on data shuffled with --seed {saved_seed}; this "
                f"run uses --seed {args.seed}, so its epochs come in another order"
            )
        model.jit_compile = kmp.xla.step_jit_compile()  # this backend's, not the saver's
        log(f"resumed from {path}: epoch {initial_epoch}, loss scale {loss_scale_of(model)[0]}")
    else:
        image_shape = run.spec.image_shape
        if args.image_size:
            image_shape = (args.image_size, args.image_size, image_shape[-1])
        model = build_model(args.model, image_shape, run.spec.num_classes, run.choice.compute_dtype)
        model = kmp.float32_outputs(model)
        model.compile(
            optimizer=make_optimizer(args, kmp, run.steps, run.world.size),
            **workloads.compile_args(args.model, args.elastic),
            jit_compile=kmp.xla.step_jit_compile(),
        )
        if path:
            print(f"rank {run.world.rank}: cannot read {path}; taking rank 0's state", flush=True)
    if args.jit_gradients:
        model.jit_compile = False  # a loaded model keeps its own setting otherwise
        kmp.xla.jit_gradients(model)
    if run.world.rank == 0:
        print(kmp.audit(model).summary(max_rows=40), flush=True)  # ResNet-50: short
    if not model.optimizer.built:  # a loaded optimizer is built, with its state
        model.optimizer.build(model.trainable_variables)
    return model


def make_callbacks(run: Run, extra: list) -> list:
    """The default callbacks of kmp for this run, then ``extra`` (the measuring ones)."""
    args = run.args
    if args.stop_after_epochs:
        extra = [*extra, stop_after(args.stop_after_epochs)]
    return run.kmp.callbacks.default_callbacks(
        # An elastic state syncs from rank 0 at the start and after every reset.
        broadcast=not args.elastic,
        # A cosine schedule has its warm-up built in; a constant rate uses the callback.
        warmup_epochs=(args.warmup_epochs or None) if args.lr_schedule == "constant" else None,
        checkpoint_dir=args.checkpoint_dir,
        keep=args.keep_checkpoints,
        checkpoint_every_steps=args.checkpoint_every_steps,
        data_seed=args.seed,  # recorded in each checkpoint, checked when resuming
        extra=extra,
        verbose=1,
    )


def train_elastic(run: Run, model, initial_epoch: int, callbacks: list) -> Trained:
    """``kmp.elastic.fit`` over whole epochs; the world may change while it runs."""
    args, kmp = run.args, run.kmp
    state = kmp.elastic.KerasState(model, epoch=initial_epoch)
    data = elastic_data(args, kmp, run.choice.compute_dtype, run.overflow_rank)
    kmp.elastic.fit(
        state,
        data,
        epochs=args.epochs,
        commit_every=args.commit_every,
        callbacks=callbacks,
        record_examples=True,
        verbose=args.verbose,
    )
    run.world = kmp.distributed.world()  # the world that finished, not the one that started
    keys = state.history[-1] if state.history else {}
    runs = state.history  # this run's epochs (the state starts empty)
    return Trained(
        history={k: [h[k] for h in runs if k in h] for k in keys},
        final_epoch=state.epoch,  # a rank that joined got the run's position in the sync
        elastic={
            "events": state.events,
            "commits": state.commits,
            "resets": state.resets,
            "examples": {str(e): ids for e, ids in state.examples.items()},
            "num_examples": data.num_examples,
        },
    )


def train_fit(run: Run, model, initial_epoch: int, callbacks: list) -> Trained:
    """``model.fit`` on this rank's shard, with the injected overflow if asked for."""
    args, kmp, world = run.args, run.kmp, run.world
    train = load_split(
        args,
        kmp,
        "train",
        batch_size=args.batch_size,
        seed=args.seed,
        epoch=initial_epoch,
        epochs=args.epochs - initial_epoch,
        steps_per_epoch=run.steps,
        image_size=args.image_size,
    )
    if args.inject_overflow is not None and world.rank == run.overflow_rank:
        train = inject_overflow(train, args.inject_overflow)
        print(f"rank {world.rank}: step {args.inject_overflow} will overflow", flush=True)
    result = model.fit(
        train,
        epochs=args.epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=run.steps,
        shuffle=False,  # kmp.data already reshuffles every epoch
        callbacks=callbacks,
        verbose=kmp.callbacks.verbosity(args.verbose),
    )
    history = {k: [float(v) for v in vals] for k, vals in result.history.items()}
    return Trained(history, initial_epoch + len(history.get("loss", [])))


def summarize(run: Run, model, facts: dict, trained: Trained, measured: dict) -> dict:
    """The run's summary: what ran, what it reached, whether the ranks agree, how fast.

    Trainable weights must be bit-identical on every rank. Non-trainable state such as
    BatchNormalization's moving statistics follows each rank's own batches (Horovod does not
    average it), so it is reported apart.
    """
    args, kmp, world = run.args, run.kmp, run.world
    metrics = evaluate(model, args, kmp)
    history = trained.history
    scale_end, skipped = loss_scale_of(model)
    rate, skips, curve, callbacks = (measured[k] for k in ("rate", "skips", "curve", "callbacks"))
    saved = [cb.saved for cb in callbacks if isinstance(cb, kmp.callbacks.AtomicCheckpoint)]
    per_epoch = rate.per_epoch[1:] or rate.per_epoch  # the first epoch includes tracing
    return {
        "model": args.model,
        "dataset": args.dataset,
        "policy": run.choice.name,
        "policy_reason": run.choice.reason,
        "master_weights": model.optimizer.settings.master_weights,
        "state_bytes_per_param": state_bytes_per_param(model),
        "ranks": world.size,
        "engine": world.engine,
        "jit_compile": bool(model.jit_compile),  # the whole step under XLA (JAX: kmp.xla)
        "batch_size_per_rank": args.batch_size,
        "steps_per_epoch": run.steps,
        **facts,  # resumed_from, initial_epoch, iterations_start, loss_scale_start
        "epochs_run": len(history.get("loss", [])),
        "final_epoch": trained.final_epoch,
        "iterations_end": int(model.optimizer.iterations.numpy()),
        "loss_scale_end": scale_end,
        "loss_scale_rule": args.loss_scale_rule,
        "skipped_steps": skipped,
        "skipped_at": skips.steps,  # steps of this run (0-based) the optimizer skipped
        "history": history,
        # With --eval-every: [{"epoch", "step", and evaluate's figures}], one per evaluation.
        "eval_history": curve.points,
        "final_loss": history["loss"][-1] if history.get("loss") else None,
        "test_accuracy": metrics.get("test_accuracy"),
        **metrics,
        "weights_max_diff": weights_max_diff(model.trainable_weights, kmp),
        "non_trainable_max_diff": weights_max_diff(model.non_trainable_weights, kmp),
        "bucket_bytes": model.optimizer.settings.bucket_bytes,
        # How often the XLA-compiled forward and backward pass was traced (None: no XLA).
        "xla_traces": (
            model.train_step.xla_function.experimental_get_tracing_count()
            if args.jit_gradients
            else None
        ),
        "images_per_sec": sum(per_epoch) / len(per_epoch) if per_epoch else None,
        # Language models: bytes predicted per second, over all ranks (sequences x seq_len).
        "tokens_per_sec": (
            sum(per_epoch) / len(per_epoch) * run.spec.image_shape[0]
            if per_epoch and args.model in workloads.LM_MODELS
            else None
        ),
        # Where this rank ran, and what it wrote (a per-rank --summary shows every rank's).
        "rank": world.rank,
        "hostname": socket.gethostname(),
        "local_rank": world.local_rank,
        "local_size": world.local_size,
        "cross_rank": world.cross_rank,
        "cross_size": world.cross_size,
        "checkpoints_written": saved[0] if saved else [],  # empty on ranks never rank 0
        "elastic": trained.elastic,
    }


def write_summary(pattern: str | None, summary: dict) -> None:
    """``--summary FILE`` (rank 0), or one file per rank where FILE holds ``{rank}``."""
    per_rank = pattern and "{rank}" in pattern
    if pattern and (per_rank or summary["rank"] == 0):
        out = Path(pattern.replace("{rank}", str(summary["rank"])))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = start(args)
    path, initial_epoch = find_checkpoint(run)
    model = resume_or_build(run, path, initial_epoch)
    facts = {
        "resumed_from": path,
        "initial_epoch": initial_epoch,
        "iterations_start": int(model.optimizer.iterations.numpy()),
        "loss_scale_start": loss_scale_of(model)[0],
    }
    kmp = run.kmp
    measured = {
        "rate": throughput_callback(args.batch_size, kmp),
        "skips": skip_recorder(kmp),
        "curve": workloads.evaluate_every(
            lambda: evaluate(model, args, kmp), args.eval_every, run.steps
        ),
    }
    measured["callbacks"] = make_callbacks(run, list(measured.values()))
    if initial_epoch >= args.epochs:
        log(f"nothing to train: {initial_epoch} of {args.epochs} epochs already done")
        trained = Trained(final_epoch=initial_epoch)
    elif args.elastic:
        trained = train_elastic(run, model, initial_epoch, measured["callbacks"])
    else:
        trained = train_fit(run, model, initial_epoch, measured["callbacks"])
    summary = summarize(run, model, facts, trained, measured)
    log(result_line(summary))
    write_summary(args.summary, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
