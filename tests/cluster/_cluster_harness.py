"""The multi-host harness for tests: a real ``kmp cluster`` that is always taken down.

``cluster(...)`` brings a cluster up with the real CLI (namespaces, sshd, ssh
keys) and takes it down when the block ends, also when the block raised; then
it checks that nothing is left behind. Tests that need it are marked
``cluster`` and skip, with the reason, where the machine cannot host one (not
root, not Linux, no sshd / iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kmp.cluster.blueprint import state_root

ROOT = Path(__file__).resolve().parents[2]
NAME = "kmptest"
STATE_ROOT = state_root()
# Set in the environment of everything a test starts on the cluster, so leftovers are found.
TAG = "KMP_CLUSTER_TEST_TAG"


def unavailable_reason() -> str | None:
    """Why a cluster cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"kmp cluster needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "kmp cluster needs root (CI runs as root): multi-host tests skipped"
    missing = [t for t in ("ip", "unshare", "ssh", "ssh-keygen") if shutil.which(t) is None]
    if not os.access("/usr/sbin/sshd", os.X_OK):
        missing.append("sshd")
    if missing:
        return f"missing {', '.join(missing)}: run `bash launch/setup.sh` as root to install them"
    return None


requires_cluster = pytest.mark.skipif(
    unavailable_reason() is not None, reason=unavailable_reason() or ""
)


def kmp(*args: str, timeout: float = 120, check: bool = True, env: dict | None = None):
    """Run ``kmp ARGS`` with this Python; return the CompletedProcess.

    It runs in a session of its own: on a timeout the whole process group (ssh,
    horovodrun, ranks) is killed, not only ``kmp``, and the timeout is raised.
    """
    child = subprocess.Popen(
        [sys.executable, "-m", "kmp.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), TAG: NAME, **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        raise AssertionError(
            f"kmp {' '.join(args)} ran past {timeout} s and was killed\n{out[-3000:]}\n"
            f"{err[-5000:]}"
        ) from None
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"kmp {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
    return proc


def leftovers(name: str = NAME) -> list[str]:
    """Everything a cluster called ``name`` could leave on the machine, if any is there."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {n}" for n in netns.split() if n.startswith(f"{name}-")]
    marker = f"# kmp-cluster:{name}"
    found += [f"/etc/hosts: {ln}" for ln in Path("/etc/hosts").read_text().splitlines()
              if ln.endswith(marker)]  # fmt: skip
    conf = Path(f"/etc/ssh/ssh_config.d/kmp-cluster-{name}.conf")
    if conf.exists():
        found.append(str(conf))
    if (STATE_ROOT / name).exists():
        found.append(str(STATE_ROOT / name))
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [f"process {ln.strip()}" for ln in ps.splitlines() if f"kmp-cluster/{name}/" in ln]
    found += [f"process {pid} started by a test" for pid in _tagged_pids(name)]
    return found


def _tagged_pids(name: str) -> list[int]:
    """Live processes whose environment carries the test tag (jobs, ranks, their children)."""
    return pids_with_env(f"{TAG}={name}")


def pids_with_env(entry: str) -> list[int]:
    """Live processes (this one aside) whose environment holds ``entry`` (``NAME=value``)."""
    needle = entry.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                if stat not in ("Z", "X"):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def status(name: str = NAME) -> dict:
    """``kmp cluster status --json``, parsed."""
    out = kmp("cluster", "status", "--json", "--name", name, check=False).stdout
    return json.loads(out)


@contextlib.contextmanager
def cluster(
    hosts: int, *, slots: int = 1, rate: str | None = None, slurm: bool = False
) -> Iterator[dict]:
    """A running cluster for the ``with`` block; down afterwards, and checked clean."""
    kmp("cluster", "down", "--name", NAME, check=False)  # a leftover of an aborted run
    args = ["cluster", "up", "--name", NAME, "--hosts", str(hosts), "--slots", str(slots)]
    if rate:
        args += ["--rate", rate]
    if slurm:
        args.append("--slurm")
    try:
        kmp(*args, timeout=180)
        yield status()
    finally:
        kmp("cluster", "down", "--name", NAME, check=False)
        left = leftovers()
        assert not left, f"kmp cluster down left behind: {left}"


def digits_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a training job on the cluster: kmp_digits prepared in ``data_dir``."""
    from kmp import datasets

    datasets.prepare("kmp_digits", data_dir)
    return {
        "KMP_DATA_DIR": str(data_dir),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def on_host(
    host: str, *argv: str, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``host`` of the test cluster (``kmp cluster exec``); never raises."""
    return kmp("cluster", "exec", "--name", NAME, host, "--", *argv, timeout=timeout,
               check=False, env=env)  # fmt: skip
