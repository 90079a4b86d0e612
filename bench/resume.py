"""The resume matrix: stop after epoch 1, resume from the checkpoint, compare with a straight run.

Not a speed benchmark: a correctness table over models, policies and both engines, on
2 real ranks, with the worker the tests use (tests/distributed/worker_resume.py): the
largest difference between the resumed and the uninterrupted weights, between the
ranks, and the optimizer's class and step count right after ``kmp.load_model``.

    python bench/resume.py            # the whole matrix (about 10 minutes on 2 cores)
    python bench/resume.py --quick    # one case per model

Writes bench/results/resume.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, markdown_table, write_results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests._support: the job runner the tests use
WORKER = ROOT / "tests" / "distributed" / "worker_resume.py"
MODELS = ("sequential", "batchnorm", "own_compile", "gpt2", "mobilenet")
POLICIES = (
    "float32",
    "mixed_float16",
    "mixed_bfloat16",
    "bfloat16:none",
    "bfloat16:kahan",
    "bfloat16:stochastic",
)


def run_job(engine: str, cases: list[str], np_: int = 2) -> list[dict]:
    """Run the tests' worker on ``np_`` ranks of ``engine``; return each rank's result."""
    from tests._support import run_workers

    out = Path(tempfile.mkdtemp(prefix="kmp-resume-"))
    try:
        return run_workers(WORKER, str(out / "ckpt"), *cases, np=np_, engine=engine, timeout=3600)
    except AssertionError as exc:  # the job failed: its output is in the message
        raise RuntimeError(str(exc)) from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one policy per model")
    args = parser.parse_args()
    rows, raw = [], {}
    for engine in ("horovod", "jax"):
        for model in MODELS:
            policies = POLICIES[1:2] if args.quick else POLICIES
            cases = [f"{model}:{p}" for p in policies]
            started = time.time()
            try:
                ranks = run_job(engine, cases)
            except RuntimeError as exc:
                raw[f"{engine}/{model}"] = {"error": str(exc)[-2000:]}
                rows.append([model, "(all)", engine, "failed: see resume.json", "", "", ""])
                continue
            for case in cases:
                got = [r["cases"][case] for r in ranks]
                raw[f"{engine}/{case}"] = got
                rows.append(
                    [
                        model,
                        case.split(":", 1)[1],
                        engine,
                        max(g["resumed_vs_straight"] for g in got),
                        got[0]["ranks"],
                        got[0]["optimizer"],
                        got[0]["iterations"],
                    ]
                )
            print(f"{engine} {model}: {time.time() - started:.0f} s", flush=True)
    headers = [
        "model",
        "policy",
        "engine",
        "resumed vs uninterrupted (max |diff|)",
        "ranks, trainable weights (max |diff|)",
        "optimizer after load",
        "iterations after load",
    ]
    info = machine()
    md = (
        "# Resume matrix: stopped after epoch 1 of 2, resumed from the checkpoint\n\n"
        f"2 ranks, 3 steps an epoch, Dropout in every model; {info['cpu']}, "
        f"{info['cores']} cores, {info['date']}.\n\n" + markdown_table(headers, rows)
    )
    write_results("resume", {"machine": info, "cases": raw}, md)
    print(md)


if __name__ == "__main__":
    main()
