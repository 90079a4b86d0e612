"""kmp against its peers and the limit, on one host and on shaped multi-host links.

    .venv/bin/python bench/peers.py [--quick] [--rounds 3] [--epochs 12]
        [--hosts 2 3] [--rates 1gbit 10gbit] [--no-cluster]

Every job is ``bench/peer_worker.py`` started by ``horovodrun`` (the process starter of
every peer). Parts, all in one run, so each ratio compares figures measured side
by side:

1. **One host, 2 ranks, the digits CNN** on the real digits (images/s and test
   accuracy): one process alone, two independent processes at once (the limit),
   kmp (default buckets and one bucket), Horovod's ``DistributedGradientTape``
   and ``MultiWorkerMirroredStrategy``; rounds interleave the jobs and every
   figure is the median of the rounds. Also: kmp's bucket size and Horovod's
   knobs (cycle time, response cache) on the same job, and XLA
   (``jit_compile=True``) against the default for one process.
2. **Hosts and links** (root only; ``kmp cluster`` with ``tc tbf`` links): the
   communication-bound ``wide_mlp`` (42 MB of gradients) on 2 and 3 hosts per
   link rate: the independent limit, kmp with one bucket (the plain grouped
   allreduce), with buckets (overlap), with fp16 / bf16 compression, and the
   two peers.

Every process runs one TensorFlow compute thread (``intra_op``) and two
inter-op threads: with a single inter-op thread TensorFlow's executor holds an
asynchronous Horovod op until the chain of compute ops it is running ends, so no
allreduce could start before the backward pass is over.

Writes ``peers.json``, ``peers.md`` and ``peers.png`` into the results folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import horovod_launcher  # noqa: E402  (bench/ is on the path from here on)

PY = sys.executable
CLUSTER = "kmpbench"
MWMS_PORT = 23456
TARGETS = {"vs_limit": 0.95, "vs_peer": 1.0, "fp16_1gbit": 1.6, "overlap_1gbit": 1.2}

BUCKET = 4 * 1024 * 1024  # the bucket size timed on the links (one bucket per wide layer)
# One host: name -> peer_worker.py arguments (beyond --peer) and extra environment.
LOCAL_JOBS = {
    "kmp_one_bucket": ("kmp", ["--one-bucket"], {}),
    "hvd_tape": ("hvd_tape", [], {}),
    "mwms": ("mwms", [], {}),
}
BUCKET_SIZES = (64 * 1024, 256 * 1024)  # digits CNN: 752 KB of gradients in all
KNOBS = {
    "cycle_5ms": {"HOROVOD_CYCLE_TIME": "5"},
    "cycle_0.5ms": {"HOROVOD_CYCLE_TIME": "0.5"},
    "no_response_cache": {"HOROVOD_CACHE_CAPACITY": "0"},
}
# Multi-host: the communication-bound model.
CLUSTER_JOBS = {
    "kmp_one_bucket": ("kmp", ["--one-bucket"]),
    f"kmp_bucket_{BUCKET // 1024}k": ("kmp", ["--bucket-bytes", str(BUCKET)]),
    "kmp_fp16_one_bucket": ("kmp", ["--one-bucket", "--compression", "fp16"]),
    "kmp_fp16": ("kmp", ["--bucket-bytes", str(BUCKET), "--compression", "fp16"]),
    "kmp_bf16": ("kmp", ["--bucket-bytes", str(BUCKET), "--compression", "bf16"]),
    "kmp_fusion_8mb": ("kmp", ["--one-bucket"], {"HOROVOD_FUSION_THRESHOLD": str(8 << 20)}),
    "hvd_tape": ("hvd_tape", []),
    "mwms": ("mwms", []),
}


def default_job() -> str:
    """The job name of kmp's default bucket size (what ``kmp.wrap_optimizer`` does)."""
    from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES

    if DEFAULT_BUCKET_BYTES is None:
        return "kmp_one_bucket"
    return f"kmp_bucket_{DEFAULT_BUCKET_BYTES // 1024}k"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="2 epochs, 1 round, no cluster, no bucket variants"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=12, help="digits epochs (the first untimed)")
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    p.add_argument("--cluster-epochs", type=int, default=4)
    p.add_argument("--cluster-steps", type=int, default=5)
    p.add_argument("--cluster-batch", type=int, default=32)
    p.add_argument("--no-cluster", action="store_true")
    p.add_argument(
        "--report",
        metavar="PEERS_JSON",
        help="measure nothing: derive the ratios and targets of a results file again (after a "
        "change of kmp's defaults) and rewrite it with its .md and .png",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.epochs, args.no_cluster = 1, 2, True
    return args


# ------------------------------------------------------------------------ running


def base_env() -> dict[str, str]:
    """The environment of every job: no inherited Horovod settings, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KMP_POLICY"))}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        TF_CPP_MIN_LOG_LEVEL="3",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def job(
    peer: str,
    extra: list[str],
    out: Path,
    *,
    np_: int,
    hosts: str,
    env: dict,
    via: list[str] | None = None,
    nic: str | None = None,
    model_args: list[str],
    engine: str = "horovod",
) -> list[dict]:
    """Run one job of ``peer_worker.py``; return the ranks' results.

    ``horovodrun`` starts it; with ``engine="jax"``, ``kmp launch --engine jax`` (the
    kmp peer then trains on the JAX engine; ``env`` must hold ``KERAS_BACKEND=jax``).
    """
    shutil.rmtree(out, ignore_errors=True)
    argv = [PY, str(HERE / "peer_worker.py"), "--peer", peer, "--out", str(out)]
    argv += [*model_args, *extra]
    if peer == "mwms":
        names = [h.split(":")[0] for h in hosts.split(",") for _ in range(int(h.split(":")[1]))]
        ports = [MWMS_PORT + i for i in range(len(names))]
        argv += ["--workers", ",".join(f"{n}:{p}" for n, p in zip(names, ports, strict=True))]
    if engine == "jax":  # kmp launch starts the script with this Python itself
        argv = argv[1:]
        cmd = [PY, "-m", "kmp.cli", "launch", "--engine", "jax", "-np", str(np_), "-H", hosts]
    else:
        cmd = [*horovod_launcher(PY), "--gloo", "-np", str(np_), "-H", hosts]
    cmd += ["--network-interface", nic] if nic else []
    cmd = [*(via or []), *cmd, *argv]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"{peer} {' '.join(extra)} failed:\n{tail}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]


def throughput(ranks: list[dict]) -> float:
    """Images/s of all ranks together: each rank's median timed epoch, summed."""
    return sum(statistics.median(r["images_per_s"]) for r in ranks)


def summarize(ranks: list[dict]) -> dict:
    """The figures of one job: throughput, accuracy, whether the ranks agree."""
    out = {"images_per_s": round(throughput(ranks), 1), "ranks": len(ranks)}
    if "accuracy" in ranks[0]:
        out["accuracy"] = round(statistics.mean(r["accuracy"] for r in ranks), 4)
    out["ranks_identical"] = len({r["checksum"] for r in ranks}) == 1
    return out


def median_of(rounds: list[dict]) -> dict:
    """Median images/s (and accuracy) over rounds of one job."""
    out = dict(rounds[-1])
    out["images_per_s"] = round(statistics.median(r["images_per_s"] for r in rounds), 1)
    out["rounds"] = [r["images_per_s"] for r in rounds]
    if "accuracy" in out:
        out["accuracy"] = round(statistics.median(r["accuracy"] for r in rounds), 4)
    return out


# ------------------------------------------------------------------------ one host


def local_part(args: argparse.Namespace, tmp: Path) -> dict:
    """One host, 2 ranks, digits CNN: peers, limit, buckets, knobs, XLA."""
    env = base_env()
    digits = ["--model", "digits_cnn", "--epochs", str(args.epochs)]
    jobs: dict[str, tuple[str, list[str], dict]] = {
        "single": ("independent", [], {}),
        "independent_pair": ("independent", [], {}),
        # --quick (a smoke run): kmp as it comes and each peer, not kmp's bucket variants.
        **{k: v for k, v in LOCAL_JOBS.items() if not (args.quick and k.startswith("kmp_"))},
    }
    for b in () if args.quick else (*BUCKET_SIZES, BUCKET):
        jobs[f"kmp_bucket_{b // 1024}k"] = ("kmp", ["--bucket-bytes", str(b)], {})
    jobs.setdefault(default_job(), ("kmp", [], {}))  # kmp as it comes, whatever the default
    for name, knob in {} if args.quick else KNOBS.items():
        jobs[f"kmp_{name}"] = ("kmp", ["--one-bucket"], knob)
    xla = {} if args.quick else {"xla_off": ["--jit", "off"], "xla_on": ["--jit", "on"]}
    runs: dict[str, list[dict]] = {k: [] for k in [*jobs, *xla]}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        for name, (peer, extra, knob) in jobs.items():
            n = 1 if name == "single" else 2
            try:
                ranks = job(
                    peer,
                    extra,
                    tmp / name,
                    np_=n,
                    hosts=f"localhost:{n}",
                    env={**env, **knob},
                    model_args=digits,
                )
                runs[name].append(summarize(ranks))
            except RuntimeError as exc:
                errors[name] = str(exc)
        for name, extra in xla.items():
            for model in ("digits_cnn", "wide_mlp"):
                key = f"{name}/{model}"
                ranks = job(
                    "independent",
                    extra,
                    tmp / key.replace("/", "_"),
                    np_=1,
                    hosts="localhost:1",
                    env=env,
                    model_args=["--model", model, "--epochs", "4", "--steps", "10"],
                )
                runs.setdefault(key, []).append(summarize(ranks))
        print(f"one host: round {r + 1}/{args.rounds} done", flush=True)
    return {"jobs": {k: median_of(v) for k, v in runs.items() if v}, "errors": errors}


def derive_local(jobs: dict) -> dict:
    """Add the ratios of the one-host jobs, and ``kmp`` = the job of kmp's default settings."""
    jobs = {k: v for k, v in jobs.items() if k != "kmp" and not k.startswith("xla_gain")}
    if default_job() in jobs:
        jobs["kmp"] = {**jobs[default_job()], "job": default_job()}
    limit = jobs["independent_pair"]["images_per_s"]
    single = jobs["single"]["images_per_s"]
    for name in [k for k in jobs if k.startswith(("kmp", "hvd", "mwms"))]:
        jobs[name]["vs_limit"] = round(jobs[name]["images_per_s"] / limit, 3)
        jobs[name]["efficiency"] = round(jobs[name]["images_per_s"] / (2 * single), 3)
    for model in ("digits_cnn", "wide_mlp"):
        on, off = jobs.get(f"xla_on/{model}"), jobs.get(f"xla_off/{model}")
        if on and off:
            jobs[f"xla_gain/{model}"] = round(on["images_per_s"] / off["images_per_s"], 3)
    return jobs


# ------------------------------------------------------------------------ cluster


def _kmp(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "kmp.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=base_env(),
    )


def cluster_reason() -> str | None:
    """Why the multi-host part cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root: kmp cluster needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "ip or tc is missing (iproute2)"
    return None


def cluster_part(args: argparse.Namespace, tmp: Path) -> dict:
    """wide_mlp on shaped links: per rate, per host count, each kmp variant and peer."""
    env = base_env()
    model = [
        "--model",
        "wide_mlp",
        "--batch",
        str(args.cluster_batch),
        "--epochs",
        str(args.cluster_epochs),
        "--steps",
        str(args.cluster_steps),
    ]
    out: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for rate in args.rates:
        _kmp("cluster", "down", "--name", CLUSTER)
        up = _kmp(
            "cluster", "up", "--name", CLUSTER, "--hosts", str(max(args.hosts)), "--rate", rate
        )
        if up.returncode != 0:
            errors[rate] = up.stdout[-1000:] + up.stderr[-2000:]
            continue
        try:
            via = [PY, "-m", "kmp.cli", "cluster", "exec", "--name", CLUSTER, "h1", "--"]
            for n in args.hosts:
                hosts = ",".join(f"h{i}:1" for i in range(1, n + 1))
                jobs = {"independent": ("independent", []), **CLUSTER_JOBS}
                for name, (peer, extra, *knob) in jobs.items():
                    key = f"{rate}/{n}/{name}"
                    try:
                        ranks = job(
                            peer,
                            extra,
                            tmp / key.replace("/", "_"),
                            np_=n,
                            hosts=hosts,
                            env={**env, **(knob[0] if knob else {})},
                            via=via,
                            nic="eth0",
                            model_args=model,
                        )
                        out[key] = summarize(ranks)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        errors[key] = str(exc)[-2000:]
                print(f"cluster: {rate}, {n} hosts done", flush=True)
        finally:
            _kmp("cluster", "down", "--name", CLUSTER)
    return {"jobs": out, "errors": errors}


def gradient_bytes(model: str = "wide_mlp") -> int:
    """Bytes of the float32 gradients of a benchmark model (what a step exchanges)."""
    import models

    return int(models.build(model).count_params()) * 4


def add_limits(row: dict, key: str, jobs: dict, batch: int, float32_bytes: int) -> None:
    """Add a links row's traffic, its four limits (bench/limits.py) and its ratio to each."""
    import limits

    rate, n, name = key.split("/")
    independent = jobs.get(f"{rate}/{n}/independent")
    if not independent or name == "independent":
        return
    payload, algorithm = limits.job_traffic(row.get("job", name), float32_bytes)
    sent = limits.bytes_sent_per_rank(payload, int(n), algorithm)
    lim = limits.limits(independent["images_per_s"], batch, int(n), sent, limits.rate_bits(rate))
    row["traffic"] = {"algorithm": algorithm, "sent_bytes_per_rank": round(sent)}
    row["limits"] = {k: round(v, 4 if k.startswith("t_") else 1) for k, v in lim.items()}
    for kind in ("wire", "non_overlapped", "overlapped"):
        row[f"vs_{kind}"] = round(row["images_per_s"] / lim[kind], 3)


def derive_cluster(jobs: dict, batch: int | None = None, float32_bytes: int | None = None) -> dict:
    """Add each job's ratio to kmp's one bucket and to the limit; ``kmp`` = the default's job.

    With the batch and the gradient bytes, also its wire and combined limits.
    """
    jobs = {k: dict(v) for k, v in jobs.items() if not k.endswith("/kmp")}
    for key in list(jobs):
        rate, n, name = key.split("/")
        if name == default_job():
            jobs[f"{rate}/{n}/kmp"] = {**jobs[key], "job": default_job()}
    for key, row in jobs.items():
        rate, n, name = key.split("/")
        base = jobs.get(f"{rate}/{n}/kmp_one_bucket")
        if base and name not in ("kmp_one_bucket", "independent"):
            row["vs_one_bucket"] = round(row["images_per_s"] / base["images_per_s"], 3)
        limit = jobs.get(f"{rate}/{n}/independent")
        if limit:
            row["vs_limit"] = round(row["images_per_s"] / limit["images_per_s"], 3)
        if batch and float32_bytes:
            add_limits(row, key, jobs, batch, float32_bytes)
    return jobs


# ------------------------------------------------------------------------ report


def report(result: dict, name: str) -> Path:
    """Derive the ratios and targets of ``result`` and write NAME.json, .md and .png."""
    from _common import write_results
    from peers_report import markdown, plot, targets

    result["local"]["jobs"] = derive_local(result["local"]["jobs"])
    if "jobs" in result["cluster"]:
        batch = result.get("settings", {}).get("cluster_batch")
        result["cluster"]["float32_gradient_bytes"] = gradient_bytes("wide_mlp")
        result["cluster"]["jobs"] = derive_cluster(
            result["cluster"]["jobs"], batch, result["cluster"]["float32_gradient_bytes"]
        )
    result["default_job"] = default_job()
    result["targets"] = targets(result, TARGETS)
    md = markdown(result)
    path = write_results(name, result, md)
    plot(result, path.with_suffix(".png"))
    print(md)
    print(f"\nwritten to {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    from _common import machine

    args = parse_args(argv)
    if args.report:  # figures already measured: derive and write them again
        result = json.loads(Path(args.report).read_text())
        report(result, Path(args.report).stem)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="kmp-peers-"))
    start = time.time()
    result: dict = {"local": local_part(args, tmp)}
    reason = "--no-cluster" if args.no_cluster else cluster_reason()
    result["cluster"] = {"skipped": reason} if reason else cluster_part(args, tmp)
    result["settings"] = {k: v for k, v in vars(args).items()}
    result["machine"] = machine()
    result["load_average"] = list(os.getloadavg())
    result["seconds"] = round(time.time() - start, 1)
    report(result, "peers_quick" if args.quick else "peers")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
