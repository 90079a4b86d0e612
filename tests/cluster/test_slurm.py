"""SLURM for real: slurmctld and slurmd on a kmp cluster, jobs submitted with ``sbatch``.

One cluster of three hosts (two CPUs each) with SLURM serves the module
(``kmp cluster up --slurm``). Each job is a batch script that runs ``kmp launch
launch/train.py`` with no host list, as users write it: the hosts and slots come
from the allocation and ``srun`` starts the ranks. Checked: the ranks run on the
allocation's nodes and end bit-identical, on Horovod (Gloo and MPI through PMIx)
and on the JAX engine, with the accuracy of the same job on one node; a job whose
node fails is requeued by SLURM and resumes from its last checkpoint to the same
accuracy as the run that never failed; a job warned of its time limit checkpoints
at one agreed step, requeues itself and resumes there; ``scancel`` leaves no rank
behind and the job cancelled. The four
training jobs run two at a time (class Jobs), and each test reads only the jobs it
checks.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kmp.cluster.slurm_daemons import have_slurm
from tests.cluster._cluster_harness import (
    NAME,
    ROOT,
    cluster,
    digits_env,
    on_host,
    pids_with_env,
    requires_cluster,
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.distributed,
    pytest.mark.slow,
    requires_cluster,
    pytest.mark.skipif(
        not have_slurm(),
        reason="SLURM is not installed: `bash launch/setup.sh` as root installs slurmctld, "
        "slurmd, slurm-client and munge",
    ),
]

PY = sys.executable
EPOCHS = 12
TRAIN = ["launch/train.py", "--model", "digits_cnn", "--epochs", str(EPOCHS), "--verbose", "2"]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def slurm():
    start = time.monotonic()
    with cluster(3, slots=2, slurm=True) as info:
        print(f"SLURM cluster up in {time.monotonic() - start:.1f} s")
        yield info
    print(f"SLURM cluster up and down, tests included: {time.monotonic() - start:.0f} s")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return digits_env(tmp_path_factory.mktemp("tfds"))


def on_h1(*argv: str, env: dict | None = None, timeout: float = 60) -> str:
    proc = on_host("h1", *argv, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.stdout


def submit(folder: Path, name: str, sbatch: list[str], launch: list[str], env: dict) -> str:
    """``sbatch`` a script that runs ``kmp launch LAUNCH``; return the job id."""
    script = folder / f"{name}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {shlex.quote(str(ROOT))}\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST at $(date +%s.%N)"\n'
        f"exec {shlex.quote(PY)} -m kmp.cli launch {shlex.join(launch)}\n"
    )
    out = folder / f"{name}.out"
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={out}", *sbatch, str(script)]
    return on_h1(*argv, env=env).strip().split(";")[0]


def job_info(job: str) -> dict[str, str]:
    """``scontrol show job -o``: one line of KEY=VALUE fields."""
    line = on_h1("scontrol", "show", "job", "-o", job)
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def wait(job: str, until=lambda info: info["JobState"] in FINAL, timeout: float = 400) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job)
        if until(info):
            return info
        time.sleep(1)
    raise AssertionError(f"job {job} still {info['JobState']} after {timeout} s: {info}")


def wait_to_end(job: str, queued: float = 1200, running: float = 400) -> dict:
    """Wait while the job is held in the queue, then up to ``running`` s once it started."""
    wait(job, until=lambda i: i["JobState"] != "PENDING", timeout=queued)
    return wait(job, timeout=running)


def summaries(folder: Path, name: str, n: int) -> list[dict]:
    return [json.loads((folder / f"{name}-{r}.json").read_text()) for r in range(n)]


def train(folder: Path, name: str, *extra: str) -> list[str]:
    summary = str(folder / f"{name}-{{rank}}.json")
    return [*TRAIN, "--checkpoint-dir", str(folder / f"{name}-ckpt"), "--summary", summary, *extra]


class Jobs:
    """The module's four training jobs: each test waits for, and checks, only its own.

    Two jobs run at a time (``--dependency=afterany``): Gloo across two nodes beside
    the same job on one node, then the JAX engine beside MPI. Four 2-node jobs at
    once share the machine's 2 cores eightfold; a job that fails or is slow errors
    only the tests that read it.
    """

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder = folder
        two, one = ["--nodes=2", "--ntasks-per-node=1"], ["--nodes=1", "--ntasks-per-node=2"]
        self.ids = {
            "gloo": submit(folder, "gloo", two, train(folder, "gloo"), env),
            "one-node": submit(folder, "one-node", one, train(folder, "one-node"), env),
        }
        after = [f"--dependency=afterany:{self.ids['gloo']}:{self.ids['one-node']}"]
        jax = ["--engine", "jax", *train(folder, "jax")]
        self.ids["jax"] = submit(folder, "jax", [*two, *after], jax, env)
        mpi = ["--mpi", *train(folder, "mpi")]
        self.ids["mpi"] = submit(folder, "mpi", [*two, *after], mpi, env)
        self._ended: dict[str, dict] = {}

    def ended(self, name: str) -> dict:
        """The job's final ``scontrol`` fields, once it ended (in any state)."""
        if name not in self._ended:
            self._ended[name] = wait_to_end(self.ids[name])
        return self._ended[name]

    def settle(self) -> None:
        """Wait for every job to end: nothing of theirs runs on a node a test takes down."""
        for name in self.ids:
            self.ended(name)

    def result(self, name: str) -> dict:
        """The completed job's fields, log and per-rank summaries; fails if it did not."""
        info = self.ended(name)
        log = (self.folder / f"{name}.out").read_text(errors="replace")
        assert info["JobState"] == "COMPLETED", f"{name}: {info}\n{log[-6000:]}"
        return {"info": info, "log": log, "ranks": summaries(self.folder, name, 2)}


