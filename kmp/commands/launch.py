"""``kmp launch``: run a training script on N processes (``horovodrun``, or kmp's own launcher).

::

    kmp launch -np 4 train.py --epochs 3                  # 4 processes on this machine
    kmp launch -np 8 -H node1:4,node2:4 train.py          # two machines, 4 slots each
    kmp launch -np 8 --hostfile hosts.txt --gloo train.py
    kmp launch --hostfile hosts.txt train.py              # -np: all slots of the hosts
    kmp launch -np 2 --policy mixed_bfloat16 --dry-run train.py   # print, do not run
    kmp launch -np 1 train.py                             # plain `python train.py`
    kmp launch -H h1:1,h2:1 --network-interface eth0 --ssh-identity-file KEY train.py
    kmp launch train.py            # in an sbatch script: srun starts a rank per SLURM task

Inside a SLURM allocation (``sbatch``, ``salloc``) and without -H/--hostfile, the
hosts and slots are the allocation's and ``srun`` starts the ranks
(:mod:`kmp.launching.slurm`): no hostfile, no ssh, and SLURM tracks every rank.

Before a job with other hosts (or a named interface) starts, every host is
checked in parallel (:mod:`kmp.launching.preflight`): one that ssh cannot reach,
or an interface missing on a host, is an error naming it, within seconds,
instead of a Gloo abort or a hang (``--no-preflight`` skips this).

This module is the command line only. The machinery lives in
:mod:`kmp.launching`: host lists in :mod:`kmp.launching.hosts`
(:func:`~kmp.launching.hosts.parse_hosts`, :func:`~kmp.launching.hosts.read_hostfile`),
the command in :mod:`kmp.launching.job` (:func:`~kmp.launching.job.build_command`,
pure, and :func:`~kmp.launching.job.execute`, the only one that starts a process),
``--elastic`` in :mod:`kmp.launching.elastic` and ``--engine`` in
:mod:`kmp.launching.engine_env`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kmp.commands import command_main
from kmp.launching.elastic import configure_elastic, options_from_args
from kmp.launching.engine_env import configure_engine
from kmp.launching.hosts import LaunchError, parse_hosts, read_hostfile
from kmp.launching.job import build_command, execute, format_command
from kmp.launching.requeue import (
    after_job,
    check_requeue_args,
    configure_requeue,
    preemption_marker,
)
from kmp.launching.slurm import allocation_hosts

__all__ = ["configure", "main", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp launch``'s arguments to ``parser``."""
    parser.add_argument(
        "-np",
        "--num-proc",
        dest="np",
        type=int,
        metavar="N",
        help="number of processes (1 runs the script directly, without horovodrun); "
        "default: all slots of -H/--hostfile",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-H",
        "--hosts",
        metavar="HOSTS",
        help="hosts and slots, e.g. node1:4,node2:4 (default: localhost:N)",
    )
    where.add_argument("--hostfile", metavar="FILE", help="file with one 'HOST slots=N' per line")
    ctl = parser.add_mutually_exclusive_group()
    ctl.add_argument(
        "--gloo",
        dest="controller",
        action="store_const",
        const="gloo",
        help="use Horovod's Gloo controller (the default)",
    )
    ctl.add_argument(
        "--mpi",
        dest="controller",
        action="store_const",
        const="mpi",
        help="use MPI (Horovod must be built with MPI)",
    )
    parser.add_argument(
        "--policy",
        metavar="P",
        help="dtype policy for every rank: auto, mixed_float16, mixed_bfloat16, float32 "
        "(sets KMP_POLICY)",
    )
    parser.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="SSH port of the hosts")
    parser.add_argument(
        "--ssh-identity-file", metavar="KEY", help="SSH private key for the other hosts"
    )
    parser.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="network_interfaces",
        metavar="NIC",
        help="network interface(s) the ranks talk over, e.g. eth0 (comma-separated for several)",
    )
    parser.add_argument(
        "--gloo-timeout",
        type=int,
        metavar="S",
        help="seconds a rank waits in a Gloo operation, start-up included, before it fails "
        "(default 30): how soon an elastic job notices a dead rank",
    )
    configure_elastic(parser)
    configure_engine(parser)
    configure_requeue(parser)
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="do not check that every host is reachable and has the interface before starting",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command and exit without running it"
    )
    parser.add_argument("script", help="the Python training script")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for the script"
    )


def run(args: argparse.Namespace) -> int:
    """Build the command from parsed arguments, then print it (``--dry-run``) or run it."""
    try:
        check_requeue_args(args)
        elastic = options_from_args(args)
        if args.hosts:
            hosts = parse_hosts(args.hosts)
        elif args.hostfile and elastic is None:
            hosts = read_hostfile(args.hostfile)
        else:
            hosts = None
        allocation = None
        if hosts is None and not args.hostfile and args.np != 1:
            allocation = allocation_hosts(os.environ)  # None outside SLURM
        listed = hosts if allocation is None else allocation
        if args.np is None and listed is None and elastic is None:
            raise LaunchError("give -np N (or -H/--hostfile, whose slots then set N).")
        np_ = args.np if args.np is not None or listed is None else sum(h.slots for h in listed)
        plan = build_command(
            np_,
            args.script,
            args.script_args,
            hosts=hosts,
            controller=args.controller,
            policy=args.policy,
            ssh_port=args.ssh_port,
            ssh_identity_file=args.ssh_identity_file,
            network_interfaces=args.network_interfaces,
            elastic=elastic,
            engine=args.engine,
            coordinator_port=args.coordinator_port,
            gloo_timeout=args.gloo_timeout,
            allocation=allocation,
        )
    except LaunchError as exc:
        print(f"kmp launch: error: {exc}", file=sys.stderr)
        return 2
    if not plan.horovodrun and hosts:
        print(
            "kmp launch: -np 1 runs on this machine without horovodrun; hosts ignored.",
            file=sys.stderr,
        )
    if args.dry_run:
        print(format_command(plan))
        if plan.rendezvous:
            print("kmp launch: the Gloo rendezvous variables are added when the job runs.",
                  file=sys.stderr)  # fmt: skip
        return 0
    received: list[int] = []  # the signals kmp launch itself gets while the job runs
    with preemption_marker() as marker:
        code = execute(plan, check_hosts=not args.no_preflight, received=received)
        return after_job(code, args, received, marker)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp launch`` arguments and run (``python -m kmp.commands.launch``)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
