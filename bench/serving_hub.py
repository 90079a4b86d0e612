"""KerasHub models served (issue 57): exports agree, generation and int8 measured.

    .venv/bin/python bench/serving_hub.py            # TensorFlow: every part
    KERAS_BACKEND=jax .venv/bin/python bench/serving_hub.py   # JAX: SavedModel, int8 speed

Real text throughout: the Python standard library's sources, one token per byte.

1. A BERT text classifier (2 layers, 256 wide, vocabulary 256, 64 tokens) trained 2
   epochs to tell which of three standard-library modules a window comes from, exported
   to ONNX and LiteRT in float32 and float16 (SavedModel too): top-1 agreement with Keras
   float32 on 256 held-out windows and each file's size against float32's.
2. A GPT-2 (2 layers, 128 wide, vocabulary 256, window 64) trained 3 epochs under
   ``kmp.enable("auto")``: ONNX and LiteRT float16 logits against float32 Keras
   (largest relative difference, next-token agreement).
3. Generation, greedy, 32 new tokens after 16 of real text, batch 4, float32: Keras's own
   ``generate`` (its cache, its compiled loop) beside ``kmp.exporting.greedy`` on files of
   ``greedy_loop`` (SavedModel, LiteRT: the loop in the runtime), of ``cached_step``
   (SavedModel, LiteRT: one call per token) and of the task (ONNX, SavedModel: the window
   each token): tokens/s and whether the tokens are Keras's.
4. int8 (``kmp.quantize``: the EinsumDense and Dense layers whose error allows it): the
   held-out perplexity beside float32's and Keras ``generate``'s tokens/s beside float32's.

Results: ``bench/results/serving_hub[_jax].{json,md}`` with the CPU they ran on, and the
issue's targets judged (``kmp bench --only inference`` runs it as its ``generation``
part). About 4 minutes on 2 cores; ``--quick`` (a tiny GPT, the SavedModel loop only,
one repeat: the figures mean nothing) checks that it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _common  # noqa: E402
from targets import part_target  # noqa: E402

SEQ, PROMPT, NEW, BATCH = 64, 16, 32, 4
SUFFIX = {"onnx": ".onnx", "litert": ".tflite", "saved_model": ""}
MODULES = ("argparse.py", "inspect.py", "typing.py")  # the classifier's three classes


def _median(fn, repeats: int = 5) -> float:
    fn()  # compile / plan once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def text_windows(rng: np.random.Generator):
    """Classifier windows (module index labels) and GPT windows, train and held out."""
    from kmp.datasets import text

    stdlib = text.stdlib_dir()
    xs, ys = [], []
    for label, name in enumerate(MODULES):
        data = np.frombuffer((stdlib / name).read_bytes(), np.uint8)[: 384 * SEQ]
        rows = data[: len(data) // SEQ * SEQ].reshape(-1, SEQ)
        xs.append(rows)
        ys.append(np.full(len(rows), label))
    x, y = np.concatenate(xs).astype("int32"), np.concatenate(ys).astype("int32")
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    corpus = text.read_corpus(max_bytes=400_000).data.astype("int32")
    lm = corpus[: 2000 * (SEQ + 1)].reshape(-1, SEQ + 1)
    return (x[:-256], y[:-256], x[-256:], y[-256:]), (lm[:-128], lm[-128:])


def bert_features(ids: np.ndarray) -> dict:
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": np.ones_like(ids)}


def lm_features(rows: np.ndarray) -> dict:
    return {"token_ids": rows[:, :-1], "padding_mask": np.ones_like(rows[:, :-1])}


def classifier_part(data, folder: str, backend: str) -> list[dict]:
    import keras
    import keras_hub

    import kmp

    x, y, x_test, y_test = data
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=SEQ,
    )  # fmt: skip
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None)
    model.compile(keras.optimizers.Adam(5e-4), keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(bert_features(x), y, epochs=2, batch_size=32, verbose=0)
    formats = [("saved_model", "float32"), ("saved_model", "float16")]
    if backend == "tensorflow":
        formats += [(f, p) for f in ("onnx", "litert") for p in ("float32", "float16")]
    rows = []
    for fmt, precision in formats:
        path = os.path.join(folder, f"bert-{fmt}-{precision}{SUFFIX[fmt]}")
        r = kmp.export(model, path, fmt, precision, sample=bert_features(x_test), labels=y_test,
                       verbose=False)  # fmt: skip
        rows.append({"model": "bert", "format": fmt, "precision": precision, **_measures(r)})
        print(rows[-1], flush=True)
    return rows


def _measures(r) -> dict:
    return {
        "size_bytes": r.size_bytes,
        "size_ratio": r.size_ratio,
        "max_abs_diff": r.max_abs_diff,
        "max_rel_diff": r.max_rel_diff,
        "top1_agreement": r.top1_agreement,
        "accuracy": r.accuracy,
        "float32_accuracy": r.float32_accuracy,
        "perplexity": r.perplexity,
        "float32_perplexity": r.float32_perplexity,
    }


def train_gpt(train: np.ndarray, quick: bool = False):
    import keras
    import keras_hub

    import kmp

    keras.utils.set_random_seed(0)
    with kmp.policy_scope("auto"):
        width = 32 if quick else 128
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=256, num_layers=1 if quick else 2, num_heads=4, hidden_dim=width,
            intermediate_dim=4 * width, max_sequence_length=SEQ,
        )  # fmt: skip
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(kmp.wrap_optimizer(keras.optimizers.Adam(2e-3)))
        epochs = 1 if quick else 3
        model.fit(lm_features(train), train[:, 1:], epochs=epochs, batch_size=32, verbose=0)
    return model


def gpt_part(gpt, held_out: np.ndarray, folder: str, backend: str) -> list[dict]:
    import kmp

    formats = [("saved_model", "float16")]
    if backend == "tensorflow":
        formats += [("onnx", "float16"), ("litert", "float16")]
    rows = []
    for fmt, precision in formats:
        path = os.path.join(folder, f"gpt-{fmt}-{precision}{SUFFIX[fmt]}")
        r = kmp.export(gpt, path, fmt, precision, sample=lm_features(held_out),
                       labels=held_out[:, 1:], verbose=False)  # fmt: skip
        rows.append({"model": "gpt", "format": fmt, "precision": precision, **_measures(r)})
        print(rows[-1], flush=True)
    return rows


def keras_generate(model, prompt: np.ndarray):
    ids = np.zeros((len(prompt), PROMPT + NEW), "int32")
    ids[:, :PROMPT] = prompt
    mask = np.zeros_like(ids, dtype=bool)
    mask[:, :PROMPT] = True
    out = model.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def generation_part(gpt32, prompt: np.ndarray, folder: str, backend: str, quick: bool) -> list:
    import kmp
    from kmp.exporting import cached_step, greedy, greedy_loop
    from kmp.exporting.runners import open_runner

    gpt32.compile(sampler="greedy")
    reference = keras_generate(gpt32, prompt)
    tokens, repeats = len(prompt) * NEW, 1 if quick else 5
    rows = [{"how": "Keras generate (as compiled by default)", "format": "keras", "kind": "keras",
             "tokens_per_s": tokens / _median(lambda: keras_generate(gpt32, prompt), repeats),
             "same_tokens": True}]  # fmt: skip
    if backend == "tensorflow" and not quick:  # TensorFlow's default leaves XLA off
        gpt32.compile(sampler="greedy", jit_compile=True)
        got = keras_generate(gpt32, prompt)
        speed = tokens / _median(lambda: keras_generate(gpt32, prompt))
        rows.append({"how": "Keras generate, jit_compile=True (XLA)", "format": "keras",
                     "kind": "keras_xla", "same_tokens": bool(np.array_equal(got, reference)),
                     "tokens_per_s": speed})  # fmt: skip
        gpt32.compile(sampler="greedy")
    window = np.zeros((len(prompt), PROMPT + NEW), "int32")
    window[:, :PROMPT] = prompt
    mask = (np.arange(PROMPT + NEW) < PROMPT)[None].repeat(len(prompt), 0).astype("int32")
    step = cached_step(gpt32, PROMPT + NEW)
    cache = np.zeros((len(prompt), *step.input["kv_cache"].shape[1:]), "float32")
    # Under JAX the served lengths are the sample's: one token per step (the prompt too).
    step_ids = prompt if backend == "tensorflow" else prompt[:, :1]
    samples = {
        "loop": {"token_ids": window, "padding_mask": mask},
        "step": {"token_ids": step_ids, "kv_cache": cache, "index": np.zeros(len(prompt), "int32")},
        "task": {"token_ids": window, "padding_mask": np.ones_like(window)},
    }
    models = {"loop": greedy_loop(gpt32), "step": step, "task": gpt32}
    how = {"loop": "the loop in the runtime", "step": "cached step, a call per token",
           "task": "the task over the window, a call per token"}  # fmt: skip
    plans = [("saved_model", "loop"), ("saved_model", "step"), ("saved_model", "task")]
    if backend == "tensorflow":
        plans += [("litert", "loop"), ("litert", "step"), ("onnx", "task")]
    if quick:
        plans = plans[:1]
    for fmt, kind in plans:
        path = os.path.join(folder, f"gen-{kind}-{fmt}{SUFFIX[fmt]}")
        kmp.export(models[kind], path, fmt, sample=samples[kind], verbose=False)
        runner = open_runner(path, num_threads=os.cpu_count())
        decode = lambda r=runner: greedy(r, prompt, NEW)  # noqa: E731
        got = decode()
        rows.append({"how": f"{fmt} file: {how[kind]}", "format": fmt, "kind": kind,
                     "tokens_per_s": tokens / _median(decode, repeats),
                     "same_tokens": bool(np.array_equal(got, reference))})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def int8_part(gpt32, held_out: np.ndarray, prompt: np.ndarray) -> dict:
    import keras

    import kmp
    from kmp._outputs import perplexity

    def ppl(model) -> float:
        logits = keras.ops.convert_to_numpy(model.predict_on_batch(lm_features(held_out)))
        return perplexity(np.asarray(logits, np.float32), held_out[:, 1:])

    tokens = len(prompt) * NEW
    float32 = {"perplexity": ppl(gpt32),
               "tokens_per_s": tokens / _median(lambda: keras_generate(gpt32, prompt))}  # fmt: skip
    report = kmp.quantize(gpt32, "int8", lm_features(held_out[:32]))
    int8 = {"perplexity": ppl(gpt32),
            "tokens_per_s": tokens / _median(lambda: keras_generate(gpt32, prompt)),
            "quantized_layers": sum(1 for o in report.layers if o.quantized)}  # fmt: skip
    base = float32["perplexity"]
    out = {"float32": float32, "int8": int8,
           "perplexity_diff": abs(int8["perplexity"] - base) / base,
           "speed_ratio": int8["tokens_per_s"] / float32["tokens_per_s"]}  # fmt: skip
    print(out, flush=True)
    return out


WHY_SLOWER = {
    "tensorflow": "no exported path ran faster than Keras's generate on this CPU: see the "
    "generation table",
    "jax": "Keras's JAX generate is one XLA program; the exported loop runs in TensorFlow, "
    "through jax2tf's XlaCallModule and the SavedModel's function call",
}


def targets(result: dict) -> list[dict]:
    """Issue 57's targets, judged from this run's figures (what did not run is not judged)."""
    out = []
    for r in result["exports"]:
        if r["precision"] != "float16" or r["format"] == "saved_model":
            continue
        agree, what = r["top1_agreement"], f"{r['model']} {r['format']} float16"
        out.append(part_target(f"serving, {what} top-1 agreement with float32", ">= 99 %",
                               agree, agree >= 0.99, f"{100 * agree:.2f} %"))  # fmt: skip
        if r["model"] == "bert":
            ratio = r["size_ratio"]
            out.append(part_target(f"serving, {what} file size vs float32", "<= 0.52x",
                                   round(ratio, 3), ratio <= 0.52, f"{ratio:.3f}x"))  # fmt: skip
    gen = result["generation"]
    exported = [r for r in gen if not r["kind"].startswith("keras")]
    if exported:
        best = max(exported, key=lambda r: r["tokens_per_s"])
        ratio = best["tokens_per_s"] / gen[0]["tokens_per_s"]
        met = ratio >= 1.0
        out.append(part_target(
            "serving, generation from the exported GPT vs Keras generate, tokens/s", ">= 1.00x",
            round(ratio, 3), met, f"{ratio:.2f}x ({best['how']})",
            "" if met else WHY_SLOWER[result["backend"]],
        ))  # fmt: skip
        same = sum(r["same_tokens"] for r in exported)
        out.append(part_target(
            "serving, exported greedy tokens identical to Keras generate's (32, float32)",
            "every path", same / len(exported), same == len(exported),
            f"{same} of {len(exported)} paths",
        ))  # fmt: skip
    q = result["int8"]
    if q is not None:
        diff = q["perplexity_diff"]
        out.append(part_target("serving, int8 GPT perplexity vs float32", "within 2 %",
                               round(diff, 5), diff <= 0.02, f"{100 * diff:.2f} %"))  # fmt: skip
        if result["backend"] == "jax":
            ratio = q["speed_ratio"]
            out.append(part_target(
                "serving, int8 GPT generate vs float32 on JAX, tokens/s", ">= 1.20x",
                round(ratio, 3), ratio >= 1.2, f"{ratio:.2f}x",
                "" if ratio >= 1.2 else "at batch 4 the matrices are small: dequantizing "
                "the int8 weights costs more than the int8 products save",
            ))  # fmt: skip
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# KerasHub models served ({result['backend']} backend)",
        "",
        f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, {m['date']}; "
        "bench/serving_hub.py. Real text: the standard library's sources, byte tokens."
        + (" **Quick run: the figures mean nothing.**" if result.get("quick") else ""),
        "",
        "## Targets",
        "",
        _common.markdown_table(
            ["target", "goal", "measured", "met"],
            [
                [t["name"], t["goal"], t["measured"], {True: "met", False: "missed"}[t["met"]]]
                for t in result["targets"]
            ],
        ),
    ]
    if result["exports"]:
        table = _common.markdown_table(
            [
                "model",
                "format",
                "precision",
                "size",
                "of float32",
                "top-1 agreement",
                "largest rel. diff",
                "accuracy / perplexity (float32 Keras)",
            ],
            [
                [
                    r["model"],
                    r["format"],
                    r["precision"],
                    f"{r['size_bytes'] / 1e6:.2f} MB",
                    "" if r["size_ratio"] is None else f"{r['size_ratio']:.3f}",
                    f"{100 * r['top1_agreement']:.2f}%",
                    f"{r['max_rel_diff']:.2e}",
                    f"{100 * r['accuracy']:.2f}% ({100 * r['float32_accuracy']:.2f}%)"
                    if r["accuracy"] is not None
                    else f"{r['perplexity']:.3f} ({r['float32_perplexity']:.3f})",
                ]
                for r in result["exports"]
            ],
        )
        lines += ["", "## Exports against Keras float32", "", table]
    lines += [
        "",
        f"## Generation: greedy, {NEW} new tokens after {PROMPT}, batch {BATCH}, float32",
        "",
        _common.markdown_table(
            ["how", "tokens/s", "of Keras generate", "Keras's tokens"],
            [
                [
                    r["how"],
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['tokens_per_s'] / result['generation'][0]['tokens_per_s']:.2f}x",
                    "identical" if r["same_tokens"] else "differ",
                ]
                for r in result["generation"]
            ],
        ),
    ]
    q = result["int8"]
    if q is None:
        return "\n".join(lines)
    lines += ["", "## int8 (kmp.quantize) against float32, Keras generate", ""]
    lines.append(
        f"- perplexity {q['int8']['perplexity']:.3f} vs {q['float32']['perplexity']:.3f} "
        f"(relative difference {100 * q['perplexity_diff']:.2f}%), "
        f"{q['int8']['quantized_layers']} layers quantized"
    )
    lines.append(
        f"- tokens/s {q['int8']['tokens_per_s']:.0f} vs {q['float32']['tokens_per_s']:.0f} "
        f"({q['speed_ratio']:.2f}x)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import keras

    import kmp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run: figures mean nothing")
    quick = parser.parse_args(argv).quick
    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    bert_data, (lm_train, lm_held) = text_windows(rng)
    prompt = lm_held[:BATCH, :PROMPT]
    with tempfile.TemporaryDirectory(prefix="kmp-serving-hub-") as folder:
        exports = [] if quick else classifier_part(bert_data, folder, backend)
        gpt = train_gpt(lm_train[:64] if quick else lm_train, quick)
        if not quick:
            exports += gpt_part(gpt, lm_held, folder, backend)
        saved = os.path.join(folder, "gpt.keras")
        kmp.save_model(gpt, saved)
        gpt32 = kmp.load_model(saved, policy="float32")
        generation = generation_part(gpt32, prompt, folder, backend, quick)
        int8 = None if quick else int8_part(gpt32, lm_held, prompt)
    result = {"backend": backend, "quick": quick, "machine": _common.machine(),
              "exports": exports, "generation": generation, "int8": int8}  # fmt: skip
    result["targets"] = targets(result)
    name = "serving_hub" + ("" if backend == "tensorflow" else f"_{backend}")
    _common.write_results(name + ("_quick" if quick else ""), result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
