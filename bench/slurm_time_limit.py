"""A SLURM job longer than its time limit: does it finish, across requeues, exactly?

    sudo .venv/bin/python bench/slurm_time_limit.py [--epochs 120] [--time-limit 1]
        [--signal-before 15] [--checkpoint-every-steps 10] [--out bench/results]

On a one-machine SLURM cluster (``kmp cluster up --slurm``: network-namespace hosts,
root only) two 2-node jobs train the digits CNN with ``launch/train.py``, one after
the other: the reference, with no time limit, and the same job with
``--time=LIMIT --signal=USR1@BEFORE --requeue``. Each time SLURM warns the ranks of
the limit, they agree on a step, write one checkpoint and exit 75; ``kmp launch``
requeues the job (``scontrol requeue``) and the next run resumes inside the epoch.

Written: ``slurm_time_limit_<LIMIT>min.json`` and ``.md`` in ``--out``: every run's start, its
warning, the checkpoint it wrote and how long after the warning, the requeues, and
the largest difference between the two jobs' final weights and optimizer variables
(0 means the interrupted job ended exactly where the one that never stopped did).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLUSTER = "kmptl"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=120, help="digits CNN epochs (the work)")
    p.add_argument("--time-limit", type=int, default=1, help="the job's limit, minutes")
    p.add_argument("--signal-before", type=int, default=15, help="USR1 this many s before")
    p.add_argument("--checkpoint-every-steps", type=int, default=10)
    p.add_argument("--max-requeues", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return p.parse_args(argv)


def kmp(*argv: str, env: dict | None = None, timeout: float = 240) -> str:
    done = subprocess.run(
        [PY, "-m", "kmp.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"kmp {shlex.join(argv)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def on_h1(*argv: str, env: dict | None = None) -> str:
    return kmp("cluster", "exec", "--name", CLUSTER, "h1", "--", *argv, env=env)


def job_info(job: str) -> dict[str, str]:
    line = on_h1("scontrol", "show", "job", "-o", job)
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def submit(folder: Path, name: str, sbatch: list[str], args: argparse.Namespace, env) -> str:
    train = [
        "launch/train.py", "--model", "digits_cnn", "--epochs", str(args.epochs),
        "--verbose", "2", "--checkpoint-dir", str(folder / f"{name}-ckpt"),
        "--checkpoint-every-steps", str(args.checkpoint_every_steps),
        "--summary", str(folder / f"{name}-{{rank}}.json"),
    ]  # fmt: skip
    launch = ["--max-requeues", str(args.max_requeues), *train]
    script = folder / f"{name}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {shlex.quote(str(ROOT))}\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} starts at $(date +%s.%N)"\n'
        f"exec {shlex.quote(PY)} -m kmp.cli launch {shlex.join(launch)}\n"
    )
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={folder / name}.out",
            "--nodes=2", "--ntasks-per-node=1", "--open-mode=append", *sbatch,
            str(script)]  # fmt: skip
    return on_h1(*argv, env=env).strip().split(";")[0]


def wait(job: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if info["JobState"] in FINAL:
            return info
        time.sleep(2)
    raise RuntimeError(f"job {job} not done after {timeout} s: {info}")


def timeline(log: str, t0: float) -> list[dict]:
    """Each run of the job: when it started, its warning's checkpoint, how it ended."""
    runs: list[dict] = []
    for line in log.splitlines():
        if m := re.match(r"run (\d+) starts at ([\d.]+)", line):
            runs.append({"run": int(m[1]), "start_s": round(float(m[2]) - t0, 1)})
        elif runs and (m := re.search(r"(SIG\w+) during epoch (\d+): checkpoint (\S+) "
                                       r"written ([\d.]+) s after it", line)):  # fmt: skip
            runs[-1].update(signal=m[1], checkpoint=Path(m[3]).name, signal_to_disk_s=float(m[4]))
        elif runs and "resumed from" in line:
            runs[-1]["resumed_from"] = Path(line.split("resumed from ")[1].split(":")[0]).name
        elif runs and "requeuing job" in line:
            runs[-1]["requeued"] = True
    return runs


