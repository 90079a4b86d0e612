"""The job ``kmp launch`` runs: its plan (:func:`build_command`, pure) and running it.

:func:`build_command` turns the options into a :class:`LaunchPlan`, an argument
list (never a shell string) and the ``KMP_*`` variables every rank receives; it
starts nothing. Only :func:`execute` starts a process: it first checks every
host in parallel (:mod:`kmp.launching.preflight`), then runs the plan with
SIGINT and SIGTERM passed on (:mod:`kmp.launching.processes`).

Settings reach every rank through the environment: ``--policy P`` sets
``KMP_POLICY=P`` and every ``KMP_*`` variable of the calling shell is passed
on. ``horovodrun`` forwards its whole environment to the ranks: with Gloo it
prefixes each rank's command with the variables (also over ssh to other
hosts), with Open MPI it adds ``-x VAR`` for each one, and MPICH / Intel MPI
pass the environment on by default.

Host lists (``-H``, ``--hostfile``) are parsed by :mod:`kmp.launching.hosts`,
the engines' variables come from :mod:`kmp.launching.engine_env` and an elastic
job's arguments from :mod:`kmp.launching.elastic`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kmp._launcher_env import LOCAL_RUN_VARS
from kmp._names import VALID_POLICIES, normalize_policy
from kmp.launching import horovodrun as horovodrun_entry
from kmp.launching import preflight, slurm
from kmp.launching.elastic import ElasticOptions, check_discovery, elastic_args
from kmp.launching.engine_env import engine_env, local_argv
from kmp.launching.hosts import HOST_RE, Host, LaunchError, check_count
from kmp.launching.processes import run_forwarding_signals

__all__ = [
    "ENV_PREFIX",
    "POLICIES",
    "LaunchPlan",
    "build_command",
    "execute",
    "format_command",
    "forwarded_env",
]

ENV_PREFIX = "KMP_"
POLICIES = VALID_POLICIES  # kmp._names imports nothing heavy: `kmp launch` stays fast
# Intel's OpenMP runtime reads variables with the same prefix (scikit-learn and joblib set
# some on import). They reach the ranks like every variable, but are not kmp settings.
_OPENMP_VARS = frozenset(
    {
        "KMP_AFFINITY",
        "KMP_BLOCKTIME",
        "KMP_DUPLICATE_LIB_OK",
        "KMP_HW_SUBSET",
        "KMP_INIT_AT_FORK",
        "KMP_SETTINGS",
        "KMP_STACKSIZE",
        "KMP_WARNINGS",
    }
)
# Read by the launch/ shell scripts themselves, not settings for the ranks.
_LAUNCHER_VARS = frozenset({"KMP_LAUNCH_ARGS", "KMP_NP", *LOCAL_RUN_VARS})


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What :func:`execute` runs.

    Attributes:
        argv: The command, as an argument list.
        env: Variables set on top of the caller's environment (the ``KMP_*``
            settings every rank receives).
        horovodrun: True when the job goes through ``horovodrun``; False for
            a single process started directly.
        checks: What to check on the hosts before starting (see
            :mod:`kmp.launching.preflight`); empty for a one-machine job.
        discovery: An elastic job's own host discovery script, run once by
            :func:`execute` to check what it prints (None: nothing to check).
        slots_per_host: Slots of a discovered host printed without ``:SLOTS``.
        rendezvous: A job that ``srun`` starts on Horovod's Gloo: its hosts and slots
            (one per rank), for the rendezvous server :func:`execute` runs
            (:func:`kmp.launching.slurm.gloo_rendezvous`).
        interface: The network interface of that rendezvous (None: the host name's address).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    horovodrun: bool
    checks: tuple[preflight.Check, ...] = ()
    discovery: str | None = None
    slots_per_host: int | None = None
    rendezvous: tuple[Host, ...] = ()
    interface: str | None = None


# ---------------------------------------------------------------- command


def forwarded_env(environ: Mapping[str, str], policy: str | None = None) -> dict[str, str]:
    """The ``KMP_*`` settings every rank receives: those in ``environ`` plus ``KMP_POLICY``.

    Intel OpenMP's own ``KMP_*`` variables (``KMP_AFFINITY``, ...) and the
    launch scripts' ``KMP_LAUNCH_ARGS`` / ``KMP_NP`` are left out: they are not
    kmp settings (the ranks still inherit them like any other variable).
    """
    skip = _OPENMP_VARS | _LAUNCHER_VARS
    env = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX) and k not in skip}
    if policy is not None:
        env["KMP_POLICY"] = policy
    return dict(sorted(env.items()))


def _default_launcher() -> list[str]:
    """The command that starts Horovod's launcher.

    Through :mod:`kmp.launching.horovodrun` where Horovod is installed beside this Python
    (it skips horovodrun's 7-second start-up probe), else ``horovodrun`` on PATH.
    """
    if Path(sys.executable).with_name("horovodrun").exists():
        return [sys.executable, "-m", horovodrun_entry.MODULE]
    return [shutil.which("horovodrun") or "horovodrun"]


def build_command(
    np: int | None,
    script: str | os.PathLike,
    script_args: Sequence[str] = (),
    *,
    hosts: Sequence[Host] | None = None,
    controller: str | None = None,
    policy: str | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | os.PathLike | None = None,
    network_interfaces: str | None = None,
    python: str | None = None,
    horovodrun: str | None = None,
    environ: Mapping[str, str] | None = None,
    elastic: ElasticOptions | None = None,
    engine: str = "horovod",
    coordinator_port: int | None = None,
    gloo_timeout: int | None = None,
    allocation: Sequence[Host] | None = None,
) -> LaunchPlan:
    """Build the command that runs ``script`` on ``np`` processes (pure: starts nothing).

    Args:
        np: Number of processes, >= 1. With 1 the script runs as a plain
            ``python script.py`` on this machine, without ``horovodrun``.
        script: The Python script; it must exist.
        script_args: Arguments passed to the script unchanged.
        hosts: Where to run; ``localhost:np`` when None.
        controller: ``"gloo"`` or ``"mpi"``; None means Gloo (kmp's default, the
            same whether or not Horovod was also built with MPI).
        policy: Dtype policy for every rank (sets ``KMP_POLICY``).
        ssh_port: SSH port of the other hosts.
        ssh_identity_file: SSH private key for the other hosts; it must exist.
        network_interfaces: Comma-separated interfaces for ``horovodrun`` (each must
            exist on every host: checked before the job starts).
        python: Interpreter for the script; this one (``sys.executable``) when None.
        horovodrun: Path of ``horovodrun``. None: Horovod's launcher through
            :mod:`kmp.launching.horovodrun` (no start-up probe) when Horovod is installed
            beside ``sys.executable``, else ``horovodrun`` on PATH.
        environ: Environment to take ``KMP_*`` variables from; ``os.environ`` when None.
        elastic: Run an elastic job (:mod:`kmp.launching.elastic`); its
            hosts come from host discovery, so ``hosts`` must be None, and
            ``np`` may be None (see :func:`~kmp.launching.elastic.elastic_args`).
        engine: ``"horovod"`` or ``"jax"`` (:mod:`kmp.launching.engine_env`:
            horovodrun starts the processes, which join JAX's runtime).
        coordinator_port: The JAX coordinator's port (None: a free one).
        gloo_timeout: Seconds a rank waits in a Gloo operation, the start-up
            rendezvous included, before it fails (``horovodrun
            --gloo-timeout-seconds``; None: Horovod's 30). In an elastic job this
            bounds how long a rank waiting on a dead peer takes to notice; it
            must exceed the spread of the ranks' start-up (import to
            ``kmp.distributed.init()``), or the job fails at start.
        allocation: The hosts of the SLURM allocation this runs in
            (:func:`kmp.launching.slurm.allocation_hosts`): ``srun`` starts the ranks
            there (:func:`kmp.launching.slurm.srun_argv`), no ssh; ``hosts``, ssh
            options and ``elastic`` must then be None.

    Returns:
        The :class:`LaunchPlan`.

    Raises:
        LaunchError: ``np < 1``, a missing script, an unknown controller or
            policy, a missing identity file, a bad port or interface name, or hosts
            with fewer slots than ``np``; bad elastic options; a ``gloo_timeout``
            that is not an integer >= 1, or one given with MPI or the JAX engine; an
            allocation with hosts, ssh options or ``elastic``, or too few tasks.
    """
    if allocation is not None:
        _check_allocation(hosts, ssh_port, ssh_identity_file, elastic)
        hosts = list(allocation)
    if elastic is not None and hosts:
        raise LaunchError(
            "--elastic takes its hosts from --hostfile (re-read while the job runs) or "
            "--host-discovery-script, not -H."
        )
    if elastic is None and (isinstance(np, bool) or not isinstance(np, int) or np < 1):
        raise LaunchError(f"-np must be an integer >= 1 (the number of processes), got {np!r}.")
    script_path = Path(script)
    if not script_path.is_file():
        raise LaunchError(
            f"Script {str(script)!r} does not exist (looked in {Path.cwd()}); give the path "
            "of a Python file."
        )
    if controller not in (None, "gloo", "mpi"):
        raise LaunchError(f"controller must be 'gloo', 'mpi' or None, got {controller!r}.")
    if policy is not None:
        try:
            policy = normalize_policy(policy)
        except (TypeError, ValueError) as exc:
            raise LaunchError(f"--policy: {exc}") from None
    environ = os.environ if environ is None else environ
    env = forwarded_env(environ, policy)
    env.update(engine_env(engine, hosts, coordinator_port, environ, elastic=elastic is not None))
    if gloo_timeout is not None:
        check_count(gloo_timeout, "--gloo-timeout")
        if controller == "mpi" or engine == "jax":
            used = "--mpi" if controller == "mpi" else f"--engine {engine}"
            raise LaunchError(
                f"--gloo-timeout sets the timeout of Horovod's Gloo controller, which {used} "
                "does not use: drop one of them."
            )
    python = python or sys.executable
    command = [python, str(script_path), *script_args]
    extra: list[str] = []
    if elastic is not None:
        np, extra, hosts = elastic_args(elastic, np, python=python, controller=controller)
    elif np == 1:
        return LaunchPlan(argv=tuple(command), env=env, horovodrun=False)
    else:
        hosts = list(hosts) if hosts else [Host("localhost", np)]
    total = sum(h.slots for h in hosts)
    if elastic is None and total < np:
        listed = ",".join(str(h) for h in hosts)
        raise LaunchError(
            f"-np {np} needs {np} slots, but the hosts ({listed}) provide {total}. "
            "Add slots (-H host:N) or hosts, or lower -np."
        )
    nics = [n.strip() for n in (network_interfaces or "").split(",") if n.strip()]
    for nic in nics:
        if not HOST_RE.match(nic) or len(nic) > 15:
            raise LaunchError(f"--network-interface {nic!r} is not an interface name (e.g. eth0).")
    if allocation is not None:
        cpus = environ.get("SLURM_CPUS_PER_TASK")
        return _srun_plan(
            np, hosts, command, env, python, controller, engine, nics, gloo_timeout, cpus
        )
    local = local_argv(engine, hosts, np, python, command)
    if local is not None:  # a JAX job on this machine: kmp's own launcher, no horovodrun
        return LaunchPlan(argv=local, env=env, horovodrun=False)
    if ssh_port is not None and (isinstance(ssh_port, bool) or not 1 <= int(ssh_port) <= 65535):
        raise LaunchError(f"--ssh-port must be a TCP port from 1 to 65535, got {ssh_port!r}.")
    if ssh_identity_file is not None and not Path(ssh_identity_file).is_file():
        raise LaunchError(
            f"--ssh-identity-file {str(ssh_identity_file)!r} does not exist; give the private "
            "key that the other hosts accept."
        )
    if elastic is not None and not nics and hosts and all(h.name == "localhost" for h in hosts):
        nics = ["lo"]  # Horovod's elastic driver probes interfaces for minutes otherwise
    argv = [*([horovodrun] if horovodrun else _default_launcher()), "-np", str(np)]
    if elastic is None:
        argv += ["-H", ",".join(str(h) for h in hosts)]
    argv += [*extra, f"--{controller or 'gloo'}"]
    if gloo_timeout is not None:
        argv += ["--gloo-timeout-seconds", str(gloo_timeout)]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["--ssh-identity-file", str(ssh_identity_file)]
    if nics:
        argv += ["--network-interfaces", ",".join(nics)]
        if controller == "mpi":  # MPI's own out-of-band channel must take the same interface
            argv.append(f"--mpi-args=-mca oob_tcp_if_include {','.join(nics)}")
    checks = preflight.plan_checks(
        [h.name for h in hosts],
        nics,
        python=python,
        ssh_port=ssh_port,
        identity_file=None if ssh_identity_file is None else str(ssh_identity_file),
    )
    return LaunchPlan(
        argv=tuple(argv + command),
        env=env,
        horovodrun=True,
        checks=checks,
        discovery=None if elastic is None else elastic.discovery_script,
        slots_per_host=None if elastic is None else elastic.slots_per_host,
    )


def _check_allocation(
    hosts: Sequence[Host] | None,
    ssh_port: int | None,
    ssh_identity_file: str | os.PathLike | None,
    elastic: ElasticOptions | None,
) -> None:
    """What cannot go with a SLURM allocation, said with what to do instead."""
    if hosts:
        raise LaunchError("give either -H/--hostfile or the SLURM allocation's hosts, not both.")
    if ssh_port is not None or ssh_identity_file is not None:
        raise LaunchError(
            "inside a SLURM allocation srun starts the ranks, without ssh: drop --ssh-port and "
            "--ssh-identity-file (or give -H/--hostfile to start them over ssh)."
        )
    if elastic is not None:
        raise LaunchError(
            "--elastic inside a SLURM allocation: SLURM replaces a failed node by requeueing "
            "the job (sbatch --requeue), which resumes from its last checkpoint; drop --elastic."
        )


def _srun_plan(
    np: int,
    hosts: Sequence[Host],
    command: Sequence[str],
    env: dict[str, str],
    python: str,
    controller: str | None,
    engine: str,
    nics: Sequence[str],
    gloo_timeout: int | None,
    cpus_per_task: str | None,
) -> LaunchPlan:
    """The plan of a job that ``srun`` starts on the allocation (:mod:`kmp.launching.slurm`)."""
    if len(nics) > 1:
        raise LaunchError(
            f"--network-interface {','.join(nics)}: a job srun starts takes one interface "
            "(Gloo's and MPI's), the one the nodes reach each other on; pass one."
        )
    argv = slurm.srun_argv(
        np, hosts, command, python=python, controller=controller, cpus_per_task=cpus_per_task
    )
    used = slurm.fill(hosts, np)
    env = {**env, slurm.HOSTS_VAR: ",".join(str(h) for h in used)}
    if gloo_timeout is not None:
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(gloo_timeout)
    nic = nics[0] if nics else None
    if controller == "mpi":
        env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"})
        if nic:
            env.update({"OMPI_MCA_btl_tcp_if_include": nic, "OMPI_MCA_oob_tcp_if_include": nic})
    gloo = engine == "horovod" and controller != "mpi"
    return LaunchPlan(
        argv=argv,
        env=env,
        horovodrun=False,
        rendezvous=used if gloo else (),
        interface=nic,
    )


def format_command(plan: LaunchPlan) -> str:
    """The plan as one copy-pasteable shell line (for display only; never executed)."""
    prefix = [f"{k}={v}" for k, v in plan.env.items()]
    return shlex.join([*prefix, *plan.argv])


def execute(
    plan: LaunchPlan, *, check_hosts: bool = True, received: list[int] | None = None
) -> int:
    """Check the hosts, run the plan and return its exit status (130 after Ctrl-C).

    Args:
        plan: What :func:`build_command` returned.
        check_hosts: Run ``plan.checks`` first; a failed check returns 2 and
            starts nothing.
        received: Where the signals ``kmp launch`` itself received while the job
            ran are appended (see :func:`run_forwarding_signals`).
    """
    if plan.discovery is not None:
        try:
            check_discovery(plan.discovery, plan.slots_per_host)
        except LaunchError as exc:
            print(f"kmp launch: error: {exc}", file=sys.stderr)
            return 2
    if check_hosts:
        problems = preflight.run_checks(plan.checks)
        for problem in problems:
            print(f"kmp launch: error: {problem}", file=sys.stderr)
        if problems:
            return 2
    if plan.horovodrun and shutil.which(plan.argv[0]) is None:
        from kmp._imports import INSTALL_HINTS

        print(
            f"kmp launch: {plan.argv[0]!r} was not found. Horovod is needed for -np > 1: "
            f"{INSTALL_HINTS['horovod']}",
            file=sys.stderr,
        )
        return 127
    env = {**os.environ, **plan.env}
    if plan.argv[0] == "srun" and shutil.which("srun") is None:
        print(
            "kmp launch: error: this runs in a SLURM allocation, but `srun` is not on PATH "
            "here (a container?): make SLURM's commands available, or pass -H/--hostfile.",
            file=sys.stderr,
        )
        return 127
    if not plan.rendezvous:
        return run_forwarding_signals(plan.argv, env, received=received)
    with contextlib.ExitStack() as stack:
        try:
            gloo = stack.enter_context(slurm.gloo_rendezvous(plan.rendezvous, plan.interface))
        except (ImportError, LaunchError) as exc:
            from kmp._imports import INSTALL_HINTS

            hint = INSTALL_HINTS["horovod"] if isinstance(exc, ImportError) else ""
            print(f"kmp launch: error: {exc} {hint}".rstrip(), file=sys.stderr)
            return 2
        return run_forwarding_signals(plan.argv, {**env, **gloo}, received=received)
