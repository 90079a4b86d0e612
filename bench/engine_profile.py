"""Where a training step's time goes on each engine and backend (issue 27, part 5).

    .venv/bin/python bench/engine_profile.py [--steps 300] [--rounds 3] [--policies ...]

One run, the digits CNN (batch 32 per process, synthetic 8x8 images, SGD through
``kmp.wrap_optimizer``), every policy, these jobs one after the other:

- ``tf_alone`` / ``jax_alone``: one process on the TensorFlow / JAX backend, no engine;
  the two side by side separate the backend's share from the engine's;
- ``jax_pair``: two such JAX processes at once (no communication): the compute limit
  of 2 processes on this machine's cores;
- ``jax_engine``: 2 processes under ``kmp launch --engine jax``;
- ``horovod``: 2 processes under ``kmp launch --engine horovod`` (TensorFlow backend).

Each process times, after a warm-up, the median of ``--rounds`` rounds of ``--steps``:
``fit`` (wall time of ``model.fit`` per step: what a user gets) and, on JAX, the
compiled step alone (Keras's own ``train_function`` called on one batch already laid
out over the devices: no input pipeline, no callbacks), and under the JAX engine the
all-reduce alone (a jitted sum of a gradient-sized float32 array over the processes).
So a JAX-engine step splits into compute (the pair's compiled step), the all-reduce,
the rest of the compiled step (what sharding adds) and the host (``fit`` minus the
compiled step: data, Python, callbacks). Writes ``engine_profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
JOBS = ("tf_alone", "jax_alone", "jax_pair", "jax_engine", "horovod")
BATCH = 32
SPLIT = {
    "fit_ms": "fit step ms",
    "compute_ms": "compute ms",
    "allreduce_ms": "all-reduce ms",
    "allreduce_flat_ms": "flat all-reduce ms",
    "rest_ms": "rest ms",
    "host_ms": "host ms",
}


def _median_time(fn, steps: int, rounds: int) -> float:
    """Median over ``rounds`` of the seconds per call of ``fn`` called ``steps`` times."""
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(steps)
        per.append((time.perf_counter() - t0) / steps)
    return statistics.median(per)


def _compiled_step(model, x, y):
    """A function running Keras's compiled JAX train step ``n`` times on one batch."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    batch = _distribute_data((x, y, None))
    model.make_train_function()
    holder = {
        "state": model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
            purge_model_variables=False,
        )
    }

    def run(n: int) -> None:
        state = holder["state"]
        for _ in range(n):
            _, state = model.train_function(state, iter([batch]))
        jax.block_until_ready(state)
        holder["state"] = state

    return run


