"""Transformer throughput on 2 ranks, both engines, against the limit (issue 27, parts 3-4).

    .venv/bin/python bench/transformer.py [--rounds 3] [--epochs 4] [--steps 10]
        [--rates 1gbit] [--no-local] [--no-cluster] [--models gpt,embed_lm]

Two token models of ``bench/models.py``: ``gpt`` (launch/train.py's byte-level GPT:
64-token sequences, 2 blocks of width 128) and ``embed_lm`` (one block over a
16,384-token vocabulary: its Embedding and logits are 8 MB each). Every job is a
2-rank ``bench/peer_worker.py`` job (synthetic tokens: throughput only; the GPT's
accuracy on real text is ``numerics.py``'s), on one host and on 2 ``kmp cluster``
hosts per ``--rates`` (root only), rounds interleaving the jobs, medians:

- ``independent`` / ``jax_independent``: 2 processes training alone (TensorFlow /
  JAX backend): the compute limit of each engine;
- ``kmp``: ``kmp.wrap_optimizer`` on the Horovod engine with kmp's defaults (4 MiB
  buckets, sparse gradients gathered); ``kmp_one_bucket`` and ``kmp_bucket_256k``: one
  bucket against small ones (overlap, part 3); ``kmp_dense``: the Embedding's
  gradient allreduced dense instead of its rows gathered;
- ``hvd_tape``: Horovod's ``DistributedGradientTape`` (it gathers sparse rows too);
- ``kmp_jax``: kmp on the JAX engine (``kmp launch --engine jax``; XLA all-reduces
  every gradient dense).

Each job is reported in tokens/s beside its compute, wire, non-overlapped and
overlapped limits (``limits.py``; the bytes each rank sends are counted per job from
the model: ring allreduce of the dense gradients, allgather of the gathered rows).
Writes ``transformer.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BATCH = {"gpt": 16, "embed_lm": 32}  # sequences per rank and step
# name -> (peer, peer_worker arguments, backend); the kmp_jax job runs on the JAX engine.
JOBS = {
    "independent": ("independent", [], "tensorflow"),
    "kmp": ("kmp", [], "tensorflow"),
    "kmp_one_bucket": ("kmp", ["--one-bucket"], "tensorflow"),
    "kmp_bucket_256k": ("kmp", ["--bucket-bytes", str(256 * 1024)], "tensorflow"),
    "kmp_dense": ("kmp", ["--sparse-gradients", "dense"], "tensorflow"),
    "hvd_tape": ("hvd_tape", [], "tensorflow"),
    "jax_independent": ("independent", [], "jax"),
    "kmp_jax": ("kmp", [], "jax"),
}
GATHERING = ("kmp", "kmp_one_bucket", "kmp_bucket_256k", "hvd_tape")  # sparse rows gathered
INDEX_BYTES = 8  # an int64 row index per gathered row
LIMITS = ("compute", "non_overlapped", "overlapped", "wire")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs per job; the first is not timed")
    p.add_argument("--steps", type=int, default=10, help="steps per epoch")
    p.add_argument("--rates", nargs="+", default=["1gbit"])
    p.add_argument("--models", default="gpt,embed_lm")
    p.add_argument("--jobs", default=",".join(JOBS), help="a subset of the jobs")
    p.add_argument("--no-local", action="store_true")
    p.add_argument("--no-cluster", action="store_true")
    p.add_argument("--report", help="derive and write again from this JSON, measuring nothing")
    args = p.parse_args(argv)
    import models

    args.models = [m for m in args.models.split(",") if m]
    if not args.models or not set(args.models) <= set(models.TOKEN_MODELS):
        p.error(f"--models from {', '.join(models.TOKEN_MODELS)}")
    args.jobs = [j for j in args.jobs.split(",") if j]
    if not args.jobs or not set(args.jobs) <= set(JOBS):
        p.error(f"--jobs from {', '.join(JOBS)}")
    if args.rounds < 1 or args.epochs < 2 or args.steps < 1:
        p.error("--rounds >= 1, --epochs >= 2 (the first is not timed), --steps >= 1")
    return args


def sent_bytes(model: str, job: str, n: int) -> tuple[float, str]:
    """Bytes one rank sends per step in ``job`` on ``n`` ranks, and how (for the wire limit).

    Dense gradients are ring-allreduced (``2 (n - 1) / n`` of their float32 bytes). Where
    the Embedding's gradient is gathered (kmp's default, Horovod's tape), its rows (one
    per token of the rank's batch, with an index) are allgathered: ``n - 1`` copies.
    """
    import limits
    import models

    seq_len, vocab, width, _ = models.TOKEN_MODELS[model]
    params = int(models.build(model).count_params())
    if job not in GATHERING:
        return limits.bytes_sent_per_rank(4.0 * params, n, "ring_allreduce"), "ring_allreduce"
    rows = BATCH[model] * seq_len * (4 * width + INDEX_BYTES)
    dense = 4.0 * (params - vocab * width)
    sent = limits.bytes_sent_per_rank(dense, n, "ring_allreduce")
    return sent + limits.bytes_sent_per_rank(rows, n, "allgather"), "ring_allreduce + allgather"


def run_setting(args, setting: str, tmp: Path, *, hosts: str, via=None, nic=None) -> dict:
    """Every model's jobs in one setting (``local`` or ``RATE/2``), rounds interleaved."""
    from peers import base_env, job, median_of, summarize

    out, errors = {}, {}
    for model in args.models:
        runs: dict[str, list] = {}
        model_args = ["--model", model, "--batch", str(BATCH[model])]
        model_args += ["--epochs", str(args.epochs), "--steps", str(args.steps)]
        for r in range(args.rounds):
            for name in args.jobs:
                peer, extra, backend = JOBS[name]
                engine = "jax" if backend == "jax" and peer == "kmp" else "horovod"
                key = f"{setting}/{model}/{name}"
                try:
                    ranks = job(
                        peer,
                        extra,
                        tmp / key.replace("/", "_"),
                        np_=2,
                        hosts=hosts,
                        env={**base_env(), "KERAS_BACKEND": backend},
                        via=via,
                        nic=nic,
                        model_args=model_args,
                        engine=engine,
                    )
                    runs.setdefault(key, []).append(summarize(ranks))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    errors[key] = str(exc)[-2000:]
            print(f"{setting} {model}: round {r + 1}/{args.rounds} done", flush=True)
        out.update({k: median_of(v) for k, v in runs.items()})
    return {"jobs": out, "errors": errors}


