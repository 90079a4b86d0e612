"""The kmp demo: 2 Horovod processes train a CNN on real handwritten digits.

Run by the README's first command (``bash launch/demo.sh``), or directly::

    .venv/bin/python launch/demo.py [--np 2] [--epochs 8] [--compare POLICY|none]

1. ``kmp launch -np 2 launch/train.py --policy auto``: two processes train the
   digits CNN on scikit-learn's 1,797 real 8x8 digits (prepared offline as
   the ``kmp_digits`` TFDS data set), each on its own shard, under the dtype
   policy kmp picks for this machine. It reports the test accuracy over the
   359 held-out digits, whether both ranks ended with identical weights, and
   the throughput.
2. The same run under a comparison policy (float32; or mixed_bfloat16 when
   "auto" already chose float32, to show what mixed precision would cost
   here), then the throughput ratio and the accuracy difference.

Exit status 0 when the auto run reaches ``--target`` test accuracy (0.95)
with identical weights on every rank, 1 otherwise. ``--json FILE`` writes the
measured numbers. This process stays light (no TensorFlow); the ranks do the
work, and their full output goes to a log file next to the JSON summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing kmp

from kmp._launcher_env import quiet_env  # noqa: E402 - after the path set-up
from kmp.commands import format_table  # noqa: E402
from kmp.launching.job import build_command  # noqa: E402

TRAIN = ROOT / "launch" / "train.py"
RANK0_PREFIXES = ("[0]<stdout>:", "[1,0]<stdout>:")  # Gloo and Open MPI tags of rank 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kmp demo: 2 Horovod processes train a CNN on real handwritten digits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--np", type=int, default=2, help="number of processes")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--policy", default="auto", help="the policy to demonstrate")
    p.add_argument(
        "--engine",
        choices=("horovod", "jax"),
        default="horovod",
        help="horovod (TensorFlow backend) or jax (Keras's JAX backend, JAX's runtime)",
    )
    p.add_argument(
        "--compare",
        default="default",
        help="comparison policy: float32, mixed_bfloat16, mixed_float16, none, or default "
        "(float32, or mixed_bfloat16 when the demonstrated policy is float32)",
    )
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    p.add_argument("--out", help="folder for logs and summaries (default: a temporary one)")
    p.add_argument("--json", help="also write the demo's numbers to this file")
    p.add_argument("--data-dir", help="TFDS data directory (default: $KMP_DATA_DIR or kmp cache)")
    args = p.parse_args(argv)
    if args.np < 1 or args.epochs < 1 or args.batch_size < 1:
        p.error("--np, --epochs and --batch-size must be >= 1")
    return args


def run_training(args, policy: str, out: Path, label: str) -> dict:
    """Launch train.py on ``args.np`` ranks under ``policy``; stream rank 0's epoch lines."""
    summary = out / f"summary-{label}.json"
    log_path = out / f"log-{label}.txt"
    script_args = [
        "--model", "digits_cnn", "--policy", policy, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--summary", str(summary), "--verbose", "2",
    ]  # fmt: skip
    if args.data_dir:
        script_args += ["--data-dir", args.data_dir]
    plan = build_command(
        args.np,
        TRAIN,
        script_args,
        controller="gloo" if args.np > 1 else None,
        environ={k: v for k, v in os.environ.items() if k != "KMP_POLICY"},
        engine=args.engine,
    )
    env = {**os.environ, **plan.env}
    env.update(quiet_env(env))  # TensorFlow's log level, unless the user set one
    env.pop("KMP_POLICY", None)  # the demo sets the policy per run
    if args.np > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.np)))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(plan.argv),
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            text = line.rstrip("\n")
            for prefix in RANK0_PREFIXES:
                text = text.removeprefix(prefix)
            from_rank0 = args.np == 1 or line.startswith(RANK0_PREFIXES)
            progress = text.startswith(("Epoch ", "kmp train:")) or " - loss: " in text
            if from_rank0 and progress:
                print(f"    {text.strip()}", flush=True)
        code = proc.wait()
    elapsed = time.perf_counter() - start
    if code != 0 or not summary.exists():
        tail = log_path.read_text().splitlines()[-40:]
        print("\n".join(["    " + t for t in tail]), file=sys.stderr)
        raise SystemExit(f"kmp demo: the {policy} run failed (exit {code}); full log: {log_path}")
    result = json.loads(summary.read_text())
    result["wall_seconds"] = elapsed
    return result


