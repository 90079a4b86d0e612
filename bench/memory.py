"""Memory of a training step under float32 and the mixed policies, in one run.

    .venv/bin/python bench/memory.py [--model cnn] [--image-size N] [--batch 64] [--quick]

Three figures per policy, each also divided by its float32 value:

* ``activation_bytes`` (counted): the bytes of every layer output of the
  forward pass at the chosen batch size, from the shapes and dtypes Keras
  gives the layer outputs. Independent of the allocator, the same on every
  backend.
* ``retained_bytes`` (measured, TensorFlow backend): the bytes that stay
  allocated after an eager forward pass under ``tf.GradientTape``, i.e. the
  tensors the tape keeps for backpropagation (activations, and under a mixed
  policy the compute-dtype copies of the weights). This is the activation
  memory mixed precision is meant to halve; the target is read from it.
* ``step_bytes`` (measured, TensorFlow backend): the peak bytes in use during
  one compiled ``train_on_batch`` call above what was in use before it
  (weights, optimizer slots, the batch). It adds the fixed costs of a step:
  the float32 weight gradients and TensorFlow's fixed-size CPU convolution
  workspaces (about 32 MiB per backward convolution, whatever the batch), so
  on small models it falls much less than the activations do.

TensorFlow keeps no statistics for its default CPU allocator, so this script
switches the CPU to its BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``)
before TensorFlow starts; ``tf.config.experimental.reset_memory_stats`` and
``get_memory_info("CPU:0")`` then work as they do on a GPU. On other backends
only the counted figure is given.

Each policy builds the same model (``bench/models.py``) and compiles it with
``kmp.wrap_optimizer(SGD(momentum=0.9))``, in a child process of its own: the
allocator then starts empty for every policy, so one policy's freed blocks
cannot decide how another's tensors are placed (a BFC allocator counts a whole
free block when it is under twice the size asked for, so a 16-bit tensor placed
in a block a float32 run left behind would count double). Writes
``bench/results/memory.json`` and ``memory.md`` (``memory_quick.*`` with
``--quick``).

``--states`` measures instead what weights and optimizer state hold under float32,
mixed_bfloat16 and bfloat16 with each ``master_weights`` mode (``bench/_states.py``),
and writes ``memory_states.*``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

# Before TensorFlow starts: its CPU allocator keeps statistics only in BFC mode. Only where
# this file runs as the program (its children too): imported, it leaves the importer's
# environment alone (a test process, whose later tests would start TensorFlow in BFC mode).
if __name__ == "__main__":
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _states
import models
import numpy as np
from _common import machine, markdown_table, write_results

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return int(np.dtype(dtype).itemsize)


def activation_bytes(model, batch_size: int) -> dict[str, int]:
    """Bytes of every layer output of ``model`` at ``batch_size``, summed per dtype.

    Input layers are left out (their tensor is the batch itself, the same for
    every policy).
    """
    import keras

    by_dtype: dict[str, int] = {}
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        outputs = layer.output if isinstance(layer.output, list | tuple) else [layer.output]
        for tensor in outputs:
            dims = [batch_size if d is None else int(d) for d in tensor.shape]
            dtype = str(tensor.dtype)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + int(np.prod(dims)) * _itemsize(dtype)
    return by_dtype


def _tf_memory():
    """Return ``(reset, read)`` callables for TF's CPU allocator, or None if unavailable."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return None
    return (
        lambda: tf.config.experimental.reset_memory_stats("CPU:0"),
        lambda: tf.config.experimental.get_memory_info("CPU:0"),
    )


def _step_peak(model, x, y, stats, steps: int) -> tuple[int, int]:
    """Return ``(peak - live before, live before)`` of the largest of ``steps`` steps."""
    reset, read = stats
    best = (0, 0)
    for _ in range(steps):
        reset()
        before = read()["current"]
        model.train_on_batch(x, y)
        best = max(best, (read()["peak"] - before, before))
    return best


def _retained_bytes(model, x, y, stats) -> int:
    """Bytes the forward pass keeps alive for backpropagation (eager, under a GradientTape)."""
    import keras
    import tensorflow as tf

    _, read = stats
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    before = read()["current"]
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    retained = read()["current"] - before
    tape.gradient(loss, model.trainable_variables)  # the tape was needed; use it once
    return int(retained)


def measure_policy(policy: str, args: argparse.Namespace) -> dict:
    """Build, compile and train the model for a few steps under ``policy``; return its figures."""
    import keras
    from keras import ops

    import kmp

    keras.backend.clear_session()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float16-on-CPU warning: measuring it is the point
        choice = kmp.enable(policy)
    try:
        model = models.build(args.model, args.image_size)
        model.compile(
            optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
            loss="sparse_categorical_crossentropy",
            jit_compile=False,
        )
        by_dtype = activation_bytes(model, args.batch)
        result: dict = {
            "policy": choice.name,
            "compute_dtype": choice.compute_dtype,
            "activation_bytes": sum(by_dtype.values()),
            "activation_bytes_by_dtype": by_dtype,
            "step_bytes": None,
            "step_peak_bytes": None,
            "step_baseline_bytes": None,
            "retained_bytes": None,
        }
        x, y = models.batch(args.model, args.batch, args.image_size)
        x, y = ops.convert_to_tensor(x), ops.convert_to_tensor(y)
        for _ in range(2):  # trace, build the optimizer, warm up
            loss = model.train_on_batch(x, y)
        if not np.isfinite(loss):
            raise RuntimeError(f"{args.model}/{policy}: non-finite loss {loss}")
        stats = _tf_memory()
        if stats is not None:
            result["retained_bytes"] = _retained_bytes(model, x, y, stats)
            delta, base = _step_peak(model, x, y, stats, args.steps)
            result.update(step_bytes=delta, step_peak_bytes=delta + base)
            result["step_baseline_bytes"] = base
        return result
    finally:
        kmp.disable()


