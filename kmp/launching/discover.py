"""``python -m kmp.launching.discover HOSTFILE``: the host discovery script behind ``--hostfile``.

``kmp launch --elastic --hostfile FILE`` gives Horovod's elastic driver this
command as its ``--host-discovery-script``. The driver runs it every second;
each run reads the hostfile again and prints one ``HOST:SLOTS`` line per host,
so editing the file adds or removes hosts while the job runs. A file that does
not parse prints the error and exits 1; the driver then keeps the hosts it had
(and says so in its log) until the file is fixed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kmp.launching.hosts import Host, LaunchError, read_hostfile

__all__ = ["discovery_lines", "main"]


def discovery_lines(hosts: Sequence[Host]) -> str:
    """The hosts in the discovery-script format: ``HOST:SLOTS`` lines."""
    return "".join(f"{h.name}:{h.slots}\n" for h in hosts)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the hostfile ``argv[0]`` as discovery lines; 1 and a message if it is bad."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m kmp.launching.discover HOSTFILE", file=sys.stderr)
        return 2
    try:
        hosts = read_hostfile(args[0])
    except LaunchError as exc:
        print(f"kmp discover: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(discovery_lines(hosts))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
