"""The benchmark suite behind ``kmp bench``: run the parts, then judge the targets.

    .venv/bin/python bench/suite.py [kmp bench options]     # same as `kmp bench ...`

Each part is one script of this folder, started as a child process (Horovod
jobs are started by the scripts themselves, so the whole run is one process
tree). Every child writes its ``NAME.json`` / ``NAME.md`` into the output folder
(``KMP_BENCH_RESULTS``); this module then reads them back, checks each target
of the suite against the figures measured in this run and writes
``summary.json``, ``summary.md`` and ``summary.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from targets import Target, judge  # noqa: E402  (bench/'s siblings import by name)

# The parts' output names (NAME.json, or NAME_quick.json for some scripts under --quick).
RESULT_NAMES = {
    "policies": "policies",
    "profile": "step_profile",
    "overhead": "overhead",
    "allreduce": "allreduce",
    "memory": "memory",
    "states": "memory_states",
    "peers": "peers",
    "numerics": "numerics",
    "inference": "inference",
    "generation": "serving_hub",
    "engines": "engines",
    "checkpoints": "checkpoints",
}
# Environment variables that would change what a benchmark measures.
_SCRUBBED_ENV = ("KMP_POLICY",)


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class Part:
    """One benchmark script to run: its name, the script and its arguments."""

    name: str
    script: str
    argv: tuple[str, ...]


def _opt(flag: str, value: Any) -> list[str]:
    return [] if value is None else [flag, str(value)]


def plan(args: argparse.Namespace) -> list[Part]:
    """Return the parts ``args`` asks for, with each script's arguments.

    ``args`` carries the ``kmp bench`` options (``model``, ``steps``, ``batch``,
    ``quick`` and ``parts``); the image size reaches the scripts through
    ``KMP_BENCH_IMAGE_SIZE`` (see :func:`child_env`).
    """
    model, steps, batch, quick = args.model, args.steps, args.batch, args.quick
    parts: list[Part] = []
    for name in args.parts:
        if name == "policies":
            argv = ["--quick"] if quick else []
            argv += ["--models", model or ("cnn" if quick else "cnn,mlp,gpt")]
            if not quick:
                argv += _opt("--steps", steps) + _opt("--batch", batch)
            parts.append(Part(name, "policies.py", tuple(argv)))
        elif name == "profile":  # TensorFlow's op time per kind: where the 16-bit gain stops
            if quick:
                argv = ["--models", "mlp", "--policies", "float32,mixed_bfloat16"]
                argv += ["--steps", "1", "--batch", "8"]
            else:
                argv = ["--models", model or "mlp,gpt"]
                argv += _opt("--steps", steps) + _opt("--batch", batch)
            parts.append(Part(name, "step_profile.py", tuple(argv)))
        elif name == "overhead":
            if quick:
                argv = ["--model", model or "digits_cnn", "--steps", "2", "--repeats", "1"]
                argv += ["--batch", "4"]
            else:
                argv = _opt("--model", model) + _opt("--steps", steps) + _opt("--batch", batch)
            parts.append(Part(name, "overhead.py", tuple(argv)))
        elif name == "allreduce":
            if quick:
                argv = ["--models", model or "digits_cnn", "--policies", "float32"]
                argv += ["--batch", "4", "--steps", "2", "--repeats", "1", "--rounds", "1"]
                argv += ["--skip-default", "--allreduce-iters", "3", "--idle-seconds", "0.5"]
            else:
                argv = _opt("--models", model) + _opt("--steps", steps) + _opt("--batch", batch)
            parts.append(Part(name, "allreduce.py", tuple(argv)))
        elif name == "memory":
            if quick:
                argv = ["--quick", "--model", model or "digits_cnn"]
            else:
                argv = _opt("--model", model) + _opt("--steps", steps) + _opt("--batch", batch)
            parts.append(Part(name, "memory.py", tuple(argv)))
        elif name == "states":  # its own model: the 67M-parameter MLP, each mode in a child
            argv = ["--states", "--quick"] if quick else ["--states", "--steps", "20"]
            parts.append(Part(name, "memory.py", tuple(argv)))
        elif name == "peers":  # its own models: the digits CNN and the wide MLP
            parts.append(Part(name, "peers.py", ("--quick",) if quick else ()))
        elif name == "numerics":  # its own workloads: digits, MNIST-1D, the GPT on text
            parts.append(Part(name, "numerics.py", ("--quick",) if quick else ()))
        elif name == "inference":  # its own models, trained then served in each precision
            argv = ["--exports"]
            if quick:
                argv += ["--quick", "--models", "digits_cnn,mlp,gpt"]
                argv += ["--precisions", "float32,bfloat16,int8"]
            parts.append(Part(name, "inference.py", tuple(argv)))
        elif name == "generation":  # KerasHub models served, generation from the export
            parts.append(Part(name, "serving_hub.py", ("--quick",) if quick else ()))
        elif name == "engines":  # the digits CNN and the GPT on both engines, 2 processes
            parts.append(Part(name, "engines.py", ("--quick",) if quick else ()))
        elif name == "checkpoints":  # the GPT on 2 processes: step checkpoints, a signal
            parts.append(Part(name, "checkpoints.py", ("--quick",) if quick else ()))
        else:
            raise ValueError(f"unknown benchmark part {name!r}")
    return parts


def child_env(out_dir: Path, image_size: int | None) -> dict[str, str]:
    """The environment of every benchmark script: results folder, image size, quiet TF."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["KMP_BENCH_RESULTS"] = str(out_dir)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if image_size is not None:
        env["KMP_BENCH_IMAGE_SIZE"] = str(image_size)
    else:
        env.pop("KMP_BENCH_IMAGE_SIZE", None)
    return env


