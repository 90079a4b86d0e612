"""``kmp.audit(model)``: which layers compute in which dtype, and what is risky.

The report has one row per layer (recursing into nested models) and a list of
findings, each with a severity:

========================  ========  ==================================================
code                      severity  meaning
========================  ========  ==================================================
low-precision-output      error     a model output is float16/bfloat16
low-precision-activation  error     a softmax/sigmoid producing a model output is
                                    computed in float16/bfloat16
low-precision-variables   error     a layer keeps float16/bfloat16 variables (no
                                    float32 master weights)
low-precision-norm        warning   a normalisation layer that does not upcast
                                    computes its statistics in float16/bfloat16
policy-mismatch           warning   a layer's dtype policy differs from the global one
float32-large-layer       warning   a large layer forced to float32 under a mixed
                                    policy: correct, but it costs speed
========================  ========  ==================================================

``report.ok`` is False when any error-level finding exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import keras

from kmp._names import MIXED_POLICIES
from kmp.layers import Float32Output, _activation_name

__all__ = ["AuditReport", "Finding", "LayerRow", "audit"]

LOW = ("float16", "bfloat16")
_RISKY_ACTIVATIONS = ("softmax", "sigmoid", "log_softmax")
# Keras normalisation layers that upcast to float32 for their statistics.
_UPCASTING_NORMS: tuple[type, ...] = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)
_LARGE_LAYER_PARAMS = 100_000
_LARGE_LAYER_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of the audited model."""

    name: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str
    params: int


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the audit noticed."""

    severity: str  # "error" | "warning" | "info"
    code: str
    layer: str
    message: str


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of :func:`audit`.

    Attributes:
        model_name: The model's name.
        global_policy: The global Keras dtype policy when the audit ran.
        rows: One :class:`LayerRow` per layer.
        findings: What is risky, worst first.
    """

    model_name: str
    global_policy: str
    rows: tuple[LayerRow, ...]
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """False when an error-level finding exists."""
        return not self.errors

    @property
    def errors(self) -> tuple[Finding, ...]:
        """The error-level findings."""
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        """The warning-level findings."""
        return tuple(f for f in self.findings if f.severity == "warning")

    def codes(self) -> set[str]:
        """The set of finding codes, handy in tests and scripts."""
        return {f.code for f in self.findings}

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return {
            "model": self.model_name,
            "global_policy": self.global_policy,
            "ok": self.ok,
            "layers": [dataclasses.asdict(r) for r in self.rows],
            "findings": [dataclasses.asdict(f) for f in self.findings],
        }

    def _verdict(self) -> str:
        return f"kmp audit of {self.model_name!r} (global policy {self.global_policy}): " + (
            "OK" if self.ok else f"NOT OK, {len(self.errors)} error(s)"
        )

    def _finding_lines(self) -> list[str]:
        return [f"[{f.severity}] {f.code} ({f.layer}): {f.message}" for f in self.findings]

    def summary(self, max_rows: int = 40) -> str:
        """Return the report for a log: the full table up to ``max_rows`` layers, else short.

        A model with more layers (ResNet-50 has 177) gets the verdict, how many
        layers compute in each dtype, and the findings instead of the table.

        Args:
            max_rows: The most layers shown as a table.

        Returns:
            The text.
        """
        if len(self.rows) <= max_rows:
            return str(self)
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.compute_dtype] = counts.get(r.compute_dtype, 0) + 1
        dtypes = ", ".join(f"{n} compute in {d}" for d, n in sorted(counts.items()))
        lines = [self._verdict(), f"{len(self.rows)} layers: {dtypes}."]
        lines.extend(self._finding_lines() or ["No findings."])
        return "\n".join(lines)

    def __str__(self) -> str:
        headers = ("layer", "class", "compute", "variables", "output", "params")
        table = [headers] + [
            (
                r.name,
                r.class_name,
                r.compute_dtype,
                r.variable_dtype,
                r.output_dtype,
                f"{r.params:,}",
            )
            for r in self.rows
        ]
        widths = [max(len(str(row[i])) for row in table) for i in range(len(headers))]
        lines = [self._verdict()]
        for i, row in enumerate(table):
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.findings:
            lines.append("")
            lines.extend(self._finding_lines())
        else:
            lines.append("\nNo findings.")
        return "\n".join(lines).rstrip()


def _walk(model: keras.Model, prefix: str = "") -> Iterator[tuple[str, keras.layers.Layer]]:
    for layer in model.layers:
        path = f"{prefix}{layer.name}"
        if isinstance(layer, keras.Model) and layer.layers:
            yield from _walk(layer, prefix=f"{path}/")
        else:
            yield path, layer


def _output_dtype(layer: keras.layers.Layer) -> str:
    try:
        out = layer.output
    except (AttributeError, ValueError):
        return layer.compute_dtype if not isinstance(layer, Float32Output) else "float32"
    tensors = keras.tree.flatten(out)
    return ",".join(sorted({str(t.dtype) for t in tensors})) if tensors else "?"