def closing_table(runs: Sequence[dict], auto_run: dict | None = None) -> str:
    """The runs side by side: policy, test accuracy, images/s and the speed against float32.

    ``auto_run``, the run whose policy "auto" chose, has " (auto)" after its policy name;
    the columns are as wide as their widest cell, whatever the policy names.
    """
    f32 = next((r for r in runs if r["policy"] == "float32"), None)
    rows = [
        (
            r["policy"] + (" (auto)" if r is auto_run else ""),
            f"{r['test_accuracy']:.4f}",
            f"{r['images_per_sec']:.0f}",
            f"{r['images_per_sec'] / f32['images_per_sec']:.2f}x" if f32 else "-",
        )
        for r in runs
    ]
    header = ("policy", "test accuracy", "images/s", "vs float32")
    return format_table(rows, header, right=(1, 2, 3), indent="  ")


def comparison_policy(requested: str, chosen: str) -> str | None:
    if requested == "none":
        return None
    if requested != "default":
        return requested
    return "mixed_bfloat16" if chosen == "float32" else "float32"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kmp-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(
        f"kmp demo: {args.np} Horovod process(es) train a CNN on scikit-learn's 1,797 real "
        f"8x8 handwritten digits ({args.epochs} epochs, batch {args.batch_size} per rank).",
        flush=True,
    )
    print(f"[1] policy {args.policy!r}", flush=True)
    main_run = run_training(args, args.policy, out, "main")
    same = main_run["weights_max_diff"] == 0
    reached = main_run["test_accuracy"] >= args.target
    print(
        f"    -> {main_run['policy']}: test accuracy {main_run['test_accuracy']:.4f} "
        f"(target {args.target}: {'reached' if reached else 'NOT reached'}), ranks' weights "
        f"{'identical' if same else 'DIFFERENT'} (max diff {main_run['weights_max_diff']:g}), "
        f"{main_run['images_per_sec']:.0f} images/s, {main_run['wall_seconds']:.0f} s",
        flush=True,
    )
    print(f"       why: {main_run['policy_reason']}", flush=True)

    runs = [main_run]
    other = comparison_policy(args.compare, main_run["policy"])
    if other:
        print(f"[2] comparison policy {other!r}", flush=True)
        runs.append(run_training(args, other, out, "compare"))
        cmp_run = runs[1]
        print(
            f"    -> {cmp_run['policy']}: test accuracy {cmp_run['test_accuracy']:.4f}, "
            f"{cmp_run['images_per_sec']:.0f} images/s, {cmp_run['wall_seconds']:.0f} s",
            flush=True,
        )
        auto_run = main_run if args.policy == "auto" else None
        print("\n" + closing_table(runs, auto_run), flush=True)
        diff = main_run["test_accuracy"] - cmp_run["test_accuracy"]
        ratio = main_run["images_per_sec"] / cmp_run["images_per_sec"]
        print(
            f"\n  {main_run['policy']} vs {cmp_run['policy']}: {ratio:.2f}x the throughput, "
            f"test accuracy {diff:+.4f}",
            flush=True,
        )
    total = time.perf_counter() - t0
    ok = same and reached
    print(f"\nkmp demo {'passed' if ok else 'FAILED'} in {total:.0f} s (logs: {out})", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"ok": ok, "seconds": total, "target": args.target, "runs": runs}, indent=2)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
