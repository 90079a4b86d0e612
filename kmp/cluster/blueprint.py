"""What ``kmp cluster up`` builds, decided without touching the machine.

A cluster of N hosts on one Linux machine is, for each host ``hI``:

* a network namespace ``NAME-hI`` with ``lo`` and an interface ``eth0`` at
  ``10.77.0.I/24``, the host end of a veth pair whose other end is a port of the
  bridge ``br0`` in the switch namespace ``NAME-sw``;
* its own hostname (a UTS namespace per process started in it), so that Horovod
  and Gloo see separate hosts;
* one ``sshd`` that listens on ``10.77.0.I:22`` only, with a generated host key,
  accepting only the cluster's generated client key;
* a line ``10.77.0.I hI`` in ``/etc/hosts`` (the namespaces share the file
  system), and an ssh client block in ``/etc/ssh/ssh_config.d/`` that gives
  ``ssh hI`` the cluster's key and known hosts, so nothing more is needed
  inside the cluster.

Everything :func:`plan_cluster` returns is plain data; ``kmp.cluster.ops``
acts on it. Optional link shaping is ``tc``'s token bucket (``tbf``) on each
``eth0``; ``netem`` (delay, loss) is not assumed to exist.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from pathlib import Path

__all__ = [
    "DEFAULT_NAME",
    "ClusterPlan",
    "ClusterPlanError",
    "HostPlan",
    "plan_cluster",
    "state_root",
]

DEFAULT_NAME = "kmp"
MAX_HOSTS = 32
SUBNET = "10.77.0"
STATE_ENV_VAR = "KMP_CLUSTER_STATE_DIR"
ETC_HOSTS = Path("/etc/hosts")
SSH_CLIENT_DIR = Path("/etc/ssh/ssh_config.d")
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RATE_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")


class ClusterPlanError(ValueError):
    """A bad ``kmp cluster`` argument; the message says what to pass instead."""


def state_root() -> Path:
    """Where clusters keep their state: ``$KMP_CLUSTER_STATE_DIR`` or ``/run/kmp-cluster``."""
    return Path(os.environ.get(STATE_ENV_VAR) or "/run/kmp-cluster")


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """One host of the cluster.

    Attributes:
        name: The host name, ``h1`` .. ``hN``.
        address: Its address on the cluster network.
        netns: Its network namespace.
        veth_host: The temporary name of the veth end that becomes its ``eth0``.
        veth_switch: The name of the veth end on the bridge.
        state_dir: Its own folder (host key, sshd config, pid file).
    """

    name: str
    address: str
    netns: str
    veth_host: str
    veth_switch: str
    state_dir: Path

    @property
    def host_key(self) -> Path:
        """The sshd host key (private)."""
        return self.state_dir / "ssh_host_ed25519_key"

    @property
    def sshd_config_path(self) -> Path:
        """The sshd configuration file."""
        return self.state_dir / "sshd_config"

    @property
    def pid_file(self) -> Path:
        """Where this host's sshd writes its pid."""
        return self.state_dir / "sshd.pid"


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """A whole cluster: its hosts, its switch and its files.

    Attributes:
        name: The cluster's name (namespaces and files carry it).
        hosts: The hosts, ``h1`` first.
        slots: Processes per host, for the ``-H`` and hostfile lines it prints.
        rate: A ``tc`` rate for every host's link (e.g. ``"1gbit"``), or None.
        state_dir: The cluster's own folder; ``down`` removes it.
        slurm: Whether ``up`` also starts SLURM on the hosts (:mod:`kmp.cluster.slurm_daemons`).
    """

    name: str
    hosts: tuple[HostPlan, ...]
    slots: int
    rate: str | None
    state_dir: Path
    slurm: bool = False

    @property
    def switch_netns(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.name}-sw"

    @property
    def marker(self) -> str:
        """The comment that marks this cluster's lines in shared files."""
        return f"# kmp-cluster:{self.name}"

    @property
    def client_key(self) -> Path:
        """The cluster's ssh client key (private, owner-only)."""
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """The known-hosts file every ssh client in the cluster uses."""
        return self.state_dir / "known_hosts"

    @property
    def ssh_client_config_path(self) -> Path:
        """The ssh client block installed for the cluster's host names."""
        return SSH_CLIENT_DIR / f"kmp-cluster-{self.name}.conf"

    @property
    def state_file(self) -> Path:
        """What ``up`` made, recorded step by step so that ``down`` can undo it."""
        return self.state_dir / "state.json"

    def host(self, name: str) -> HostPlan:
        """Return the host called ``name``.

        Raises:
            ClusterPlanError: There is no such host.
        """
        for h in self.hosts:
            if h.name == name:
                return h
        names = ", ".join(h.name for h in self.hosts)
        raise ClusterPlanError(f"cluster {self.name!r} has no host {name!r}; its hosts: {names}.")

    def etc_hosts_lines(self) -> list[str]:
        """The ``/etc/hosts`` lines ``up`` adds, each ending with :attr:`marker`."""
        return [f"{h.address} {h.name}  {self.marker}" for h in self.hosts]

    def host_list(self) -> str:
        """The ``-H`` value for every slot of every host, e.g. ``h1:2,h2:2``."""
        return ",".join(f"{h.name}:{self.slots}" for h in self.hosts)

    def hostfile_text(self) -> str:
        """The same hosts as a hostfile."""
        return "".join(f"{h.name} slots={self.slots}\n" for h in self.hosts)

    def sshd_config(self, host: HostPlan, authorized_keys: Path) -> str:
        """The sshd configuration of ``host``: its address only, the cluster's key only."""
        return "\n".join(
            [
                f"# {self.marker[2:]}: sshd of {host.name}, written by kmp cluster up",
                f"ListenAddress {host.address}:22",
                f"HostKey {host.host_key}",
                f"PidFile {host.pid_file}",
                f"AuthorizedKeysFile {authorized_keys}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                "UseDNS no",
                "AllowUsers root",
                "AllowTcpForwarding no",
                "X11Forwarding no",
                "LogLevel ERROR",
                "",
            ]
        )

    def ssh_client_config(self) -> str:
        """The ssh client block for the cluster's host names and addresses."""
        names = " ".join([*(h.name for h in self.hosts), *(h.address for h in self.hosts)])
        return "\n".join(
            [
                f"{self.marker} (written by kmp cluster up; kmp cluster down removes it)",
                f"Host {names}",
                f"    IdentityFile {self.client_key}",
                "    IdentitiesOnly yes",
                f"    UserKnownHostsFile {self.known_hosts}",
                "    StrictHostKeyChecking yes",
                "    BatchMode yes",
                "    ConnectTimeout 10",
                "    LogLevel ERROR",
                "",
            ]
        )

    def tc_args(self) -> list[str] | None:
        """The ``tc`` arguments that shape each ``eth0``, or None without a rate.

        The bucket holds 10 ms at the rate (at least 256 KiB), so that fast rates
        are not capped by the kernel's timer granularity.
        """
        if self.rate is None:
            return None
        burst = max(256 * 1024, int(rate_bits_per_s(self.rate) / 8 / 100))
        return [
            *("qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate),
            *("burst", str(burst), "latency", "50ms"),
        ]


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bits_per_s(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``"1gbit"`` or ``"125mbps"`` (bytes)."""
    m = _RATE_RE.match(rate)
    if not m:
        raise ClusterPlanError(f"{rate!r} is not a tc rate such as 1gbit.")
    unit = m.group(2)
    number = float(rate[: len(rate) - len(unit)])
    if unit.endswith("bps"):
        return number * 8 * _UNITS[unit[:-3] + "bit"]
    return number * _UNITS[unit]


def _check_count(what: str, value: object, low: int, high: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterPlanError(f"{what} must be an integer from {low} to {high}, not {value!r}.")
    if not low <= value <= high:
        raise ClusterPlanError(f"{what} must be from {low} to {high}, not {value}. {hint}")
    return value


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid cluster name (it ends up in interface names)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ClusterPlanError(
            f"--name {name!r}: use 1 to 12 lower-case letters and digits, starting with a "
            f"letter (e.g. {DEFAULT_NAME!r}); it becomes part of namespace names."
        )
    return name


def plan_cluster(
    hosts: int,
    *,
    slots: int = 1,
    rate: str | None = None,
    name: str = DEFAULT_NAME,
    root: Path | None = None,
    slurm: bool = False,
) -> ClusterPlan:
    """Decide everything ``kmp cluster up`` will create (pure).

    Args:
        hosts: How many hosts, 1 to 32 (they share this machine's cores).
        slots: Processes per host, for the printed ``-H`` line and hostfile.
        rate: Shape every host's link to this ``tc`` rate, e.g. ``"1gbit"``.
        name: The cluster's name.
        root: Where cluster state lives (default :func:`state_root`).
        slurm: Also run SLURM (slurmctld on h1, slurmd and munged on every host).

    Returns:
        The :class:`ClusterPlan`.

    Raises:
        ClusterPlanError: A bad count, rate or name.
    """
    n = _check_count("--hosts", hosts, 1, MAX_HOSTS, "All hosts share this machine's cores.")
    slots = _check_count("--slots", slots, 1, 64, "Slots are processes per host.")
    name = check_name(name)
    if rate is not None and (not isinstance(rate, str) or not _RATE_RE.match(rate)):
        raise ClusterPlanError(
            f"--rate {rate!r} is not a tc rate: use a number and a unit, e.g. 1gbit, 100mbit "
            "or 10gbit."
        )
    state_dir = (root or state_root()) / name
    tag = f"k{zlib.crc32(name.encode()) & 0xFFFF:04x}"  # veth names must fit in 15 characters
    plans = tuple(
        HostPlan(
            name=f"h{i}",
            address=f"{SUBNET}.{i}",
            netns=f"{name}-h{i}",
            veth_host=f"{tag}h{i}",
            veth_switch=f"{tag}s{i}",
            state_dir=state_dir / f"h{i}",
        )
        for i in range(1, n + 1)
    )
    if not isinstance(slurm, bool):
        raise TypeError(f"slurm must be True or False, got {slurm!r}")
    return ClusterPlan(
        name=name, hosts=plans, slots=slots, rate=rate, state_dir=state_dir, slurm=slurm
    )
