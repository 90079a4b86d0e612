"""SLURM for ``kmp launch``: the allocation's hosts, ``srun``, and each task's rank.

Inside ``sbatch`` or ``salloc`` SLURM describes the allocation in variables, in
compressed forms this module expands:

* ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST`` on older versions): host names with
  ranges in brackets, ``node[1-3,10]``, ``gpu[01-04]``, ``rack[1-2]-n[1-2]`` (each
  bracket group a range, the names their product), several separated by commas.
* ``SLURM_TASKS_PER_NODE``: the tasks of each node in node-list order, runs of equal
  counts written ``N(xK)``: ``2(x3),1`` is 2, 2, 2, 1.

:func:`allocation_hosts` turns them into ``kmp launch``'s hosts, one slot per task.
``kmp launch`` then starts the ranks with ``srun`` (:func:`srun_argv`, pure), so
SLURM tracks, signals and cleans up every one of them (``scancel``, a failed
node); no ssh between the nodes is needed. Each task runs this module first
(``python -m kmp.launching.slurm -- CMD``), which turns SLURM's task variables
into the engine's (:func:`task_env`: ``HOROVOD_RANK`` ... for Horovod,
``KMP_RANK`` ... for JAX) and then becomes CMD. Horovod's Gloo controller
needs a rendezvous server, which ``kmp launch`` runs itself for the job
(:func:`gloo_rendezvous`), as ``horovodrun`` would; with ``--mpi`` Open MPI
starts through SLURM's PMIx (``srun --mpi=pmix``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence

from kmp._launcher_env import LOCAL_RUN_VARS, launched_engine
from kmp.launching.hosts import Host, LaunchError, check_count, parse_hosts

__all__ = [
    "HOSTS_VAR",
    "MODULE",
    "allocation_hosts",
    "expand_counts",
    "expand_nodelist",
    "fill",
    "gloo_rendezvous",
    "slot",
    "srun_argv",
    "task_env",
]

MODULE = "kmp.launching.slurm"
HOSTS_VAR = "KMP_SLURM_HOSTS"  # the job's hosts and slots, for each task's rank
# salloc's shell under LaunchParameters=use_interactive_step is this step, not a rank.
INTERACTIVE_STEP = "4294967290"

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"SLURM node list {text!r}: a ']' closes nothing.")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchError(f"SLURM node list {text!r}: a '[' is never closed.")
    parts.append(text[start:])
    return parts


def _expand_ranges(group: str, text: str) -> list[str]:
    """``1-3,10`` -> 1 2 3 10, each as wide as its bound is written (``01-03``: 01 02 03)."""
    out = []
    for item in group.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise LaunchError(f"SLURM node list {text!r}: {item!r} is not a number or range.")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise LaunchError(f"SLURM node list {text!r}: the range {item!r} runs backwards.")
        width = len(low)
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM node list: ``"h[1-3],g01"`` -> ``["h1", "h2", "h3", "g01"]``.

    Raises:
        LaunchError: Unbalanced brackets, a bad range or an empty name.
    """
    names: list[str] = []
    for entry in _split_top(text.strip()):
        pieces = re.split(r"(\[[^\]]*\])", entry.strip())
        choices = [_expand_ranges(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p]
        if not choices:
            raise LaunchError(f"SLURM node list {text!r}: an empty name (two commas?).")
        names += ["".join(combo) for combo in itertools.product(*choices)]
    return names


def expand_counts(text: str) -> list[int]:
    """Expand SLURM's per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        LaunchError: An entry that is not ``N`` or ``N(xK)``.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        m = _COUNT.match(item.strip())
        if not m:
            raise LaunchError(f"SLURM task counts {text!r}: {item!r} is not N or N(xK).")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def allocation_hosts(environ: Mapping[str, str]) -> list[Host] | None:
    """The allocation's hosts, one slot per SLURM task; None outside an allocation.

    Args:
        environ: The environment (``os.environ``).

    Returns:
        One :class:`~kmp.launching.hosts.Host` per node, or None when no
        ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) is set.

    Raises:
        LaunchError: The node list or the task counts cannot be read, or they do not
            match (the message says which variables to check); called inside an srun
            step (a rank), where ``kmp launch`` must not start ranks again.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    if environ.get("SLURM_STEP_ID") not in (None, INTERACTIVE_STEP):
        raise LaunchError(
            f"kmp launch runs inside an srun step (SLURM_STEP_ID={environ['SLURM_STEP_ID']}): "
            "run it once, in the batch script or the salloc shell, not under srun; it starts "
            "one rank per task with srun itself. (-H/--hostfile choose the hosts yourself.)"
        )
    nodes = expand_nodelist(nodelist)
    per_node = environ.get("SLURM_TASKS_PER_NODE")
    counts = expand_counts(per_node) if per_node else [1] * len(nodes)
    if len(counts) != len(nodes):
        raise LaunchError(
            f"SLURM_TASKS_PER_NODE={per_node!r} gives {len(counts)} counts for the "
            f"{len(nodes)} nodes of SLURM_JOB_NODELIST={nodelist!r}; run kmp launch in the "
            "job's batch step (sbatch/salloc), or pass -H/--hostfile."
        )
    return [Host(name, slots) for name, slots in zip(nodes, counts, strict=True) if slots > 0]


