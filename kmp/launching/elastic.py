"""The elastic part of ``kmp launch``: ``--elastic --min-np A --max-np B`` and host discovery.

::

    kmp launch --elastic --min-np 2 --max-np 4 --hostfile hosts.txt train.py --elastic
    kmp launch --elastic --min-np 2 --host-discovery-script ./discover.sh train.py

Horovod's elastic driver polls a host discovery script every second. With
``--hostfile`` kmp supplies it (:mod:`kmp.launching.discover` re-reads the file,
so editing the file adds or removes hosts); ``--host-discovery-script`` takes
the user's own. Elastic jobs run on Gloo.

:func:`elastic_args` is pure: it checks the options and returns the
``horovodrun`` arguments. :func:`check_discovery` runs a user's script once
before the job starts, so that a script that fails or prints a malformed line
is an error naming the line, not a driver that waits or dies later.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

from kmp.launching.hosts import (
    Host,
    LaunchError,
    check_count,
    parse_discovery_output,
    read_hostfile,
)

__all__ = [
    "DISCOVERY_TIMEOUT_S",
    "ElasticOptions",
    "check_discovery",
    "configure_elastic",
    "elastic_args",
    "options_from_args",
]

DISCOVERY_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """The elastic settings of one ``kmp launch``.

    Attributes:
        min_np: Fewest processes the job runs with; below it the driver waits
            ``elastic_timeout`` seconds for hosts, then stops the job.
        max_np: Most processes (None: as many as the hosts' slots).
        hostfile: A hostfile kmp's discovery script re-reads every second.
        discovery_script: The user's own discovery script (executable).
        slots_per_host: Slots of a discovered host printed without ``:SLOTS``.
        elastic_timeout: Seconds to wait for enough hosts after a change.
        reset_limit: Most resets before the job is stopped.
        cooldown_range: ``(min, max)`` seconds a failed host stays blacklisted
            (None: for the rest of the job).
    """

    min_np: int
    max_np: int | None = None
    hostfile: str | None = None
    discovery_script: str | None = None
    slots_per_host: int | None = None
    elastic_timeout: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None


def elastic_args(
    options: ElasticOptions, np: int | None, *, python: str, controller: str | None
) -> tuple[int, list[str], list[Host]]:
    """Check ``options``; return ``(np, horovodrun arguments, hosts)`` (pure but for file reads).

    ``hosts`` are those the ``--hostfile`` lists now (empty with a discovery
    script, whose hosts are known only when it runs).

    Args:
        options: The elastic settings.
        np: ``-np``, the processes to start with (None: all slots of the
            hostfile up to ``max_np``, or ``min_np`` with a discovery script).
        python: The interpreter that runs kmp's discovery script.
        controller: ``"gloo"``, ``"mpi"`` or None; elastic jobs need Gloo.

    Raises:
        LaunchError: ``min_np > max_np``, ``np`` outside ``[min_np, max_np]``,
            no discovery source or both, a script that does not exist or is not
            executable, a bad hostfile or one with fewer slots than ``min_np``,
            MPI, or a bad number.
    """
    if controller == "mpi":
        raise LaunchError(
            "--elastic runs on Gloo (Horovod's elastic driver does not support MPI); drop --mpi."
        )
    min_np = check_count(options.min_np, "--min-np")
    max_np = None if options.max_np is None else check_count(options.max_np, "--max-np")
    if max_np is not None and min_np > max_np:
        raise LaunchError(
            f"--min-np {min_np} is more than --max-np {max_np}: the job could never start. "
            "Make --min-np <= --max-np."
        )
    if (options.hostfile is None) == (options.discovery_script is None):
        raise LaunchError(
            "--elastic needs one source of hosts: --hostfile FILE (kmp re-reads it, so editing "
            "it adds or removes hosts) or --host-discovery-script SCRIPT."
        )
    if options.discovery_script is not None:
        script = Path(options.discovery_script)
        if not script.is_file():
            raise LaunchError(
                f"--host-discovery-script {str(script)!r} does not exist; give the path of an "
                "executable that prints one 'HOST:SLOTS' line per available host."
            )
        if not os.access(script, os.X_OK):
            raise LaunchError(
                f"--host-discovery-script {str(script)!r} is not executable; run "
                f"`chmod +x {shlex.quote(str(script))}`."
            )
        discovery = str(script.resolve())
        start_np = min_np
        hosts: list[Host] = []
    else:
        hosts = read_hostfile(options.hostfile)
        slots = sum(h.slots for h in hosts)
        if slots < min_np:
            raise LaunchError(
                f"--hostfile {options.hostfile!r} gives {slots} slot(s), fewer than --min-np "
                f"{min_np}: add hosts to the file or lower --min-np."
            )
        discovery = shlex.join(
            [python, "-m", "kmp.launching.discover", str(Path(options.hostfile).resolve())]
        )
        start_np = slots if max_np is None else min(slots, max_np)
    np = start_np if np is None else check_count(np, "-np")
    if np < min_np or (max_np is not None and np > max_np):
        upper = "" if max_np is None else f" and <= --max-np {max_np}"
        raise LaunchError(f"-np {np} must be >= --min-np {min_np}{upper}.")
    args = ["--min-np", str(min_np)]
    if max_np is not None:
        args += ["--max-np", str(max_np)]
    args += ["--host-discovery-script", discovery]
    if options.slots_per_host is not None:
        args += ["--slots-per-host", str(check_count(options.slots_per_host, "--slots-per-host"))]
    if options.elastic_timeout is not None:
        timeout = check_count(options.elastic_timeout, "--elastic-timeout")
        args += ["--elastic-timeout", str(timeout)]
    if options.reset_limit is not None:
        args += ["--reset-limit", str(check_count(options.reset_limit, "--reset-limit", 0))]
    if options.cooldown_range is not None:
        low, high = (check_count(v, "--blacklist-cooldown-range") for v in options.cooldown_range)
        if low > high:
            raise LaunchError(
                f"--blacklist-cooldown-range {low} {high}: give the shorter time first."
            )
        args += ["--blacklist-cooldown-range", str(low), str(high)]
    return np, args, hosts


def check_discovery(
    script: str, default_slots: int | None = None, *, timeout: float = DISCOVERY_TIMEOUT_S
) -> list[Host]:
    """Run the discovery script once and parse what it printed.

    Raises:
        LaunchError: It failed, ran past ``timeout`` or printed a malformed line.
    """
    source = f"--host-discovery-script {script!r}"
    try:
        done = subprocess.run(
            [script], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"{source} ran past {timeout:g} s; Horovod runs it every second, so it must answer "
            "fast."
        ) from None
    except OSError as exc:
        raise LaunchError(f"{source} could not run ({exc}); check its #! line.") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LaunchError(
            f"{source} exited with status {done.returncode}: {' | '.join(tail) or 'no output'}"
        )
    return parse_discovery_output(done.stdout, source, default_slots)


# ------------------------------------------------------------------ parser


def configure_elastic(parser: argparse.ArgumentParser) -> None:
    """Add the elastic arguments to ``kmp launch``'s parser."""
    el = parser.add_argument_group("elastic (workers may die or join; Gloo)")
    el.add_argument(
        "--elastic",
        action="store_true",
        help="run an elastic job: it goes on when a worker dies and grows when hosts join "
        "(needs --min-np and --hostfile or --host-discovery-script)",
    )
    el.add_argument("--min-np", type=int, metavar="A", help="fewest processes to run with")
    el.add_argument("--max-np", type=int, metavar="B", help="most processes to run with")
    el.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="executable printing one HOST:SLOTS line per available host (polled every second)",
    )
    el.add_argument(
        "--slots-per-host", type=int, metavar="N", help="slots of a discovered host without :SLOTS"
    )
    el.add_argument(
        "--elastic-timeout",
        type=int,
        metavar="S",
        help="seconds to wait for --min-np processes after a change before stopping (600)",
    )
    el.add_argument("--reset-limit", type=int, metavar="N", help="stop after this many resets")
    el.add_argument(
        "--blacklist-cooldown-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="seconds a failed host stays blacklisted (default: for good)",
    )


def options_from_args(args: argparse.Namespace) -> ElasticOptions | None:
    """The elastic settings of the command line (None without ``--elastic``)."""
    given = [
        flag
        for flag, value in (
            ("--min-np", args.min_np),
            ("--max-np", args.max_np),
            ("--host-discovery-script", args.host_discovery_script),
            ("--slots-per-host", args.slots_per_host),
            ("--elastic-timeout", args.elastic_timeout),
            ("--reset-limit", args.reset_limit),
            ("--blacklist-cooldown-range", args.blacklist_cooldown_range),
        )
        if value is not None
    ]
    if not args.elastic:
        if given:
            raise LaunchError(f"{', '.join(given)} only apply to an elastic job: add --elastic.")
        return None
    if args.min_np is None:
        raise LaunchError("--elastic needs --min-np A, the fewest processes the job runs with.")
    cooldown = args.blacklist_cooldown_range
    return ElasticOptions(
        min_np=args.min_np,
        max_np=args.max_np,
        hostfile=args.hostfile,
        discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=None if cooldown is None else (cooldown[0], cooldown[1]),
    )