# ------------------------------------------------------------------------------ run


def run_part(part: Part, out_dir: Path, env: dict[str, str], bench_dir: Path) -> dict:
    """Run one part, teeing its output to ``out_dir/logs/NAME.log``; return its record."""
    script = bench_dir / part.script
    record: dict[str, Any] = {
        "script": part.script,
        "argv": list(part.argv),
        "status": "failed",
        "result_file": None,
    }
    if not script.is_file():
        record["error"] = f"{script} does not exist"
        print(f"[kmp bench] {part.name}: {record['error']}", flush=True)
        return record
    cmd = [sys.executable, str(script), *part.argv]
    print(f"\n[kmp bench] {part.name}: {shlex.join(cmd)}", flush=True)
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with (logs / f"{part.name}.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        returncode = proc.wait()
    record["seconds"] = round(time.time() - start, 1)
    record["returncode"] = returncode
    found = find_result(out_dir, RESULT_NAMES[part.name], since=start)
    if returncode == 0 and found is not None:
        record["status"] = "ok"
        record["result_file"] = found.name
    else:
        record["error"] = (
            f"exit status {returncode}"
            if returncode
            else f"no {RESULT_NAMES[part.name]}.json was written"
        ) + f"; see logs/{part.name}.log"
    print(f"[kmp bench] {part.name}: {record['status']} in {record['seconds']} s", flush=True)
    return record


def find_result(out_dir: Path, stem: str, since: float = 0.0) -> Path | None:
    """Return the newest ``STEM.json`` / ``STEM_quick.json`` written at or after ``since``.

    ``STEM_jax.json`` (``_quick`` too) counts as well: ``inference.py`` names its file by
    the backend it ran on, and ``KERAS_BACKEND=jax kmp bench`` runs it on JAX.
    """
    names = [f"{stem}{backend}{quick}.json" for backend in ("", "_jax") for quick in ("", "_quick")]
    found = [
        p
        for p in (out_dir / name for name in names)
        if p.is_file() and p.stat().st_mtime >= since - 1.0
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def load_results(out_dir: Path, records: dict[str, dict]) -> dict[str, dict]:
    """Read back the JSON of every part that ran."""
    results = {}
    for name, rec in records.items():
        if rec.get("result_file"):
            results[name] = json.loads((out_dir / rec["result_file"]).read_text())
    gpu = find_result(out_dir, "gpu_resnet50")
    if gpu is not None:  # written by bench/gpu_resnet50.py on a GPU machine, if ever
        results["gpu_resnet50"] = json.loads(gpu.read_text())
    return results


# -------------------------------------------------------------------------- summary


def _demote(md: str) -> str:
    return "\n".join(
        "###" + line[1:] if line.startswith("# ") else line for line in md.splitlines()
    )


def summary_markdown(
    targets: list[Target], records: dict[str, dict], out_dir: Path, meta: dict
) -> str:
    """The Markdown summary: the targets table, then each part's own table."""
    from _common import markdown_table

    m = meta["machine"]
    lines = [
        "# kmp benchmark summary",
        "",
        f"`{meta['command']}` on {m.get('cpu')} ({m.get('cores')} cores, "
        + ("AVX512_BF16" if m.get("avx512_bf16") else "no AVX512_BF16")
        + ("/AMX" if m.get("amx") else "")
        + f"), {meta['date']}, load average at the start {meta['load_average'][0]:.1f}."
        + (" **Quick run: the figures mean nothing.**" if meta["quick"] else ""),
        "",
        "## Targets (ratios measured in this run)",
        "",
        markdown_table(
            ["target", "goal", "measured", "result", "why"],
            [
                [t.name, t.goal, t.measured or "-", t.result, t.why.replace("|", "/") or "-"]
                for t in targets
            ],
        ),
    ]
    titles = {
        "policies": "Training throughput per policy",
        "overhead": "Wrapper overhead",
        "allreduce": "Allreduce and weak scaling",
        "memory": "Memory of a training step",
        "states": "Weights, optimizer state and the step's peak per master-weights mode",
        "peers": "Peers, the limit, hosts and links",
        "numerics": "Numerics: accuracy per policy on real workloads",
        "generation": "KerasHub models served, generation from the exported GPT",
    }
    for name, rec in records.items():
        lines += ["", f"## {titles.get(name, name)}", ""]
        md_file = out_dir / (Path(rec["result_file"]).stem + ".md") if rec["result_file"] else None
        if rec["status"] == "ok" and md_file is not None and md_file.is_file():
            lines.append(_demote(md_file.read_text().strip()))
        else:
            lines.append(f"Failed: {rec.get('error', 'unknown error')}.")
    if meta.get("plot"):
        lines += ["", f"![kmp benchmarks]({meta['plot']})"]
    return "\n".join(lines) + "\n"


def _command_line(args: argparse.Namespace) -> str:
    parts = ["kmp bench"]
    for flag in ("model", "image_size", "steps", "batch", "only"):
        value = getattr(args, flag, None)
        if value is not None:
            parts += [f"--{flag.replace('_', '-')}", str(value)]
    if args.quick:
        parts.append("--quick")
    return " ".join(parts)


def run_suite(args: argparse.Namespace, bench_dir: Path = HERE) -> int:
    """Run the parts of ``args.parts`` and write the summary; return the exit status."""
    from _common import RESULTS, machine

    out_dir = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    meta = {
        "command": _command_line(args),
        "quick": bool(args.quick),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": list(os.getloadavg()),
        "machine": machine(),
        "scrubbed_env": [k for k in _SCRUBBED_ENV if k in os.environ],
    }
    env = child_env(out_dir, args.image_size)
    records = {p.name: run_part(p, out_dir, env, bench_dir) for p in plan(args)}
    results = load_results(out_dir, records)
    targets = judge(results)

    plot_name = f"summary{suffix}.png"
    try:
        import plot

        plot.plot_summary(results, targets, out_dir / plot_name)
        meta["plot"] = plot_name
    except ImportError as exc:  # matplotlib missing
        print(f"[kmp bench] no plot: {exc}", file=sys.stderr)
        meta["plot"] = None
    summary = {
        **meta,
        "out_dir": str(out_dir),
        "parts": records,
        "targets": [{**dataclasses.asdict(t), "result": t.result} for t in targets],
    }
    (out_dir / f"summary{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = summary_markdown(targets, records, out_dir, meta)
    (out_dir / f"summary{suffix}.md").write_text(md)
    print("\n" + md)
    print(f"[kmp bench] written: {out_dir / f'summary{suffix}.md'}")
    failed = [n for n, r in records.items() if r["status"] != "ok"]
    if failed:
        print(f"[kmp bench] failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from kmp.commands import bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.configure(parser)
    args = parser.parse_args(argv)
    args.bench_dir = args.bench_dir or HERE
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
