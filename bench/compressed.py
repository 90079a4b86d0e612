"""Compressed allreduce paths timed side by side: Horovod's 16-bit sum against kmp's scatter.

    .venv/bin/python bench/compressed.py [--np 2] [--rounds 15] [--rate 1gbit] [--hosts 2]

One job of N ranks (``horovodrun --gloo``; with ``--rate``, on ``kmp cluster`` hosts
joined by ``tc tbf`` links of that rate) reduces wide_mlp's gradients (40.1 MB of float32,
the tensors in the model's shapes) inside one ``tf.function`` per path, interleaved over
the rounds: float32 (no compression), ``fp16`` and ``bf16`` through Horovod
(``_horovod.COMPRESSED_PATH = "horovod"``: Horovod's float16 allreduce, kmp's bf16
allgather-sum) and through ``kmp/distributed/_scatter_reduce.py`` (``"scatter"``:
alltoall, one float32 sum in TensorFlow, allgather). Per path: the median time, its ratio
to float32's, its share of the 16-bit wire limit (bench/limits.py) on a shaped link, and
whether every rank got the same values. Writes ``compressed[_RATE_Nh].{json,md}``.
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

PATHS = {  # name -> (compression, path)
    "float32": (None, "horovod"),
    "fp16 horovod": ("fp16", "horovod"),
    "fp16 scatter": ("fp16", "scatter"),
    "bf16 horovod": ("bf16", "horovod"),
    "bf16 scatter": ("bf16", "scatter"),
}


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf

    import kmp
    from kmp.distributed import _horovod

    world = kmp.distributed.init()
    hvd = kmp.distributed.engine().hvd
    import models

    shapes = [tuple(w.shape) for w in models.build("wide_mlp").trainable_weights]
    rng = np.random.default_rng(world.rank)
    grads = [tf.constant(rng.normal(size=s).astype("float32") * 1e-3) for s in shapes]
    fns = {
        name: tf.function(
            lambda g, c=c, p=p: _horovod.grouped_allreduce(hvd, list(g), "average", c, p)
        )
        for name, (c, p) in PATHS.items()
    }
    results = {name: fn(grads) for name, fn in fns.items()}  # trace and warm up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(args.rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            start = time.perf_counter()
            out = fns[name](grads)
            _ = [o.numpy() for o in out[-1:]]  # wait for the values
            times[name].append(time.perf_counter() - start)
    exact = np.concatenate([np.ravel(o.numpy()) for o in results["float32"]])
    report = {}
    for name, out in results.items():
        flat = np.concatenate([np.ravel(o.numpy()).astype("float64") for o in out])
        gathered = np.asarray(kmp.distributed.allgather(flat[None]))
        report[name] = {
            "median_s": statistics.median(times[name]),
            "times_s": times[name],
            "ranks_identical": bool((gathered == gathered[0]).all()),
            "max_error_vs_float32": float(np.max(np.abs(flat - exact))),
        }
    if world.rank == 0:
        nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
        result = {"ranks": world.size, "paths": report, "float32_bytes": nbytes}
        Path(args.out).write_text(json.dumps(result))


def run(args: argparse.Namespace) -> dict:
    """Start the worker job (on kmp cluster hosts when --rate is given); return its result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KMP_POLICY"))}
    env.update(PYTHONPATH=f"{ROOT}:{HERE}", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    out = Path(tempfile.mkdtemp(prefix="kmp-compressed-")) / "result.json"
    from _common import horovod_launcher

    hvdrun = horovod_launcher()
    worker_argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
                   "--rounds", str(args.rounds)]  # fmt: skip
    kmp = [sys.executable, "-m", "kmp.cli", "cluster"]
    if args.rate:
        subprocess.run([*kmp, "down", "--name", "kmpbench"], cwd=ROOT, env=env, capture_output=True)
        up = [*kmp, "up", "--name", "kmpbench", "--hosts", str(args.np), "--rate", args.rate]
        subprocess.run(up, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
        hosts = ",".join(f"h{i}:1" for i in range(1, args.np + 1))
        cmd = [*kmp, "exec", "--name", "kmpbench", "h1", "--", *hvdrun, "--gloo", "-np",
               str(args.np), "-H", hosts, "--network-interface", "eth0", *worker_argv]  # fmt: skip
    else:
        cmd = [*hvdrun, "--gloo", "-np", str(args.np), "-H", f"localhost:{args.np}", *worker_argv]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit((proc.stdout + proc.stderr)[-4000:])
        return json.loads(out.read_text())
    finally:
        if args.rate:
            subprocess.run([*kmp, "down", "--name", "kmpbench"], cwd=ROOT, env=env,
                           capture_output=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rate", help="a tc rate (1gbit): on kmp cluster hosts (root)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import limits
    from _common import machine, markdown_table, write_results

    result = run(args)
    base = result["paths"]["float32"]["median_s"]
    rows = []
    for name, f in result["paths"].items():
        f["vs_float32_speed"] = base / f["median_s"]
        if args.rate:
            payload = limits.job_traffic(name, result["float32_bytes"])[0]
            wire = limits.bytes_sent_per_rank(payload, args.np, "ring_allreduce")
            f["wire_limit_s"] = wire * 8 / limits.rate_bits(args.rate)
            f["vs_wire_limit"] = f["wire_limit_s"] / f["median_s"]
        rows.append([name, f"{1000 * f['median_s']:.0f}", f"{f['vs_float32_speed']:.2f}",
                     f"{f.get('vs_wire_limit', float('nan')):.2f}" if args.rate else "-",
                     f["ranks_identical"], f"{f['max_error_vs_float32']:.2g}"])  # fmt: skip
    where = f"{args.np} hosts at {args.rate}" if args.rate else f"{args.np} ranks on localhost"
    md = f"# Compressed allreduce paths, {where}\n\n" + markdown_table(
        ["path", "median ms", "speed vs float32", "vs 16-bit wire limit", "ranks identical",
         "max error vs float32"], rows)  # fmt: skip
    md += (
        f"\n\nwide_mlp's gradients ({result['float32_bytes'] / 1e6:.1f} MB float32), the "
        f"average over {args.np} ranks in one tf.function per path, {args.rounds} interleaved "
        "rounds, median. The wire limit: a ring allreduce's 2(N-1)/N of the 16-bit payload "
        "over the link rate (the scatter path sends exactly that)."
    )
    result.update(machine=machine(), rate=args.rate, rounds=args.rounds)
    name = "compressed" + (f"_{args.rate}_{args.np}h" if args.rate else "")
    write_results(name, result, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
