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
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "command_main"]

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
    module = sys.modules[module_name]
    spec = module.__spec__  # under ``python -m`` the module is ``__main__``; its spec knows
    name = (spec.name if spec else module_name).rpartition(".")[2].replace("_", "-")
    parser = argparse.ArgumentParser(prog=f"kmp {name}", description=COMMANDS[name])
    module.configure(parser)
    return int(module.run(parser.parse_args(argv)) or 0)