def largest_difference(a: str, b: str) -> dict[str, float]:
    import numpy as np

    import kmp

    ma, mb = kmp.load_model(a), kmp.load_model(b)

    def diff(xs, ys) -> float:
        return max(
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(xs, ys, strict=True)
        )

    return {
        "weights": diff(ma.get_weights(), mb.get_weights()),
        "optimizer": diff(
            [v.numpy() for v in ma.optimizer.variables], [v.numpy() for v in mb.optimizer.variables]
        ),
        "iterations": [int(ma.optimizer.iterations), int(mb.optimizer.iterations)],
    }


def write(args: argparse.Namespace, result: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"slurm_time_limit_{args.time_limit}min"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# A SLURM job longer than its time limit (bench/slurm_time_limit.py)",
        "",
        f"{result['date']}, {result['cpu']}: digits CNN, {args.epochs} epochs, 2 nodes x 1 "
        f"rank, step checkpoints every {args.checkpoint_every_steps} steps.",
        "",
        f"- reference (no limit): {result['reference']['seconds']:.0f} s, state "
        f"{result['reference']['state']}",
        f"- limited (`--time={args.time_limit} --signal=USR1@{args.signal_before} --requeue`): "
        f"{result['limited']['seconds']:.0f} s from submission, state "
        f"{result['limited']['state']}, {result['limited']['restarts']} requeues",
        f"- final state, limited vs reference: largest weight difference "
        f"{result['difference']['weights']}, optimizer {result['difference']['optimizer']}, "
        f"iterations {result['difference']['iterations']}",
        "",
        "| run | started (s) | resumed from | signal | checkpoint | signal to disk (s) "
        "| requeued |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["limited"]["runs"]:
        lines.append(
            f"| {r['run']} | {r['start_s']} | {r.get('resumed_from', '-')} | "
            f"{r.get('signal', '-')} | {r.get('checkpoint', '-')} | "
            f"{r.get('signal_to_disk_s', '-')} | {'yes' if r.get('requeued') else 'no'} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench/slurm_time_limit.py: kmp cluster needs root", file=sys.stderr)
        return 2
    from kmp import datasets

    tmp = Path(tempfile.mkdtemp(prefix="kmp-slurm-tl-"))
    datasets.prepare("kmp_digits", tmp / "data")
    env = {"KMP_DATA_DIR": str(tmp / "data"), "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
    subprocess.run([PY, "-m", "kmp.cli", "cluster", "down", "--name", CLUSTER], cwd=ROOT,
                   capture_output=True, check=False)  # fmt: skip
    kmp("cluster", "up", "--name", CLUSTER, "--hosts", "2", "--slots", "2", "--slurm")
    result: dict = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or ""}
    try:
        with open("/proc/cpuinfo") as f:
            result["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
        for name, sbatch in (
            ("reference", []),
            ("limited", [f"--time={args.time_limit}",
                         f"--signal=USR1@{args.signal_before}", "--requeue"]),
        ):  # fmt: skip
            t0 = time.time()
            job = submit(tmp, name, sbatch, args, env)
            info = wait(job, timeout=3600)
            log = (tmp / f"{name}.out").read_text(errors="replace")
            result[name] = {
                "seconds": time.time() - t0,
                "state": info["JobState"],
                "restarts": int(info.get("Restarts", 0)),
                "runs": timeline(log, t0),
                "log_tail": log[-3000:],
            }
            print(f"{name}: {info['JobState']} after {time.time() - t0:.0f} s", flush=True)
    finally:
        subprocess.run([PY, "-m", "kmp.cli", "cluster", "down", "--name", CLUSTER], cwd=ROOT,
                       capture_output=True, check=False)  # fmt: skip
    last = f"ckpt-{args.epochs:04d}.keras"
    ended = all((tmp / f"{name}-ckpt" / last).exists() for name in ("reference", "limited"))
    result["difference"] = (
        largest_difference(str(tmp / "reference-ckpt" / last), str(tmp / "limited-ckpt" / last))
        if ended
        else {"weights": None, "optimizer": None, "iterations": None}
    )
    result["settings"] = vars(args) | {"out": str(args.out)}
    write(args, result)
    return 0 if result["limited"]["state"] == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
