"""The result of :func:`kmp.probe`: per layer and variable, what float16 and bfloat16 lose.

Plain data built from one float32 pass (:mod:`kmp.probing.float32_pass`) and the rules of
:mod:`kmp.probing.stats`. The verdicts live here, each once:

* a layer whose outputs exceed 65504 overflows float16 in its forward pass: keep it in
  float32 (the first reason of :attr:`ProbeReport.keep_float32`); so must every layer whose
  *inputs* exceed it, or it casts them back to float16 (to inf) when it reads them;
* a gradient still losing more than :data:`LOSS_TOLERANCE` of its values to underflow at
  the recommended scale: keep the layer in float32 as well (its backward runs in float32);
* both are float16's problems: only layers that compute in float16 are listed, or every
  layer when none computes in 16 bits (a float32 model probed before choosing a policy).
  bfloat16 has float32's range; its rounding error is reported, not acted on;
* the recommended initial loss scale is :func:`kmp.probing.stats.recommend_loss_scale` of
  every gradient measured (the gradients reaching layer outputs and the variables').
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kmp._names import LOW_FLOATS
from kmp.probing.stats import FLOAT16_MAX, FLOAT16_SMALLEST, ValueStats

__all__ = ["LOSS_TOLERANCE", "LayerNumbers", "ProbeReport", "VariableNumbers"]

# A gradient losing more than this fraction of its non-zero values to underflow at the
# recommended scale is a reason to keep its layer in float32.
LOSS_TOLERANCE = 0.01


@dataclasses.dataclass
class LayerNumbers:
    """One layer's measured outputs and the gradients that reached them (over all calls).

    ``compute_dtype`` is what the layer computes in outside the probe (the pass itself runs
    every layer in float32).
    """

    name: str
    class_name: str
    compute_dtype: str
    calls: int
    inputs: ValueStats
    outputs: ValueStats
    output_grads: ValueStats


@dataclasses.dataclass
class VariableNumbers:
    """One trainable variable's measured gradient."""

    name: str
    layer: str
    gradient: ValueStats


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


