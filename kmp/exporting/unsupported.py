"""Which layer a format cannot hold, from the converter's op names: :func:`blame_layer`.

Converters name the operations they cannot express after TensorFlow's name scopes, which
follow the Keras layers: ``sequential_1/odd_layer_1/erfinv/Erfinv`` is an ``Erfinv`` op
inside the layer ``odd_layer`` (TensorFlow adds ``_1``, ``_2`` to scopes it reopens). The
layer is the one whose name matches the innermost scope; among layers of one name, the
one whose whole path matches. Pure string work, so it is tested on made-up names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["blame_layer", "litert_failed_ops", "unsupported_error"]

# The op entries of a TFLite converter error: fused["Erfinv:", "scope/layer/Erfinv@__inf..."]
_FUSED_OP = re.compile(r'fused\["(\w+):", "([^"@]+)@')


def _matches(scope: str, name: str) -> bool:
    return scope == name or re.fullmatch(re.escape(name) + r"_\d+", scope) is not None


def blame_layer(op_names: Iterable[str], layer_paths: Iterable[str]) -> str | None:
    """The path of the layer the first blamable op belongs to, or None.

    Args:
        op_names: Full op names (``"model/dense_1/MatMul"``), in the converter's order.
        layer_paths: The model's layer paths, as :func:`kmp.layer_walk.walk` names them.

    Returns:
        The layer's path, or None when no op name holds a layer's name.
    """
    paths = list(layer_paths)
    for op in op_names:
        scopes = op.split("/")[:-1]  # the last part is the op itself
        best: tuple[int, int, bool, str] | None = None
        for path in paths:
            parts = path.split("/")
            for at in range(len(scopes) - 1, -1, -1):  # innermost scope first
                if _matches(scopes[at], parts[-1]):
                    # How much of the path, read outward, the scopes before it match.
                    depth = 1
                    while (
                        depth < len(parts)
                        and at - depth >= 0
                        and _matches(scopes[at - depth], parts[-1 - depth])
                    ):
                        depth += 1
                    key = (at, depth, scopes[at] == parts[-1], path)
                    if best is None or key[:3] > best[:3]:
                        best = key
                    break
        if best is not None:
            return best[3]
    return None


def litert_failed_ops(message: str) -> list[tuple[str, str]]:
    """``(op type, op name)`` for each op a TFLite converter error names, in order.

    Args:
        message: The converter's error text.

    Returns:
        The ops, without the call wrappers (``StatefulPartitionedCall``).
    """
    seen: list[tuple[str, str]] = []
    for op_type, name in _FUSED_OP.findall(message):
        if op_type != "StatefulPartitionedCall" and (op_type, name) not in seen:
            seen.append((op_type, name))
    return seen


def unsupported_error(
    fmt: str, ops: list[tuple[str, str]], layers: dict[str, str], advice: str
) -> ValueError:
    """The error for ops ``fmt`` cannot hold: it names the layer, the ops and what to do.

    Args:
        fmt: The format's display name (``"ONNX"``, ``"LiteRT"``).
        ops: ``(op type, op name)`` of each op it cannot hold.
        layers: The model's layer paths -> class names.
        advice: What to do instead.

    Returns:
        The ValueError to raise.
    """
    path = blame_layer([name for _, name in ops], layers)
    kinds = ", ".join(sorted({kind for kind, _ in ops})) or "unknown"
    where = (
        f"layer {path!r} ({layers[path]})"
        if path is not None
        else f"a layer (op {ops[0][1]!r})"
        if ops
        else "a layer"
    )
    return ValueError(
        f"kmp.export: {fmt} cannot hold {where}: it computes with {kinds}, which {fmt} has "
        f"no operation for. {advice}"
    )
