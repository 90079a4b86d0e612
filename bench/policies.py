"""Training throughput of each model under each dtype policy, in one run.

    .venv/bin/python bench/policies.py [--models cnn,mlp,gpt] [--steps 12] [--min-seconds 8]
        [--rounds 3] [--quick]

For each model of ``models.py`` named in ``--models`` (default: the small CNN,
the MLP and the byte-level GPT, a token model), every policy (float32,
mixed_bfloat16, mixed_float16, bfloat16 weights with kmp's compensated updates, and
"auto") trains the same architecture, compiled
the kmp way (``kmp.float32_outputs`` and ``kmp.wrap_optimizer(SGD)``, so float16
gets its dynamic loss scaling), on the same batch with ``model.train_on_batch``
for at least ``--steps`` steps and ``--min-seconds`` seconds. The policies are
interleaved over ``--rounds`` rounds (see :func:`round_order`) and the best round
counts, so a noisy neighbour hurts all of them alike. Writes
``bench/results/policies.json`` and ``policies.md`` (``policies_jax.*`` with
``KERAS_BACKEND=jax``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models
import numpy as np
from _common import machine, markdown_table, write_results

CANDIDATES = ["float32", "mixed_bfloat16", "mixed_float16"]  # what "auto" chooses among
# "bfloat16": bfloat16 weights too, with kmp's compensated updates (master_weights="auto").
POLICIES = [*CANDIDATES, "bfloat16", "auto"]


def round_order(r: int) -> list[str]:
    """The policies in the order of round ``r``.

    Rotated by ``r``, so each round starts with another policy, and on odd
    rounds the policies after the first are reversed, so none always follows the
    same neighbour (a slow float16 run could leave work behind for the next).
    """
    k = r % len(POLICIES)
    order = POLICIES[k:] + POLICIES[:k]
    return [order[0], *order[:0:-1]] if r % 2 else order


def time_policy(
    model_name: str, policy: str, steps: int, batch: int, min_seconds: float = 0.0
) -> tuple[float, str]:
    import keras

    import kmp

    keras.backend.clear_session()
    gc.collect()  # the previous policy's model, so its collection does not land in our timing
    model, x, y, choice = models.compiled(model_name, policy, batch)  # traced and warmed up
    gc.collect()
    gc.disable()  # as timeit does: no collector pauses inside the timed steps
    try:
        start = time.perf_counter()
        done = 0
        # At least `steps` steps and at least `min_seconds`: a fast policy's few steps
        # would otherwise last a second or two, and one hiccup would decide its figure.
        while done < steps or time.perf_counter() - start < min_seconds:
            loss = model.train_on_batch(x, y)
            done += 1
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    if not np.isfinite(loss):
        raise RuntimeError(f"{model_name}/{policy}: non-finite loss {loss}")
    kmp.disable()
    return done * batch / elapsed, choice.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=8.0,
        help="each measurement runs at least --steps steps and at least this long",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--models", default="cnn,mlp,gpt", help=f"comma-separated: {', '.join(models.MODELS)}"
    )
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round, batch 8")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.batch, args.min_seconds = 2, 1, 8, 0.0
    if args.steps < 1 or args.rounds < 1 or args.batch < 1 or args.min_seconds < 0:
        parser.error("--steps, --rounds and --batch must be >= 1 and --min-seconds >= 0")

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    known = (*models.MODELS, *models.TOKEN_MODELS)
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        parser.error(f"--models {args.models!r}: use names from {', '.join(known)}")
    results: dict = {
        "machine": machine(),
        "steps": args.steps,
        "min_seconds": args.min_seconds,
        "rounds": args.rounds,
        "batch": args.batch,
        "models": {},
    }
    rows = []
    for model_name in names:
        best: dict[str, float] = {}
        resolved: dict[str, str] = {}
        failed: dict[str, str] = {}
        for r in range(args.rounds):
            for policy in round_order(r):
                if policy in failed:
                    continue
                try:
                    rate, name = time_policy(
                        model_name, policy, args.steps, args.batch, args.min_seconds
                    )
                except ValueError as exc:  # e.g. XLA:CPU refusing a float16 product (JAX)
                    failed[policy] = str(exc).splitlines()[0]
                    continue
                best[policy] = max(best.get(policy, 0.0), rate)
                resolved[policy] = name
        base = best["float32"]
        fastest = max(best[p] for p in CANDIDATES if p in best)
        results["models"][model_name] = {
            p: (
                {
                    "examples_per_s": round(best[p], 1),
                    "vs_float32": round(best[p] / base, 3),
                    "policy": resolved[p],
                }
                if p in best
                else {"failed": failed[p]}
            )
            for p in POLICIES
        }
        auto = best.get("auto")
        results["models"][model_name]["auto_vs_fastest"] = auto and round(auto / fastest, 3)
        for p in POLICIES:
            if p not in best:
                rows.append([model_name, p, f"failed: {failed[p]}", "-"])
                continue
            label = f"auto ({resolved[p]})" if p == "auto" else p
            rows.append([model_name, label, f"{best[p]:.0f}", f"{best[p] / base:.2f}"])
    md = markdown_table(["model", "policy", "examples/s", "vs float32"], rows)
    md += "\n\n" + ", ".join(
        f"{m}: auto = {v['auto_vs_fastest']:.2f} x the fastest policy it chooses among"
        for m, v in results["models"].items()
    )
    md += (
        f"\n\nMachine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        + ("AVX512_BF16" if results["machine"]["avx512_bf16"] else "no AVX512_BF16/AMX")
        + f"; batch {args.batch}, at least {args.steps} steps and {args.min_seconds:g} s per "
        f"measurement, best of {args.rounds} interleaved rounds (order varied)."
    )
    import keras

    results["backend"] = keras.backend.backend()
    md += f" Keras backend: {results['backend']}."
    name = "policies" + ("" if results["backend"] == "tensorflow" else f"_{results['backend']}")
    path = write_results(name + ("_quick" if args.quick else ""), results, md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
