"""Allreduce cost per step and 2-process weak-scaling efficiency of kmp.wrap_optimizer.

    .venv/bin/python bench/allreduce.py [--models digits_cnn [cnn]]
        [--policies float32 mixed_bfloat16] [--batch 64] [--steps 20] [--repeats 3]
        [--rounds 2] [--cycle-times 5] [--fusion-mb 64] [--skip-default] [--idle-seconds 4]

It starts itself several times:

* ``--role single``: one process, one TensorFlow thread, no launcher: training
  throughput of each model and policy with ``kmp.wrap_optimizer(SGD)``.
* ``--role worker`` under ``horovodrun --gloo -np 2 -H localhost:2``: the same
  training on each of the two ranks (one thread each, the per-rank batch as
  above, gradients averaged every step), plus the time of one allreduce of each
  model's gradients, grouped (one fused Horovod op, as kmp does) against one
  tensor at a time, without and with fp16 / bf16 compression.

Weak-scaling efficiency = (images/s of the two ranks together) / (2 x images/s of
the single process). Because a busy machine slows two processes more than one,
the same two-rank figure is also divided by two independent single processes
started at the same time ("vs independent": the cost of communication alone),
and each rank's CPU use while it waits idle (``--idle-seconds``) is recorded:
Horovod's background thread wakes every ``HOROVOD_CYCLE_TIME`` even when there
is nothing to reduce, and on a machine whose cores all train that CPU is
taken from training.
The two-process job runs with Horovod's defaults (unless ``--skip-default``)
and once per ``--cycle-times`` value (with the fusion threshold and response
cache set). Single and two-process jobs alternate over ``--rounds`` and each
figure keeps its best round, so a noisy neighbour does not decide the result. Writes
``bench/results/allreduce.json`` and ``allreduce.md``.
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

TARGET = 0.90
COMPRESSIONS = (None, "fp16", "bf16")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="launch", choices=("launch", "single", "worker"))
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument(
        "--models", nargs="+", default=["digits_cnn"], help="digits_cnn, cnn, mlp, resnet50"
    )
    p.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    p.add_argument("--batch", type=int, default=64, help="images per process and step")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per job (best kept)")
    p.add_argument("--rounds", type=int, default=2, help="single/2-process alternations")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per process")
    p.add_argument(
        "--cycle-times",
        type=float,
        nargs="+",
        default=[5.0],
        help="HOROVOD_CYCLE_TIME values (ms) to try besides Horovod's default (1 ms); a "
        "longer cycle wakes Horovod's background thread less often",
    )
    p.add_argument("--fusion-mb", type=int, default=64, help="tuned HOROVOD_FUSION_THRESHOLD")
    p.add_argument("--allreduce-iters", type=int, default=30)
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=4.0,
        help="seconds each rank waits idle while its CPU use is measured (0: skip)",
    )
    p.add_argument("--skip-default", action="store_true", help="skip the untuned 2-process job")
    return p.parse_args(argv)


# ------------------------------------------------------------------ in a process


def _setup_tf(threads: int):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def train_throughput(model_name: str, policy: str, args: argparse.Namespace) -> dict:
    """Images/s of this process training ``model_name`` with kmp.wrap_optimizer."""
    import keras
    import models
    import tensorflow as tf

    import kmp
    import kmp.distributed as dist

    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = models.build(model_name)
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    dist.broadcast_variables(model.variables)
    x, y = models.batch(model_name, args.batch, seed=dist.rank())
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)  # trace and warm up
    rates = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        rates.append(args.steps * args.batch / (time.perf_counter() - t0))
    keras.backend.clear_session()
    return {
        "images_per_s": max(rates),
        "all": [round(r, 1) for r in rates],
        "bytes_per_step": opt.allreduce_bytes_per_step,
    }


def allreduce_times(model_name: str, args: argparse.Namespace) -> dict:
    """Milliseconds per allreduce of the model's gradients: grouped vs one at a time."""
    import keras
    import models
    import tensorflow as tf

    import kmp.distributed as dist
    from kmp.distributed.buckets import payload_bytes

    keras.config.set_dtype_policy("float32")
    model = models.build(model_name)
    grads = [tf.random.normal(v.shape, seed=i) for i, v in enumerate(model.trainable_variables)]
    out = {"tensors": len(grads), "float32_bytes": payload_bytes(grads)}
    for comp in COMPRESSIONS:

        @tf.function
        def grouped(comp=comp):
            return dist.grouped_allreduce(grads, compression=comp)

        @tf.function
        def one_at_a_time(comp=comp):
            results, prev = [], []
            for g in grads:
                with tf.control_dependencies(prev):
                    r = dist.allreduce(tf.identity(g), compression=comp)
                results.append(r)
                prev = [r]
            return results

        for name, fn in (("grouped", grouped), ("one_at_a_time", one_at_a_time)):
            for _ in range(3):
                fn()
            times = []
            for _ in range(args.allreduce_iters):
                t0 = time.perf_counter()
                res = fn()
                _ = res[-1].numpy()
                times.append((time.perf_counter() - t0) * 1e3)
            out[f"{name}/{comp}"] = round(statistics.median(times), 3)
        out[f"bytes/{comp}"] = payload_bytes(grads, comp)
    keras.backend.clear_session()
    return out