def _variable_dtype(layer: keras.layers.Layer) -> str:
    dtypes = sorted({str(v.dtype) for v in layer.weights})
    return ",".join(dtypes) if dtypes else "-"


def _model_outputs(model: keras.Model) -> list:
    """The model's symbolic outputs, flattened; empty for a subclassed model."""
    try:
        return keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):
        return []


def _model_output_layers(outputs: list) -> set[int]:
    """Ids of the layers (innermost, through nested models) producing ``outputs``."""
    ids: set[int] = set()
    for t in outputs:
        layer = t._keras_history.operation
        while isinstance(layer, keras.Model) and getattr(layer, "outputs", None):
            layer = keras.tree.flatten(layer.outputs)[0]._keras_history.operation
        ids.add(id(layer))
    return ids


def _activation_of(layer: keras.layers.Layer) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    return _activation_name(getattr(layer, "activation", None))


def audit(model: keras.Model) -> AuditReport:
    """Audit the dtypes of a built Keras model.

    Args:
        model: A built Keras model (Sequential, Functional or subclassed).

    Returns:
        An :class:`AuditReport`; ``str(report)`` is a readable table and
        ``report.ok`` is False when an error-level finding exists.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: The model is not built yet (call it on data or give it an
            input shape first).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"kmp.audit expects a Keras model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: give it an input shape (keras.Input) or "
            "call it on a batch of data, then audit it."
        )
    global_policy = keras.config.dtype_policy().name
    mixed = global_policy in MIXED_POLICIES
    rows: list[LayerRow] = []
    findings: list[Finding] = []
    outputs = _model_outputs(model)
    output_layer_ids = _model_output_layers(outputs)
    total_params = max(model.count_params(), 1)

    for path, layer in _walk(model):
        params = int(sum(int(keras.ops.size(v)) for v in layer.weights))
        compute = layer.compute_dtype
        variable = _variable_dtype(layer)
        rows.append(
            LayerRow(path, type(layer).__name__, compute, variable, _output_dtype(layer), params)
        )
        if isinstance(layer, keras.layers.InputLayer):
            continue
        is_head = isinstance(layer, Float32Output)
        activation = _activation_of(layer)
        if compute in LOW and activation in _RISKY_ACTIVATIONS and id(layer) in output_layer_ids:
            findings.append(
                Finding(
                    "error",
                    "low-precision-activation",
                    path,
                    f"{activation} producing a model output is computed in {compute}: "
                    "probabilities and the loss lose precision. Use kmp.float32_outputs(model) "
                    "(or end with kmp.layers.Float32Output('" + activation + "') after logits).",
                )
            )
        low_vars = sorted({str(v.dtype) for v in layer.weights if str(v.dtype) in LOW})
        if low_vars:
            findings.append(
                Finding(
                    "error",
                    "low-precision-variables",
                    path,
                    f"variables stored in {', '.join(low_vars)}: no float32 master weights, so "
                    "small updates are lost. Use a mixed_* policy (float32 variables) instead of "
                    f"{layer.dtype_policy.name!r}.",
                )
            )
        if (
            compute in LOW
            and type(layer).__name__.endswith("Normalization")
            and not isinstance(layer, _UPCASTING_NORMS)
        ):
            findings.append(
                Finding(
                    "warning",
                    "low-precision-norm",
                    path,
                    f"{type(layer).__name__} computes its statistics in {compute}; mean and "
                    "variance overflow or lose precision there. Give it dtype='float32' or "
                    "upcast inside the layer.",
                )
            )
        if layer.dtype_policy.name != global_policy and not is_head:
            findings.append(
                Finding(
                    "warning",
                    "policy-mismatch",
                    path,
                    f"dtype policy {layer.dtype_policy.name!r} differs from the global "
                    f"{global_policy!r}: built before kmp.enable() (call kmp.enable() before "
                    "building the model), or given dtype=... on purpose.",
                )
            )
        if (
            mixed
            and compute == "float32"
            and not is_head
            and params >= _LARGE_LAYER_PARAMS
            and params >= _LARGE_LAYER_FRACTION * total_params
        ):
            findings.append(
                Finding(
                    "warning",
                    "float32-large-layer",
                    path,
                    f"{params:,} parameters ({params / total_params:.0%} of the model) computed in "
                    "float32 under a mixed policy: this layer does not get the mixed-precision "
                    "speed-up. Keep only the output activation in float32 (Float32Output).",
                )
            )

    for i, t in enumerate(outputs):
        if str(t.dtype) in LOW:
            layer = t._keras_history.operation
            findings.append(
                Finding(
                    "error",
                    "low-precision-output",
                    layer.name,
                    f"model output {i} is {t.dtype}: the loss would be computed in low "
                    "precision. Use kmp.float32_outputs(model).",
                )
            )

    order = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: order[f.severity])
    return AuditReport(model.name, global_policy, tuple(rows), tuple(findings))
