"""Run N copies of a command on this machine, with kmp's rank variables: no Horovod needed.

``kmp launch --engine jax -np N script.py`` on one machine starts the processes
here instead of through ``horovodrun``, so the JAX engine works where Horovod
is not installed. Each process gets ``KMP_RANK``, ``KMP_SIZE``,
``KMP_LOCAL_RANK`` and ``KMP_LOCAL_SIZE`` (read by :mod:`kmp._launcher_env`);
its output lines are tagged ``[R]<stdout>:`` / ``[R]<stderr>:`` as horovodrun
tags them. When one process fails the others are stopped (SIGTERM, then
SIGKILL after a grace period) and its exit status is returned; SIGINT, SIGTERM
and SIGUSR1 are passed on to every process (:data:`kmp.launching.processes.FORWARDED_SIGNALS`).

::

    python -m kmp.launching.local_run -np 2 -- python train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO

from kmp._launcher_env import LOCAL_RUN_VARS
from kmp.launching.processes import FORWARDED_SIGNALS

__all__ = ["main", "rank_env", "run"]

GRACE_S = 10.0


def rank_env(rank: int, size: int) -> dict[str, str]:
    """The variables process ``rank`` of ``size`` gets (pure)."""
    names = dict(zip(("rank", "size", "local_rank", "local_size"), LOCAL_RUN_VARS, strict=True))
    values = {"rank": rank, "size": size, "local_rank": rank, "local_size": size}
    return {names[k]: str(v) for k, v in values.items()}


def _pump(stream: IO[str], tag: str, out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"{tag}{line}" if line.endswith("\n") else f"{tag}{line}\n")
            out.flush()


def run(command: Sequence[str], np: int, env: Mapping[str, str] | None = None) -> int:
    """Start ``np`` copies of ``command``; return 0, or the status of the first that failed."""
    base = dict(os.environ if env is None else env)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(np):
        proc = subprocess.Popen(
            list(command),
            env={**base, **rank_env(rank, np)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        procs.append(proc)
        streams = ((proc.stdout, "stdout", sys.stdout), (proc.stderr, "stderr", sys.stderr))
        for stream, name, out in streams:
            t = threading.Thread(target=_pump, args=(stream, f"[{rank}]<{name}>:", out, lock))
            t.daemon = True
            t.start()
            pumps.append(t)

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    failed: int | None = None
    try:
        while True:
            states = [p.poll() for p in procs]  # every process, each time
            if all(code is not None for code in states):
                break
            bad = [code for code in states if code not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                _stop(procs)
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for t in pumps:
        t.join(timeout=5)
    if failed is None:
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return 128 - failed if failed < 0 else failed


def _stop(procs: list[subprocess.Popen]) -> None:
    """Ask the processes still running to end; kill those that outlive the grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kmp.launching.local_run -np N -- COMMAND ...``."""
    parser = argparse.ArgumentParser(prog="kmp-local-run", description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, required=True, metavar="N")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.np < 1 or not command:
        parser.error("give -np N >= 1 and a command after --")
    return run(command, args.np)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
