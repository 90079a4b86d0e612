"""The ``kmp`` command-line commands, one thin module each.

Each module is split as parser / command / main:

* ``configure(parser)`` adds the command's arguments to an ``argparse`` parser;
* ``run(args) -> int`` does the work and returns the exit status;
* ``main(argv=None) -> int`` parses ``argv`` and calls ``run`` (``python -m kmp.commands.X``),
  through :func:`command_main`.

The machinery they drive lives in packages by concern: :mod:`kmp.launching`
(``kmp launch``), :mod:`kmp.cluster` (``kmp cluster``) and :mod:`kmp.install`
(``kmp install-horovod``, ``kmp doctor``). :mod:`kmp.cli` collects the commands
under one ``kmp`` program; a command's module is its name with ``-`` spelled
``_`` (``install-horovod``: :mod:`kmp.commands.install_horovod`).

What kmp's programs print goes through two helpers here, shared with ``launch/``:
:func:`format_table`, columns as wide as their widest cell (a policy named
``mixed_bfloat16 (auto)`` keeps them aligned), and :func:`tensorflow_notices_dropped`,
around a TensorFlow import, for the start-up notices TensorFlow prints before its log
level (:func:`kmp._launcher_env.quiet_env`) applies.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Collection, Iterable, Iterator, Sequence

from kmp._launcher_env import quiet_env, tf_log_level

__all__ = [
    "COMMANDS",
    "command_main",
    "format_table",
    "is_tensorflow_notice",
    "tensorflow_notices_dropped",
]

COMMANDS: dict[str, str] = {
    "doctor": "Show versions, Horovod build facts, hardware and the policy 'auto' picks.",
    "audit": "Audit a saved Keras model's layer dtypes; exit 1 when it is not ok.",
    "launch": (
        "Run a training script on N processes (under horovodrun; a JAX-engine job on this "
        "machine alone through kmp's own launcher)."
    ),
    "bench": "Run kmp's benchmarks and write bench/results/.",
    "cluster": "Make a multi-host cluster on this Linux machine (network namespaces, sshd).",
    "install-horovod": (
        "Build Horovod 0.28.1 against this environment's TensorFlow (NCCL on GPUs), cached "
        "and verified."
    ),
}


def command_main(module_name: str, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as the arguments of the command in ``module_name``, then run it.

    The ``main`` of every command module (``python -m kmp.commands.X``): the same
    parser as ``kmp X`` builds, named and described from :data:`COMMANDS`.
    """
    os.environ.update(quiet_env())  # before any TensorFlow import, here and in children
    module = sys.modules[module_name]
    spec = module.__spec__  # under ``python -m`` the module is ``__main__``; its spec knows
    name = (spec.name if spec else module_name).rpartition(".")[2].replace("_", "-")
    parser = argparse.ArgumentParser(prog=f"kmp {name}", description=COMMANDS[name])
    module.configure(parser)
    return int(module.run(parser.parse_args(argv)) or 0)


def format_table(
    rows: Iterable[Sequence[object]],
    header: Sequence[str] | None = None,
    *,
    right: Collection[int] = (),
    indent: str = "",
) -> str:
    """Return ``rows`` (under ``header``) as text columns, each as wide as its widest cell.

    Cells are ``str()``-ed and two spaces apart; the columns whose indexes are in
    ``right`` are right-aligned (numbers), the others left-aligned. No line ends in spaces.

    Raises:
        ValueError: A row has another number of cells than the first.
    """
    table = [[str(c) for c in row] for row in ([header] if header else []) + list(rows)]
    if not table:
        return ""
    if any(len(row) != len(table[0]) for row in table):
        raise ValueError(f"format_table: rows of different lengths: {table}")
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


# TensorFlow's C++ log lines, in absl's format ("I0000 00:00:1796374048.701077   13205
# port.cc:153] ...") and in its own ("2026-01-30 22:44:42.456316: I tensorflow/...:153] ...").
_LOG_LINE = re.compile(
    r"(?:(?P<absl>[IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ |\d{4}-\d\d-\d\d [\d:.]+: (?P<tf>[IWEF]) )"
    r"\S+:\d+\] "
)
# Start-up notices that are not log lines: absl's note before its first line and the second
# line of TensorFlow's CPU-instructions notice.
_NOTICE_STARTS = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions: ",
)
# Log lines that are notices at any severity: CUDA plugins registered twice (harmless).
_HARMLESS = ("when one has already been registered", "computation placer already registered")


def is_tensorflow_notice(line: str, level: int) -> bool:
    """Whether ``line`` is a TensorFlow start-up notice that log level ``level`` leaves out.

    A TensorFlow log line below ``level`` (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL) or one of
    the known start-up notices; nothing at level 0, where the user asked for everything.
    """
    if level <= 0:
        return False
    found = _LOG_LINE.match(line)
    if found is None:
        return line.startswith(_NOTICE_STARTS)
    below = "IWEF".index(found["absl"] or found["tf"]) < level
    return below or any(h in line for h in _HARMLESS)


@contextlib.contextmanager
def tensorflow_notices_dropped() -> Iterator[None]:
    """Leave TensorFlow's start-up notices out of what this process writes to stderr meanwhile.

    TensorFlow 2.21 logs some notices before it applies ``TF_CPP_MIN_LOG_LEVEL`` (oneDNN's,
    once for each of its libraries that holds its own absl). Around a TensorFlow import,
    stderr (file descriptor 2) goes to a temporary file; then every line that is not such a
    notice (:func:`is_tensorflow_notice` at the level in the environment) is written to
    stderr, in order. Nothing is held at level 0 (``TF_CPP_MIN_LOG_LEVEL=0``: everything,
    live), nor when there is no stderr.
    """
    level = tf_log_level()
    saved = None
    if level > 0:
        with contextlib.suppress(OSError, ValueError):
            if sys.stderr is not None:
                sys.stderr.flush()
            saved = os.dup(2)
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "surrogateescape")
            kept = [ln for ln in text.splitlines(True) if not is_tensorflow_notice(ln, level)]
            data = "".join(kept).encode("utf-8", "surrogateescape")
            while data:
                data = data[os.write(2, data) :]
