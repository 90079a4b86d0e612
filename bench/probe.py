"""What ``kmp.probe`` costs: one probe against one training step, on both Keras backends.

    .venv/bin/python bench/probe.py [--repeats 5] [--batch 16] [--quick]

The model is the byte-level GPT of ``launch/train.py --model gpt`` (about 0.47 M
parameters, sequences of 128 bytes) under mixed_bfloat16, compiled with kmp's optimizer.
For each backend (TensorFlow, then JAX, each in a child process: Keras fixes its backend
per process) it times, on the same batch, the median of ``--repeats``:

* one training step, ``model.train_on_batch`` (compiled, after warm-up steps), and
* one ``kmp.probe`` (eager: one float32 forward and backward pass plus the statistics),

and reports the ratio. Results go to ``bench/results/probe.{json,md}`` (``$KMP_BENCH_RESULTS``
elsewhere), with the CPU they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
BACKENDS = ("tensorflow", "jax")


def measure(repeats: int, batch: int, seq_len: int) -> dict:
    """Time one probe and one training step in this process's backend."""
    import importlib.util

    import keras
    import numpy as np

    import kmp
    from kmp.datasets import text

    spec = importlib.util.spec_from_file_location(
        "workloads", HERE.parent / "launch" / "workloads.py"
    )
    workloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workloads)
    kmp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    data = text.split_bytes(text.read_corpus().data, "train")
    x, y = text.windows(data, seq_len)
    x, y = x[:batch], y[:batch]
    model = kmp.float32_outputs(workloads.build_gpt(seq_len=seq_len))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-3)), loss=loss)
    for _ in range(3):  # trace and warm up
        model.train_on_batch(x, y)
    steps, probes = [], []
    report = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        report = kmp.probe(model, x, y, loss=loss)
        probes.append(time.perf_counter() - t0)
    step, probe = statistics.median(steps), statistics.median(probes)
    return {
        "backend": keras.backend.backend(),
        "parameters": int(model.count_params()),
        "batch": batch,
        "seq_len": seq_len,
        "layers_probed": len(report.layers),
        "train_step_s": step,
        "probe_s": probe,
        "probe_vs_step": probe / step,
        "recommended_loss_scale": report.recommended_loss_scale,
        "keep_float32": report.keep_float32,
        "finite_values": bool(np.isfinite(report.loss)),
    }


def markdown(result: dict) -> str:
    from _common import markdown_table

    m = result["machine"]
    rows = [
        [
            r["backend"],
            f"{r['train_step_s'] * 1e3:.1f} ms",
            f"{r['probe_s'] * 1e3:.1f} ms",
            f"{r['probe_vs_step']:.2f}x",
            r["layers_probed"],
            f"{r['recommended_loss_scale']:g}",
        ]
        for r in result["runs"]
    ]
    return "\n".join(
        [
            "# kmp.probe against one training step",
            "",
            f"The byte-level GPT ({result['runs'][0]['parameters']:,} parameters), batch "
            f"{result['runs'][0]['batch']} x {result['runs'][0]['seq_len']} bytes, "
            f"mixed_bfloat16, median of {result['repeats']}, on {m.get('cpu')} "
            f"({m.get('cores')} cores), {m.get('date')}. The step is compiled; the probe is "
            "eager (a float32 forward and backward pass that records every layer, plus "
            "NumPy statistics).",
            "",
            markdown_table(
                ["backend", "training step", "probe", "probe / step", "layers", "scale"], rows
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="2 repeats, batch 4 x 32: a smoke run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.batch, args.seq_len = 2, 4, 32
    if args.child:
        print("RESULT " + json.dumps(measure(args.repeats, args.batch, args.seq_len)))
        return 0
    from _common import machine, write_results

    runs = []
    for backend in BACKENDS:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.pop("KMP_POLICY", None)
        cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
        cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"bench/probe.py on {backend} failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(lines[-1][len("RESULT ") :]))
    result = {"quick": args.quick, "repeats": args.repeats, "machine": machine(), "runs": runs}
    name = "probe_quick" if args.quick else "probe"
    write_results(name, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
