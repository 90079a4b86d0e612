"""SLURM on a ``kmp cluster``: munged on every host, slurmctld on h1, slurmd on every host.

``kmp cluster up --slurm`` makes the hosts a SLURM cluster with Debian's packages
(``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``), so that ``sbatch``,
``srun``, ``scancel`` and requeueing can be tried on one machine. What it runs,
all under the cluster's folder ``S = STATE/NAME/slurm``:

* **munge**: one key (``mungekey``), and one ``munged`` per host with its own
  socket. A shared one would refuse the second node of a multi-node step: a
  step's credential is decoded by every node, and munged rejects a credential it
  has seen before ("replayed").
* **one slurm.conf per host**, the same but for ``AuthInfo=socket=`` (which
  munged that host's daemons and commands use) and so ``DebugFlags=NO_CONF_HASH``.
  The nodes are ``NodeName=hI NodeAddr=10.77.0.I CPUs=SLOTS``; slurmctld runs on
  h1. No cgroups (``proctrack/linuxproc``, ``task/none``; ``ip netns exec``
  mounts a sysfs without them), and short timers: a node is DOWN about 10 s after
  its slurmd dies (``SlurmdTimeout``) and a requeued job starts again about 11 s
  later (``cred_expire``; SLURM's defaults are minutes).
* every daemon in the foreground, started through the host's namespace and host
  name (:func:`kmp.cluster.state.host_argv`), its pid recorded; ``down`` stops
  them with everything else on the hosts.

Commands reach the cluster from a host with ``SLURM_CONF`` set to that host's
file (``kmp cluster exec`` sets it), e.g.
``kmp cluster exec h1 -- sbatch -N2 job.sh``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from kmp.cluster import blueprint as cp
from kmp.cluster.state import ClusterError, host_argv, pid_alive, run_cmd, save_state

__all__ = [
    "PACKAGES",
    "TOOLS",
    "cgroup_conf",
    "client",
    "conf_path",
    "daemons",
    "have_slurm",
    "mpi_conf",
    "node_states",
    "require_slurm",
    "slurm_conf",
    "slurm_dir",
    "start",
]

PACKAGES = "slurmctld slurmd slurm-client munge"
TOOLS = {
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/bin/sinfo": "slurm-client",
    "/usr/bin/sbatch": "slurm-client",
    "/usr/sbin/munged": "munge",
    "/usr/sbin/mungekey": "munge",
}
READY_S = 60.0


def slurm_dir(plan: cp.ClusterPlan) -> Path:
    """The folder of the cluster's SLURM files: key, configs, sockets, spools, logs."""
    return plan.state_dir / "slurm"


def conf_path(plan: cp.ClusterPlan, host: cp.HostPlan) -> Path:
    """``host``'s slurm.conf: what ``SLURM_CONF`` names for commands run on it."""
    return slurm_dir(plan) / host.name / "slurm.conf"


def slurm_conf(plan: cp.ClusterPlan, host: cp.HostPlan) -> str:
    """The slurm.conf of ``host`` (pure): every host's differs only in its munge socket."""
    s = slurm_dir(plan)
    first = plan.hosts[0]
    lines = [
        f"ClusterName={plan.name}",
        f"SlurmctldHost={first.name}({first.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long a requeued job waits before it starts again.
        f"AuthInfo=socket={s / host.name / 'munge.socket'},cred_expire=10",
        "DebugFlags=NO_CONF_HASH",  # the files differ on purpose (their AuthInfo)
        f"StateSaveLocation={s / 'ctld'}",
        f"SlurmctldPidFile={s / 'ctld' / 'slurmctld.pid'}",
        f"SlurmctldLogFile={s / 'ctld' / 'slurmctld.log'}",
        f"SlurmdSpoolDir={s / '%n' / 'spool'}",
        f"SlurmdPidFile={s / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={s / '%n' / 'slurmd.log'}",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerParameters=bf_interval=1,sched_interval=2",
        "SlurmdParameters=config_overrides",  # trust CPUs= below: the hosts share the cores
        "PropagateResourceLimits=NONE",
        "JobRequeue=1",
        "ReturnToService=2",
        "SlurmdTimeout=10",
        "KillWait=5",
        "MinJobAge=600",
    ]
    lines += [
        f"NodeName={h.name} NodeAddr={h.address} CPUs={plan.slots} State=UNKNOWN"
        for h in plan.hosts
    ]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    """cgroup.conf: slurmd always loads a cgroup plugin; v1's starts without a cgroup mount."""
    return "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


def mpi_conf(plan: cp.ClusterPlan, host: cp.HostPlan) -> str:
    """mpi.conf: each host's own PMIx folder (they share ``/tmp``, where the names collide)."""
    return f"PMIxCliTmpDirBase={slurm_dir(plan) / host.name / 'pmix'}\n"