@dataclasses.dataclass
class ProbeReport:
    """What one float32 pass says about 16-bit training of a model on a batch.

    Attributes:
        model_name: The model's name.
        backend: The Keras backend of the pass.
        loss: The batch's loss in float32.
        layers: Every probed layer that produced a float output, in call order.
        variables: Every trainable variable, with its gradient's figures.
        recommended_loss_scale: The initial loss scale to give
            ``kmp.wrap_optimizer(..., initial_scale=...)``.
        min_scale: The lower bound the recommendation respected.
        max_scale: The upper bound the recommendation respected.
        seconds: Wall time of the pass and the bookkeeping.
    """

    model_name: str
    backend: str
    loss: float
    layers: list[LayerNumbers]
    variables: list[VariableNumbers]
    recommended_loss_scale: float
    min_scale: float
    max_scale: float
    seconds: float

    # ------------------------------------------------------------------ verdicts

    @property
    def overflowing(self) -> list[LayerNumbers]:
        """Layers whose forward values exceed float16's range, largest first."""
        found = [n for n in self.layers if n.outputs.over_float16]
        return sorted(found, key=lambda n: -n.outputs.max_abs)

    @property
    def reading_overflow(self) -> list[LayerNumbers]:
        """Layers whose inputs exceed float16's range (they would read inf), largest first."""
        found = [n for n in self.layers if n.inputs.over_float16]
        return sorted(found, key=lambda n: -n.inputs.max_abs)

    def underflowing(self, scale: float = 1.0) -> list[tuple[str, float]]:
        """``(name, fraction lost)`` of every gradient losing values at ``scale``, worst first.

        Layer output gradients are named by their layer, variable gradients by the variable.
        """
        found = [(n.name, n.output_grads.lost_to_underflow(scale)) for n in self.layers]
        found += [(v.name, v.gradient.lost_to_underflow(scale)) for v in self.variables]
        return sorted((f for f in found if f[1] > 0), key=lambda f: -f[1])

    def _at_risk(self) -> set[str]:
        """The layers float16's range can hurt: those computing in float16 (see the module)."""
        low = {n.name for n in self.layers if n.compute_dtype in LOW_FLOATS}
        if not low:
            return {n.name for n in self.layers}
        return {n.name for n in self.layers if n.compute_dtype == "float16"}

    @property
    def reasons(self) -> dict[str, str]:
        """Layer name -> the measured reason to keep it in float32, worst first."""
        out: dict[str, str] = {}
        risk = self._at_risk()
        for n in self.overflowing:
            if n.name not in risk:
                continue
            out[n.name] = (
                f"outputs reach {n.outputs.max_abs:.4g} > {FLOAT16_MAX:g} (float16's largest): "
                f"{_pct(n.outputs.overflows_float16())} of them overflow float16"
            )
        for n in self.reading_overflow:
            if n.name in risk and n.name not in out:
                out[n.name] = (
                    f"its inputs reach {n.inputs.max_abs:.4g} > {FLOAT16_MAX:g}: read in "
                    "float16 they are inf"
                )
        scale = self.recommended_loss_scale
        for n in sorted(self.layers, key=lambda n: -n.output_grads.lost_to_underflow(scale)):
            lost = n.output_grads.lost_to_underflow(scale)
            if lost > LOSS_TOLERANCE and n.name in risk and n.name not in out:
                out[n.name] = (
                    f"{_pct(lost)} of the gradient reaching its outputs is below float16's "
                    f"smallest value (2**-24) even at the recommended scale {scale:g}"
                )
        return out

    @property
    def keep_float32(self) -> list[str]:
        """The layers to keep in float32: ``kmp.keep_float32(model, *report.keep_float32)``."""
        return list(self.reasons)

    # ------------------------------------------------------------------- output

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the verdicts and every layer's and variable's figures."""
        scale = self.recommended_loss_scale
        return {
            "model": self.model_name,
            "backend": self.backend,
            "loss": self.loss,
            "recommended_loss_scale": scale,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "seconds": self.seconds,
            "keep_float32": self.reasons,
            "overflowing": [n.name for n in self.overflowing],
            "underflowing_at_scale_1": dict(self.underflowing(1.0)),
            "underflowing_at_recommended_scale": dict(self.underflowing(scale)),
            "layers": [
                {
                    "name": n.name,
                    "class_name": n.class_name,
                    "compute_dtype": n.compute_dtype,
                    "calls": n.calls,
                    "inputs_max_abs": n.inputs.max_abs,
                    "outputs": n.outputs.to_dict(),
                    "output_grads": n.output_grads.to_dict(),
                }
                for n in self.layers
            ],
            "variables": [
                {"name": v.name, "layer": v.layer, "gradient": v.gradient.to_dict()}
                for v in self.variables
            ],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        scale = self.recommended_loss_scale
        lines = [
            f"kmp probe of {self.model_name!r} ({self.backend}, one float32 pass, "
            f"{self.seconds:.2f} s): loss {self.loss:.5g}",
            f"recommended initial loss scale: {scale:g} "
            f"(kmp.wrap_optimizer(..., initial_scale={scale:g}))",
        ]
        reasons = self.reasons
        if reasons:
            lines.append("keep in float32 (kmp.keep_float32(model, *report.keep_float32)):")
            lines += [f"  {name}: {why}" for name, why in reasons.items()]
        else:
            lines.append("keep in float32: nothing (no float16 overflow, no lasting underflow)")
        lost = self.underflowing(1.0)
        if lost:
            lines.append(f"gradients losing values to float16 underflow at scale 1 ({len(lost)}):")
            lines += [
                f"  {name}: {_pct(frac)} lost, {_pct(self._lost_at(name, scale))} at {scale:g}"
                for name, frac in lost[:10]
            ]
        lines.append(self._table())
        return "\n".join(lines)

    def _lost_at(self, name: str, scale: float) -> float:
        for n in self.layers:
            if n.name == name:
                return n.output_grads.lost_to_underflow(scale)
        for v in self.variables:
            if v.name == name:
                return v.gradient.lost_to_underflow(scale)
        return 0.0

    def _table(self) -> str:
        head = (
            f"{'layer':36s} {'class':20s} {'max |out|':>10s} {'min |out|':>10s} "
            f"{'>f16':>7s} {'bf16 err':>9s} {'max |grad|':>10s} {'min |grad|':>10s} "
            f"{'lost@1':>7s}"
        )
        rows = [head, "-" * len(head)]
        for n in self.layers:
            o, g = n.outputs, n.output_grads
            rows.append(
                f"{n.name[-36:]:36s} {n.class_name[:20]:20s} {o.max_abs:10.3g} "
                f"{_small(o.min_nonzero):>10s} {_pct(o.overflows_float16()):>7s} "
                f"{o.bfloat16_error_mean:9.2g} {g.max_abs:10.3g} {_small(g.min_nonzero):>10s} "
                f"{_pct(g.lost_to_underflow(1.0)):>7s}"
            )
        return "\n".join(rows)

    def plot(self, ax: Any = None) -> Any:
        """A matplotlib figure: each layer's output and gradient magnitudes (min to max).

        float16's range (2**-24 to 65504) is shaded; bfloat16 reaches float32's range. Returns
        the figure.
        """
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(self.layers) + 2), 4.2))
        else:
            fig = ax.figure
        xs = range(len(self.layers))
        for offset, attr, label, colour in (
            (-0.15, "outputs", "outputs", "tab:blue"),
            (0.15, "output_grads", "gradients reaching them (scale 1)", "tab:red"),
        ):
            lows, highs = [], []
            for n in self.layers:
                s = getattr(n, attr)
                high = s.max_abs if s.max_abs > 0 else float("nan")
                lows.append(s.min_nonzero if s.nonzero else float("nan"))
                highs.append(high)
            ax.vlines([x + offset for x in xs], lows, highs, colors=colour, lw=3, label=label)
        ax.axhspan(FLOAT16_SMALLEST, FLOAT16_MAX, color="tab:green", alpha=0.1, label="float16")
        ax.axhline(FLOAT16_MAX, color="tab:green", ls="--", lw=1)
        ax.axhline(FLOAT16_SMALLEST, color="tab:green", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [n.name[-28:] for n in self.layers], rotation=90, fontsize=7)
        ax.set_ylabel("|value| (float32 pass)")
        ax.set_title(f"kmp.probe: {self.model_name} (bfloat16 covers float32's range)")
        ax.legend(fontsize=8, loc="lower left")
        fig.tight_layout()
        return fig


def _small(x: float) -> str:
    return "-" if x == float("inf") else f"{x:.3g}"
