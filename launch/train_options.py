"""launch/train.py's command line: its flags, their defaults per model, and their checks.

A sibling of train.py (imported as ``train_options``); nothing heavy is imported here, so
``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import workloads

from kmp._names import MASTER_WEIGHTS  # the vocabulary only: nothing heavy

MODELS = ("digits_cnn", "resnet50", *workloads.MODELS)
DEFAULT_DATASET = {
    "digits_cnn": "kmp_digits",
    "resnet50": "kmp_synthetic_images",
    "gpt": "kmp_pytext",
    "gpt2-hub": "kmp_pytext",
    "mnist1d_cnn": "mnist1d",
    "mnist1d_gru": "mnist1d",
}
# MNIST-1D: the paper's batch of 100 on 2 ranks, and its Adam rate.
DEFAULT_BATCH = {"digits_cnn": 32, "resnet50": 8, "gpt": 16, "gpt2-hub": 16}
DEFAULT_BATCH |= dict.fromkeys(workloads.MNIST1D_MODELS, 50)
DEFAULT_LR = {"digits_cnn": 4e-3, "resnet50": 0.01, "gpt": 3e-3, "gpt2-hub": 3e-3}
DEFAULT_LR |= dict.fromkeys(workloads.MNIST1D_MODELS, 1e-2)
CONSTANT_LR = ("resnet50", *workloads.MNIST1D_MODELS)  # the others decay (cosine) by default
# Defaults sized for a run of about a minute on 2 CPU ranks (the paper's 8,000 steps of 100
# for mnist1d_cnn: 200 epochs of 4,000); any other model: 10 epochs of every full batch.
DEFAULT_EPOCHS = {"gpt": 4, "gpt2-hub": 4, "mnist1d_cnn": 200, "mnist1d_gru": 200}
DEFAULT_STEPS = {"gpt": 50, "gpt2-hub": 50}


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
        "(bytes, for gpt and gpt2-hub), mnist1d (for mnist1d_cnn and mnist1d_gru)",
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
        help="total epochs, a resumed run included (default: 10; 4 for gpt, 200 for mnist1d_*)",
    )
    p.add_argument(
        "--steps-per-epoch", type=int, help="batches per epoch (default: all; 50 for gpt)"
    )
    p.add_argument("--lr", type=float, help="learning rate before --scale-lr")
    p.add_argument(
        "--lr-schedule",
        choices=("cosine", "constant"),
        help="cosine decay to 0 over the run, or constant (default: constant for resnet50 "
        "and mnist1d_*, cosine for the others)",
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
    p.add_argument(
        "--checkpoint-every-steps",
        type=int,
        metavar="N",
        help="also checkpoint every N steps, inside the epoch (SIGTERM/SIGUSR1 always write one)",
    )
    p.add_argument("--image-size", type=int, help="resize images (resnet50 default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--loss-scale-growth-interval",
        type=int,
        default=2000,
        help="finite steps before a dynamic loss scale doubles (float16 only)",
    )
    p.add_argument(
        "--loss-scale-rule",
        choices=("kmp", "keras"),
        default="kmp",
        help="float16's dynamic loss scale: kmp's (grows early while gradients underflow) or "
        "Keras's and PyTorch's (overflow alone moves it: underflow_threshold=None)",
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
    if args.checkpoint_every_steps is not None and args.checkpoint_every_steps < 1:
        p.error("--checkpoint-every-steps must be >= 1")
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