def require_slurm() -> None:
    """Check that SLURM's and munge's programs are installed, with what to do if not."""
    missing = _missing()
    if missing:
        raise ClusterError(
            f"kmp cluster up --slurm needs {', '.join(missing)}, which are not installed. "
            f"Install them with `apt-get update && apt-get install -y {PACKAGES}` (bash "
            "launch/setup.sh does this when it runs as root), then run kmp cluster up again."
        )


def _spawn(
    plan: cp.ClusterPlan, state: dict[str, Any], host: cp.HostPlan, what: str, argv: list[str]
) -> int:
    log = slurm_dir(plan) / host.name / f"{what}.out"
    with open(log, "ab") as out:
        child = subprocess.Popen(
            host_argv(host, argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    state["slurm"][f"{what}:{host.name}"] = child.pid
    save_state(plan, state)
    return child.pid


def _wait(what: str, ready, pid: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if not pid_alive(pid):
            break
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no output)"
    raise ClusterError(f"{what} did not start; its output ends:\n{tail}")


def client(plan: cp.ClusterPlan, host: cp.HostPlan, *argv: str, timeout: float = 30) -> str:
    """Run a SLURM command (``sinfo``, ``scontrol`` ...) on ``host``; return its output."""
    env_argv = ["env", f"SLURM_CONF={conf_path(plan, host)}", *argv]
    return run_cmd(*host_argv(host, env_argv), timeout=timeout)


def node_states(plan: cp.ClusterPlan) -> dict[str, str]:
    """Each node's state as ``sinfo`` prints it (``idle``, ``alloc``, ``down*`` ...)."""
    out = client(plan, plan.hosts[0], "sinfo", "-N", "-h", "-o", "%N %T")
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def start(plan: cp.ClusterPlan, state: dict[str, Any], timeout_s: float = READY_S) -> None:
    """Start munged, slurmctld and slurmd; return once every node is idle.

    Each pid is recorded in ``state["slurm"]`` before the next step. The caller has
    checked the programs (:func:`require_slurm`, which ``ops.up`` runs before it makes
    anything).

    Raises:
        ClusterError: A daemon that exits or a node that is not idle within ``timeout_s``,
            with the end of its log.
    """
    s = slurm_dir(plan)
    state["slurm"] = {}
    save_state(plan, state)
    (s / "ctld").mkdir(parents=True, mode=0o755)
    os.chmod(s, 0o755)
    key = s / "munge.key"
    run_cmd("/usr/sbin/mungekey", "--create", f"--keyfile={key}")
    os.chmod(key, 0o600)
    for h in plan.hosts:
        d = s / h.name
        d.mkdir(mode=0o755)
        (d / "slurm.conf").write_text(slurm_conf(plan, h))
        (d / "cgroup.conf").write_text(cgroup_conf())
        (d / "mpi.conf").write_text(mpi_conf(plan, h))
        for sub in ("spool", "pmix"):
            (d / sub).mkdir(mode=0o755)
        sock = d / "munge.socket"
        argv = ["/usr/sbin/munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
                f"--log-file={d / 'munged.log'}"]  # fmt: skip
        pid = _spawn(plan, state, h, "munged", argv)
        _wait(f"munged on {h.name}", sock.exists, pid, d / "munged.out", 10)
    first = plan.hosts[0]
    conf = conf_path(plan, first)
    pid = _spawn(
        plan, state, first, "slurmctld", ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(conf)]
    )
    for h in plan.hosts:
        argv = ["/usr/sbin/slurmd", "-D", "-N", h.name, "-f", str(conf_path(plan, h))]
        _spawn(plan, state, h, "slurmd", argv)

    def all_idle() -> bool:
        try:
            states = node_states(plan)
        except ClusterError:  # slurmctld not answering yet
            return False
        return len(states) == len(plan.hosts) and set(states.values()) == {"idle"}

    _wait("SLURM (every node idle)", all_idle, pid, s / first.name / "slurmctld.out", timeout_s)


def daemons(state: dict[str, Any]) -> dict[str, bool]:
    """Each recorded SLURM daemon (``slurmd:h2`` ...) and whether it still runs."""
    return {k: pid_alive(p) for k, p in state.get("slurm", {}).items()}


def have_slurm() -> bool:
    """True when SLURM and munge are installed here (what ``up --slurm`` needs)."""
    return not _missing()


def _missing() -> list[str]:
    """The packages of :data:`TOOLS` whose programs are not installed."""
    return sorted({pkg for path, pkg in TOOLS.items() if not os.access(path, os.X_OK)})