def cluster(args, tmp: Path) -> dict:
    """2 ``kmp cluster`` hosts per rate (one rank each)."""
    from peers import CLUSTER, PY, _kmp

    jobs, errors = {}, {}
    for rate in args.rates:
        _kmp("cluster", "down", "--name", CLUSTER)
        up = _kmp("cluster", "up", "--name", CLUSTER, "--hosts", "2", "--rate", rate)
        if up.returncode != 0:
            errors[rate] = up.stdout[-1000:] + up.stderr[-2000:]
            continue
        try:
            via = [PY, "-m", "kmp.cli", "cluster", "exec", "--name", CLUSTER, "h1", "--"]
            part = run_setting(args, f"{rate}/2", tmp, hosts="h1:1,h2:1", via=via, nic="eth0")
            jobs.update(part["jobs"])
            errors.update(part["errors"])
        finally:
            _kmp("cluster", "down", "--name", CLUSTER)
    return {"jobs": jobs, "errors": errors}


def derive(jobs: dict) -> dict:
    """Tokens/s of every job and its ratio to each of its limits (its own engine's compute)."""
    import limits
    import models

    jobs = {k: dict(v) for k, v in jobs.items()}
    for key, row in jobs.items():
        setting, model, name = key.rsplit("/", 2)
        seq_len = models.TOKEN_MODELS[model][0]
        row["tokens_per_s"] = round(row["images_per_s"] * seq_len, 1)
        if name.endswith("independent"):
            continue
        own = "jax_independent" if name == "kmp_jax" else "independent"
        compute = jobs.get(f"{setting}/{model}/{own}")
        if not compute:
            continue
        sent, algorithm = sent_bytes(model, name, 2)
        rate = 40e9 if setting == "local" else limits.rate_bits(setting.split("/")[0])
        lim = limits.limits(compute["images_per_s"], BATCH[model], 2, sent, rate)
        row["traffic"] = {"algorithm": algorithm, "sent_bytes_per_rank": round(sent)}
        row["limits_tokens_per_s"] = {k: round(lim[k] * seq_len, 1) for k in LIMITS}
        for kind in LIMITS:
            row[f"vs_{kind}"] = round(row["images_per_s"] / lim[kind], 3)
    return jobs


