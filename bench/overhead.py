"""Overhead of kmp.wrap_optimizer against a hand-wired Keras LossScaleOptimizer, one process.

    .venv/bin/python bench/overhead.py [--model digits_cnn] [--policy mixed_float16]
                                       [--batch 64] [--steps 40] [--repeats 7]

Both models start from the same weights and train on the same batch with the same
inner optimizer (Adam); one is compiled with ``kmp.wrap_optimizer(Adam())``, the
other with ``keras.optimizers.LossScaleOptimizer(Adam())``. After one warm-up
epoch each, they are timed in alternation (the order flips every repeat) so a
noisy neighbour slows both alike. The headline ratio is kmp's best throughput
over Keras's best; the median of the per-repeat ratios is stored too. The target
is a ratio of at least 0.98. Writes ``bench/results/overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, markdown_table, write_results

TARGET = 0.98


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="digits_cnn", choices=("digits_cnn", "cnn", "resnet50"))
    p.add_argument(
        "--policy", default="mixed_float16", choices=("mixed_float16", "mixed_bfloat16", "float32")
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="steps per timed epoch")
    p.add_argument("--repeats", type=int, default=7)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import keras
    import models
    import tensorflow as tf

    import kmp

    keras.config.set_dtype_policy(args.policy)
    x, y = models.batch(args.model, args.batch)
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)

    def compiled(optimizer, weights=None):
        keras.utils.set_random_seed(0)
        model = models.build(args.model)
        if weights is not None:
            model.set_weights(weights)
        model.compile(
            optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=False
        )
        return model

    ours = compiled(kmp.wrap_optimizer(keras.optimizers.Adam(1e-3)))
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    theirs = compiled(keras_lso, ours.get_weights())
    runs = {"kmp": ours, "keras": theirs}

    def epoch(model) -> float:
        t0 = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        return args.steps * args.batch / (time.perf_counter() - t0)

    for model in runs.values():  # warm-up: tracing, first allocations
        epoch(model)
    speeds: dict[str, list[float]] = {"kmp": [], "keras": []}
    for r in range(args.repeats):
        order = ("kmp", "keras") if r % 2 == 0 else ("keras", "kmp")
        for name in order:
            speeds[name].append(epoch(runs[name]))
    best = {k: max(v) for k, v in speeds.items()}
    ratio = best["kmp"] / best["keras"]
    paired = [a / b for a, b in zip(speeds["kmp"], speeds["keras"], strict=True)]
    result = {
        "model": args.model,
        "policy": args.policy,
        "batch": args.batch,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "images_per_s": {k: [round(s, 1) for s in v] for k, v in speeds.items()},
        "best_images_per_s": {k: round(v, 1) for k, v in best.items()},
        "ratio_best": round(ratio, 4),
        "ratio_median_paired": round(statistics.median(paired), 4),
        "kmp_loss_scale": ours.optimizer.loss_scale,
        "keras_loss_scale": float(keras_lso.dynamic_scale.numpy()),
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "load_average": list(os.getloadavg()),
        "machine": machine(),
    }
    md = "# kmp.wrap_optimizer vs hand-wired LossScaleOptimizer\n\n" + markdown_table(
        [
            "model",
            "policy",
            "batch",
            "kmp img/s",
            "Keras LSO img/s",
            "ratio (best)",
            "ratio (median, paired)",
        ],
        [
            [
                args.model,
                args.policy,
                args.batch,
                result["best_images_per_s"]["kmp"],
                result["best_images_per_s"]["keras"],
                result["ratio_best"],
                result["ratio_median_paired"],
            ]
        ],
    )
    path = write_results("overhead", result, md)
    print(md)
    print(f"\nratio {ratio:.3f} (target >= {TARGET}); written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
