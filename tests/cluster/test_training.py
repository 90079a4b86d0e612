"""Multi-host training on a real kmp cluster: ssh between namespaces, Gloo and MPI.

One cluster of three hosts serves the module. Every job is started on h1 with
``kmp cluster exec h1 -- kmp launch ...`` (or ``launch/hostfile.sh``), exactly as
a user would, and checked for what multi-host training must get right: ranks on
the right hosts with the right local and cross ranks, disjoint data shards that
together cover the split, ``KMP_*`` settings on every rank, every rank skipping
an overflow injected on one rank, identical weights, and checkpoints from rank 0
only. Bad hosts and interfaces fail within seconds with a message naming them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.cluster._cluster_harness import ROOT, cluster, digits_env, on_host, requires_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.distributed, pytest.mark.slow, requires_cluster]

PY = sys.executable
TRAIN = str(ROOT / "launch" / "train.py")
TOPOLOGY = str(Path(__file__).with_name("worker_topology.py"))
DIGITS_TRAIN = 1438  # examples in kmp_digits' train split


@pytest.fixture(scope="module")
def hosts():
    with cluster(3, slots=2) as info:
        yield info


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return digits_env(tmp_path_factory.mktemp("tfds"), KMP_PROBE_TOKEN="from-the-caller")


def launch(*args: str, env: dict, timeout: float = 240):
    """``kmp launch ARGS`` started on h1."""
    return on_host("h1", PY, "-m", "kmp.cli", "launch", *args, env=env, timeout=timeout)


def check_ok(proc) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}"
    )


def layout(kind: str) -> tuple[str, list[tuple[str, int, int]]]:
    """``-H`` value and, per rank, (host, local_rank, cross_rank)."""
    if kind == "3x1":
        return "h1:1,h2:1,h3:1", [("h1", 0, 0), ("h2", 0, 1), ("h3", 0, 2)]
    if kind == "2x1":
        return "h1:1,h2:1", [("h1", 0, 0), ("h2", 0, 1)]
    return "h1:2,h2:2", [("h1", 0, 0), ("h1", 1, 0), ("h2", 0, 1), ("h2", 1, 1)]


def read_ranks(folder: Path, pattern: str, n: int) -> list[dict]:
    files = [folder / pattern.format(rank=r) for r in range(n)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"no result from {missing}"
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("kind", ["3x1", "2x2"])
def test_ranks_hosts_settings_and_data_shards(hosts, env, tmp_path, kind):
    spec, expected = layout(kind)
    n = len(expected)
    # The command as users type it: no controller flag (kmp launch's default is Gloo).
    proc = launch("-np", str(n), "-H", spec, "--network-interface", "eth0",
                  TOPOLOGY, str(tmp_path), env["KMP_DATA_DIR"], env=env)  # fmt: skip
    check_ok(proc)
    ranks = read_ranks(tmp_path, "rank{rank}.json", n)
    hosts_n = len({h for h, _, _ in expected})
    for r, (host, local_rank, cross_rank) in zip(ranks, expected, strict=True):
        assert (r["hostname"], r["local_rank"], r["cross_rank"]) == (host, local_rank, cross_rank)
        assert (r["size"], r["local_size"], r["cross_size"]) == (n, n // hosts_n, hosts_n)
        assert r["kmp_env"] == {"KMP_PROBE_TOKEN": "from-the-caller"}  # on every host
    shards = [set(r["ids"]) for r in ranks]
    assert sum(len(s) for s in shards) == len(set().union(*shards))  # disjoint
    assert len(set().union(*shards)) == DIGITS_TRAIN == ranks[0]["total"]  # the whole split


def train_args(tmp_path: Path) -> list[str]:
    return [
        TRAIN, "--model", "digits_cnn", "--epochs", "2", "--batch-size", "32",
        "--inject-overflow", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--summary", str(tmp_path / "summary-{rank}.json"), "--verbose", "2",
    ]  # fmt: skip


def check_training(tmp_path: Path, kind: str, out: str) -> list[dict]:
    _, expected = layout(kind)
    n = len(expected)
    runs = read_ranks(tmp_path, "summary-{rank}.json", n)
    assert f"rank {n - 1}: step 3 will overflow" in out  # injected on the last rank only
    for s, (host, local_rank, cross_rank) in zip(runs, expected, strict=True):
        assert s["policy"] == "mixed_float16" and s["ranks"] == n
        assert (s["hostname"], s["local_rank"], s["cross_rank"]) == (host, local_rank, cross_rank)
        assert s["weights_max_diff"] == 0.0  # allgathered over every rank: identical weights
    # The overflow on one rank made every rank skip the same steps, step 3 among them,
    # with the same scale.
    assert all(s["skipped_at"] == runs[0]["skipped_at"] for s in runs)
    assert 3 in runs[0]["skipped_at"]
    assert {s["skipped_steps"] for s in runs} == {len(runs[0]["skipped_at"])}
    assert {s["loss_scale_end"] for s in runs} == {runs[0]["loss_scale_end"]}
    assert {s["iterations_end"] for s in runs} == {runs[0]["iterations_end"]}
    # Checkpoints: written by rank 0 only, one per epoch, and nothing else in the folder.
    assert len(runs[0]["checkpoints_written"]) == 2
    assert all(s["checkpoints_written"] == [] for s in runs[1:])
    on_disk = sorted(str(p) for p in (tmp_path / "ckpt").iterdir())
    assert on_disk == sorted(runs[0]["checkpoints_written"])
    assert runs[0]["test_accuracy"] > 0.5
    return runs


def test_three_hosts_one_slot_gloo_overflow_on_one_rank(hosts, env, tmp_path):
    start = time.monotonic()
    proc = launch("-np", "3", "-H", "h1:1,h2:1,h3:1", "--network-interface", "eth0", "--gloo",
                  "--policy", "mixed_float16", *train_args(tmp_path), env=env)  # fmt: skip
    check_ok(proc)
    check_training(tmp_path, "3x1", proc.stdout + proc.stderr)
    print(f"3 hosts x 1 slot, Gloo: {time.monotonic() - start:.0f} s")


def test_two_hosts_on_the_jax_engine_overflow_on_one_process(hosts, env, tmp_path):
    job_env = {k: v for k, v in env.items() if k != "KERAS_BACKEND"}
    proc = launch("--engine", "jax", "-np", "2", "-H", "h1:1,h2:1", "--network-interface",
                  "eth0", "--policy", "mixed_float16", *train_args(tmp_path),
                  env=job_env)  # fmt: skip
    check_ok(proc)
    out = proc.stdout + proc.stderr
    assert "joins the JAX job at h1:" in out  # the coordinator runs on the first host
    runs = check_training(tmp_path, "2x1", out)
    assert runs[0]["engine"] == "jax" and runs[0]["jit_compile"] is True


def test_two_hosts_two_slots_gloo_through_the_hostfile_script(hosts, env, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two hosts of the test cluster\nh1 slots=2\nh2 slots=2\n")
    job_env = {**env, "KMP_POLICY": "mixed_float16",
               "KMP_LAUNCH_ARGS": "--gloo --network-interface eth0"}  # fmt: skip
    proc = on_host("h1", "bash", str(ROOT / "launch" / "hostfile.sh"), str(hostfile),
                   *train_args(tmp_path), env=job_env)  # fmt: skip
    check_ok(proc)
    check_training(tmp_path, "2x2", proc.stdout + proc.stderr)


def _mpi_reason() -> str | None:
    import shutil

    if shutil.which("mpirun") is None:
        return "OpenMPI is not installed (bash launch/setup.sh installs it as root)"
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return "Horovod is not installed"
    if not hvd.mpi_built():
        return "Horovod was built without MPI (rerun bash launch/setup.sh after OpenMPI)"
    return None


@pytest.mark.skipif(_mpi_reason() is not None, reason=_mpi_reason() or "")
def test_two_hosts_two_slots_mpi(hosts, env, tmp_path):
    proc = launch("-np", "4", "-H", "h1:2,h2:2", "--network-interface", "eth0", "--mpi",
                  "--policy", "mixed_float16", *train_args(tmp_path), env=env)  # fmt: skip
    check_ok(proc)
    check_training(tmp_path, "2x2", proc.stdout + proc.stderr)


def test_an_unreachable_host_is_named_within_seconds(hosts, env):
    start = time.monotonic()
    proc = launch("-np", "2", "-H", "h1:1,h9:1", "--network-interface", "eth0", TRAIN,
                  env=env, timeout=60)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "host 'h9' cannot be reached by ssh" in proc.stderr
    assert "h1" not in proc.stderr.split("error:", 1)[1].split("(")[0]  # only h9 is blamed
    assert elapsed < 20, elapsed
    assert "Epoch" not in proc.stdout  # nothing started


def test_a_missing_interface_is_named_within_seconds(hosts, env):
    start = time.monotonic()
    proc = launch("-np", "2", "-H", "h1:1,h2:1", "--network-interface", "eth7", TRAIN,
                  env=env, timeout=60)  # fmt: skip
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for host in ("h1", "h2"):
        assert f"network interface 'eth7' does not exist on host '{host}'" in proc.stderr
    assert "(it has: eth0, lo)" in proc.stderr
    assert elapsed < 20, elapsed


def test_cluster_env_is_clean_of_launcher_variables():
    """The harness itself must not leak a launcher's world size into these tests."""
    assert not any(k in os.environ for k in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE"))
