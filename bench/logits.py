"""What float32 logits cost: a GPT-2-vocabulary causal LM's training step, three ways.

    .venv/bin/python bench/logits.py [--policy mixed_bfloat16] [--vocab 50257]
                                     [--hidden 128] [--layers 2] [--seq 64] [--batch 8]
                                     [--steps 5] [--rounds 3] [--threads 1]

KerasHub's ``GPT2CausalLM`` with GPT-2's vocabulary (50,257 tokens; smaller layers so a
CPU step takes about a second), built from code, trained with ``kmp.wrap_optimizer(Adam)``
and a from-logits cross-entropy, in three forms with the same weights and batch:

- ``16-bit logits``: the tied head's vocabulary matmul in the policy's 16-bit dtype
  (``reverse_dtype`` set to it) and the loss reading those 16-bit logits;
- ``kmp.float32_outputs``: the same 16-bit matmul, its logits cast to float32 before the
  loss (what ``kmp.float32_outputs`` does to such a head);
- ``float32 matmul``: the model as KerasHub builds it under Keras 3.15: the tied
  ``ReversibleEmbedding`` reads its float32 table without autocasting, so the backend
  upcasts the hidden states and the whole vocabulary matmul runs in float32.

After one warm-up epoch each, the forms are timed in turn, round after round (the
order rotates), and the median step time of each is kept; ratios are to the 16-bit
logits. Writes ``bench/results/logits.json`` and ``.md`` with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, markdown_table, write_results

FORMS = ("16-bit logits", "kmp.float32_outputs", "float32 matmul")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policy", default="mixed_bfloat16", choices=("mixed_bfloat16", "mixed_float16")
    )
    p.add_argument("--vocab", type=int, default=50257, help="GPT-2's vocabulary by default")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads (0: default)")
    return p.parse_args(argv)


def build(form: str, args: argparse.Namespace, weights: list | None):
    import keras
    import keras_hub

    import kmp

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocab,
        num_layers=args.layers,
        num_heads=2,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        max_sequence_length=args.seq,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if weights is not None:
        lm.set_weights(weights)
    if form == "kmp.float32_outputs":
        lm = kmp.float32_outputs(lm)
    elif form == "16-bit logits":
        backbone.token_embedding.reverse_dtype = backbone.token_embedding.compute_dtype
    lm.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-4)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras
    import numpy as np

    import kmp

    kmp.enable(args.policy)
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    ids = rng.integers(0, args.vocab, size=(n, args.seq + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, args.seq), "int32")}
    y = ids[:, 1:]

    models, dtypes, weights = {}, {}, None
    for form in FORMS:
        models[form] = build(form, args, weights)
        weights = weights or models[form].get_weights()
        out = models[form]({k: v[: args.batch] for k, v in x.items()})
        dtypes[form] = keras.backend.standardize_dtype(out.dtype)
        models[form].fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # warm-up, traces

    times: dict[str, list[float]] = {f: [] for f in FORMS}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        order = FORMS[r % len(FORMS) :] + FORMS[: r % len(FORMS)]
        for form in order:
            t0 = time.perf_counter()
            hist = models[form].fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
            times[form].append((time.perf_counter() - t0) / args.steps)
            losses[form] = float(hist.history["loss"][-1])

    base = statistics.median(times[FORMS[0]])
    rows, results = [], []
    for form in FORMS:
        step = statistics.median(times[form])
        results.append(
            {
                "form": form,
                "logits_dtype": dtypes[form],
                "step_s": step,
                "ratio_to_16bit": step / base,
                "tokens_per_s": args.batch * args.seq / step,
                "last_loss": losses[form],
                "step_times": times[form],
            }
        )
        rows.append(
            [
                form,
                dtypes[form],
                f"{step * 1000:.0f}",
                f"{step / base:.3f}",
                f"{args.batch * args.seq / step:.0f}",
                f"{losses[form]:.4f}",
            ]
        )
    info = machine()
    md = (
        f"# Float32 logits: step-time cost ({args.policy}, vocab {args.vocab:,})\n\n"
        f"GPT2CausalLM: {args.layers} layers, hidden {args.hidden}, sequence {args.seq}, "
        f"batch {args.batch}; median of {args.rounds} rounds of {args.steps} steps; "
        f"{info['cpu']}, {info['cores']} cores, avx512_bf16={info['avx512_bf16']}, "
        f"{info['date']}.\n\n"
        + markdown_table(["form", "logits", "step ms", "x 16-bit", "tokens/s", "last loss"], rows)
    )
    write_results("logits", {"args": vars(args), "machine": info, "results": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
