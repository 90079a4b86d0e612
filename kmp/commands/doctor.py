"""``kmp doctor``: versions, Horovod build facts, hardware, and what "auto" picks.

``kmp doctor`` prints a report; ``kmp doctor --json`` prints one JSON object whose
stable keys are documented in :mod:`kmp.install.stack_report` (which gathers the facts;
the warnings come from :func:`kmp.install.checks.diagnose`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kmp.commands import command_main, tensorflow_notices_dropped
from kmp.install.stack_report import collect, format_report

__all__ = ["configure", "main", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp doctor``'s arguments."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the report; always exits 0 (a missing Horovod is reported, not fatal)."""
    with tensorflow_notices_dropped():  # collect imports TensorFlow and Horovod
        info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp doctor`` arguments and run (``python -m kmp.commands.doctor``)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
