"""The audit's data: a layer's facts, a measurement, a finding, a row and the report.

Plain data only (no Keras): the rules in :mod:`kmp.auditing.rules` are pure functions
from :class:`LayerFacts` to :class:`Finding`, and :class:`AuditReport` formats the result.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AuditReport", "Finding", "LayerFacts", "LayerRow", "Measurement", "UNKNOWN"]

UNKNOWN = "?"
_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What a measured check found by running a layer.

    Attributes:
        status: ``"ok"`` (behaves like float32), ``"bad"`` (does not) or ``"unknown"``
            (the check could not run; ``detail`` says why).
        detail: What was measured, in words.
        error: The measured error against float32 (``inf`` for non-finite output).
    """

    status: str
    detail: str
    error: float | None = None


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What the audit knows about one layer; the rules read nothing else.

    Attributes:
        path: The layer's path in the model (``"backbone/transformer_layer_0/..."``).
        class_name: The layer's class name.
        compute: Its compute dtype (``"?"`` when unknown).
        policy: Its dtype policy's name.
        variable_dtypes: The dtypes of its variables.
        params: How many parameters it holds (its sublayers' included).
        activation: Its activation's name, None when it has none.
        kinds: What it is: ``input``, ``head`` (a Float32Output), ``model`` (a nested model),
            ``norm``, ``attention``, ``softmax``, ``embedding``, ``keras`` (a class of Keras).
        makes_output: It produces one of the model's outputs.
        neighbour_computes: The compute dtypes of the layers it feeds or is fed by (its
            siblings next to it when the graph is not known).
        consumer_computes: The compute dtypes of the layers it feeds.
        softmax_computes: The compute dtypes of the Softmax layers inside it.
        in_float32_parent: An enclosing layer already computes in float32.
        parent_policy: The policy of the layer it sits in (None at a model's level).
        kept_float32: :func:`kmp.keep_float32` kept it (or a layer around it) in float32.
        norm_check: The measured normalisation check, for norms computing in 16 bits.
        mask_check: The measured attention-mask check, for attention computing in 16 bits.
        problem: Why the layer could not be inspected, if it could not.
    """

    path: str
    class_name: str
    compute: str
    policy: str
    variable_dtypes: tuple[str, ...] = ()
    params: int = 0
    activation: str | None = None
    kinds: frozenset[str] = frozenset()
    makes_output: bool = False
    neighbour_computes: tuple[str, ...] = ()
    consumer_computes: tuple[str, ...] = ()
    softmax_computes: tuple[str, ...] = ()
    in_float32_parent: bool = False
    parent_policy: str | None = None
    kept_float32: bool = False
    norm_check: Measurement | None = None
    mask_check: Measurement | None = None
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of the audited model."""

    name: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    output_dtype: str
    params: int
    kept_float32: bool = False  # kmp.keep_float32 kept it: the table says "float32 (kept)"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing the audit noticed."""

    severity: str  # "error" | "warning" | "info"
    code: str
    layer: str
    message: str


def sort_findings(findings: list[Finding]) -> tuple[Finding, ...]:
    """Worst first, in the order found otherwise."""
    return tuple(sorted(findings, key=lambda f: _ORDER.get(f.severity, 3)))


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The result of :func:`kmp.audit`.

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
                f"{r.compute_dtype} (kept)" if r.kept_float32 else r.compute_dtype,
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
