"""What :func:`kmp.quantize` did: every weighted layer's status and error, and the model's.

Plain frozen data: :class:`LayerOutcome` per layer, :class:`QuantizeReport` for the model.
``str(report)`` is a short table, ``report.to_dict()`` plain JSON-ready data.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kmp.quantizing.selection import QUANTIZED

__all__ = ["LayerOutcome", "QuantizeReport"]


@dataclasses.dataclass(frozen=True)
class LayerOutcome:
    """One layer holding weights: quantized, or kept and why.

    Attributes:
        path: Its path (``kmp.layer_walk``: what ``kmp.audit`` shows and
            ``kmp.keep_float32`` selects).
        class_name: Its class's name.
        status: ``"quantized"``, or why it was left as it was
            (``kmp.quantizing.selection.STATUSES``).
        error: Its relative RMS error quantized, ``||q - f|| / ||f||`` over its outputs on the
            batch (fed the float model's own inputs), or None where it was not measured.
        detail: A sentence on the status (Keras's error, the threshold exceeded, ...).
    """

    path: str
    class_name: str
    status: str
    error: float | None = None
    detail: str = ""

    @property
    def quantized(self) -> bool:
        """Whether the layer was quantized."""
        return self.status == QUANTIZED

    def to_dict(self) -> dict[str, Any]:
        """The outcome as plain data (a non-finite error as None)."""
        return {
            "path": self.path,
            "class": self.class_name,
            "status": self.status,
            "error": _finite(self.error),
            "detail": self.detail,
        }


@dataclasses.dataclass(frozen=True)
class QuantizeReport:
    """What ``kmp.quantize`` measured and did.

    Attributes:
        mode: The quantization mode (``"int8"``, ``"int4"``, ``"float8"``).
        threshold: The largest relative error a quantized layer was allowed.
        layers: Every layer holding weights, in the walk's order.
        samples: The number of examples in the batch measured on.
        output_error: The model's relative RMS output error after quantizing, against its
            outputs before, on the batch.
        accuracy_before: Top-1 accuracy on the batch before quantizing (labels given), or None.
        accuracy_after: The same after quantizing, or None.
    """

    mode: str
    threshold: float
    layers: tuple[LayerOutcome, ...]
    samples: int
    output_error: float
    accuracy_before: float | None = None
    accuracy_after: float | None = None

    @property
    def quantized(self) -> tuple[str, ...]:
        """The paths of the layers quantized."""
        return tuple(o.path for o in self.layers if o.quantized)

    @property
    def kept(self) -> dict[str, str]:
        """Every layer left as it was: path -> status (why)."""
        return {o.path: o.status for o in self.layers if not o.quantized}

    @property
    def errors(self) -> dict[str, float]:
        """Every measured layer's relative error, by path."""
        return {o.path: o.error for o in self.layers if o.error is not None}

    @property
    def accuracy_change(self) -> float | None:
        """``accuracy_after - accuracy_before`` (a fraction), or None without labels."""
        if self.accuracy_before is None or self.accuracy_after is None:
            return None
        return self.accuracy_after - self.accuracy_before

    def layer(self, path: str) -> LayerOutcome:
        """The outcome of the layer at ``path``.

        Args:
            path: The layer's path, as the report gives it.

        Raises:
            KeyError: No reported layer has that path; the message lists them.
        """
        for outcome in self.layers:
            if outcome.path == path:
                return outcome
        raise KeyError(
            f"no layer {path!r} in the report; its layers: {[o.path for o in self.layers]}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (non-finite numbers as None)."""
        return {
            "mode": self.mode,
            "threshold": self.threshold,
            "samples": self.samples,
            "output_error": _finite(self.output_error),
            "accuracy_before": self.accuracy_before,
            "accuracy_after": self.accuracy_after,
            "quantized": list(self.quantized),
            "layers": [o.to_dict() for o in self.layers],
        }

    def __str__(self) -> str:
        head = (
            f"kmp.quantize {self.mode}: {len(self.quantized)} of {len(self.layers)} weighted "
            f"layers quantized (threshold {self.threshold:.3g}, {self.samples} examples); "
            f"output error {_percent(self.output_error)}"
        )
        if self.accuracy_before is not None and self.accuracy_after is not None:
            head += f"; accuracy {self.accuracy_before:.2%} -> {self.accuracy_after:.2%}"
        rows = [("layer", "class", "error", "status", "detail")]
        rows += [
            (o.path, o.class_name, _percent(o.error), o.status, _short(o.detail))
            for o in self.layers
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [head]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
        return "\n".join(lines)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _short(text: str, limit: int = 72) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2%}" if math.isfinite(value) else "inf"
