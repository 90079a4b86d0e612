"""ResNet-50 training throughput and peak memory under each policy, Keras 3 on JAX.

    python bench/gpu_resnet50.py [--batch 256] [--image-size 224] [--steps 50] [--warmup 5]
    python bench/gpu_resnet50.py --quick          # 32x32 images, batch 4, 2 steps (CPU check)

Made for a GPU machine without TensorFlow: it needs only ``keras``, ``jax``
and kmp (the ``KERAS_BACKEND`` is forced to ``jax``). For each policy
(float32, mixed_bfloat16, mixed_float16) a fresh child process builds
``keras.applications.ResNet50(weights=None)`` with ``kmp.enable(policy)`` and
``kmp.float32_outputs``, wraps SGD with ``kmp.wrap_optimizer`` (dynamic loss
scaling under float16) and trains it on one synthetic batch that stays on the
device, with a jitted step built from Keras's stateless APIs
(``model.stateless_call`` and ``optimizer.stateless_apply``). After
``--warmup`` steps (compilation) it times ``--steps`` steps and reads the
device's ``peak_bytes_in_use``. One process per policy because JAX's peak
counter cannot be reset.

Prints images/s, the ratios to float32 and the peak memory, and writes JSON to
``--out``, else ``$OUT/gpu_resnet50.json`` when ``$OUT`` is set, else
``bench/results/gpu_resnet50.json`` (``gpu_resnet50_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
TARGET = 2.6  # NVIDIA's ResNet-50 mixed-precision speed-up over TF32 on A100

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    print(
        f"gpu_resnet50.py runs on the JAX backend; ignoring KERAS_BACKEND="
        f"{os.environ['KERAS_BACKEND']}.",
        file=sys.stderr,
    )
os.environ["KERAS_BACKEND"] = "jax"
# Allocate as needed, so that peak_bytes_in_use reflects the model, not a preallocated pool.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=50, help="timed steps per policy")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true", help="32x32 images, batch 4, 2 steps")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # policy, in a child
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.image_size, args.steps, args.warmup = 4, 32, 2, 1
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in args.policies if s not in POLICIES]
    if unknown or not args.policies:
        p.error(f"--policies takes a comma-separated subset of {', '.join(POLICIES)}")
    if args.image_size < 32:
        p.error("--image-size must be >= 32 (ResNet-50 pools the image by 32)")
    if min(args.batch, args.steps) < 1 or args.warmup < 0:
        p.error("--batch and --steps must be >= 1, --warmup >= 0")
    return args


def train_policy(policy: str, args: argparse.Namespace) -> dict:
    """Train ResNet-50 under ``policy`` in this process; return its figures."""
    import warnings

    import jax
    import keras
    import numpy as np

    import kmp

    # The engine users run on JAX (kmp launch --engine jax): one process here, so a world of
    # one; several would train on the DataParallel distribution it sets.
    world = kmp.distributed.init(engine="jax")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on a CPU (the --quick check) warns
        choice = kmp.enable(policy)
    keras.utils.set_random_seed(0)
    shape = (args.image_size, args.image_size, 3)
    model = kmp.float32_outputs(
        keras.applications.ResNet50(weights=None, input_shape=shape, classes=1000)
    )
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def scaled_loss(trainable, non_trainable, opt_vars, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        loss = loss_fn(y, y_pred)
        with keras.StatelessScope(state_mapping=list(zip(opt.variables, opt_vars, strict=True))):
            scaled = opt.scale_loss(loss)
        return scaled, (loss, non_trainable)

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def step(state, x, y):
        trainable, non_trainable, opt_vars = state
        (_, (loss, non_trainable)), grads = grad_fn(trainable, non_trainable, opt_vars, x, y)
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    train_step = jax.jit(step, donate_argnums=0)
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.random((args.batch, *shape), dtype=np.float32), device)
    y = jax.device_put(rng.integers(0, 1000, args.batch).astype("int32"), device)
    # Commit the state to the device like the batch: the step's outputs are committed, and
    # uncommitted inputs on the first call would make the second call compile again.
    state = jax.device_put(
        (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in opt.variables],
        ),
        device,
    )
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss, state = train_step(state, x, y)
    jax.block_until_ready(loss)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, state = train_step(state, x, y)
    loss = float(jax.block_until_ready(loss))
    elapsed = time.perf_counter() - t0
    cache_size = getattr(train_step, "_cache_size", None)  # compilations so far, if exposed
    compiles = cache_size() if cache_size is not None else None
    if not np.isfinite(loss):
        raise RuntimeError(f"{policy}: non-finite loss {loss} after {args.steps} steps")
    opt_values = dict(zip([id(v) for v in opt.variables], state[2], strict=True))
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "policy": choice.name,
        "engine": world.engine,
        "processes": world.size,
        "compute_dtype": choice.compute_dtype,
        "images_per_s": round(args.steps * args.batch / elapsed, 2),
        "step_ms": round(1000 * elapsed / args.steps, 2),
        "warmup_s": round(warmup_s, 2),
        "final_loss": round(loss, 4),
        "compilations": compiles,
        "loss_scale": float(opt_values[id(opt.dynamic_scale)]),
        "peak_bytes_in_use": None if peak is None else int(peak),
    }


def run_child(policy: str, args: argparse.Namespace) -> dict:
    """Run :func:`train_policy` for ``policy`` in a fresh process and return its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            policy,
            "--child-out",
            str(out),
            "--batch",
            str(args.batch),
            "--image-size",
            str(args.image_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {policy} run failed (exit {proc.returncode}); see above")
        return json.loads(out.read_text())


def device_facts() -> dict:
    import jax
    import keras

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
    }


