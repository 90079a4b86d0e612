"""Sparse gradients on 2 ranks: allreduce them dense, or allgather their rows?

    .venv/bin/python bench/sparse.py [--vocab 16384] [--dim 128] [--batch 32] [--seq 16]
        [--steps 30] [--rounds 2]

Started plainly, it runs itself under ``horovodrun --gloo -np 2 -H localhost:2`` (as
``bench/peers.py`` starts its jobs); started by horovodrun (``--worker``) it is one rank.
Each rank trains a model whose gradient is dominated by a large ``Embedding``
(vocab x dim, short sequences, mean pooled, a small Dense head) with
``kmp.wrap_optimizer(Adam, sparse_gradients=...)`` in a custom ``tf.function`` step,
on its own data. The two strategies alternate for ``--rounds`` rounds of ``--steps``
timed steps (after a warm-up); each figure is the median of the rounds. It reports
steps/s, tokens/s (both ranks), the bytes each rank hands to the collectives per
step, whether the ranks ended bit-identical, and the CPU. Writes ``sparse.json`` and
``sparse.md`` into the results folder.

Every rank runs one TensorFlow compute thread and two inter-op threads, as in
``bench/peers.py``.
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
sys.path.insert(0, str(HERE))

STRATEGIES = ("dense", "gather")
HEADERS = [
    "sparse_gradients",
    "steps/s",
    "tokens/s",
    "MiB per rank and step",
    "ranks identical",
    "rounds (steps/s)",
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import kmp

    world = kmp.distributed.init()
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    rng = np.random.default_rng(world.rank)
    n = args.batch * (args.steps + 3)
    x = rng.integers(0, args.vocab, size=(n, args.seq)).astype("int32")
    y = (x[:, 0] % 10).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(strategy: str):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((args.seq,), dtype="int32"),
                keras.layers.Embedding(args.vocab, args.dim),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), sparse_gradients=strategy)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(loss_fn(yb, model(xb, training=True)))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        return model, opt, step

    jobs = {s: build(s) for s in STRATEGIES}
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    b = args.batch
    for _, _, step in jobs.values():  # trace and warm up
        for i in range(3):
            step(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]).numpy()
    for _ in range(args.rounds):
        for s, (_, _, step) in jobs.items():
            kmp.distributed.barrier()
            start = time.perf_counter()
            for i in range(3, 3 + args.steps):
                loss = step(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
            loss.numpy()
            times[s].append(args.steps / (time.perf_counter() - start))
    out: dict = {}
    for s, (model, opt, _) in jobs.items():
        flat = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype("float64")
        gathered = kmp.distributed.allgather(tf.constant(flat)[None]).numpy()
        rates = times[s]
        out[s] = {
            "steps_per_s": statistics.median(rates),
            "rounds": rates,
            "tokens_per_s": statistics.median(rates) * world.size * b * args.seq,
            "bytes_per_step": opt.allreduce_bytes_per_step,
            "identical": bool(np.max(np.abs(gathered - gathered[0])) == 0.0),
        }
    if world.rank == 0:
        Path(args.worker).write_text(json.dumps(out))


# ------------------------------------------------------------------ the driver


def report(args: argparse.Namespace, result: dict, machine: dict, load: tuple) -> str:
    from _common import markdown_table

    rows = [
        [
            s,
            f"{r['steps_per_s']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['bytes_per_step'] / 2**20:.2f}",
            r["identical"],
            ", ".join(f"{v:.2f}" for v in r["rounds"]),
        ]
        for s, r in result.items()
    ]
    ratio = result["gather"]["steps_per_s"] / result["dense"]["steps_per_s"]
    return "\n".join(
        [
            "# Sparse gradients: dense allreduce or allgather of the rows",
            "",
            f"CPU: {machine['cpu']}, {machine['cores']} cores, avx512_bf16="
            f"{machine['avx512_bf16']}, amx={machine['amx']}; load average at the end "
            f"{', '.join(f'{v:.2f}' for v in load)}. The machine is shared: figures are noisy.",
            "",
            f"2 ranks (horovodrun --gloo, one host), Embedding {args.vocab} x {args.dim} float32 "
            f"(+ a 64-unit Dense head), {args.batch} sequences of {args.seq} tokens per rank and "
            f"step, Adam, float32; median of {args.rounds} rounds of {args.steps} steps.",
            "",
            markdown_table(HEADERS, rows),
            "",
            f"gather / dense: {ratio:.2f}x steps/s.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from _common import machine, write_results

    out = Path(tempfile.mkdtemp(prefix="kmp-sparse-")) / "rank0.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        TF_CPP_MIN_LOG_LEVEL="2",
        OMP_NUM_THREADS="1",
    )
    from _common import horovod_launcher

    cmd = [*horovod_launcher(), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, __file__]
    cmd += [*(argv if argv is not None else sys.argv[1:]), "--worker", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    result = json.loads(out.read_text())
    facts = machine()
    load = os.getloadavg()
    md = report(args, result, facts, load)
    payload = {"args": vars(args) | {"worker": None}, "machine": facts, "load": load}
    write_results("sparse", {**payload, "results": result}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
