"""Progress of a long build step: its output to a log file, a heartbeat on the terminal.

Compiling Horovod takes about 9 minutes on a fresh machine. :func:`run_logged`
runs such a step with all its output (standard output and error, line by line)
appended to a log file, and every ``interval`` seconds while it runs reports
one line: how long it has run, how far the build says it is (CMake's
``[ 45%]`` counter, when it prints one) and the last line it printed::

    still compiling Horovod: 3 min 20 s, 45%, last: [ 45%] Building CXX object ...

The wording is decided by pure functions (:func:`format_elapsed`,
:func:`build_percent`, :func:`format_progress`). Standard library only.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "HEARTBEAT_S",
    "build_percent",
    "format_elapsed",
    "format_progress",
    "run_logged",
]

HEARTBEAT_S = 30.0
_PERCENT = re.compile(r"^\s*\[\s*(\d{1,3})%\]")
_MAX_LAST = 100


def format_elapsed(seconds: float) -> str:
    """``seconds`` as ``"45 s"``, ``"3 min 20 s"`` or ``"1 h 05 min"`` (rounded down)."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def build_percent(line: str) -> int | None:
    """The build's own progress in ``line``: CMake's ``[ 45%] ...`` gives 45; None otherwise."""
    match = _PERCENT.match(line)
    if match is None:
        return None
    percent = int(match.group(1))
    return percent if percent <= 100 else None


def format_progress(
    what: str, elapsed_s: float, last_line: str | None, percent: int | None = None
) -> str:
    """The heartbeat line: ``"still <what>: 3 min 20 s, 45%, last: <last line>"``.

    Args:
        what: The step, e.g. ``"compiling Horovod"``.
        elapsed_s: Seconds since the step started.
        last_line: The last non-empty line it printed (None: nothing yet). Lines
            longer than 100 characters are cut, with ``...`` at the end.
        percent: The highest progress the build reported (None: none).
    """
    parts = [f"still {what}: {format_elapsed(elapsed_s)}"]
    if percent is not None:
        parts.append(f"{percent}%")
    if last_line:
        line = last_line.strip()
        if len(line) > _MAX_LAST:
            line = line[: _MAX_LAST - 3] + "..."
        parts.append(f"last: {line}")
    else:
        parts.append("no output yet")
    return ", ".join(parts)


class _Tail:
    """What the reader thread has seen: the last non-empty line and the highest percentage."""

    def __init__(self) -> None:
        self.last: str | None = None
        self.percent: int | None = None

    def see(self, line: str) -> None:
        if line.strip():
            self.last = line.rstrip()
            found = build_percent(line)
            if found is not None and (self.percent is None or found > self.percent):
                self.percent = found


def run_logged(
    argv: Sequence[str],
    log: Path,
    *,
    what: str,
    env: Mapping[str, str] | None = None,
    interval: float = HEARTBEAT_S,
    report: Callable[[str], None] = print,
) -> int:
    """Run ``argv`` with its output appended to ``log``; report progress every ``interval`` s.

    Args:
        argv: The command.
        log: The log file; created (with its folder) if missing, appended to otherwise.
        what: The step, for the heartbeat (:func:`format_progress`).
        env: The command's environment (None: this process's).
        interval: Seconds between heartbeats.
        report: Where heartbeats go (one line each).

    Returns:
        The command's exit status.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = _Tail()
    start = time.monotonic()
    with open(log, "a", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )

        def pump() -> None:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                tail.see(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            while True:
                try:
                    code = proc.wait(timeout=interval)
                    break
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - start
                    report(format_progress(what, elapsed, tail.last, tail.percent))
        except BaseException:  # Ctrl-C: never leave the build running behind
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join()
    return code
