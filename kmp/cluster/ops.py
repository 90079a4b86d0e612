"""What ``kmp cluster`` does to the machine: namespaces, veths, sshd, files, and undoing them.

:func:`up` realises a :class:`~kmp.cluster.blueprint.ClusterPlan` step by
step and records each step in the cluster's ``state.json``
(:mod:`kmp.cluster.state`) before taking the next, so :func:`down`
removes exactly what was made, also after a failed ``up`` (which calls it
itself) or a crash, and a second ``down`` is harmless. Nothing that was not
recorded is touched, except leftovers that carry the cluster's own marker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kmp.cluster import blueprint as cp
from kmp.cluster import slurm_daemons as sl
from kmp.cluster import state as cs
from kmp.cluster.state import (
    ClusterError,
    check_state_dir,
    host_argv,
    is_our_sshd,
    load,
    locked,
    pid_alive,
    require_environment,
    run_cmd,
    running,
    save_state,
    write_private,
)
from kmp.launching.processes import run_forwarding_signals

__all__ = ["ClusterError", "down", "exec_on", "load", "running", "status", "up"]

RUN_SSHD = Path("/run/sshd")  # sshd's privilege-separation directory


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
        if line.rstrip().endswith(plan.marker):
            raise ClusterError(
                f"/etc/hosts still has cluster {plan.name!r}'s line {line.strip()!r} (left by a "
                f"reboot or a crash); run `kmp cluster down --name {plan.name}`, which removes it."
            )
        fields = line.split("#", 1)[0].split()
        taken = sorted(names & set(fields[1:]))
        if taken:
            raise ClusterError(
                f"/etc/hosts already names {taken[0]} ({line.strip()!r}); a cluster host would "
                "clash with it. Remove that line, or use fewer hosts."
            )
    existing = set(run_cmd("ip", "netns", "list").split())
    clash = sorted(n for n in [plan.switch_netns, *(h.netns for h in plan.hosts)] if n in existing)
    if clash:
        raise ClusterError(
            f"network namespace {clash[0]!r} already exists but no cluster {plan.name!r} is "
            f"recorded: remove it (`ip netns del {clash[0]}`) or pick another --name."
        )


def _add_netns(plan: cp.ClusterPlan, state: dict[str, Any], netns: str) -> None:
    run_cmd("ip", "netns", "add", netns)
    state["netns"].append(netns)
    save_state(plan, state)
    run_cmd("ip", "-n", netns, "link", "set", "lo", "up")


def _build_network(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    sw = plan.switch_netns
    _add_netns(plan, state, sw)
    run_cmd("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
    run_cmd("ip", "-n", sw, "link", "set", "br0", "up")
    for h in plan.hosts:
        _add_netns(plan, state, h.netns)
        # Both ends are made inside their namespaces: nothing is left in this one on failure.
        run_cmd(
            *("ip", "-n", h.netns, "link", "add", "eth0", "type", "veth"),
            *("peer", "name", h.veth_switch, "netns", sw),
        )
        run_cmd("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        run_cmd("ip", "-n", h.netns, "link", "set", "eth0", "up")
        run_cmd("ip", "-n", sw, "link", "set", h.veth_switch, "master", "br0")
        run_cmd("ip", "-n", sw, "link", "set", h.veth_switch, "up")
        tc = plan.tc_args()
        if tc:
            run_cmd("ip", "netns", "exec", h.netns, "tc", *tc)


def _keygen(path: Path, comment: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    run_cmd("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    os.chmod(path, 0o600)
    return path.with_name(path.name + ".pub").read_text().strip()


def _wait_for_pid(host: cp.HostPlan, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(host.pid_file.read_text().split()[0])
        time.sleep(0.05)
    raise ClusterError(f"sshd of {host.name} did not start (no pid in {host.pid_file}).")


def _start_sshd(plan: cp.ClusterPlan, state: dict[str, Any], authorized: Path) -> None:
    if not RUN_SSHD.is_dir():
        RUN_SSHD.mkdir(mode=0o755, parents=True)
        state["made_run_sshd"] = True
        save_state(plan, state)
    known = []
    for h in plan.hosts:
        public = _keygen(h.host_key, f"kmp-cluster-{plan.name}-{h.name}")
        known.append(f"{h.name},{h.address} {' '.join(public.split()[:2])}")
        write_private(h.sshd_config_path, plan.sshd_config(h, authorized))
        h.pid_file.unlink(missing_ok=True)
        run_cmd(*host_argv(h, [cs.SSHD, "-f", str(h.sshd_config_path)]))
        state["sshd"][h.name] = _wait_for_pid(h)
        save_state(plan, state)
    write_private(plan.known_hosts, "\n".join(known) + "\n", 0o644)


def _append_etc_hosts(plan: cp.ClusterPlan, state: dict[str, Any]) -> None:
    state["etc_hosts"] = True
    save_state(plan, state)
    text = cp.ETC_HOSTS.read_text()
    with open(cp.ETC_HOSTS, "a") as f:  # appended in place: /etc/hosts is often a bind mount
        f.write("" if not text or text.endswith("\n") else "\n")
        f.write("\n".join(plan.etc_hosts_lines()) + "\n")


def _verify(plan: cp.ClusterPlan) -> None:
    """From h1, ``ssh hI hostname`` must answer ``hI`` for every host."""
    first = plan.hosts[0]
    for h in plan.hosts:
        out = run_cmd(*host_argv(first, ["ssh", h.name, "hostname"]), timeout=30).strip()
        if out != h.name:
            raise ClusterError(f"ssh {h.name} from {first.name} answered {out!r}, not {h.name!r}.")


def up(plan: cp.ClusterPlan, root: Path | None = None) -> None:
    """Create the cluster ``plan`` describes; on any failure undo it all and raise.

    Raises:
        ClusterError: Not root, missing tools, a cluster or name in the way, or a
            failed step (everything made so far is removed first).
    """
    require_environment(need_tc=plan.rate is not None)
    if plan.slurm:
        sl.require_slurm()
    with locked(root):
        _up(plan, root)


def _up(plan: cp.ClusterPlan, root: Path | None) -> None:
    _check_free(plan, root)
    check_state_dir(plan.state_dir)
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
        "slurm_enabled": plan.slurm,
    }
    save_state(plan, state)
    try:
        _build_network(plan, state)
        public = _keygen(plan.client_key, f"kmp-cluster-{plan.name}")
        authorized = plan.state_dir / "authorized_keys"
        write_private(authorized, public + "\n")
        _start_sshd(plan, state, authorized)
        _append_etc_hosts(plan, state)
        state["ssh_client_config"] = True
        save_state(plan, state)
        write_private(plan.ssh_client_config_path, plan.ssh_client_config(), 0o644)
        _verify(plan)
        if plan.slurm:
            sl.start(plan, state)
    except BaseException as exc:
        removed = _down(plan.name, root)
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
    kept = [ln for ln in lines if not ln.rstrip().endswith(marker)]
    if len(kept) == len(lines):
        return False
    path.write_text("".join(kept))
    return True


def _kill(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGTERM ``pids``, then SIGKILL what still runs after ``grace_s``; return those signalled."""
    hit = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
            hit.append(pid)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(p) for p in hit) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in hit:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return hit


