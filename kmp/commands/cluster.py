"""``kmp cluster``: a multi-host cluster on one Linux machine, to try multi-host jobs first.

::

    kmp cluster up --hosts 3 [--slots 2] [--rate 1gbit] [--name kmp] [--slurm]
    kmp cluster status [--json]
    kmp cluster exec h1 -- kmp launch -np 3 -H h1:1,h2:1,h3:1 --network-interface eth0 train.py
    kmp cluster down

Each host ``hI`` is a network namespace with its own ``eth0`` (``10.77.0.I``) on
one bridge, its own hostname, and its own sshd that accepts only the cluster's
generated key; ``ssh hI`` works from every host with nothing more to set up.
All hosts share this machine's file system (so the same ``.venv`` works on
each) and its cores: a run here proves multi-host correctness and measures
communication over shaped links, not compute scaling. It needs root.

Every subcommand takes ``--name`` (default ``kmp``). What ``up`` makes is
recorded under ``/run/kmp-cluster/NAME`` (``$KMP_CLUSTER_STATE_DIR``), and
``down`` removes exactly that: sshd processes by pid, namespaces, the
``/etc/hosts`` lines, the ssh client block and the keys. With ``--slurm`` the hosts
are also a SLURM cluster (:mod:`kmp.cluster.slurm_daemons`): slurmctld on h1, slurmd
and munged on every host, and ``exec`` sets ``SLURM_CONF`` so ``sbatch`` works there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kmp.cluster import blueprint as cp
from kmp.cluster import ops
from kmp.commands import command_main, format_table

__all__ = ["configure", "main", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp cluster``'s subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--name", default=cp.DEFAULT_NAME, help=f"cluster name (default {cp.DEFAULT_NAME})"
        )
        return p

    upp = named(sub.add_parser("up", help="create the hosts h1..hN and their sshd"))
    upp.add_argument("--hosts", type=int, required=True, metavar="N", help="number of hosts")
    upp.add_argument("--slots", type=int, default=1, metavar="S", help="processes per host")
    upp.add_argument("--rate", metavar="RATE", help="shape every link, e.g. 1gbit or 100mbit")
    upp.add_argument(
        "--slurm", action="store_true", help="also run SLURM: slurmctld on h1, slurmd everywhere"
    )
    named(sub.add_parser("down", help="remove everything `up` made"))
    st = named(sub.add_parser("status", help="list the hosts"))
    st.add_argument("--json", action="store_true", help="print one JSON object")
    ex = named(sub.add_parser("exec", help="run a command on a host: exec h1 -- CMD ..."))
    ex.add_argument("host", help="h1 .. hN")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")


def _print_up(plan: cp.ClusterPlan) -> None:
    print(f"cluster {plan.name!r} is up: {len(plan.hosts)} host(s)")
    rows = [(h.name, h.address, f"netns {h.netns}", "eth0") for h in plan.hosts]
    print(format_table(rows, indent="  "))
    if plan.rate:
        print(f"  links shaped to {plan.rate}")
    print(f"-H {plan.host_list()}")
    print("hostfile:\n" + "".join(f"  {line}\n" for line in plan.hostfile_text().splitlines()))
    print(
        f"run a command on a host:  kmp cluster exec {plan.hosts[0].name} --name {plan.name} -- "
        "hostname\n"
        f"a job across hosts:       kmp cluster exec {plan.hosts[0].name} --name {plan.name} -- "
        f"kmp launch -H {plan.host_list()} --network-interface eth0 launch/train.py\n"
        f"remove it:                kmp cluster down --name {plan.name}"
    )
    if plan.slurm:
        print(
            f"SLURM is up (slurmctld on {plan.hosts[0].name}): kmp cluster exec "
            f"{plan.hosts[0].name} --name {plan.name} -- sbatch -N2 --ntasks-per-node=1 "
            "--gpus-per-node=0 --cpus-per-task=1 launch/slurm.sbatch"
        )


def _split_exec(name: str, rest: list[str]) -> tuple[str, list[str]]:
    """``exec HOST [--name N] [--] CMD ...``: leading ``--name`` is exec's, the rest is CMD.

    The command may hold ``--`` itself (``git diff -- path``): only a ``--`` right
    after exec's own options separates.
    """
    while rest:
        if rest[0] == "--name" and len(rest) > 1:
            name, rest = cp.check_name(rest[1]), rest[2:]
        elif rest[0].startswith("--name="):
            name, rest = cp.check_name(rest[0].split("=", 1)[1]), rest[1:]
        else:
            break
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return name, rest


def run(args: argparse.Namespace) -> int:
    """Do ``args.action``; print errors as ``kmp cluster: error: ...`` and return 2."""
    try:
        cp.check_name(args.name)
        if args.action == "up":
            plan = cp.plan_cluster(
                args.hosts, slots=args.slots, rate=args.rate, name=args.name, slurm=args.slurm
            )
            ops.up(plan)
            _print_up(plan)
            return 0
        ops.require_environment()
        if args.action == "down":
            removed = ops.down(args.name)
            if not removed:
                print(f"no cluster {args.name!r} is up; nothing to remove")
            else:
                print(f"cluster {args.name!r} removed ({len(removed)} item(s))")
            return 0
        if args.action == "status":
            info = ops.status(args.name)
            if args.json:
                print(json.dumps(info, indent=2))
            elif not info["up"]:
                print(f"no cluster {args.name!r} is up")
            else:
                rows = [
                    (h["name"], h["address"], f"netns {h['netns']}", f"pid {h['sshd_pid']}",
                     "sshd up" if h["sshd_alive"] else "sshd DOWN")
                    for h in info["hosts"]
                ]  # fmt: skip
                print(format_table(rows))
                if info.get("slurm"):
                    daemons = ", ".join(
                        f"{k} {'up' if alive else 'DOWN'}" for k, alive in info["slurm"].items()
                    )
                    print(f"SLURM: {daemons}")
            return 0 if info["up"] else 1
        name, command = _split_exec(args.name, list(args.command))
        return ops.exec_on(name, args.host, command)
    except (cp.ClusterPlanError, ops.ClusterError) as exc:
        print(f"kmp cluster: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp cluster`` arguments and run (``python -m kmp.commands.cluster``)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
