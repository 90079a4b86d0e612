"""Where a training step's time goes under each policy: TensorFlow's op time by kind.

    .venv/bin/python bench/step_profile.py [--models mlp,gpt] [--steps 10]
        [--policies float32,mixed_bfloat16,bfloat16] [--batch 64]

Each model of ``models.py`` (image or token model) is compiled the kmp way
(``kmp.wrap_optimizer(SGD)``, as ``policies.py`` does) under each policy, warmed up,
then ``--steps`` steps of ``train_on_batch`` run under TensorFlow's profiler. The
profile's per-op self times (TensorFlow's ``framework_op_stats``, the host's op
kernels; the idle time left out) are summed per kind of op (:func:`op_kind`): matrix
products (oneDNN's MatMul, BatchMatMul, Einsum, Conv), casts, variable reads and
updates, and the rest (elementwise and reductions). Per kind: milliseconds of op time
per step and the gain against float32's, so the share a policy cannot speed up is
visible (issue 44, target 3; the ``profile`` part of ``kmp bench``, whose target
for the best 16-bit policy quotes it). TensorFlow backend only (XLA:CPU's kernels,
JAX's, do not show in this profile; ``engine_profile.py`` splits the JAX step): on
another backend it records that it was skipped. Writes
``bench/results/step_profile.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models
from _common import machine, markdown_table, write_results

POLICIES = ("float32", "mixed_bfloat16", "bfloat16")
KINDS = ("matmul", "cast", "variables", "other")
MATMUL_TYPES = ("MatMul", "Conv", "Einsum")
VARIABLE_TYPES = ("ResourceApply", "AssignVariable", "AssignAdd", "AssignSub", "ReadVariable")


def op_kind(op_type: str) -> str | None:
    """The kind of a TensorFlow op type (pure); None for the profiler's IDLE row."""
    if op_type == "IDLE":
        return None
    if any(k in op_type for k in MATMUL_TYPES):
        return "matmul"
    if op_type == "Cast":
        return "cast"
    if any(k in op_type for k in VARIABLE_TYPES):
        return "variables"
    return "other"


def split_by_kind(rows: list[dict], steps: int) -> dict:
    """Op self time per step (ms) per kind, and the op types that took most (pure).

    Args:
        rows: ``framework_op_stats`` rows: dicts with ``type`` and ``total_self_time`` (us).
        steps: The steps the profile covered.
    """
    per_kind = dict.fromkeys(KINDS, 0.0)
    per_type: dict[str, float] = {}
    for row in rows:
        kind = op_kind(row["type"])
        if kind is None:
            continue
        us = float(row.get("total_self_time") or 0.0)
        per_kind[kind] += us
        per_type[row["type"]] = per_type.get(row["type"], 0.0) + us
    total = sum(per_kind.values())
    top = sorted(per_type.items(), key=lambda kv: -kv[1])[:6]
    return {
        "op_ms": round(total / steps / 1000, 3),
        "kinds_ms": {k: round(v / steps / 1000, 3) for k, v in per_kind.items()},
        "top_types": [[t, round(v / total, 4) if total else 0.0] for t, v in top],
    }


def _op_stats(logdir: str) -> list[dict]:
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    data, ok = plugin.xspace_to_tools_data(paths, "framework_op_stats", {})
    if not ok:
        raise RuntimeError(f"TensorFlow's profiler gave no op statistics: {data[:200]!r}")
    table = json.loads(data)
    table = table[0] if isinstance(table, list) else table
    cols = [c["id"] for c in table["cols"]]
    return [
        dict(zip(cols, [c.get("v") if c else None for c in r["c"]], strict=False))
        for r in table["rows"]
    ]


def profile(model_name: str, policy: str, steps: int, batch: int) -> dict:
    """Profile ``steps`` training steps of ``model_name`` under ``policy``."""
    import tensorflow as tf

    import kmp

    try:
        model, x, y, _ = models.compiled(model_name, policy, batch, warmup=3)
        with tempfile.TemporaryDirectory(prefix="kmp-profile-") as logdir:
            tf.profiler.experimental.start(logdir)
            start = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(x, y)
            wall = (time.perf_counter() - start) / steps
            tf.profiler.experimental.stop()
            split = split_by_kind(_op_stats(logdir), steps)
    finally:
        kmp.disable()
    return {"model": model_name, "policy": policy, "wall_ms": round(1000 * wall, 3), **split}


def markdown(payload: dict) -> str:
    """The tables of a run (pure): op time per kind, and each kind's gain over float32."""
    rows = []
    base = {r["model"]: r for r in payload["runs"] if r["policy"] == "float32"}
    for r in payload["runs"]:
        ref = base.get(r["model"])

        def cell(key: str, kind: str | None = None, r: dict = r, ref: dict | None = ref) -> str:
            mine = r[key] if kind is None else r[key][kind]
            theirs = None if ref is None else (ref[key] if kind is None else ref[key][kind])
            if theirs is None or mine < 0.1 or theirs < 0.1:  # too small to compare
                return f"{mine:.2f}"
            return f"{mine:.2f} ({theirs / mine:.2f}x)"

        cells = [cell("kinds_ms", k) for k in KINDS]
        top = ", ".join(f"{t} {100 * share:.0f} %" for t, share in r["top_types"][:4])
        rows.append([r["model"], r["policy"], cell("wall_ms"), cell("op_ms"), *cells, top])
    info = payload["machine"]
    flags = " ".join(info.get("cpu_flags") or [])
    header = ["model", "policy", "wall ms/step (gain)", "op ms/step (gain)"]
    header += [f"{k} ms" for k in KINDS] + ["top op types"]
    md = markdown_table(
        header,
        rows,
    )
    md += (
        f"\n\n{info['cpu']} ({info['cores']} cores; {flags}), {info['date']}, TensorFlow "
        f"backend, batch {payload['batch']}, {payload['steps']} profiled steps after 3 warm-up "
        "steps. Op ms: the self time of TensorFlow's op kernels per step (oneDNN's products "
        "use both cores inside one op), idle time left out; XLA-compiled computations (kmp's "
        "per-weight updates under bfloat16 weights) are not in it. (gain): float32's time "
        "over this policy's, per kind. Wall: the step's time, the host's work included."
    )
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    known = (*models.MODELS, *models.TOKEN_MODELS)
    if not names or any(m not in known for m in names):
        p.error(f"--models {args.models!r}: use names from {', '.join(known)}")
    policies = [x for x in args.policies.split(",") if x]
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be >= 1")
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":  # nothing to profile; the suite still gets its record
        why = f"TensorFlow's profiler: not run on the {backend} backend (KERAS_BACKEND)"
        payload = {"machine": machine(), "backend": backend, "runs": [], "skipped": why}
        print(f"written: {write_results('step_profile', payload, why + '.')}")
        return 0
    runs = []
    for model_name in names:
        for policy in policies:
            runs.append(profile(model_name, policy, args.steps, args.batch))
            print(json.dumps(runs[-1]), flush=True)
    payload = {"machine": machine(), "backend": backend, "batch": args.batch}
    payload |= {"steps": args.steps, "runs": runs}
    md = markdown(payload)
    path = write_results("step_profile", payload, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
