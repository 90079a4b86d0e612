"""Inference speed beside accuracy, per precision: ``kmp bench --only inference``.

    .venv/bin/python bench/inference.py [--models digits_cnn,mnist1d_cnn,mlp,resnet50,gpt]
        [--precisions float32,bfloat16,float16,mixed_bfloat16,int8] [--exports] [--quick]

"Train mixed, serve anywhere", measured. For each model it trains once under the
policy ``kmp.enable("auto")`` picks on this machine (``--train-policy``), saves it with
``kmp.save_model``, then serves the saved file in each precision side by side in this one
process: ``kmp.load_model(path, policy=p)`` for the float precisions and
``kmp.quantize`` of the float32 load for ``int8``; with ``--exports`` (TensorFlow backend)
also each ``kmp.export`` format in float32 and float16, timed in its own runtime.

Per precision it reports the latency of one example (batch 1, median call), the
throughput at batch ``--batch`` (examples/s; for the GPT, tokens/s of greedy generation,
one forward pass of the whole window per new token), and beside them the accuracy on the
held-out split (digits, MNIST-1D) or the validation perplexity (the GPT on the standard
library's text), the top-1 agreement with the float32 load and the largest difference of
its outputs from float32's. ResNet50 (``keras.applications``, no weights can be
downloaded here) is timed on random images: its agreement is shown, no accuracy.

The models: ``digits_cnn`` (launch/train.py's, the 8x8 digits), ``mnist1d_cnn`` (the
MNIST-1D paper's CNN), ``mlp`` (Dense-heavy: 40 -> 3 x 1024 -> 10 on MNIST-1D),
``resnet50`` at 64x64 and ``gpt`` (launch/workloads.py's byte-level GPT).

Writes ``inference.json`` and ``inference.md`` (``inference_jax.*`` on the JAX backend,
``*_quick.*`` with ``--quick``) into ``--out``, else ``$KMP_BENCH_RESULTS``, else
bench/results/. Runs on either Keras backend (``KERAS_BACKEND``); the JSON carries the
issue's targets, judged from this run's figures (``kmp bench`` shows them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common  # noqa: E402
import models as bench_models  # noqa: E402
from targets import part_target  # noqa: E402

MODELS = ("digits_cnn", "mnist1d_cnn", "mlp", "resnet50", "gpt")
PRECISIONS = ("float32", "bfloat16", "float16", "mixed_bfloat16", "int8")
EXPORTS = (("onnx", "float32"), ("onnx", "float16"), ("litert", "float32"), ("litert", "float16"))
# Per model: training epochs (full, quick), batch size and Adam's learning rate.
_TRAIN = {
    "digits_cnn": (30, 1, 64, 1e-2),
    "mnist1d_cnn": (40, 1, 100, 1e-2),
    "mlp": (20, 1, 100, 1e-3),
    "resnet50": (0, 0, 0, 1e-3),
    "gpt": (2, 1, 32, 3e-3),
}
RESNET_SIZE = [64]  # --resnet-size
GPT_MAX_BYTES = 600_000  # the corpus cap: a few minutes of training on 2 cores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--train-policy", default="auto", help="the policy the models train in")
    p.add_argument("--batch", type=int, default=64, help="throughput batch size")
    p.add_argument("--resnet-size", type=int, default=64, help="ResNet50's image side")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per figure")
    p.add_argument("--exports", action="store_true", help="also time kmp.export's formats")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.precisions = [m for m in args.precisions.split(",") if m]
    for name in args.models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}: use some of {', '.join(MODELS)}")
    for name in args.precisions:
        if name not in PRECISIONS:
            p.error(f"unknown precision {name!r}: use some of {', '.join(PRECISIONS)}")
    if args.quick:
        args.batch, args.repeats = min(args.batch, 8), 2
    return args


# ----------------------------------------------------------------------------- data


def task_data(name: str, quick: bool) -> dict[str, np.ndarray] | None:
    """The model's real train and test arrays; None for ResNet50 (random images)."""
    if name == "digits_cnn":
        from kmp.datasets import digits

        images, labels = digits.load_arrays()
        train, test = digits.split_indices(labels)
        x = images.astype("float32") / 255.0
        data = {"x": x[train], "y": labels[train], "x_test": x[test], "y_test": labels[test]}
    elif name in ("mnist1d_cnn", "mlp"):
        from kmp.datasets import mnist1d

        x, y = mnist1d.load_arrays("train")
        x_test, y_test = mnist1d.load_arrays("test")
        data = {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
    elif name == "gpt":
        from kmp.datasets import text

        corpus = text.read_corpus(max_bytes=60_000 if quick else GPT_MAX_BYTES)
        seq_len = bench_models.TOKEN_MODELS["gpt"][0]
        x, y = text.windows(text.split_bytes(corpus.data, "train"), seq_len)
        x_test, y_test = text.windows(text.split_bytes(corpus.data, "test"), seq_len)
        data = {"x": x, "y": y, "x_test": x_test, "y_test": y_test}
    else:
        return None
    if quick:
        data = {k: v[:256] for k, v in data.items()}
    return data


def build(name: str) -> Any:
    """The uncompiled model, built under the global policy, float32 outputs."""
    import keras

    import kmp

    if name == "gpt":  # logits: the perplexity and generation read them
        model = bench_models._train_script().workloads.build_gpt()
        return kmp.float32_outputs(model)
    if name == "resnet50":
        return bench_models.build("resnet50", image_size=RESNET_SIZE[0])
    if name == "digits_cnn":
        return bench_models.build("digits_cnn")
    if name == "mnist1d_cnn":
        workloads = bench_models._train_script().workloads
        return kmp.float32_outputs(workloads.build_mnist1d_cnn((40,), 10, "float32"))
    inputs = keras.Input((40,), name="signals")
    x = inputs
    for i in range(3):
        x = keras.layers.Dense(1024, activation="relu", name=f"dense{i}")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="probs")(x)
    return kmp.float32_outputs(keras.Model(inputs, outputs, name="mlp"))


