"""The resume matrix: preempt inside an epoch, resume at the next batch, compare with no stop.

Not a speed benchmark: a correctness table over stop steps, models, policies and both
engines, on 2 real ranks, with the worker the tests use (tests/distributed/worker_resume.py):
rank 1 alone gets SIGTERM as a chosen batch starts, both ranks stop after it with one
checkpoint; the run resumed from it (the batches done skipped) is compared with the
uninterrupted one: the largest difference of the weights, between the ranks, and the
optimizer's class and step count right after ``kmp.load_model``.

    python bench/resume.py                        # the whole matrix, stopped at epoch 2's batch 1
    python bench/resume.py --quick                # one case per model
    python bench/resume.py --quick --stops 0:1 1:0 1:2   # several stop steps (epoch:batch)
    python bench/resume.py --quick --one-job ...  # every model's case in one job per engine

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


def run_job(engine: str, cases: list[str], stop: str, np_: int = 2) -> list[dict]:
    """Run the tests' worker on ``np_`` ranks of ``engine``; return each rank's result."""
    from tests._support import run_workers

    out = Path(tempfile.mkdtemp(prefix="kmp-resume-"))
    env = {"KMP_RESUME_SIGNAL_AT": stop}
    try:
        return run_workers(
            WORKER, str(out / "ckpt"), *cases, np=np_, engine=engine, env=env, timeout=3600
        )
    except AssertionError as exc:  # the job failed: its output is in the message
        raise RuntimeError(str(exc)) from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one policy per model")
    parser.add_argument(
        "--stops", nargs="+", default=["1:0"], help="where rank 1 is signalled: epoch:batch"
    )
    parser.add_argument("--one-job", action="store_true", help="every model in one job")
    args = parser.parse_args()
    rows, raw = [], {}
    policies = POLICIES[1:2] if args.quick else POLICIES
    # One job per model, or (--one-job) every model's cases in one job: fewer start-ups.
    groups = [list(MODELS)] if args.one_job else [[m] for m in MODELS]
    for stop in args.stops:
        for engine in ("horovod", "jax"):
            for models in groups:
                cases = [f"{model}:{p}" for model in models for p in policies]
                started = time.time()
                try:
                    ranks = run_job(engine, cases, stop)
                except RuntimeError as exc:
                    raw[f"{stop}/{engine}/{'+'.join(models)}"] = {"error": str(exc)[-2000:]}
                    rows.append([stop, "+".join(models), "(all)", engine, "failed: see json"])
                    continue
                for case in cases:
                    model = case.split(":", 1)[0]
                    got = [r["cases"][case] for r in ranks]
                    raw[f"{stop}/{engine}/{case}"] = got
                    rows.append(
                        [
                            stop,
                            model,
                            case.split(":", 1)[1],
                            engine,
                            f"epoch {got[0]['epoch']}, step {got[0]['step']}",
                            max(g["resumed_vs_straight"] for g in got),
                            got[0]["ranks"],
                            got[0]["optimizer"],
                            got[0]["iterations"],
                        ]
                    )
                took = time.time() - started
                print(f"{stop} {engine} {'+'.join(models)}: {took:.0f} s", flush=True)
    headers = [
        "signalled at (epoch:batch)",
        "model",
        "policy",
        "engine",
        "checkpoint (epochs done, batches)",
        "resumed vs uninterrupted (max |diff|)",
        "ranks, trainable weights (max |diff|)",
        "optimizer after load",
        "iterations after load",
    ]
    info = machine()
    md = (
        "# Resume matrix: preempted inside an epoch, resumed at the next batch\n\n"
        "Rank 1 alone gets SIGTERM as the batch starts; both ranks stop after it with one "
        "checkpoint.\n"
        f"2 ranks, 3 steps an epoch, 2 epochs, Dropout in every model; {info['cpu']}, "
        f"{info['cores']} cores, {info['date']}.\n\n" + markdown_table(headers, rows)
    )
    write_results("resume", {"machine": info, "cases": raw}, md)
    print(md)


if __name__ == "__main__":
    main()