# ------------------------------------------------------------------ the job's command


def srun_argv(
    np: int,
    hosts: Sequence[Host],
    command: Sequence[str],
    *,
    python: str,
    controller: str | None = None,
    cpus_per_task: str | None = None,
) -> tuple[str, ...]:
    """The ``srun`` command that starts ``np`` ranks on the allocation (pure).

    Ranks fill the hosts in order, as ``horovodrun`` places them: the layout is
    pinned (``--nodes``, ``--ntasks-per-node``, ``--distribution=block``), not left to
    srun's defaults, which follow the job's options. One rank that fails ends the step
    (``--kill-on-bad-exit``). With ``controller="mpi"`` Open MPI starts through
    SLURM's PMIx (``--mpi=pmix``), else SLURM starts plain tasks.

    Args:
        np: The number of ranks, at most the allocation's tasks.
        hosts: The allocation's hosts, one slot per task (:func:`allocation_hosts`).
        command: What each rank runs (after this module has set its rank).
        python: The interpreter that runs this module on each node.
        controller: ``"mpi"`` for Horovod over MPI; anything else starts plain tasks.
        cpus_per_task: The job's ``SLURM_CPUS_PER_TASK``, passed on (srun does not
            inherit it since SLURM 22.05).

    Raises:
        LaunchError: ``np`` is not a positive integer or is above the allocation's
            tasks, or the ranks cannot fill the nodes in order with the same number
            of tasks on each (an uneven allocation such as ``1,3``).
    """
    check_count(np, "-np")
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ",".join(str(h) for h in hosts)
        raise LaunchError(
            f"-np {np} is more than the {total} task(s) of this SLURM allocation ({listed}): "
            "ask SLURM for more (sbatch --ntasks-per-node / --nodes) or lower -np."
        )
    used = fill(hosts, np)
    per_node = max(h.slots for h in used)
    if any(h.slots != per_node for h in used[:-1]):
        layout = ",".join(str(h) for h in used)
        raise LaunchError(
            f"the ranks would fill this allocation's nodes unevenly ({layout}), which srun "
            "cannot be told to repeat: ask SLURM for the same tasks on every node "
            "(sbatch --ntasks-per-node), or pass -H/--hostfile to start the ranks over ssh."
        )
    argv = ["srun", f"--nodes={len(used)}", f"--ntasks={np}", f"--ntasks-per-node={per_node}"]
    if cpus_per_task:
        argv.append(f"--cpus-per-task={cpus_per_task}")
    mpi = "pmix" if controller == "mpi" else "none"
    argv += ["--distribution=block", "--kill-on-bad-exit=1", "--export=ALL", f"--mpi={mpi}"]
    return (*argv, python, "-m", MODULE, "--", *command)


def fill(hosts: Sequence[Host], np: int) -> tuple[Host, ...]:
    """The hosts that ``np`` ranks use when they fill ``hosts`` in order, with their slots.

    Args:
        hosts: The hosts, in order.
        np: The number of ranks (at most the hosts' slots).
    """
    used, left = [], np
    for h in hosts:
        if left <= 0:
            break
        used.append(Host(h.name, min(h.slots, left)))
        left -= used[-1].slots
    return tuple(used)


def slot(hosts: Sequence[Host], rank: int) -> dict[str, int | str]:
    """Where rank ``rank`` runs when ranks fill ``hosts`` in order (as Horovod assigns them).

    Args:
        hosts: The job's hosts, one slot per rank.
        rank: The global rank, from 0.

    Raises:
        LaunchError: ``rank`` is not an integer in ``[0, slots)``.

    Returns:
        ``host``, ``rank``, ``size``, ``local_rank``, ``local_size``, ``cross_rank``
        (this host among the hosts that have this local rank) and ``cross_size``.
    """
    size = sum(h.slots for h in hosts)
    check_count(rank, "the rank", minimum=0)
    if not 0 <= rank < size:
        raise LaunchError(f"rank {rank} is outside the job's {size} slots.")
    first = 0
    for index, host in enumerate(hosts):
        if rank < first + host.slots:
            local = rank - first
            return {
                "host": host.name,
                "rank": rank,
                "size": size,
                "local_rank": local,
                "local_size": host.slots,
                "cross_rank": sum(1 for h in hosts[:index] if h.slots > local),
                "cross_size": sum(1 for h in hosts if h.slots > local),
            }
        first += host.slots
    raise AssertionError("unreachable")  # pragma: no cover


