"""Checks ``kmp launch`` runs before a multi-host job starts: hosts reachable, NICs present.

Without them a host that cannot be reached, or a network interface missing on
one host, shows up late and unclearly: an ssh timeout inside ``horovodrun``, a
Gloo abort, or a job that hangs. :func:`plan_checks` decides what to check
(pure), :func:`run_checks` does it, every host in parallel, in seconds, and
returns messages that name the host or the interface.

A remote host is checked with one ``ssh`` that runs the job's own Python there
and lists the host's interfaces (``socket.if_nameindex``); this host is checked
in process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shlex
import socket
import subprocess
from collections.abc import Sequence

__all__ = ["Check", "is_local", "plan_checks", "run_checks"]

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SSH_CONNECT_TIMEOUT_S = 10
# Exit status of the remote probe when interfaces are missing (ssh itself uses 255).
_MISSING = 3
_PROBE = (
    "import socket, sys\n"
    "have = sorted(n for _, n in socket.if_nameindex())\n"
    "missing = [n for n in sys.argv[1:] if n not in have]\n"
    "print(' '.join(have))\n"
    f"sys.exit({_MISSING} if missing else 0)\n"
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One host to check.

    Attributes:
        host: The host name as given to ``-H`` / ``--hostfile``.
        nics: Interfaces that must exist there.
        argv: The ssh command that probes it; None for this host (checked in process).
        python: The interpreter the probe runs there.
    """

    host: str
    nics: tuple[str, ...]
    argv: tuple[str, ...] | None
    python: str = ""


def is_local(host: str, hostname: str | None = None) -> bool:
    """True when ``host`` names this machine (``localhost`` or this host's name)."""
    me = hostname or socket.gethostname()
    return host in LOCAL_NAMES or host in (me, me.split(".", 1)[0])


def plan_checks(
    hosts: Sequence[str],
    nics: Sequence[str],
    *,
    python: str,
    ssh_port: int | None = None,
    identity_file: str | None = None,
    hostname: str | None = None,
) -> tuple[Check, ...]:
    """Decide what to check before the job (pure).

    Nothing is checked for a job on this host alone with no interface named:
    that is the plain one-machine case, which needs no ssh.

    Args:
        hosts: The job's host names.
        nics: The interfaces ``--network-interface`` names (maybe none).
        python: The interpreter the ranks run (it must exist on every host).
        ssh_port: ssh port of the hosts.
        identity_file: ssh key for the hosts.
        hostname: This machine's name (default: ``socket.gethostname()``).

    Returns:
        One :class:`Check` per host, or none.
    """
    nics = tuple(nics)
    if not nics and all(is_local(h, hostname) for h in hosts):
        return ()
    # Horovod itself does not check host keys; accept-new at least refuses a changed one.
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
    ssh += ["-o", "StrictHostKeyChecking=accept-new"]
    if ssh_port is not None:
        ssh += ["-p", str(ssh_port)]
    if identity_file:
        ssh += ["-i", identity_file]
    checks = []
    for host in hosts:
        if is_local(host, hostname):
            checks.append(Check(host, nics, None, python))
        else:
            remote = shlex.join([python, "-c", _PROBE, *nics])  # ssh hands one string to a shell
            checks.append(Check(host, nics, (*ssh, host, remote), python))
    return tuple(checks)


def _missing_message(host: str, missing: list[str], have: list[str]) -> str:
    names = ", ".join(repr(n) for n in missing)
    return (
        f"network interface {names} does not exist on host {host!r} (it has: "
        f"{', '.join(have) or 'none'}). Pass --network-interface with an interface that "
        "exists on every host."
    )


def _run_one(check: Check, timeout: float) -> str | None:
    if check.argv is None:
        have = sorted(n for _, n in socket.if_nameindex())
        missing = [n for n in check.nics if n not in have]
        return _missing_message(check.host, missing, have) if missing else None
    try:
        proc = subprocess.run(
            list(check.argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"host {check.host!r} did not answer within {timeout:.0f} s (ssh {check.host})."
    except OSError as exc:
        return f"cannot run ssh to check host {check.host!r}: {exc}. Install openssh-client."
    if proc.returncode == 0:
        return None
    if proc.returncode == _MISSING:
        have = proc.stdout.split()
        return _missing_message(check.host, [n for n in check.nics if n not in have], have)
    detail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
    if proc.returncode == 255:
        known = (
            " Its host key changed: fix ~/.ssh/known_hosts." if "host key" in detail.lower() else ""
        )
        return (
            f"host {check.host!r} cannot be reached by ssh ({detail}). Check that the name "
            "resolves here, that sshd runs there and accepts this host's key "
            f"(--ssh-identity-file, --ssh-port).{known}"
        )
    return (
        f"host {check.host!r} is reachable, but the job's Python ({check.python}) did not run "
        f"there (exit {proc.returncode}: {detail}). Every host needs the same environment at "
        "the same path."
    )


def run_checks(checks: Sequence[Check], timeout: float = 20.0) -> list[str]:
    """Run ``checks`` in parallel; return one message per failed host (empty: all fine)."""
    if not checks:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(checks))) as pool:
        results = list(pool.map(lambda c: _run_one(c, timeout), checks))
    return [r for r in results if r]