def _allreduce(shapes: list[tuple[int, ...]], flat: bool):
    """A function summing float32 arrays of ``shapes`` over the processes ``n`` times.

    ``flat=False`` sums one array per shape in one jitted call, as the engine's step
    sums its gradients (XLA combines them into one tuple all-reduce); ``flat=True``
    sums one array holding as many floats.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    if flat:
        shapes = [(sum(int(np.prod(s)) for s in shapes),)]
    arrays = [
        jax.make_array_from_process_local_data(
            NamedSharding(mesh, PartitionSpec("batch")),
            np.ones((jax.local_device_count(), *s), np.float32),
        )
        for s in shapes
    ]
    total = jax.jit(
        lambda xs: [a.sum(0) for a in xs], out_shardings=NamedSharding(mesh, PartitionSpec())
    )

    def run(n: int) -> None:
        out = None
        for _ in range(n):
            out = total(arrays)
        jax.block_until_ready(out)

    return run


def worker(args: argparse.Namespace) -> int:
    """One process of a job: build, warm up, time; rank 0 (or a lone process) writes JSON."""
    import keras
    import numpy as np
    from models import _train_script, input_shape

    import kmp

    world = kmp.distributed.init() if args.engine else None
    choice = kmp.enable(args.policy)
    shape = input_shape("digits_cnn")
    model = _train_script().build_model("digits_cnn", shape, 10, choice.compute_dtype)
    model = kmp.float32_outputs(model)
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.05)),
        loss="sparse_categorical_crossentropy",
        jit_compile=kmp.xla.step_jit_compile(),
    )
    rank = world.rank if world else 0
    rng = np.random.default_rng(rank)
    steps = args.steps
    x = rng.random((BATCH * steps, *shape), dtype=np.float32)
    y = rng.integers(0, 10, BATCH * steps).astype("int32")
    fit = lambda n: model.fit(x[: BATCH * n], y[: BATCH * n], batch_size=BATCH, verbose=0)  # noqa: E731
    fit(min(steps, 20))  # compile
    out = {"backend": keras.backend.backend(), "engine": args.engine or "none", "rank": rank}
    out["fit_ms"] = 1e3 * _median_time(fit, steps, args.rounds)
    if keras.backend.backend() == "jax":
        step = _compiled_step(model, x[:BATCH], y[:BATCH])
        step(5)
        out["compiled_step_ms"] = 1e3 * _median_time(step, steps, args.rounds)
        if args.engine == "jax":
            shapes = [tuple(v.shape) for v in model.trainable_variables]
            for key, flat in (("allreduce_ms", False), ("allreduce_flat_ms", True)):
                reduce = _allreduce(shapes, flat)
                reduce(5)
                out[key] = 1e3 * _median_time(reduce, steps, args.rounds)
            out["gradient_tensors"] = len(shapes)
            out["gradient_floats"] = sum(int(np.prod(s)) for s in shapes)
    out["images_per_sec"] = BATCH * (world.size if world else 1) / out["fit_ms"] * 1e3
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    return 0


def _env(backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KMP_POLICY")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1"})
    return env


def run_job(job: str, policy: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Run one job; return the JSON of each writing process (two for ``jax_pair``)."""
    base = [str(HERE / "engine_profile.py"), "--worker", "--policy", policy]
    base += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    outs = [tmp / f"{job}-{policy}-{i}.json" for i in range(2 if job == "jax_pair" else 1)]
    if job in ("jax_engine", "horovod"):
        engine = "jax" if job == "jax_engine" else "horovod"
        cmd = [sys.executable, "-m", "kmp.cli", "launch", "--engine", engine, "-np", "2"]
        cmds = [[*cmd, *base, "--engine", engine, "--out", str(outs[0])]]
    else:
        cmds = [[sys.executable, *base, "--out", str(o)] for o in outs]
    backend = "tensorflow" if job in ("tf_alone", "horovod") else "jax"
    procs = [
        subprocess.Popen(
            c,
            env=_env(backend),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in cmds
    ]
    for p, c in zip(procs, cmds, strict=True):
        text, _ = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(
                f"{job} {policy} failed ({p.returncode}): {' '.join(c)}\n{text[-3000:]}"
            )
    return [json.loads(o.read_text()) for o in outs]


def breakdown(rows: dict) -> dict:
    """Split the JAX engine's ``fit`` step (ms) into compute, all-reduce, sharding and host."""
    engine, pair = rows["jax_engine"][0], rows["jax_pair"]
    compute = statistics.mean(r["compiled_step_ms"] for r in pair)
    return {
        "fit_ms": engine["fit_ms"],
        "compute_ms": compute,
        "allreduce_ms": engine["allreduce_ms"],
        "allreduce_flat_ms": engine["allreduce_flat_ms"],
        "rest_ms": engine["compiled_step_ms"] - compute - engine["allreduce_ms"],
        "host_ms": engine["fit_ms"] - engine["compiled_step_ms"],
    }


def table(result: dict) -> str:
    """Markdown: images/s per job and policy, then the JAX engine's step split."""
    from _common import markdown_table

    rows = []
    for policy, jobs in result["policies"].items():
        ips = {j: sum(r["images_per_sec"] for r in rs) for j, rs in jobs.items()}
        ratios = (
            ips["jax_alone"] / ips["tf_alone"],
            ips["jax_engine"] / ips["horovod"],
            ips["jax_engine"] / ips["jax_pair"],
            ips["horovod"] / ips["jax_pair"],
        )
        rows.append([policy, *(f"{ips[j]:.0f}" for j in JOBS), *(f"{r:.2f}" for r in ratios)])
    head = ["policy", *(f"{j} images/s" for j in JOBS)]
    head += ["jax / tf (1 process)", "jax engine / horovod", "jax engine / pair", "horovod / pair"]
    split = [[p, *(f"{b[k]:.2f}" for k in SPLIT)] for p, b in result["breakdown"].items()]
    split_head = ["policy", *SPLIT.values()]
    return (
        markdown_table(head, rows)
        + "\n\nThe JAX engine's step (2 processes), ms. Compute: the pair's compiled step. "
        "All-reduce: a jitted sum over the processes of arrays shaped as the gradients (one "
        "tuple all-reduce, as in the step); flat: the same floats in one array (not part of "
        "the step, for comparison). Rest: the engine's compiled step minus compute and "
        "all-reduce (waiting for the other process, sharding). Host: fit minus the compiled "
        "step (input pipeline, Python, callbacks).\n\n" + markdown_table(split_head, split)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=("jax", "horovod"), help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.worker:
        return worker(args)
    policies = [x for x in args.policies.split(",") if x]
    if not set(policies) <= set(POLICIES) or args.steps < 1 or args.rounds < 1:
        p.error(f"--policies from {POLICIES}; --steps and --rounds >= 1")
    from _common import machine, write_results

    result = {"machine": machine(), "batch": BATCH, "steps": args.steps, "rounds": args.rounds}
    result["policies"], result["breakdown"] = {}, {}
    with tempfile.TemporaryDirectory(prefix="kmp-profile-") as tmp:
        for policy in policies:
            jobs = {}
            for job in JOBS:
                print(f"--- {job} {policy}", flush=True)
                jobs[job] = run_job(job, policy, args, Path(tmp))
                print(json.dumps(jobs[job]), flush=True)
            result["policies"][policy] = jobs
            result["breakdown"][policy] = breakdown(jobs)
    info = result["machine"]
    header = (
        f"# Where a step's time goes: engines and backends\n\nDigits CNN, batch {BATCH} per "
        f"process, {args.steps} steps x {args.rounds} rounds (medians), OMP_NUM_THREADS=1, on "
        f"{info['cpu']} ({info['cores']} cores, avx512_bf16: {info['avx512_bf16']}), "
        f"{info['date']}."
    )
    md = header + "\n\n" + table(result)
    path = write_results("engine_profile", result, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