def task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a task of :func:`srun_argv` adds before it becomes the rank (pure).

    From ``SLURM_PROCID`` and the job's hosts (``KMP_SLURM_HOSTS``): Horovod's
    ``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``, ``_CROSS_RANK``,
    ``_CROSS_SIZE`` and ``_HOSTNAME`` or, for the JAX engine (``KMP_ENGINE=jax``),
    ``KMP_RANK``, ``KMP_SIZE``, ``KMP_LOCAL_RANK`` and ``KMP_LOCAL_SIZE``.

    Raises:
        LaunchError: A variable is missing, or SLURM put the task on another node or
            local slot than the rank's (the ranks would not agree on the layout).
    """
    missing = [v for v in (HOSTS_VAR, "SLURM_PROCID") if v not in environ]
    if missing:
        raise LaunchError(
            f"{' and '.join(missing)} not set: this module runs as the start of each task "
            "of the srun command kmp launch builds, not by hand."
        )
    where = slot(parse_hosts(environ[HOSTS_VAR]), int(environ["SLURM_PROCID"]))
    node = environ.get("SLURMD_NODENAME")
    local = environ.get("SLURM_LOCALID")
    if (node is not None and node != where["host"]) or (
        local is not None and int(local) != where["local_rank"]
    ):
        raise LaunchError(
            f"SLURM started rank {where['rank']} on {node} as local task {local}, but the job "
            f"places it on {where['host']} as local rank {where['local_rank']}: start the job "
            "with kmp launch, which passes srun --distribution=block."
        )
    if launched_engine(environ) == "jax":  # the variables kmp's own launchers set
        keys = dict(zip(("rank", "size", "local_rank", "local_size"), LOCAL_RUN_VARS, strict=True))
    else:
        keys = {k: f"HOROVOD_{k.upper()}" for k in where if k != "host"}
        keys["host"] = "HOROVOD_HOSTNAME"
    return {var: str(where[k]) for k, var in keys.items()}


def _address(nic: str | None, hosts: Sequence[Host]) -> str:
    """This node's address for the other nodes: ``nic``'s IPv4 address, or its host name's."""
    if nic:
        import psutil

        for addr in psutil.net_if_addrs().get(nic, []):
            if addr.family == socket.AF_INET:
                return addr.address
        raise LaunchError(f"--network-interface {nic}: no IPv4 address on this node.")
    name = socket.gethostname()
    address = socket.gethostbyname(name)
    others = {h.name for h in hosts} - {name, "localhost"}
    if address.startswith("127.") and others:
        raise LaunchError(
            f"this node's name ({name}) resolves to {address}, which the other nodes cannot "
            "reach: pass --network-interface with the interface they reach it on (e.g. ib0)."
        )
    return address


@contextlib.contextmanager
def gloo_rendezvous(hosts: Sequence[Host], nic: str | None = None) -> Iterator[dict[str, str]]:
    """Run Horovod's Gloo rendezvous server for the job; yield the variables its ranks need.

    The server is Horovod's own (what ``horovodrun`` runs), on this node, told the
    job's layout (one rank per slot of ``hosts``); it stops when the block ends.

    Args:
        hosts: The hosts the ranks run on, one slot per rank.
        nic: The interface the other nodes reach this one on (None: the address of
            this node's name).

    Raises:
        LaunchError: ``nic`` has no IPv4 address here, or this node's name resolves to a
            loopback address while other nodes take part.
        ImportError: Horovod is not installed.
    """
    np = sum(h.slots for h in hosts)
    from horovod.runner.common.util.hosts import get_host_assignments
    from horovod.runner.common.util.hosts import parse_hosts as horovod_hosts
    from horovod.runner.http.http_server import RendezvousServer

    address = _address(nic, hosts)  # before the server: a bad address starts nothing
    server = RendezvousServer()
    port = server.start()
    try:
        layout = horovod_hosts(",".join(str(h) for h in hosts))
        server.init(get_host_assignments(layout, np, np))
        env = {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": address,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
        }
        if nic:
            env["HOROVOD_GLOO_IFACE"] = nic
        yield env
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kmp.launching.slurm -- CMD ...``: set this task's rank variables, run CMD."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m kmp.launching.slurm -- COMMAND ...", file=sys.stderr)
        return 2
    try:
        env = {**os.environ, **task_env(os.environ)}
    except (LaunchError, ValueError) as exc:
        print(f"kmp launch (SLURM task): error: {exc}", file=sys.stderr)
        return 2
    os.execvpe(args[0], args, env)
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
