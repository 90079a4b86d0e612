"""``kmp install-horovod``: build Horovod 0.28.1 into this Python environment and check it.

Horovod ships only as a source distribution, and it does not compile against
TensorFlow >= 2.19 as released. This command builds it against the TensorFlow
installed in the running Python environment, following the plan of
:mod:`kmp.install.plan` (NCCL on NVIDIA GPUs, MPI when OpenMPI is present, the
xla_mpi_ops.cc fix), then verifies the result: Horovod's TensorFlow ops load with
the planned flags and ``horovodrun --version`` runs. The build lives in
:mod:`kmp.install.build`: a cached wheel (``~/.cache/kmp``, ``KMP_CACHE_DIR``) is
reused, and a compile reports its progress every 30 s and keeps its full log.
Run again with nothing changed, the command only checks the installed build.

``launch/setup.sh`` calls it; ``--dry-run`` prints the plan and does nothing.
Only the standard library is imported: set-up runs ``--summary`` before
anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from kmp.commands import command_main
from kmp.install import build, cuda, record
from kmp.install import plan as ip

__all__ = ["configure", "main", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp install-horovod``'s arguments."""
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (packages, variables, patch) only"
    )
    parser.add_argument(
        "--gpu",
        choices=ip.GPU_OPERATIONS,
        default=None,
        help="Horovod's GPU collectives (default: nccl with NVIDIA GPUs or KMP_DEVICE=cuda)",
    )
    mpi = parser.add_mutually_exclusive_group()
    mpi.add_argument("--mpi", dest="mpi", action="store_true", default=None, help="build MPI in")
    mpi.add_argument("--no-mpi", dest="mpi", action="store_false", help="build without MPI")
    parser.add_argument(
        "--force",
        action="store_true",
        help="reinstall even if the installed Horovod matches (from the cache if it has it)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="compile, neither using nor filling the cache"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    parser.add_argument(
        "--summary", action="store_true", help="print the plan's one-line summary only"
    )


def _plan(args: argparse.Namespace, facts: record.PythonFacts) -> ip.InstallPlan:
    from kmp import hardware

    device = ip.device_override(os.environ)
    hw = hardware.detect() if device is None else hardware.Hardware()
    return ip.plan_install(
        hw,
        device=device,
        gpu=args.gpu,
        mpi=args.mpi,
        mpi_available=bool(facts.mpicxx),
        tensorflow_version=facts.tensorflow_version or ip.TENSORFLOW_VERSION,
    )


def run(args: argparse.Namespace) -> int:
    """Plan, then (unless ``--dry-run``) build or reuse a wheel, install and verify it."""
    facts = record.python_facts()
    try:
        plan = _plan(args, facts)
    except ValueError as exc:
        print(f"kmp install-horovod: {exc}", file=sys.stderr)
        return 2
    if args.summary:
        print(plan.summary())
        return 0
    toolkit = cuda.find(os.environ) if plan.gpu_operations else None
    key = build.wheel_key(plan, facts, toolkit)
    root = build.cache_root(os.environ)
    wheel = None if args.no_cache else build.cached_wheel(root, key)
    found = build.problems(plan, facts, toolkit)
    if args.dry_run:
        if args.json:
            out = {**plan.to_dict(), "cache_key": key, "problems": found}
            print(json.dumps({**out, "cached_wheel": str(wheel) if wheel else None}, indent=2))
        else:
            print(build.format_plan(plan, facts, key, wheel, toolkit, found))
        return 0
    if found:
        for p in found:
            print(f"kmp install-horovod: {p}", file=sys.stderr)
        return 1
    return build.install(
        plan, facts, toolkit, key, root=root, wheel=wheel, force=args.force, no_cache=args.no_cache
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp install-horovod`` arguments and run (``python -m`` entry)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