def markdown(result: dict) -> str:
    """One table per setting and model: tokens/s and the ratios to the limits."""
    from _common import markdown_table

    info = result["machine"]
    lines = [
        "# Transformer throughput: kmp on both engines against Horovod's tape and the limit",
        "",
        f"{info['cpu']} ({info['cores']} cores, avx512_bf16: {info['avx512_bf16']}), "
        f"{info['date']}; 2 ranks; median of {result['settings']['rounds']} rounds; "
        f"{result['settings']['steps']} steps x {result['settings']['epochs'] - 1} timed epochs "
        "per job. One host: the link is loopback (the wire limit is taken at 40 Gbit/s, so "
        "compute bounds it). Limits from the job's own engine's independent processes.",
    ]
    head = ["job", "tokens/s", "vs compute", "vs non-overlapped", "vs overlapped", "vs wire"]
    head += ["MB sent per rank and step", "ranks identical", "rounds (sequences/s)"]
    by: dict[tuple, list] = {}
    for key, row in result["jobs"].items():
        setting, model, name = key.rsplit("/", 2)
        by.setdefault((setting, model), []).append((name, row))
    for (setting, model), rows in by.items():
        lines += ["", f"## {setting}, {model} (batch {BATCH[model]} per rank)", ""]
        table = []
        for name, row in rows:
            ratios = [f"{row[f'vs_{k}']:.2f}" if f"vs_{k}" in row else "-" for k in LIMITS]
            mb = row.get("traffic", {}).get("sent_bytes_per_rank")
            mb_text = f"{mb / 1e6:.2f}" if mb else "-"
            tokens = f"{row['tokens_per_s']:.0f}"
            table.append([name, tokens, *ratios, mb_text, row["ranks_identical"], row["rounds"]])
        lines.append(markdown_table(head, table))
    if result.get("errors"):
        lines += ["", "## Errors", ""]
        lines += [f"- {k}: {v[-300:]!r}" for k, v in result["errors"].items()]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """One panel per setting and model: tokens/s per job, its two combined limits as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, list] = {}
    for key, row in result["jobs"].items():
        setting, model, name = key.rsplit("/", 2)
        panels.setdefault((setting, model), []).append((name, row))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 4.2))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, ((setting, model), rows) in zip(axes, panels.items(), strict=False):
        names = [n for n, _ in rows]
        ax.bar(names, [r["tokens_per_s"] for _, r in rows], color="tab:blue", label="measured")
        for kind, marker, color in (("non_overlapped", "_", "black"), ("overlapped", "x", "red")):
            pts = [(i, r["limits_tokens_per_s"][kind]) for i, (_, r) in enumerate(rows)
                   if "limits_tokens_per_s" in r]  # fmt: skip
            xs, ys = [i for i, _ in pts], [v for _, v in pts]
            ax.scatter(xs, ys, marker=marker, s=120, color=color, label=f"{kind} limit")
        ax.set_title(f"{model}, {setting}", fontsize=9)
        ax.set_ylabel("tokens/s (2 ranks)")
        ax.tick_params(axis="x", rotation=60, labelsize=7)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from _common import machine, write_results
    from peers import cluster_reason

    args = parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
    else:
        tmp = Path(tempfile.mkdtemp(prefix="kmp-transformer-"))
        start = time.time()
        jobs, errors = {}, {}
        if not args.no_local:
            part = run_setting(args, "local", tmp, hosts="localhost:2")
            jobs.update(part["jobs"])
            errors.update(part["errors"])
        reason = "--no-cluster" if args.no_cluster else cluster_reason()
        if reason:
            errors["cluster"] = f"skipped: {reason}"
        else:
            part = cluster(args, tmp)
            jobs.update(part["jobs"])
            errors.update(part["errors"])
        shutil.rmtree(tmp, ignore_errors=True)
        result = {"jobs": jobs, "errors": errors, "machine": machine()}
        result["settings"] = {k: v for k, v in vars(args).items() if k != "report"}
        result["load_average"] = list(os.getloadavg())
        result["seconds"] = round(time.time() - start, 1)
    result["jobs"] = derive(result["jobs"])
    md = markdown(result)
    path = write_results("transformer", result, md)
    plot(result, path.with_suffix(".png"))
    print(md)
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