def idle_cpu_fraction(seconds: float) -> float:
    """CPU seconds this process burns per wall second while it waits (all its threads).

    Under Horovod this is the cost of its background thread, which wakes every
    ``HOROVOD_CYCLE_TIME`` and coordinates with the other ranks even when no
    tensor is waiting; on a machine whose cores all train, it is taken from them.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def run_role(args: argparse.Namespace) -> None:
    _setup_tf(args.threads)
    import kmp.distributed as dist

    world = dist.init()
    result = {"size": world.size, "rank": world.rank, "train": {}, "allreduce": {}}
    if world.size > 1 and args.idle_seconds > 0:
        dist.barrier()
        result["idle_cpu_fraction"] = idle_cpu_fraction(args.idle_seconds)
    for model_name in args.models:
        for policy in args.policies:
            result["train"][f"{model_name}/{policy}"] = train_throughput(model_name, policy, args)
        if world.size > 1:
            result["allreduce"][model_name] = allreduce_times(model_name, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{world.rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------ launcher


def _child_args(args: argparse.Namespace, role: str, out: Path) -> list[str]:
    return [
        str(HERE / "allreduce.py"), "--role", role, "--out", str(out),
        "--models", *args.models, "--policies", *args.policies,
        "--batch", str(args.batch), "--steps", str(args.steps),
        "--repeats", str(args.repeats), "--threads", str(args.threads),
        "--allreduce-iters", str(args.allreduce_iters),
        "--idle-seconds", str(args.idle_seconds),
    ]  # fmt: skip


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"benchmark job failed: {' '.join(cmd[:6])} ...")


def _run_pair(cmds: list[list[str]], env: dict[str, str]) -> None:
    """Run independent processes at the same time (the contention-matched baseline)."""
    procs = [
        subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in cmds
    ]
    for proc, cmd in zip(procs, cmds, strict=True):
        out, err = proc.communicate()
        if proc.returncode != 0:
            sys.stderr.write(out.decode()[-3000:] + err.decode()[-5000:])
            raise SystemExit(f"benchmark job failed: {' '.join(cmd[:6])} ...")


def _read(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def combine_idle(dual: dict[str, list[list[dict]]]) -> dict[str, float]:
    """Idle CPU fraction per Horovod setting: mean of the ranks, median of the rounds.

    ``dual`` maps a setting to its rounds, each a list of the ranks' results;
    settings where some rank did not measure it are left out.
    """
    out = {}
    for name, rounds in dual.items():
        if rounds and all("idle_cpu_fraction" in rk for ranks in rounds for rk in ranks):
            per_round = [
                statistics.mean(rk["idle_cpu_fraction"] for rk in ranks) for ranks in rounds
            ]
            out[name] = round(statistics.median(per_round), 3)
    return out


def launch(args: argparse.Namespace) -> int:
    from _common import horovod_launcher, machine, markdown_table, write_results

    py = sys.executable
    threads = str(args.threads)
    base = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")},
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMP_NUM_THREADS": threads,
        "TF_NUM_INTRAOP_THREADS": threads,
        "TF_NUM_INTEROP_THREADS": threads,
    }
    settings: dict[str, dict[str, str]] = {} if args.skip_default else {"default": {}}
    for ct in args.cycle_times:
        settings[f"cycle_{ct:g}ms"] = {
            "HOROVOD_CYCLE_TIME": f"{ct:g}",
            "HOROVOD_FUSION_THRESHOLD": str(args.fusion_mb * 1024 * 1024),
            "HOROVOD_CACHE_CAPACITY": "1024",
        }
    tmp = Path(tempfile.mkdtemp(prefix="kmp-bench-"))
    single: list[dict] = []
    pair: list[list[dict]] = []
    dual: dict[str, list[list[dict]]] = {k: [] for k in settings}
    t_start = time.time()
    for r in range(args.rounds):
        out = tmp / f"single{r}"
        _run([py, *_child_args(args, "single", out)], base)
        single.append(_read(out, 1)[0])
        outs = [tmp / f"pair{r}_{i}" for i in range(2)]
        _run_pair([[py, *_child_args(args, "single", o)] for o in outs], base)
        pair.append([_read(o, 1)[0] for o in outs])
        for name, extra in settings.items():
            out = tmp / f"{name}{r}"
            cmd = [*horovod_launcher(py), "--gloo", "-np", "2", "-H", "localhost:2", py,
                   *_child_args(args, "worker", out)]  # fmt: skip
            _run(cmd, {**base, **extra})
            dual[name].append(_read(out, 2))
        print(f"round {r + 1}/{args.rounds} done ({time.time() - t_start:.0f} s)", flush=True)

    rows, scaling = [], {}
    for key in single[0]["train"]:
        one = max(s["train"][key]["images_per_s"] for s in single)
        two = max(sum(p["train"][key]["images_per_s"] for p in ps) for ps in pair)
        entry = {
            "single_images_per_s": round(one, 1),
            "independent_pair_images_per_s": round(two, 1),
        }
        for name in settings:
            # Per round: the two ranks together; best round kept.
            both = max(
                sum(rk["train"][key]["images_per_s"] for rk in ranks) for ranks in dual[name]
            )
            entry[f"{name}_2proc_images_per_s"] = round(both, 1)
            entry[f"{name}_efficiency"] = round(both / (2 * one), 3)
            entry[f"{name}_efficiency_vs_pair"] = round(both / two, 3)
        scaling[key] = entry
        rows.append([key, entry["single_images_per_s"], entry["independent_pair_images_per_s"]]
                    + [entry[f"{n}_2proc_images_per_s"] for n in settings]
                    + [entry[f"{n}_efficiency"] for n in settings]
                    + [entry[f"{n}_efficiency_vs_pair"] for n in settings])  # fmt: skip

    allreduce: dict[str, dict] = {}
    ar_rows = []
    for name in settings:
        allreduce[name] = {}
        for model_name in args.models:
            per_round = [ranks[0]["allreduce"][model_name] for ranks in dual[name]]
            merged = dict(per_round[0])
            for k in list(merged):
                if "/" in k and not k.startswith("bytes"):
                    merged[k] = min(p[k] for p in per_round)
            allreduce[name][model_name] = merged
            ar_rows += [
                [name, model_name, str(c), merged[f"bytes/{c}"], merged[f"grouped/{c}"],
                 merged[f"one_at_a_time/{c}"]]
                for c in COMPRESSIONS
            ]  # fmt: skip
    idle = combine_idle(dual)
    best = {key: max((e[f"{n}_efficiency"], n) for n in settings) for key, e in scaling.items()}
    result = {
        "weak_scaling": scaling,
        "best_efficiency": {k: {"efficiency": v[0], "setting": v[1]} for k, v in best.items()},
        "allreduce_ms": allreduce,
        "horovod_idle_cpu_fraction": idle,
        "target_efficiency": TARGET,
        "meets_target": all(v[0] >= TARGET for v in best.values()),
        "settings": {"horovod_env": settings, "threads_per_process": args.threads,
                     "batch_per_process": args.batch, "steps": args.steps,
                     "repeats": args.repeats, "rounds": args.rounds},
        "load_average": list(os.getloadavg()),
        "machine": machine(),
    }  # fmt: skip
    md = "\n\n".join(
        [
            "# Allreduce and 2-process weak scaling (kmp.wrap_optimizer, Horovod Gloo)",
            f"One TensorFlow thread per process, batch {args.batch} per process; efficiency = "
            "2-process images/s / (2 x 1-process images/s); 'vs independent' divides by two "
            "unsynchronised single processes run at the same time instead (same core "
            "contention, no communication). Settings: "
            + "; ".join(
                f"{n}: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "Horovod defaults")
                for n, env in settings.items()
            ),
            markdown_table(
                ["model/policy", "1 proc img/s", "2 independent procs img/s"]
                + [f"2 ranks img/s ({n})" for n in settings]
                + [f"efficiency ({n})" for n in settings]
                + [f"vs independent ({n})" for n in settings],
                rows,
            ),
            "CPU used by each rank while idle (Horovod's background thread; fraction of one "
            "core, mean of the ranks, median of the rounds): "
            + (", ".join(f"{n} {v:.3f}" for n, v in idle.items()) or "not measured"),
            "Allreduce of one step's gradients (2 ranks, median ms):",
            markdown_table(
                [
                    "setting",
                    "model",
                    "compression",
                    "bytes sent",
                    "grouped ms",
                    "one tensor at a time ms",
                ],
                ar_rows,
            ),
        ]
    )
    path = write_results("allreduce", result, md)
    print(md)
    print(f"\nwritten to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "launch":
        return launch(args)
    run_role(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
