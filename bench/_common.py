"""Small helpers shared by the benchmark scripts (timing, results files)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def horovod_launcher(python: str | None = None) -> list[str]:
    """How a benchmark starts Horovod's launcher: as ``kmp launch`` does.

    ``python -m kmp.launching.horovodrun`` is horovodrun without its start-up probe (a
    TensorFlow import, about 7 s per job): the probe is not part of any figure measured.
    """
    from kmp.launching.horovodrun import MODULE

    return [python or sys.executable, "-m", MODULE]


# The CPU flags that decide 16-bit and int8 speed, as /proc/cpuinfo names them.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of :data:`CPU_FLAGS` this CPU has (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            present = set(f.read().split())
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in present]


def machine() -> dict:
    """Facts about where a benchmark ran, stored next to its figures (the CPU's flags too)."""
    from kmp import hardware

    hw = hardware.detect()
    return {
        "cpu": hw.cpu.model,
        "cores": hw.cpu.cores,
        "cpu_flags": cpu_flags(),
        "avx512_bf16": hw.cpu.avx512_bf16,
        "amx": hw.cpu.amx,
        "gpus": [g.name for g in hw.gpus],
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name: str, payload: dict, markdown: str | None = None) -> Path:
    """Write ``bench/results/NAME.json`` (and ``NAME.md``) atomically; return the JSON path."""
    out_dir = Path(os.environ.get("KMP_BENCH_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    if markdown is not None:
        md = out_dir / f"{name}.md"
        md.write_text(markdown.rstrip() + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """Render a Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"


def run_train_job(
    train_args: list[str],
    np_: int,
    summary: Path,
    label: str,
    launch_args: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
    timeout: float = 3600,
) -> tuple[dict, float]:
    """Run ``kmp launch -np N launch/train.py ARGS --summary FILE``; return its summary and wall s.

    ``KERAS_BACKEND`` and ``KMP_POLICY`` are removed from the job's environment (they would
    override the job's own engine and policy).

    Raises:
        SystemExit: The job failed or wrote no summary; the message has ``label`` and the tail
            of its output.
    """
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kmp.cli", "launch", *launch_args, "-np", str(np_), str(TRAIN)]
    cmd += [*train_args, "--summary", str(summary)]
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KMP_POLICY")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(env_extra or {})
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, cwd=TRAIN.parents[1], capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not summary.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{tail}")
    return json.loads(summary.read_text()), wall
