"""The two engines side by side: the digits job under 3 policies x {horovod, jax}.

    .venv/bin/python bench/engines.py [--np 2] [--epochs 6] [--policies float32,...]

Each run is ``kmp launch --engine E -np 2 launch/train.py --model digits_cnn`` (the
demo's job), one after the other in this process's order, so the figures are
side by side on one machine. Under mixed_float16 step 3 of the last process is
made to overflow (``--inject-overflow 3``): every process must skip it. Each run
reports the weights' max difference across processes (allgathered), the
skipped steps, the test accuracy and images/s. Results go to
``bench/results/engines.{json,md}``, with the CPU they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
ENGINES = ("horovod", "jax")


def run_one(engine: str, policy: str, args: argparse.Namespace, out: Path) -> dict:
    """Launch the digits job once; return its summary plus the wall time."""
    from _common import run_train_job

    args_ = ["--model", "digits_cnn", "--policy", policy, "--epochs", str(args.epochs)]
    args_ += ["--batch-size", "32", "--verbose", "0"]
    if policy == "mixed_float16":
        args_ += ["--inject-overflow", "3"]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.np)))
    s, wall = run_train_job(
        args_,
        args.np,
        out / f"{engine}-{policy}.json",
        f"bench/engines.py: {engine} {policy}",
        launch_args=("--engine", engine),
        env_extra={"OMP_NUM_THREADS": threads},
        timeout=1800,
    )
    return {
        "engine": engine,
        "policy": policy,
        "weights_max_diff": s["weights_max_diff"],
        "skipped_steps": s["skipped_steps"],
        "skipped_at": s["skipped_at"],
        "loss_scale_end": s["loss_scale_end"],
        "test_accuracy": s["test_accuracy"],
        "images_per_sec": s["images_per_sec"],
        "wall_s": round(wall, 1),
    }


def table(rows: list[dict]) -> str:
    """The markdown table: one row per policy, both engines side by side."""
    by = {(r["policy"], r["engine"]): r for r in rows}
    lines = [
        "| policy | engine | weights max diff | skipped steps | test accuracy | images/s "
        "| jax / horovod images/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy in [p for p in POLICIES if any(k[0] == p for k in by)]:
        hvd, jx = by.get((policy, "horovod")), by.get((policy, "jax"))
        ratio = (
            f"{jx['images_per_sec'] / hvd['images_per_sec']:.2f}x"
            if hvd and jx and hvd["images_per_sec"]
            else "-"
        )
        for engine, r in (("horovod", hvd), ("jax", jx)):
            if r is None:
                continue
            lines.append(
                f"| {policy} | {engine} | {r['weights_max_diff']:g} | {r['skipped_steps']} "
                f"| {r['test_accuracy']:.4f} | {r['images_per_sec']:.0f} "
                f"| {ratio if engine == 'jax' else ''} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--engines", default=",".join(ENGINES))
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    engines = [x for x in args.engines.split(",") if x]
    if not set(policies) <= set(POLICIES) or not set(engines) <= set(ENGINES):
        p.error(f"--policies from {POLICIES}, --engines from {ENGINES}")
    sys.path.insert(0, str(HERE))
    from _common import machine, write_results

    rows = []
    with tempfile.TemporaryDirectory(prefix="kmp-engines-") as tmp:
        for policy in policies:
            for engine in engines:
                print(f"--- {engine} {policy}", flush=True)
                rows.append(run_one(engine, policy, args, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    info = machine()
    header = (
        f"Digits CNN, {args.np} processes, {args.epochs} epochs, batch 32 per process, on "
        f"{info['cpu']} ({info['cores']} cores, avx512_bf16: {info['avx512_bf16']}), "
        f"{info['date']}. mixed_float16 runs overflow step 3 on the last process."
    )
    payload = {"machine": info, "np": args.np, "epochs": args.epochs, "runs": rows}
    path = write_results("engines", payload, header + "\n\n" + md)
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