def _netns_pids(netns: str) -> list[int]:
    """Every process in network namespace ``netns`` (ssh sessions, horovodrun, ranks...)."""
    proc = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def down(name: str, root: Path | None = None) -> list[str]:
    """Remove everything cluster ``name`` made; return what was removed (empty: nothing up).

    Without recorded state (after a reboot, say) only the leftovers that carry the
    cluster's own marker are removed: its ``/etc/hosts`` lines and ssh client block.
    """
    name = cp.check_name(name)
    with locked(root):
        return _down(name, root)


def _down(name: str, root: Path | None) -> list[str]:
    loaded = load(name, root)
    if loaded is None:
        plan = cp.plan_cluster(1, name=name, root=root)
        removed = []
        if _remove_marked_lines(cp.ETC_HOSTS, plan.marker):
            removed.append(f"{cp.ETC_HOSTS} lines")
        if plan.ssh_client_config_path.exists():
            plan.ssh_client_config_path.unlink()
            removed.append(str(plan.ssh_client_config_path))
        return removed
    plan, state = loaded
    removed: list[str] = []
    for host_name, pid in state.get("sshd", {}).items():
        if pid_alive(pid) and is_our_sshd(pid, plan.host(host_name)):
            _kill([pid])
            removed.append(f"sshd {pid} ({host_name})")
    existing = set(run_cmd("ip", "netns", "list").split()) if shutil.which("ip") else set()
    recorded = [n for n in reversed(state.get("netns", [])) if n in existing]
    inside = [pid for netns in recorded for pid in _netns_pids(netns)]
    if inside:  # whatever still runs on the hosts: ssh sessions, jobs, their ranks
        removed += [f"process {pid}" for pid in _kill(inside)]
    for netns in recorded:
        run_cmd("ip", "netns", "del", netns)
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
    return removed


# ------------------------------------------------------------------ exec / status


def exec_on(name: str, host: str, argv: list[str], root: Path | None = None) -> int:
    """Run ``argv`` on ``host`` of cluster ``name``, keeping the environment and directory."""
    loaded = load(name, root)
    if loaded is None:
        raise ClusterError(f"no cluster {name!r} is up: start one with `kmp cluster up`.")
    if not argv:
        raise ClusterError("give the command after `--`: kmp cluster exec h1 -- hostname")
    plan, _ = loaded
    target = plan.host(host)
    env = {**os.environ, "SLURM_CONF": str(sl.conf_path(plan, target))} if plan.slurm else None
    return run_forwarding_signals(host_argv(target, argv), env)


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
                "sshd_alive": bool(pid) and pid_alive(pid) and is_our_sshd(pid, h),
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
        "slurm": sl.daemons(state) if plan.slurm else None,
    }
