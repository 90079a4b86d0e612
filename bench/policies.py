"""Training throughput of a small CNN and an MLP under each dtype policy, in one run.

    .venv/bin/python bench/policies.py [--steps 12] [--rounds 2] [--quick]

For each model, every policy (float32, mixed_bfloat16, mixed_float16 and
"auto") trains the same architecture on the same batches for a fixed number
of steps with ``model.train_on_batch``; the policies are interleaved over
``--rounds`` rounds and the best round counts, so a noisy neighbour hurts all
of them alike. Writes ``bench/results/policies.json`` and ``policies.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _common import machine, markdown_table, write_results

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "auto"]


def build(model_name: str):
    import keras

    import kmp

    if model_name == "cnn":
        # 6 convolutions, pooled after each pair (the small CNN of STACK.md).
        layers = [keras.Input((32, 32, 3))]
        for filters in (32, 64, 128):
            layers.append(keras.layers.Conv2D(filters, 3, padding="same", activation="relu"))
            layers.append(keras.layers.Conv2D(filters, 3, padding="same", activation="relu"))
            layers.append(keras.layers.MaxPooling2D())
        layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, "softmax")]
    else:
        layers = [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10, "softmax"),
        ]
    model = kmp.float32_outputs(keras.Sequential(layers))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    return model


def data(model_name: str, batch: int):
    rng = np.random.default_rng(0)
    shape = (batch, 32, 32, 3) if model_name == "cnn" else (batch, 784)
    return rng.random(shape, dtype=np.float32), rng.integers(0, 10, batch)


def time_policy(model_name: str, policy: str, steps: int, batch: int) -> tuple[float, str]:
    import keras

    import kmp

    keras.backend.clear_session()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16-on-CPU warning: measuring it is the point
        choice = kmp.enable(policy)
    model = build(model_name)
    x, y = data(model_name, batch)
    model.train_on_batch(x, y)  # trace and warm up
    model.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        loss = model.train_on_batch(x, y)
    elapsed = time.perf_counter() - start
    if not np.isfinite(loss):
        raise RuntimeError(f"{model_name}/{policy}: non-finite loss {loss}")
    kmp.disable()
    return steps * batch / elapsed, choice.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round, batch 8")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.batch = 2, 1, 8

    results: dict = {"machine": machine(), "steps": args.steps, "batch": args.batch, "models": {}}
    rows = []
    for model_name in args.models.split(","):
        best: dict[str, float] = {}
        resolved: dict[str, str] = {}
        for _ in range(args.rounds):
            for policy in POLICIES:
                rate, name = time_policy(model_name, policy, args.steps, args.batch)
                best[policy] = max(best.get(policy, 0.0), rate)
                resolved[policy] = name
        base = best["float32"]
        fastest = max(best[p] for p in POLICIES if p != "auto")
        results["models"][model_name] = {
            p: {
                "examples_per_s": round(best[p], 1),
                "vs_float32": round(best[p] / base, 3),
                "policy": resolved[p],
            }
            for p in POLICIES
        }
        results["models"][model_name]["auto_vs_fastest"] = round(best["auto"] / fastest, 3)
        for p in POLICIES:
            label = f"auto ({resolved[p]})" if p == "auto" else p
            rows.append([model_name, label, f"{best[p]:.0f}", f"{best[p] / base:.2f}"])
    md = markdown_table(["model", "policy", "examples/s", "vs float32"], rows)
    md += "\n\n" + ", ".join(
        f"{m}: auto = {v['auto_vs_fastest']:.2f} x the fastest policy"
        for m, v in results["models"].items()
    )
    md += (
        f"\n\nMachine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        + ("AVX512_BF16" if results["machine"]["avx512_bf16"] else "no AVX512_BF16/AMX")
        + f"; batch {args.batch}, {args.steps} steps, best of {args.rounds} interleaved rounds."
    )
    path = write_results("policies" + ("_quick" if args.quick else ""), results, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
