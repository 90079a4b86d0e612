"""``kmp audit MODEL.keras``: audit a saved model's dtypes; exit 1 when not ok."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kmp.commands import command_main, tensorflow_notices_dropped

__all__ = ["configure", "main", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``kmp audit``'s arguments."""
    parser.add_argument("model", type=Path, help="a model saved with model.save('x.keras')")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--policy",
        default=None,
        help="global policy to audit against (default: the policy the model was built with)",
    )


def run(args: argparse.Namespace) -> int:
    """Load the model, print its audit, and return 0 if ok, 1 if not, 2 on bad input."""
    path: Path = args.model
    if not path.exists():
        print(f"kmp audit: no such file: {path}", file=sys.stderr)
        return 2
    if path.suffix not in (".keras", ".h5"):
        print(
            f"kmp audit: {path} is not a Keras model file; save the model with "
            "model.save('model.keras') and audit that file.",
            file=sys.stderr,
        )
        return 2
    with tensorflow_notices_dropped():
        import keras

        import kmp.layers  # noqa: F401  (registers Float32Output for loading)
        from kmp.auditing import audit

    try:
        model = keras.saving.load_model(path, compile=False)
    except Exception as exc:  # keras raises many kinds for bad files
        print(f"kmp audit: could not load {path}: {exc}", file=sys.stderr)
        return 2
    if args.policy:
        keras.config.set_dtype_policy(args.policy)
    else:
        # Audit against the policy most layers were built with.
        policies = [layer.dtype_policy.name for layer in model.layers]
        if policies:
            keras.config.set_dtype_policy(max(set(policies), key=policies.count))
    report = audit(model)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` as ``kmp audit`` arguments and run (``python -m kmp.commands.audit``)."""
    return command_main(__name__, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
