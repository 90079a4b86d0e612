"""``kmp bench``: run kmp's benchmark suite in one run and summarise it against its targets.

::

    kmp bench                                  # every benchmark, results in bench/results/
    kmp bench --quick --out /tmp/bench         # tiny sizes and few steps: a smoke run
    kmp bench --only policies,memory           # a subset
    kmp bench --model resnet50 --image-size 64 --steps 10

The parts (each a script in the ``bench/`` folder of a kmp source checkout,
started as a child process of this one):

* ``policies``: training throughput under float32, mixed_bfloat16,
  mixed_float16, bfloat16 weights (kmp's compensated updates) and "auto"
  (``bench/policies.py``: the small CNN, the MLP and the byte-level GPT);
* ``profile``: where a TensorFlow training step's op time goes per policy (matrix
  products, casts, variables, the rest), for the MLP and the GPT: the share a 16-bit
  policy cannot speed up (``bench/step_profile.py``);
* ``overhead``: ``kmp.wrap_optimizer`` against a hand-wired Keras
  ``LossScaleOptimizer`` (``bench/overhead.py``);
* ``allreduce``: grouped vs per-tensor allreduce with and without fp16/bf16
  compression, and the 2-process weak-scaling efficiency under
  ``horovodrun`` (``bench/allreduce.py``; ``scaling`` is the same part);
* ``memory``: activation and step memory under each policy (``bench/memory.py``);
* ``states``: weights, optimizer state, the step's peak and step time of a 67M-parameter
  MLP with Adam per master-weights mode against mixed_bfloat16 (``bench/memory.py
  --states``);
* ``peers``: kmp against Horovod's ``DistributedGradientTape``,
  ``MultiWorkerMirroredStrategy`` and two independent processes (the limit) on
  one host, and on 2-3 ``kmp cluster`` hosts over links shaped to 1 and 10
  Gbit/s with compression and bucketed overlap (``bench/peers.py``; the
  multi-host half needs root, and ``--quick`` runs the one-host half only);
* ``numerics``: test accuracy and validation loss under float32, mixed_bfloat16 and
  mixed_float16 on the digits CNN, the MNIST-1D paper's CNN and a byte-level GPT, 3
  seeds each on 2 ranks, with skipped steps, loss scales and the ranks' weights
  (``bench/numerics.py``; ``--quick``: the GPT under 2 policies, 2 steps an epoch);
* ``inference``: latency and throughput of serving the trained digits CNN, MNIST-1D CNN,
  a Dense-heavy MLP, the GPT (tokens/s of generation) and ResNet50 in float32, bfloat16,
  float16, mixed_bfloat16 and int8 and through each ``kmp.export`` runtime, beside their
  accuracy or perplexity (``bench/inference.py``); ``--only inference`` runs
  ``generation`` with it;
* ``generation``: KerasHub models served: a BERT classifier's and a GPT-2's 16-bit
  exports against float32, greedy generation from the exported GPT (its loop, its
  cached step, the task) beside Keras's ``generate``, int8 perplexity and speed
  (``bench/serving_hub.py``; ``--quick``: a tiny GPT, the SavedModel loop only);
* ``engines``: the digits CNN and the byte-level GPT on 2 processes under each policy, on
  the Horovod engine, the JAX engine with kmp's step and with Keras's own
  (``bench/engines.py``; ``--quick``: the digits CNN, float32, 1 epoch, two engines);
* ``checkpoints``: the GPT on 2 processes without, with synchronous and with
  asynchronous step checkpoints, and the time from a signal to the checkpoint on disk
  (``bench/checkpoints.py``; ``--quick``: 30 steps, a checkpoint every 10).

Each part writes ``NAME.json`` and ``NAME.md`` into the output folder; then
``summary.json``, ``summary.md`` (each target, the measured figure, met or
missed and why) and ``summary.png`` are written next to them. ``--quick``
writes into ``bench/results/quick/`` unless ``--out`` is given, so a smoke run
never overwrites real results. The exit status is 0 when every part ran (a
missed target is a finding, not a failure) and 1 when a part failed.

This module only defines the command line; the work is done by
``bench/suite.py``, which is loaded from the checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from kmp.commands import command_main

__all__ = ["ALIASES", "MODELS", "PARTS", "WITH", "configure", "find_bench_dir", "main", "run"]

PARTS = ("policies", "profile", "overhead", "allreduce", "memory", "states")
PARTS += ("peers", "numerics", "inference", "generation", "engines", "checkpoints")
# Other names accepted by --only, and the part that measures them.
ALIASES = {"scaling": "allreduce", "weak_scaling": "allreduce", "policy": "policies"}
# Parts that --only NAME runs with NAME.
WITH = {"inference": ("generation",)}
# The models of bench/models.py, repeated so that the parser needs no import of bench/.
MODELS = ("digits_cnn", "cnn", "mlp", "wide_mlp", "resnet50")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``kmp bench`` arguments to ``parser``."""
    parser.add_argument(
        "--model",
        choices=MODELS,
        help="model every part trains (default: each benchmark's own: the small CNN and the MLP "
        "for the policies, the small CNN for the memory, the digits CNN for the overhead and "
        "the allreduce)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        metavar="N",
        help="side of the square input images (default: the model's own: 8 digits, 32 cnn, "
        "28 mlp (flattened), 64 resnet50)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per measurement (default: each's)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="batch size per process (default: each's)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and 1-2 steps: checks that everything runs; the figures mean nothing",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="PARTS",
        help=f"comma-separated subset of: {', '.join(PARTS)} (scaling = allreduce)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the results (default: bench/results/, bench/results/quick/ with --quick)",
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        help="the bench/ folder of a kmp checkout (default: next to the kmp package)",
    )


def parse_only(value: str | None) -> tuple[str, ...]:
    """Return the parts named by ``--only`` (all of them for None), in suite order.

    Raises:
        ValueError: A name that is not a part; the message lists the valid names.
    """
    if value is None:
        return PARTS
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--only needs at least one of: {', '.join(PARTS)}.")
    chosen = set()
    for name in names:
        part = ALIASES.get(name, name)
        if part not in PARTS:
            raise ValueError(
                f"--only: unknown part {name!r}; choose from {', '.join(PARTS)} "
                "(scaling = allreduce)."
            )
        chosen.update((part, *WITH.get(part, ())))
    return tuple(p for p in PARTS if p in chosen)


def find_bench_dir(explicit: Path | None = None) -> Path:
    """Return the ``bench/`` folder holding ``suite.py``.

    Raises:
        FileNotFoundError: No such folder; the message says where to get one.
    """
    if explicit is not None:
        if (explicit / "suite.py").is_file():
            return explicit.resolve()
        raise FileNotFoundError(
            f"--bench-dir {explicit}: no suite.py there. Pass the bench/ folder of a kmp "
            "source checkout."
        )
    candidates = [Path(__file__).resolve().parents[2] / "bench", Path.cwd() / "bench"]
    for folder in candidates:
        if (folder / "suite.py").is_file():
            return folder.resolve()
    raise FileNotFoundError(
        f"No benchmark suite at {candidates[0]}: `kmp bench` runs the scripts in the bench/ "
        "folder of a kmp source checkout. Run it from a checkout (an editable install, "
        "`pip install -e .`) or pass --bench-dir path/to/kmp/bench."
    )


def _validate(args: argparse.Namespace) -> None:
    for name in ("steps", "batch", "image_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a positive integer, got {value}.")
    if args.image_size is not None and args.model is not None:
        minimum = {"digits_cnn": 2, "cnn": 8, "resnet50": 32}[args.model]
        if args.image_size < minimum:
            raise ValueError(
                f"--image-size {args.image_size} is too small for {args.model}: it needs at "
                f"least {minimum}."
            )


def run(args: argparse.Namespace) -> int:
    """Run the suite described by ``args``; return the exit status."""
    try:
        _validate(args)
        args.parts = parse_only(args.only)
        bench_dir = find_bench_dir(args.bench_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kmp bench: error: {exc}", file=sys.stderr)
        return 2
    return int(_load_suite(bench_dir).run_suite(args, bench_dir))


def _load_suite(bench_dir: Path) -> ModuleType:
    """Import ``bench_dir/suite.py`` (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("kmp_bench_suite", bench_dir / "suite.py")
    suite = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = suite  # dataclasses look their module up there
    spec.loader.exec_module(suite)
    return suite


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp bench`` arguments and run (``python -m kmp.commands.bench``)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