def child_argv(argv: list[str], policy: str, out: str) -> list[str]:
    """The options of the child that measures ``policy``: ours, ``--policies`` narrowed."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--policies":
            skip = True
        elif not a.startswith("--policies="):
            kept.append(a)
    return [*kept, "--policies", policy, "--child-out", out]


def _measure_in_child(policy: str, argv: list[str]) -> dict:
    """Run :func:`measure_policy` for ``policy`` in a new Python process; return its figures."""
    with tempfile.TemporaryDirectory(prefix="kmp-memory-") as tmp:
        out = os.path.join(tmp, "figures.json")
        cmd = [sys.executable, os.path.abspath(__file__), *child_argv(argv, policy, out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            raise SystemExit(f"memory benchmark of {policy} failed (exit {proc.returncode})")
        with open(out) as f:
            return json.load(f)


def _write_child_figures(path: str, figures: dict) -> None:
    """The child's figures and its Keras backend (the parent never imports Keras)."""
    import keras

    with open(path, "w") as f:
        json.dump({**figures, "backend": keras.backend.backend()}, f)


def _backend_of(figures: dict) -> str:
    """The backend the children reported, taken out of their figures."""
    (backend,) = {fig.pop("backend") for fig in figures.values()}
    return backend


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=models.MODELS)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (largest counts)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="batch 4, 1 measured step")
    parser.add_argument(
        "--states",
        action="store_true",
        help="weights + optimizer state per master-weights configuration instead",
    )
    parser.add_argument("--child-out", help=argparse.SUPPRESS)  # internal: one policy -> JSON
    args = parser.parse_args(argv)
    if args.states:
        return states_main(args, argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.batch, args.steps = 4, 1
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "float32" not in policies and not args.child_out:
        parser.error("--policies must include float32 (the figures are ratios to it)")
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be >= 1")
    try:
        models.input_shape(args.model, args.image_size)
    except ValueError as exc:
        parser.error(str(exc))

    if args.child_out:  # one policy, in this fresh process
        _write_child_figures(args.child_out, measure_policy(policies[0], args))
        return 0

    figures = {p: _measure_in_child(p, argv if argv is not None else sys.argv[1:])
               for p in policies}  # fmt: skip
    backend = _backend_of(figures)
    base = figures["float32"]
    for fig in figures.values():
        for key in ("activation", "retained", "step"):
            value, ref = fig[f"{key}_bytes"], base[f"{key}_bytes"]
            fig[f"{key}_vs_float32"] = round(value / ref, 4) if value is not None and ref else None
    results = {
        "machine": machine(),
        "backend": backend,
        "model": args.model,
        "image_size": models.image_side(args.model, args.image_size),
        "batch": args.batch,
        "steps": args.steps,
        "method": {
            "activation_bytes": "sum of the bytes of every layer output at this batch size",
            "step_bytes": (
                "peak minus live bytes of TensorFlow's CPU BFC allocator over one "
                "train_on_batch call"
                if base["step_bytes"] is not None
                else "unavailable on this backend"
            ),
            "retained_bytes": (
                "live bytes of TensorFlow's CPU BFC allocator after an eager forward pass "
                "under tf.GradientTape minus before it: the tensors kept for backpropagation"
                if base["retained_bytes"] is not None
                else "unavailable on this backend"
            ),
        },
        "policies": figures,
    }
    rows = [
        [
            p,
            _mib(f["activation_bytes"]),
            _ratio(f["activation_vs_float32"]),
            _mib(f["retained_bytes"]),
            _ratio(f["retained_vs_float32"]),
            _mib(f["step_bytes"]),
            _ratio(f["step_vs_float32"]),
        ]
        for p, f in figures.items()
    ]
    headers = ["policy", "layer outputs MiB", "vs fp32", "kept for backward MiB", "vs fp32"]
    md = markdown_table([*headers, "step peak MiB", "vs fp32"], rows)
    md += (
        f"\n\n{args.model}, {results['image_size']}x{results['image_size']} images, batch "
        f"{args.batch}, {results['backend']} backend. Layer outputs: bytes of all layer outputs "
        "(counted). Kept for backward: bytes still allocated after a forward pass under a "
        "GradientTape (measured). Step peak: peak bytes in use during one training step above "
        f"those in use before it (measured, largest of {args.steps}); it includes fixed costs "
        "(weight gradients, fixed-size convolution workspaces)."
    )
    path = write_results("memory" + ("_quick" if args.quick else ""), results, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


def states_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``--states``: every configuration of :mod:`_states` in a child process of its own."""
    if args.child_out:
        figures = _states.measure(args.policies, args.quick, args.steps, _tf_memory())
        _write_child_figures(args.child_out, figures)
        return 0
    figures = {c: _measure_in_child(c, argv) for c in _states.CONFIGS}
    backend = _backend_of(figures)
    checks = _states.targets(figures)
    md = _states.markdown(figures, checks, args.quick)
    results = {
        "machine": machine(),
        "backend": backend,
        "quick": args.quick,
        "configs": figures,
        "targets": checks,
    }
    path = write_results("memory_states" + ("_quick" if args.quick else ""), results, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