def output_path(args: argparse.Namespace) -> Path:
    name = "gpu_resnet50" + ("_quick" if args.quick else "") + ".json"
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    return Path(os.environ.get("KMP_BENCH_RESULTS", HERE / "results")) / name


def report(figures: dict[str, dict], args: argparse.Namespace) -> tuple[dict, str]:
    base = figures.get("float32")
    for fig in figures.values():
        fig["vs_float32"] = round(fig["images_per_s"] / base["images_per_s"], 3) if base else None
    best_mixed = max(
        (f["vs_float32"] for p, f in figures.items() if p != "float32" and f["vs_float32"]),
        default=None,
    )
    lines = [
        "| policy | images/s | vs float32 | step ms | peak memory GiB |",
        "|---|---|---|---|---|",
    ]
    for p, f in figures.items():
        peak = f["peak_bytes_in_use"]
        lines.append(
            f"| {p} | {f['images_per_s']:.1f} | "
            f"{'n/a' if f['vs_float32'] is None else format(f['vs_float32'], '.2f')} | "
            f"{f['step_ms']:.1f} | {'n/a' if peak is None else format(peak / 2**30, '.2f')} |"
        )
    md = "\n".join(lines)
    md += (
        f"\n\nResNet-50, {args.image_size}x{args.image_size}, batch {args.batch}, "
        f"{args.steps} timed steps after {args.warmup} warm-up steps, Keras on JAX."
    )
    if best_mixed is not None:
        verdict = "met" if best_mixed >= TARGET else "missed"
        md += f" Best mixed policy: {best_mixed:.2f}x float32 (target >= {TARGET}x: {verdict})."
    return {"best_mixed_vs_float32": best_mixed, "target": TARGET}, md


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = train_policy(args.child, args)
        # The device's facts come from a child too: the parent never imports Keras or JAX.
        args.child_out.write_text(json.dumps({**result, "device": device_facts()}))
        return 0
    sys.path.insert(0, str(HERE))
    from _common import machine

    figures = {}
    for policy in args.policies:
        print(f"--- {policy}", flush=True)
        figures[policy] = run_child(policy, args)
        device = figures[policy].pop("device")
        print(json.dumps(figures[policy]), flush=True)
    summary, md = report(figures, args)
    payload = {
        "machine": machine(),
        "device": device,
        "model": "resnet50",
        "image_size": args.image_size,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "policies": figures,
        **summary,
    }
    path = output_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    path.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