def train_and_save(name: str, data: dict | None, policy: str, path: str, quick: bool) -> dict:
    """Train ``name`` under ``policy`` (ResNet50: not trained) and save it to ``path``."""
    import keras

    import kmp

    keras.utils.set_random_seed(0)
    with kmp.policy_scope(policy):
        model = build(name)
        epochs, quick_epochs, batch, lr = _TRAIN[name]
        loss = "sparse_categorical_crossentropy"
        if name == "gpt":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(lr)), loss=loss)
        started = time.perf_counter()
        if data is not None:
            model.fit(
                data["x"],
                data["y"],
                batch_size=batch,
                epochs=quick_epochs if quick else epochs,
                verbose=0,
                shuffle=True,
            )
        else:  # built and saved untrained: timed on random images
            model(np.zeros((1, RESNET_SIZE[0], RESNET_SIZE[0], 3), "float32"))
        seconds = time.perf_counter() - started
        kmp.save_model(model, path)
    return {"train_policy": policy, "train_seconds": round(seconds, 1)}


# ----------------------------------------------------------------------------- serving


def serve(path: str, precision: str, data: dict | None, sample: np.ndarray) -> tuple[Any, dict]:
    """Load ``path`` to serve in ``precision``; int8: the float32 load quantized."""
    import kmp

    if precision != "int8":
        return kmp.load_model(path, policy=precision), {}
    model = kmp.load_model(path, policy="float32")
    calibration = sample if data is None else data["x"][:256]
    report = kmp.quantize(model, "int8", calibration)
    return model, {"quantized_layers": len(getattr(report, "quantized", ()) or ())}


