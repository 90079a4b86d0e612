"""Host lists for ``kmp launch``: ``-H host1:N,host2:M`` and hostfiles.

Hostfile format (one host per line, ``#`` starts a comment)::

    node1 slots=4
    node2:4          # the -H spelling works too
    node3            # one slot
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

__all__ = [
    "Host",
    "LaunchError",
    "check_count",
    "parse_discovery_output",
    "parse_hostfile",
    "parse_hosts",
    "read_hostfile",
]

HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


class LaunchError(ValueError):
    """Bad input to ``kmp launch``; the message says what was wrong and what to do."""


def check_count(value: object, flag: str, minimum: int = 1) -> int:
    """Return ``value`` if it is an integer >= ``minimum``; else a LaunchError naming ``flag``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(f"{flag} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine and how many processes it may run."""

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


# ------------------------------------------------------------------ hosts


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"{where}: slots must be a positive integer, got {text!r}.")
    return int(text)


def _host_name(text: str, where: str) -> str:
    if not HOST_RE.match(text):
        raise LaunchError(f"{where}: {text!r} is not a host name (letters, digits, '.', '-', '_').")
    return text


def _entry(text: str, where: str, default_slots: int = 1) -> Host:
    """One ``HOST:N`` or ``HOST`` (``default_slots`` slots)."""
    name, sep, slots = text.partition(":")
    return Host(_host_name(name, where), _slots(slots, where) if sep else default_slots)


def _no_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise LaunchError(f"{where}: host {host.name!r} is listed twice; list it once.")
        seen.add(host.name)
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """Parse a ``-H`` value such as ``"node1:4,node2:4"`` (a host without ``:N`` has 1 slot).

    Raises:
        LaunchError: An empty entry, a bad host name or a bad slot count.
    """
    hosts = []
    for i, entry in enumerate(spec.split(","), start=1):
        where = f"-H {spec!r}, entry {i}"
        entry = entry.strip()
        if not entry:
            raise LaunchError(f"{where}: empty entry; use -H host1:N,host2:M.")
        hosts.append(_entry(entry, where))
    return _no_duplicates(hosts, f"-H {spec!r}")


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile text: one ``HOST slots=N``, ``HOST:N`` or ``HOST`` per line.

    Blank lines and ``#`` comments are ignored.

    Args:
        text: The file's contents.
        source: How to name the file in errors.

    Returns:
        The hosts, in file order.

    Raises:
        LaunchError: A malformed line (the message names its number and text),
            a host listed twice, or no hosts at all.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number} ({raw.strip()!r})"
        fields = line.split()
        if len(fields) == 1:
            hosts.append(_entry(fields[0], where))
        elif len(fields) == 2 and fields[1].startswith("slots="):
            hosts.append(
                Host(_host_name(fields[0], where), _slots(fields[1][len("slots=") :], where))
            )
        else:
            raise LaunchError(
                f"{where}: expected 'HOST slots=N', 'HOST:N' or 'HOST', one host per line."
            )
    if not hosts:
        raise LaunchError(f"{source} lists no hosts; add lines like 'node1 slots=4'.")
    return _no_duplicates(hosts, source)


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read and parse a hostfile (see :func:`parse_hostfile`)."""
    path = Path(path)
    if not path.is_file():
        raise LaunchError(f"Hostfile {str(path)!r} does not exist or is not a file.")
    return parse_hostfile(path.read_text(), source=f"hostfile {str(path)!r}")


def parse_discovery_output(text: str, source: str, default_slots: int | None = None) -> list[Host]:
    """Parse what a host discovery script printed: one ``HOST:SLOTS`` or ``HOST`` per line.

    This is the format Horovod's elastic driver reads every second.

    Args:
        text: The script's standard output.
        source: How to name the script in errors.
        default_slots: Slots of a line without ``:SLOTS`` (``--slots-per-host``);
            None makes such a line an error.

    Raises:
        LaunchError: A malformed line (named with its number), a host printed
            twice, or no host at all.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source} printed line {number} ({raw!r})"
        if ":" not in line and default_slots is None:
            raise LaunchError(
                f"{where}: expected 'HOST:SLOTS' (or pass --slots-per-host for lines with a host "
                "only)."
            )
        if " " in line or "\t" in line:
            raise LaunchError(f"{where}: expected 'HOST:SLOTS', one host per line.")
        hosts.append(_entry(line, where, default_slots or 1))
    if not hosts:
        raise LaunchError(
            f"{source} printed no hosts, so the job would have nowhere to start; it must print "
            "one 'HOST:SLOTS' line per available host."
        )
    return _no_duplicates(hosts, source)
