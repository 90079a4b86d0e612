"""The ground under ``kmp cluster``: its errors, system commands, and its recorded state.

``state.json`` in the cluster's folder records each thing ``up`` made before the
next step; :func:`load` reads it back for ``down``, ``exec`` and ``status``. One
``up`` or ``down`` runs at a time (:func:`locked`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from kmp._files import atomic_write_text
from kmp.cluster import blueprint as cp

__all__ = [
    "ClusterError",
    "check_state_dir",
    "host_argv",
    "is_our_sshd",
    "load",
    "locked",
    "pid_alive",
    "require_environment",
    "run_cmd",
    "running",
    "save_state",
    "write_private",
]

SSHD = "/usr/sbin/sshd"
PACKAGES = "openssh-server openssh-client iproute2 iputils-ping"
_HOSTNAME_THEN_EXEC = 'hostname "$0" && exec "$@"'


class ClusterError(RuntimeError):
    """``kmp cluster`` could not do what was asked; the message says why and what to do."""


# ------------------------------------------------------------------ helpers


def run_cmd(*argv: str, timeout: float = 30) -> str:
    """Run a system command; raise ClusterError with its output when it fails."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if proc.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


def host_argv(host: cp.HostPlan, argv: list[str]) -> list[str]:
    """The command that runs ``argv`` on ``host``: in its network namespace, with its hostname."""
    return [
        *("ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c"),
        _HOSTNAME_THEN_EXEC,
        host.name,
        *argv,
    ]


def require_environment(*, need_tc: bool = False) -> None:
    """Check for Linux, root and the tools ``up`` needs, with a message that says what to do."""
    if not sys.platform.startswith("linux"):
        raise ClusterError("kmp cluster needs Linux network namespaces; this is " + sys.platform)
    if os.geteuid() != 0:
        raise ClusterError(
            "kmp cluster needs root (it creates network namespaces, starts sshd and edits "
            "/etc/hosts): run it as root, e.g. `sudo .venv/bin/kmp cluster up --hosts 3`."
        )
    tools = {"ip": "iproute2", "unshare": "util-linux", "ssh": "openssh-client"}
    tools["ssh-keygen"] = "openssh-client"
    if need_tc:
        tools["tc"] = "iproute2"
    missing = sorted({pkg for tool, pkg in tools.items() if shutil.which(tool) is None})
    if not os.access(SSHD, os.X_OK):
        missing.append("openssh-server")
    if missing:
        raise ClusterError(
            f"kmp cluster needs {', '.join(sorted(set(missing)))}, which are not installed. "
            f"Install them with `apt-get update && apt-get install -y {PACKAGES}` (bash "
            "launch/setup.sh does this when it runs as root), then run kmp cluster up again."
        )


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``path`` atomically and durably with ``mode`` (private by default).

    The new file is created afresh, never through a symlink, with ``mode`` from
    the start (:func:`kmp._files.atomic_write_text`).
    """
    atomic_write_text(path, text, mode=mode)


def pid_alive(pid: int | None) -> bool:
    """True for a running process (a zombie, dead but not reaped, is not running)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def is_our_sshd(pid: int, host: cp.HostPlan) -> bool:
    """True when ``pid`` is the sshd that ``up`` started for ``host`` (by its config path)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(host.sshd_config_path) in cmdline


# ------------------------------------------------------------------ state


def save_state(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    """Record ``state`` in the cluster's ``state.json`` (atomically)."""
    write_private(plan.state_file, json.dumps(state, indent=2))


def load(name: str, root: Path | None = None) -> tuple[cp.ClusterPlan, dict[str, Any]] | None:
    """Return the plan and recorded state of cluster ``name``, or None when it is not up."""
    name = cp.check_name(name)
    path = (root or cp.state_root()) / name / "state.json"
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except ValueError as exc:
        raise ClusterError(
            f"the state of cluster {name!r} ({path}) is unreadable ({exc}); remove what it made "
            f"by hand (`ip netns list`, lines ending '# kmp-cluster:{name}' in /etc/hosts), "
            f"then delete {path.parent}."
        ) from None
    plan = cp.plan_cluster(
        state["hosts"],
        slots=state["slots"],
        rate=state["rate"],
        name=name,
        root=root,
        slurm=bool(state.get("slurm_enabled", False)),
    )
    return plan, state


def running(root: Path | None = None) -> list[str]:
    """The names of the clusters that have state on this machine."""
    base = root or cp.state_root()
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "state.json").is_file())


@contextlib.contextmanager
def locked(root: Path | None):
    """One ``up`` or ``down`` at a time on this machine (an exclusive lock file)."""
    base = root or cp.state_root()
    base.mkdir(parents=True, exist_ok=True, mode=0o755)
    with open(base / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_state_dir(path: Path) -> None:
    """The state folder must be root's own and private: sshd trusts the keys in it."""
    if path.is_symlink():
        raise ClusterError(f"{path} is a symlink; remove it (kmp cluster keeps keys there).")
    if path.exists():
        st = path.stat()
        if st.st_uid != 0 or st.st_mode & 0o077:
            raise ClusterError(
                f"{path} exists but is not private to root (uid {st.st_uid}, mode "
                f"{oct(st.st_mode & 0o777)}); remove it, or set {cp.STATE_ENV_VAR} to a private "
                "folder."
            )