def _median_seconds(fn, repeats: int) -> float:
    for _ in range(2):  # compile, warm the caches
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _predict(model: Any, x: np.ndarray) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(model.predict_on_batch(x)), np.float32)


def generate(model: Any, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy generation over the model's fixed window: one forward pass per new token."""
    window = prompt.copy()
    for _ in range(new_tokens):
        logits = _predict(model, window)[:, -1, :]
        window = np.concatenate([window[:, 1:], logits.argmax(-1)[:, None].astype("int32")], 1)
    return window


def speed(name: str, model: Any, x1: np.ndarray, xb: np.ndarray, repeats: int) -> dict:
    """Latency of one example (ms) and throughput at ``len(xb)`` (examples or tokens per s)."""
    if name == "gpt":
        tokens = 8
        latency = _median_seconds(lambda: generate(model, x1, tokens), max(2, repeats // 4))
        batch_time = _median_seconds(lambda: generate(model, xb, tokens), max(2, repeats // 4))
        return {
            "latency_ms": 1000 * latency / tokens,  # per generated token, batch 1
            "throughput": len(xb) * tokens / batch_time,
            "unit": "tokens/s",
        }
    latency = _median_seconds(lambda: _predict(model, x1), repeats)
    batch_time = _median_seconds(lambda: _predict(model, xb), repeats)
    return {"latency_ms": 1000 * latency, "throughput": len(xb) / batch_time, "unit": "examples/s"}


def quality(name: str, outputs: np.ndarray, data: dict | None, reference: np.ndarray) -> dict:
    """Accuracy or perplexity on the held-out split; agreement with the float32 outputs."""
    from kmp._outputs import accuracy, perplexity

    row = {
        "top1_agreement": float(np.mean(outputs.argmax(-1) == reference.argmax(-1))),
        "max_abs_diff": float(np.max(np.abs(outputs - reference))),
    }
    if data is None:
        return row
    labels = data["y_test"][: len(outputs)]  # held_out's rows (the GPT: its windows)
    if name == "gpt":
        row["perplexity"] = perplexity(outputs, labels)
    else:
        row["accuracy"] = accuracy(outputs, labels)
    return row


def held_out(name: str, data: dict | None, sample: np.ndarray) -> np.ndarray:
    if data is None:
        return sample
    return data["x_test"][:512] if name == "gpt" else data["x_test"]


def outputs_of(model: Any, x: np.ndarray, batch: int = 256) -> np.ndarray:
    return np.concatenate([_predict(model, x[i : i + batch]) for i in range(0, len(x), batch)])


def run_model(name: str, args: argparse.Namespace, folder: str) -> dict:
    """Train and save ``name``, then serve it in every precision; its rows."""
    try:
        data = task_data(name, args.quick)
    except ImportError as err:  # e.g. the digits' TFDS builder on a machine without TensorFlow
        print(f"  {name}: skipped, {err}", flush=True)
        return {"model": name, "skipped": str(err), "rows": []}
    rng = np.random.default_rng(1)
    if data is None:
        side = RESNET_SIZE[0]
        sample = rng.random((args.batch, side, side, 3), dtype=np.float32)
    else:
        sample = data["x_test"][: args.batch]
        if len(sample) < args.batch:
            sample = np.resize(sample, (args.batch, *sample.shape[1:]))
    path = os.path.join(folder, f"{name}.keras")
    info = train_and_save(name, data, args.train_policy, path, args.quick)
    x_eval = held_out(name, data, sample)
    rows, reference = [], None
    for precision in ["float32", *[p for p in args.precisions if p != "float32"]]:
        row: dict[str, Any] = {"model": name, "precision": precision}
        try:
            model, extra = serve(path, precision, data, sample)
            outputs = outputs_of(model, x_eval)
            reference = outputs if reference is None else reference
            row.update(extra)
            row.update(quality(name, outputs, data, reference))
            row.update(speed(name, model, sample[:1], sample, args.repeats))
        except Exception as err:  # a precision this Keras/backend cannot serve: reported
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print(_common_row(row), flush=True)
    if args.exports:
        rows += export_rows(name, path, data, sample, x_eval, reference, folder, args)
    return {"model": name, **info, "rows": rows}


def _common_row(row: dict) -> str:
    if "error" in row:
        return f"  {row['model']:12s} {row['precision']:16s} {row['error']}"
    quality_text = (
        f"acc {row['accuracy']:.3f}"
        if "accuracy" in row
        else f"ppl {row['perplexity']:.2f}"
        if "perplexity" in row
        else f"agree {row['top1_agreement']:.3f}"
    )
    return (
        f"  {row['model']:12s} {row['precision']:16s} {row['latency_ms']:8.2f} ms  "
        f"{row['throughput']:10.0f} {row['unit']:10s} {quality_text}"
    )


def export_rows(name, path, data, sample, x_eval, reference, folder, args) -> list[dict]:
    """Each export format, written (and verified) by ``kmp.export``, timed in its runtime."""
    import keras

    import kmp

    if keras.backend.backend() != "tensorflow" or name == "gpt":
        return []
    rows = []
    model = kmp.load_model(path, policy="float32")
    for fmt, precision in EXPORTS:
        row: dict[str, Any] = {"model": name, "precision": f"{fmt}-{precision}"}
        try:
            target = os.path.join(folder, f"{name}-{precision}{_SUFFIX[fmt]}")
            result = kmp.export(
                model, target, format=fmt, precision=precision, sample=sample, verbose=False
            )
            runner = _runner(fmt, target)
            row["size_bytes"] = result.size_bytes
            row.update(
                quality(name, outputs_of(runner, x_eval, batch=len(sample)), data, reference)
            )
            row.update(speed_of_runner(runner, sample, args.repeats))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print(_common_row(row), flush=True)
    return rows


_SUFFIX = {"onnx": ".onnx", "litert": ".tflite"}


def _runner(fmt: str, path: str) -> Any:
    """The route's runner, opened once as a server keeps it (LiteRT on every core)."""
    if fmt == "onnx":
        from kmp.exporting.onnx_route import OnnxRunner

        return OnnxRunner(path)
    from kmp.exporting.litert_route import LiteRTRunner

    return LiteRTRunner(path, num_threads=os.cpu_count())


def speed_of_runner(runner, sample: np.ndarray, repeats: int) -> dict:
    latency = _median_seconds(lambda: runner.predict_on_batch(sample[:1]), repeats)
    batch_time = _median_seconds(lambda: runner.predict_on_batch(sample), repeats)
    return {
        "latency_ms": 1000 * latency,
        "throughput": len(sample) / batch_time,
        "unit": "examples/s",
    }


# ----------------------------------------------------------------------------- report


def ratios(models: list[dict]) -> dict[str, dict[str, float]]:
    """Throughput of every precision over float32's, per model."""
    out = {}
    for entry in models:
        base = next(
            (r for r in entry["rows"] if r["precision"] == "float32" and "throughput" in r), None
        )
        if base is None:
            continue
        out[entry["model"]] = {
            r["precision"]: r["throughput"] / base["throughput"]
            for r in entry["rows"]
            if "throughput" in r
        }
    return out


def _row(result: dict, model: str, precision: str) -> dict | None:
    for entry in result["models"]:
        for row in entry["rows"] if entry["model"] == model else ():
            if row["precision"] == precision:
                return row
    return None


def _speed_target(result: dict, model: str, precision: str, goal: float, why_slow: str) -> dict:
    name = f"inference, {precision} vs float32 throughput, {model}"
    ratio = result["ratios"].get(model, {}).get(precision)
    if ratio is None:
        row = _row(result, model, precision)
        measured = (row or {}).get("error", "not measured in this run")
        return part_target(name, f">= {goal:.2f}x", None, None, measured)
    met = ratio >= goal
    return part_target(
        name, f">= {goal:.2f}x", round(ratio, 3), met, f"{ratio:.2f}x", "" if met else why_slow
    )


def _quality_target(result: dict, model: str, precision: str) -> dict:
    base, row = _row(result, model, "float32"), _row(result, model, precision)
    if model == "gpt":
        name, goal = f"inference, {precision} perplexity vs float32, gpt", "within 2 %"
        if not base or not row or "perplexity" not in row:
            return part_target(name, goal, None, None, "not measured in this run")
        change = row["perplexity"] / base["perplexity"] - 1
        return part_target(
            name,
            goal,
            round(change, 4),
            abs(change) <= 0.02,
            f"{100 * change:+.2f} % ({base['perplexity']:.3f} -> {row['perplexity']:.3f})",
        )
    if precision == "int8":
        name, goal = f"inference, int8 accuracy vs float32, {model}", "within 1 point"
        if not base or not row or "accuracy" not in row:
            return part_target(name, goal, None, None, "not measured in this run")
        points = 100 * (row["accuracy"] - base["accuracy"])
        return part_target(
            name, goal, round(points, 2), abs(points) <= 1.0, f"{points:+.2f} points"
        )
    name, goal = f"inference, {precision} top-1 agreement with float32, {model}", ">= 99 %"
    if not row or "top1_agreement" not in row:
        return part_target(name, goal, None, None, "not measured in this run")
    agree = row["top1_agreement"]
    return part_target(name, goal, agree, agree >= 0.99, f"{100 * agree:.1f} %")


def _size_target(result: dict, model: str, fmt: str) -> dict:
    name, goal = f"inference, {fmt} float16 file size vs float32, {model}", "<= 0.52x"
    f32, f16 = _row(result, model, f"{fmt}-float32"), _row(result, model, f"{fmt}-float16")
    if not f32 or not f16 or "size_bytes" not in f32 or "size_bytes" not in f16:
        return part_target(name, goal, None, None, "not measured in this run")
    ratio = f16["size_bytes"] / f32["size_bytes"]
    return part_target(name, goal, round(ratio, 3), ratio <= 0.52, f"{ratio:.3f}x")


def targets(result: dict) -> list[dict]:
    """Issue 43's inference targets, judged from this run's figures."""
    bf16_cpu = bool(result["machine"].get("avx512_bf16") or result["machine"].get("amx"))
    slow = "see docs/serving.md (speed beside accuracy) for where the time goes"
    if not bf16_cpu and not result["machine"].get("gpus"):
        slow = "measured on a CPU without AVX512_BF16/AMX, where bfloat16 is emulated"
    gpt_slow = slow
    if bf16_cpu and not result["machine"].get("gpus"):
        gpt_slow = (
            "the small GPT's forward pass is bound by its non-matmul ops (norms, softmax, "
            "GELU, mask, casts), which run no faster in bfloat16 on this CPU; wider models "
            "gain (docs/serving.md, speed beside accuracy)"
        )
    out = [
        _speed_target(result, "resnet50", "bfloat16", 1.5, slow),
        _speed_target(result, "gpt", "bfloat16", 1.5, gpt_slow),
    ]
    out += [_quality_target(result, m, "bfloat16") for m in ("digits_cnn", "mnist1d_cnn")]
    int8_slow = "see docs/quantization.md for where the time goes"
    if result["backend"] == "tensorflow" and not result["machine"].get("gpus"):
        int8_slow = (
            "TensorFlow's int8 matmul falls back to Eigen on this CPU (oneDNN's int8 path "
            "is not taken); on the JAX backend the same int8 layers are faster than float32 "
            "(docs/quantization.md)"
        )
    out += [_speed_target(result, m, "int8", 1.3, int8_slow) for m in ("gpt", "mlp")]
    out += [_quality_target(result, m, "int8") for m in ("digits_cnn", "mnist1d_cnn", "gpt")]
    out += [_size_target(result, "mlp", fmt) for fmt in ("onnx", "litert")]
    return out


def _machine_text(machine: dict) -> str:
    where = ", ".join(machine.get("gpus") or []) or f"{machine['cpu']} ({machine['cores']} cores)"
    if "cpu_flags" in machine:
        flags = "CPU flags " + (" ".join(machine["cpu_flags"]) or "unknown")
    else:
        flags = "AVX512_BF16" if machine.get("avx512_bf16") else "no AVX512_BF16"
        flags += ", AMX" if machine.get("amx") else ""
    return f"{where}, {flags}, {machine['date']}"


def markdown(result: dict) -> str:
    lines = [
        "# Inference per precision (`bench/inference.py`)",
        "",
        f"Backend {result['backend']}; {_machine_text(result['machine'])}. Trained under "
        f"{result['train_policy']}; served from the saved file in each precision, side by side "
        "in one process. Throughput: examples/s at batch "
        f"{result['batch']} (the GPT: tokens/s of greedy generation).",
        "",
        "| model | precision | latency, batch 1 (ms) | throughput | x float32 "
        "| accuracy / perplexity | top-1 agreement | max abs diff | size |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    table = ratios(result["models"])
    for entry in result["models"]:
        for r in entry["rows"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['precision']} | {r['error']} | | | | | | |")
                continue
            metric = (
                f"{r['accuracy']:.3f}"
                if "accuracy" in r
                else f"ppl {r['perplexity']:.3f}"
                if "perplexity" in r
                else "-"
            )
            size = f"{r['size_bytes'] / 1e6:.2f} MB" if "size_bytes" in r else ""
            ratio = table.get(r["model"], {}).get(r["precision"])
            lines.append(
                f"| {r['model']} | {r['precision']} | {r['latency_ms']:.2f} | "
                f"{r['throughput']:,.0f} {r['unit']} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | "
                f"{metric} | {r['top1_agreement']:.3f} | {r['max_abs_diff']:.1e} | {size} |"
            )
    lines += ["", "| target | goal | measured | result | why |", "| --- | --- | --- | --- | --- |"]
    for t in result.get("targets", []):
        verdict = "not run" if t["met"] is None else "met" if t["met"] else "missed"
        lines.append(f"| {t['name']} | {t['goal']} | {t['measured']} | {verdict} | {t['why']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # keras.applications' inputs are named; a plain array is what a server passes.
    warnings.filterwarnings("ignore", message="The structure of `inputs` doesn't match")
    RESNET_SIZE[0] = args.resnet_size
    import keras

    from kmp import hardware, policy

    if args.train_policy == "auto":
        args.train_policy = policy.choose_policy(hardware.detect())[0]
    machine = _common.machine()
    print(f"inference: {keras.backend.backend()}, {_machine_text(machine)}")
    print(f"trained under {args.train_policy}")
    results = []
    with tempfile.TemporaryDirectory(prefix="kmp-inference-") as folder:
        for name in args.models:
            results.append(run_model(name, args, folder))
    result = {
        "backend": keras.backend.backend(),
        "machine": machine,
        "train_policy": args.train_policy,
        "batch": args.batch,
        "quick": args.quick,
        "models": results,
        "ratios": ratios(results),
    }
    result["targets"] = targets(result)
    # One file per backend: the suite's part (and its targets) is the default backend's.
    stem = "inference" + ("" if result["backend"] == "tensorflow" else f"_{result['backend']}")
    stem += "_quick" if args.quick else ""
    if args.out is not None:
        os.environ["KMP_BENCH_RESULTS"] = str(args.out)
    path = _common.write_results(stem, result, markdown(result))
    print(f"wrote {path} and its .md")
    failed = [r for e in results for r in e["rows"] if "error" in r]
    return 1 if failed and args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
