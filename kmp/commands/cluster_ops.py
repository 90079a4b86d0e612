"""What ``kmp cluster`` does to the machine: namespaces, veths, sshd, files, and undoing them.

:func:`up` realises a :class:`~kmp.commands.cluster_plan.ClusterPlan` step by
step and records each step in the cluster's ``state.json`` before taking the
next, so :func:`down` removes exactly what was made, also after a failed
``up`` (which calls it itself) or a crash, and a second ``down`` is harmless.
Nothing that was not recorded is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kmp.commands import cluster_plan as cp

__all__ = ["ClusterError", "down", "exec_on", "load", "running", "status", "up"]

SSHD = "/usr/sbin/sshd"
RUN_SSHD = Path("/run/sshd")  # sshd's privilege-separation directory
PACKAGES = "openssh-server openssh-client iproute2 iputils-ping"
_HOSTNAME_THEN_EXEC = 'hostname "$0" && exec "$@"'


class ClusterError(RuntimeError):
    """``kmp cluster`` could not do what was asked; the message says why and what to do."""


# ------------------------------------------------------------------ helpers


def _sh(*argv: str, timeout: float = 30) -> str:
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


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_our_sshd(pid: int, host: cp.HostPlan) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(host.sshd_config_path) in cmdline


# ------------------------------------------------------------------ state


def _save(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    _write_private(plan.state_file, json.dumps(state, indent=2))


def load(name: str, root: Path | None = None) -> tuple[cp.ClusterPlan, dict[str, Any]] | None:
    """Return the plan and recorded state of cluster ``name``, or None when it is not up."""
    name = cp.check_name(name)
    path = (root or cp.state_root()) / name / "state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    plan = cp.plan_cluster(
        state["hosts"], slots=state["slots"], rate=state["rate"], name=name, root=root
    )
    return plan, state


def running(root: Path | None = None) -> list[str]:
    """The names of the clusters that have state on this machine."""
    base = root or cp.state_root()
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "state.json").is_file())


# ------------------------------------------------------------------ up


def _check_free(plan: cp.ClusterPlan, root: Path | None) -> None:
    if load(plan.name, root) is not None:
        raise ClusterError(
            f"cluster {plan.name!r} is already up; run `kmp cluster down --name {plan.name}` "
            "first (or use it: `kmp cluster status`)."
        )
    others = [n for n in running(root) if n != plan.name]
    if others:
        raise ClusterError(
            f"cluster {others[0]!r} is up and uses the host names h1, h2, ...: two clusters "
            f"would clash. Run `kmp cluster down --name {others[0]}` first."
        )
    names = {h.name for h in plan.hosts}
    for line in cp.ETC_HOSTS.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        taken = sorted(names & set(fields[1:]))
        if taken:
            raise ClusterError(
                f"/etc/hosts already names {taken[0]} ({line.strip()!r}); a cluster host would "
                "clash with it. Remove that line, or use fewer hosts."
            )
    existing = set(_sh("ip", "netns", "list").split())
    clash = sorted(n for n in [plan.switch_netns, *(h.netns for h in plan.hosts)] if n in existing)
    if clash:
        raise ClusterError(
            f"network namespace {clash[0]!r} already exists but no cluster {plan.name!r} is "
            f"recorded: remove it (`ip netns del {clash[0]}`) or pick another --name."
        )


def _add_netns(plan: cp.ClusterPlan, state: dict[str, Any], netns: str) -> None:
    _sh("ip", "netns", "add", netns)
    state["netns"].append(netns)
    _save(plan, state)
    _sh("ip", "-n", netns, "link", "set", "lo", "up")


def _build_network(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    sw = plan.switch_netns
    _add_netns(plan, state, sw)
    _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
    _sh("ip", "-n", sw, "link", "set", "br0", "up")
    for h in plan.hosts:
        _add_netns(plan, state, h.netns)
        _sh("ip", "link", "add", h.veth_host, "type", "veth", "peer", "name", h.veth_switch)
        _sh("ip", "link", "set", h.veth_host, "netns", h.netns)
        _sh("ip", "link", "set", h.veth_switch, "netns", sw)
        _sh("ip", "-n", h.netns, "link", "set", h.veth_host, "name", "eth0")
        _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _sh("ip", "-n", h.netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", sw, "link", "set", h.veth_switch, "master", "br0")
        _sh("ip", "-n", sw, "link", "set", h.veth_switch, "up")
        tc = plan.tc_args()
        if tc:
            _sh("ip", "netns", "exec", h.netns, "tc", *tc)


def _keygen(path: Path, comment: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    os.chmod(path, 0o600)
    return path.with_name(path.name + ".pub").read_text().strip()


def _start_sshd(plan: cp.ClusterPlan, state: dict[str, Any], authorized: Path) -> None:
    if not RUN_SSHD.is_dir():
        RUN_SSHD.mkdir(mode=0o755, parents=True)
        state["made_run_sshd"] = True
        _save(plan, state)
    known = []
    for h in plan.hosts:
        public = _keygen(h.host_key, f"kmp-cluster-{plan.name}-{h.name}")
        known.append(f"{h.name},{h.address} {' '.join(public.split()[:2])}")
        _write_private(h.sshd_config_path, plan.sshd_config(h, authorized))
        h.pid_file.unlink(missing_ok=True)
        _sh(*host_argv(h, [SSHD, "-f", str(h.sshd_config_path)]))
        deadline = time.monotonic() + 10
        while not h.pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not h.pid_file.is_file():
            raise ClusterError(f"sshd of {h.name} did not start (no {h.pid_file}).")
        state["sshd"][h.name] = int(h.pid_file.read_text().split()[0])
        _save(plan, state)
    _write_private(plan.known_hosts, "\n".join(known) + "\n", 0o644)


def _append_etc_hosts(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    state["etc_hosts"] = True
    _save(plan, state)
    text = cp.ETC_HOSTS.read_text()
    if text and not text.endswith("\n"):
        text += "\n"
    cp.ETC_HOSTS.write_text(text + "\n".join(plan.etc_hosts_lines()) + "\n")


def _verify(plan: cp.ClusterPlan) -> None:
    """From h1, ``ssh hI hostname`` must answer ``hI`` for every host."""
    first = plan.hosts[0]
    for h in plan.hosts:
        out = _sh(*host_argv(first, ["ssh", h.name, "hostname"]), timeout=30).strip()
        if out != h.name:
            raise ClusterError(f"ssh {h.name} from {first.name} answered {out!r}, not {h.name!r}.")


def up(plan: cp.ClusterPlan, root: Path | None = None) -> None:
    """Create the cluster ``plan`` describes; on any failure undo it all and raise.

    Raises:
        ClusterError: Not root, missing tools, a cluster or name in the way, or a
            failed step (everything made so far is removed first).
    """
    require_environment(need_tc=plan.rate is not None)
    _check_free(plan, root)
    plan.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    state: dict[str, Any] = {
        "name": plan.name,
        "hosts": len(plan.hosts),
        "slots": plan.slots,
        "rate": plan.rate,
        "netns": [],
        "sshd": {},
        "etc_hosts": False,
        "ssh_client_config": False,
        "made_run_sshd": False,
    }
    _save(plan, state)
    try:
        _build_network(plan, state)
        public = _keygen(plan.client_key, f"kmp-cluster-{plan.name}")
        authorized = plan.state_dir / "authorized_keys"
        _write_private(authorized, public + "\n")
        _start_sshd(plan, state, authorized)
        _append_etc_hosts(plan, state)
        state["ssh_client_config"] = True
        _save(plan, state)
        _write_private(plan.ssh_client_config_path, plan.ssh_client_config(), 0o644)
        _verify(plan)
    except BaseException as exc:
        removed = down(plan.name, root)
        if isinstance(exc, ClusterError):
            raise ClusterError(f"{exc} (cleaned up: {len(removed)} item(s) removed)") from exc
        raise


# ------------------------------------------------------------------ down


def _remove_marked_lines(path: Path, marker: str) -> bool:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return False
    lines = text.splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.rstrip("\n").endswith(marker)]
    if len(kept) == len(lines):
        return False
    path.write_text("".join(kept))
    return True


def down(name: str, root: Path | None = None) -> list[str]:
    """Remove everything cluster ``name`` made; return what was removed (empty: nothing up)."""
    loaded = load(name, root)
    if loaded is None:
        return []
    plan, state = loaded
    removed: list[str] = []
    for host_name, pid in state.get("sshd", {}).items():
        host = plan.host(host_name)
        if _pid_alive(pid) and _is_our_sshd(pid, host):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            removed.append(f"sshd {pid} ({host_name})")
    existing = set(_sh("ip", "netns", "list").split()) if shutil.which("ip") else set()
    for netns in reversed(state.get("netns", [])):
        if netns in existing:
            _sh("ip", "netns", "del", netns)
            removed.append(f"netns {netns}")
    if state.get("etc_hosts") and _remove_marked_lines(cp.ETC_HOSTS, plan.marker):
        removed.append(f"{cp.ETC_HOSTS} lines")
    if state.get("ssh_client_config") and plan.ssh_client_config_path.exists():
        plan.ssh_client_config_path.unlink()
        removed.append(str(plan.ssh_client_config_path))
    others = [n for n in running(root) if n != name]
    made_run_sshd = state.get("made_run_sshd") and not others and RUN_SSHD.is_dir()
    if made_run_sshd and not any(RUN_SSHD.iterdir()):
        RUN_SSHD.rmdir()
        removed.append(str(RUN_SSHD))
    shutil.rmtree(plan.state_dir, ignore_errors=True)
    removed.append(str(plan.state_dir))
    with contextlib.suppress(OSError):  # the state root too, once no cluster is left
        plan.state_dir.parent.rmdir()
    return removed


# ------------------------------------------------------------------ exec / status


def exec_on(name: str, host: str, argv: list[str], root: Path | None = None) -> int:
    """Run ``argv`` on ``host`` of cluster ``name``, keeping the environment and directory."""
    loaded = load(name, root)
    if loaded is None:
        raise ClusterError(f"no cluster {name!r} is up: start one with `kmp cluster up`.")
    if not argv:
        raise ClusterError("give the command after `--`: kmp cluster exec h1 -- hostname")
    target = loaded[0].host(host)
    try:
        return subprocess.run(host_argv(target, argv), check=False).returncode
    except KeyboardInterrupt:
        return 130


def status(name: str, root: Path | None = None) -> dict[str, Any]:
    """What cluster ``name`` is: its hosts (name, address, netns, sshd pid and liveness)."""
    loaded = load(name, root)
    if loaded is None:
        return {"name": name, "up": False, "hosts": []}
    plan, state = loaded
    hosts = []
    for h in plan.hosts:
        pid = state.get("sshd", {}).get(h.name)
        hosts.append(
            {
                "name": h.name,
                "address": h.address,
                "netns": h.netns,
                "sshd_pid": pid,
                "sshd_alive": bool(pid) and _pid_alive(pid) and _is_our_sshd(pid, h),
            }
        )
    return {
        "name": plan.name,
        "up": True,
        "slots": plan.slots,
        "rate": plan.rate,
        "hosts_arg": plan.host_list(),
        "state_dir": str(plan.state_dir),
        "hosts": hosts,
    }
