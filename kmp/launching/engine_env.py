"""``kmp launch --engine``: the variables each engine's processes get, and a JAX job's start.

The JAX engine (:mod:`kmp.distributed._jax`) needs three things in every
process: ``KERAS_BACKEND=jax``, the coordinator's ``host:port`` (process 0
runs the coordinator service, on the first host) and the process's id.
On this machine alone the processes are started by kmp's own launcher
(:mod:`kmp.launching.local_run`, :func:`local_argv`), so no Horovod is needed.
With other hosts, ``horovodrun`` starts one process per slot on every host,
over ssh, with its rank in ``HOROVOD_RANK``: kmp reuses it as the process
launcher, so ``-H``, ``--hostfile``, ssh options and ``kmp cluster`` hosts work
the same for both engines. :func:`jax_env` is the pure decision of the
variables; :func:`pick_port` finds a free port.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence

from kmp._launcher_env import COORDINATOR_VAR, ENGINE_VAR
from kmp._names import ENGINE_NAMES
from kmp.launching.hosts import Host, LaunchError

__all__ = [
    "LAUNCH_ENGINES",
    "configure_engine",
    "engine_env",
    "jax_env",
    "local_argv",
    "pick_port",
    "port_is_free",
]

LAUNCH_ENGINES = ENGINE_NAMES  # the names live in kmp._names
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def pick_port() -> int:
    """Return a TCP port that is free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    """True when nothing listens on ``port`` on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def jax_env(
    hosts: Sequence[Host] | None,
    port: int,
    environ: Mapping[str, str],
    *,
    port_free: bool = True,
) -> dict[str, str]:
    """Return the variables every process of a JAX job gets.

    Args:
        hosts: The job's hosts; the first runs process 0 and so the coordinator
            (None: this machine).
        port: The coordinator's port.
        environ: The caller's environment (``KERAS_BACKEND`` is checked).
        port_free: Whether ``port`` is free here (checked when the coordinator
            runs on this machine).

    Raises:
        LaunchError: ``KERAS_BACKEND`` names another backend, a bad port, or a
            port already in use on this machine.
    """
    backend = environ.get("KERAS_BACKEND") or "jax"
    if backend != "jax":
        raise LaunchError(
            f"--engine jax runs Keras on its JAX backend, but KERAS_BACKEND={backend}. Unset "
            "it (kmp launch sets KERAS_BACKEND=jax), or use --engine horovod."
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise LaunchError(f"--coordinator-port must be a TCP port from 1 to 65535, got {port!r}.")
    names = [h.name for h in hosts] if hosts else ["localhost"]
    local_names = _LOOPBACK | {socket.gethostname()}
    if names[0] in local_names and not port_free:
        raise LaunchError(
            f"--coordinator-port {port} is already in use on this machine; pick another "
            "port, or leave the option out (kmp launch then picks a free one)."
        )
    if names[0] in _LOOPBACK and not all(n in local_names for n in names):
        raise LaunchError(
            f"The first host ({names[0]}) runs the JAX coordinator, and the other hosts must "
            "reach it: name it by an address they can reach (e.g. its hostname), not localhost."
        )
    address = "127.0.0.1" if names[0] in _LOOPBACK else names[0]
    return {"KERAS_BACKEND": "jax", ENGINE_VAR: "jax", COORDINATOR_VAR: f"{address}:{port}"}


def engine_env(
    engine: str,
    hosts: Sequence[Host] | None,
    coordinator_port: int | None,
    environ: Mapping[str, str],
    *,
    elastic: bool = False,
) -> dict[str, str]:
    """Return the variables ``engine`` adds to every process (none for Horovod).

    Raises:
        LaunchError: An unknown engine; Horovod with ``KERAS_BACKEND=jax``; the JAX
            engine with ``--elastic``; what :func:`jax_env` refuses.
    """
    if engine not in LAUNCH_ENGINES:
        raise LaunchError(f"--engine must be one of {', '.join(LAUNCH_ENGINES)}, got {engine!r}.")
    if engine == "horovod":
        if environ.get("KERAS_BACKEND") == "jax":
            raise LaunchError(
                "KERAS_BACKEND=jax, but Horovod averages with TensorFlow ops: launch with "
                "--engine jax (JAX's runtime), or unset KERAS_BACKEND."
            )
        return {}
    if elastic:
        raise LaunchError("--elastic runs on Horovod's elastic driver: use --engine horovod.")
    port = pick_port() if coordinator_port is None else coordinator_port
    checkable = isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535
    free = coordinator_port is None or not checkable or port_is_free(port)
    return jax_env(hosts, port, environ, port_free=free)


def local_argv(
    engine: str, hosts: Sequence[Host], np: int, python: str, command: Sequence[str]
) -> tuple[str, ...] | None:
    """The command of a JAX job on this machine alone: kmp's local launcher, no horovodrun.

    Returns None for Horovod jobs and for jobs with other hosts (those go through
    horovodrun, which reaches them over ssh).
    """
    local = _LOOPBACK | {socket.gethostname()}
    if engine != "jax" or not all(h.name in local for h in hosts):
        return None
    return (python, "-m", "kmp.launching.local_run", "-np", str(np), "--", *command)


def configure_engine(parser: argparse.ArgumentParser) -> None:
    """Add ``--engine`` and ``--coordinator-port`` to ``kmp launch``'s parser."""
    parser.add_argument(
        "--engine",
        choices=LAUNCH_ENGINES,
        default="horovod",
        help="what carries the collectives: horovod (TensorFlow backend, the default) or jax "
        "(Keras's JAX backend and JAX's runtime; sets KERAS_BACKEND=jax)",
    )
    parser.add_argument(
        "--coordinator-port",
        type=int,
        metavar="PORT",
        help="--engine jax: the coordinator's port on the first host (default: a free port)",
    )