@pytest.fixture(scope="module")
def jobs(slurm, env, tmp_path_factory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("jobs"), env)


@pytest.mark.parametrize("name", ["gloo", "mpi", "jax"])
def test_an_sbatch_job_on_two_nodes_ends_bit_identical(jobs, name):
    run = jobs.result(name)
    ranks = run["ranks"]
    hosts = [r["hostname"] for r in ranks]
    # One rank per node, in the allocation's order, as srun placed them.
    assert hosts == on_h1("scontrol", "show", "hostnames", run["info"]["NodeList"]).split()
    assert len(set(hosts)) == 2
    assert all(r["ranks"] == 2 and r["weights_max_diff"] == 0.0 for r in ranks)
    assert ranks[0]["engine"] == ("jax" if name == "jax" else "horovod")
    assert ranks[0]["test_accuracy"] > 0.9
    print(f"{name}: hosts {hosts}, accuracy {ranks[0]['test_accuracy']:.4f}, weights' max "
          f"difference {ranks[0]['weights_max_diff']}")  # fmt: skip


def test_two_nodes_train_exactly_as_one_node_does(jobs):
    """Horovod over Gloo across nodes, over MPI, and on one node: the same sums, same model."""
    finished = {name: jobs.result(name) for name in jobs.ids}
    one = finished["one-node"]["ranks"]
    assert [r["hostname"] for r in one] == [one[0]["hostname"]] * 2
    accuracy = {k: finished[k]["ranks"][0]["test_accuracy"] for k in ("one-node", "gloo", "mpi")}
    assert len(set(accuracy.values())) == 1, accuracy
    jax = finished["jax"]["ranks"][0]["test_accuracy"]
    assert abs(jax - accuracy["gloo"]) < 0.03, (jax, accuracy)  # another engine's arithmetic


