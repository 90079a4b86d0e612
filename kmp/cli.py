"""The ``kmp`` program: ``kmp doctor | audit | launch | bench | cluster | install-horovod``.

Each subcommand lives in :mod:`kmp.commands` as parser / command / main; this
module only gathers them under one parser and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kmp._launcher_env import quiet_env
from kmp._version import __version__
from kmp.commands import COMMANDS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level ``kmp`` parser with every subcommand configured."""
    parser = argparse.ArgumentParser(
        prog="kmp", description="Keras-first mixed precision with Horovod distribution."
    )
    parser.add_argument("--version", action="version", version=f"kmp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        module_name = f"kmp.commands.{name.replace('-', '_')}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a command not shipped in this build
            if exc.name != module_name:
                raise
            continue
        cmd_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(cmd_parser)
        cmd_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kmp`` program and return its exit status.

    TensorFlow's log level is set first (unless the user set it), before any command imports
    TensorFlow, for this process and every process it starts (:func:`~kmp._launcher_env.quiet_env`).
    """
    os.environ.update(quiet_env())
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
