"""Running a child command the way a launcher must: signals passed on, never cut short.

``subprocess.run`` answers Ctrl-C by killing the child a quarter of a second
later, which cuts off ``horovodrun``'s own clean-up of remote ranks, and it does
not pass SIGTERM on at all. :func:`run_forwarding_signals` sends SIGINT, SIGTERM
and SIGUSR1 (what a scheduler sends before a time limit) on to the child and waits
for it to finish, killing it only if it outlives a grace period: long enough for
the ranks to write their checkpoint (``kmp.callbacks.AtomicCheckpoint``).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping, Sequence
from types import FrameType

__all__ = ["FORWARDED_SIGNALS", "run_forwarding_signals"]

GRACE_S = 30.0
# What a launcher passes on to what it started: Ctrl-C, a stop, a time limit's warning.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def run_forwarding_signals(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    grace_s: float = GRACE_S,
    received: list[int] | None = None,
) -> int:
    """Run ``argv``; forward :data:`FORWARDED_SIGNALS` to it; return its exit status.

    Args:
        argv: The command.
        env: Its environment (default: this process's).
        grace_s: How long the child may take to exit after a forwarded signal
            before it is killed.
        received: A list the caller owns; each signal this process received while
            the child ran is appended (what a launcher then decides on: a job
            cancelled with SIGTERM is not requeued).

    Returns:
        The child's exit status; 130 when it was interrupted and died of it, 128 + the
        signal's number when another forwarded signal killed it.
    """
    child = subprocess.Popen(list(argv), env=None if env is None else dict(env))
    received = [] if received is None else received

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        while True:
            try:
                code = child.wait(timeout=grace_s if received else None)
                break
            except subprocess.TimeoutExpired:  # it ignored the signal for too long
                child.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received and code < 0:
        return 128 + int(received[-1])  # 130 after Ctrl-C
    return code