def _is_rank(pid: int) -> bool:
    """A training process itself: not the launcher, srun or the task module before it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"train.py") for a in argv[1:2])


def _ranks(marker: str) -> list[int]:
    return [p for p in pids_with_env(marker) if _is_rank(p)]


def _until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.5)


def test_a_warned_job_requeues_itself_and_resumes_and_scancel_then_ends_it(slurm, env, tmp_path):
    """A time limit's warning (``--signal=USR1@T`` sends SIGUSR1 to the ranks, as ``scancel
    --signal=USR1`` does here, when we choose) makes every rank checkpoint at one agreed
    step and exit 75; kmp launch requeues the job (on by default) and the second run goes
    on from that step's checkpoint. ``scancel`` then ends every rank, and
    the job stays cancelled: its SIGTERM reaches kmp launch too, which then never requeues."""
    marker = f"KMP_SLURM_TEST_JOB=cancel-{tmp_path.name}"
    job_env = {**env, marker.split("=")[0]: marker.split("=")[1]}
    args = [*train(tmp_path, "cancel"), "--epochs", "500", "--checkpoint-every-steps", "4"]
    sbatch = ["--nodes=2", "--ntasks-per-node=1", "--requeue", "--open-mode=append"]
    job = submit(tmp_path, "cancel", sbatch, args, job_env)
    ckpt, out = tmp_path / "cancel-ckpt", tmp_path / "cancel.out"
    _until(lambda: ckpt.is_dir() and any(ckpt.glob("*-step-*")), 180, "a step checkpoint")
    assert len(_ranks(marker)) == 2, "one rank on each node should run"
    on_h1("scancel", "--signal=USR1", job)  # to every step's tasks, not the batch shell
    wait(job, until=lambda i: int(i.get("Restarts", 0)) >= 1, timeout=120)
    _until(lambda: "resumed from" in out.read_text(errors="replace"), 120, "a resumed run")
    log = out.read_text(errors="replace")
    assert "requeuing job" in log, log[-4000:]
    written = next(line for line in log.splitlines() if "SIGUSR1 during" in line)
    path = written.split(": checkpoint ")[1].split(" written")[0]
    assert f"resumed from {path}:" in log, log[-4000:]  # the warning's own checkpoint
    _until(lambda: len(_ranks(marker)) == 2, 60, "the second run's ranks")
    on_h1("scancel", job)
    _until(lambda: not pids_with_env(marker), 30, "scancel left processes of the job running")
    info = wait(job, timeout=30)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", info


def test_a_failed_node_requeues_the_job_which_resumes_exactly(slurm, env, jobs, tmp_path):
    """The network link of one of the job's nodes goes down mid-training (a dead node, as the
    other nodes see it). SLURM marks it DOWN, requeues the job, and runs it again on the two
    nodes left; the job resumes from its last checkpoint and ends where the run that never
    failed ended."""
    jobs.settle()  # nothing else runs on the node whose link goes down
    reference = jobs.result("gloo")["ranks"][0]
    launch = ["--gloo-timeout", "300", *train(tmp_path, "requeue")]
    sbatch = ["--nodes=2", "--ntasks-per-node=1", "--requeue", "--open-mode=append"]
    job = submit(tmp_path, "requeue", sbatch, launch, env)
    first = wait(job, until=lambda i: i["JobState"] == "RUNNING")
    nodes = on_h1("scontrol", "show", "hostnames", first["NodeList"]).split()
    ckpt = tmp_path / "requeue-ckpt"
    deadline = time.monotonic() + 240
    while not (ckpt / "ckpt-0003.keras").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    failed = nodes[-1]
    subprocess.run(["ip", "netns", "exec", f"{NAME}-{failed}", "ip", "link", "set", "eth0",
                    "down"], check=True)  # fmt: skip
    t_fail = time.time()
    requeued = wait(job, until=lambda i: int(i.get("Restarts", 0)) >= 1, timeout=120)
    t_requeue = time.time()
    info = wait(job)
    log = (tmp_path / "requeue.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log[-6000:]}"
    second = on_h1("scontrol", "show", "hostnames", info["NodeList"]).split()
    assert failed not in second and len(second) == 2
    ranks = summaries(tmp_path, "requeue", 2)
    resumed = ranks[0]["resumed_from"]
    assert resumed and 3 <= ranks[0]["initial_epoch"] < EPOCHS, ranks[0]
    assert all(r["weights_max_diff"] == 0.0 for r in ranks)
    assert ranks[0]["test_accuracy"] == reference["test_accuracy"]  # exact resume
    restarted = [float(line.split()[-1]) for line in log.splitlines() if line.startswith("run 1 ")]
    print(
        f"requeue: {nodes} -> link of {failed} down at 0 s; requeued "
        f"(Restarts={requeued['Restarts']}) at +{t_requeue - t_fail:.0f} s; run 1 started at "
        f"+{restarted[0] - t_fail:.0f} s on {second}, resumed from epoch "
        f"{ranks[0]['initial_epoch']}; test accuracy {ranks[0]['test_accuracy']:.4f} "
        f"(never-failed run: {reference['test_accuracy']:.4f})"
    )
