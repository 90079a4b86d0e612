"""The audit's rules: pure functions from a layer's facts to findings.

Every rule reads :class:`~kmp.auditing.report.LayerFacts` (the measured checks
included) and nothing else, so each can be tested without a model. The codes and
severities are listed in :mod:`kmp.auditing`.
"""

from __future__ import annotations

import dataclasses
import math

from kmp._names import LOW_FLOATS, MIXED_POLICIES
from kmp.auditing.report import UNKNOWN, Finding, LayerFacts
from kmp.master_weights import update_mode

__all__ = [
    "AuditContext",
    "LARGE_VOCAB",
    "layer_findings",
    "output_findings",
]

LARGE_VOCAB = 2048
_RISKY_ACTIVATIONS = ("softmax", "sigmoid", "log_softmax")
_LARGE_LAYER_PARAMS = 100_000
_LARGE_LAYER_FRACTION = 0.10
_FIX_OUTPUTS = "Use kmp.float32_outputs(model)"


@dataclasses.dataclass(frozen=True)
class AuditContext:
    """What the rules know about the whole model.

    Attributes:
        global_policy: The global dtype policy's name.
        total_params: The model's parameter count.
        master_weights: The ``master_weights`` setting of the model's kmp optimizer
            (:mod:`kmp.master_weights`); None when it has none (not compiled, or a
            plain Keras optimizer): its 16-bit weights then take lossy updates.
    """

    global_policy: str
    total_params: int
    master_weights: str | None = None

    @property
    def mixed(self) -> bool:
        """The global policy is a mixed one."""
        return self.global_policy in MIXED_POLICIES


def _not_checked(f: LayerFacts) -> list[Finding]:
    out = []
    if f.problem:
        out.append(Finding("info", "not-checked", f.path, f"{f.class_name}: {f.problem}."))
    if f.activation and f.activation.startswith("unknown:"):
        out.append(
            Finding(
                "info",
                "not-checked",
                f.path,
                f"its activation ({f.activation}) could not be identified: the activation "
                "rules did not check it.",
            )
        )
    return out


def _activation(f: LayerFacts) -> list[Finding]:
    if not (f.compute in LOW_FLOATS and f.activation in _RISKY_ACTIVATIONS and f.makes_output):
        return []
    return [
        Finding(
            "error",
            "low-precision-activation",
            f.path,
            f"{f.activation} producing a model output is computed in {f.compute}: "
            f"probabilities and the loss lose precision. {_FIX_OUTPUTS} (or end with "
            f"kmp.layers.Float32Output('{f.activation}') after logits).",
        )
    ]


def _variables(f: LayerFacts, ctx: AuditContext) -> list[Finding]:
    low = sorted({d for d in f.variable_dtypes if d in LOW_FLOATS})
    if not low:
        return []
    stored = f"variables stored in {', '.join(low)}"
    fix = (
        "Compile with kmp.wrap_optimizer(opt) (master_weights='kahan', the default for 16-bit "
        "weights, or 'stochastic'), or use a mixed_* policy (float32 variables) instead of "
        f"{f.policy!r}."
    )
    if ctx.master_weights is None:
        why = "the model's optimizer is not kmp's (or it is not compiled)"
        return [_lossy(f, f"{stored} and {why}: small updates are lost. {fix}")]
    try:
        modes = sorted({update_mode(ctx.master_weights, d) for d in low})
    except ValueError as exc:
        return [_lossy(f, f"{stored}: {exc}")]
    if "none" in modes:
        return [_lossy(f, f"{stored} with master_weights='none': small updates are lost. {fix}")]
    return [
        Finding(
            "info",
            "low-precision-variables",
            f.path,
            f"{stored} on purpose: the optimizer compensates their updates "
            f"(master_weights={' and '.join(repr(m) for m in modes)}).",
        )
    ]


def _lossy(f: LayerFacts, message: str) -> Finding:
    return Finding("error", "low-precision-variables", f.path, message)


def _norm(f: LayerFacts) -> list[Finding]:
    check = f.norm_check
    if (
        "norm" not in f.kinds
        or f.compute not in LOW_FLOATS
        or check is None
        or check.status == "ok"
    ):
        return []
    if check.status == "unknown":
        return [
            Finding(
                "info",
                "not-checked",
                f.path,
                f"{f.class_name} computes in {f.compute}; whether it upcasts its statistics "
                f"was not measured: {check.detail}.",
            )
        ]
    return [
        Finding(
            "warning",
            "low-precision-norm",
            f.path,
            f"{f.class_name} computes its statistics in {f.compute}: measured {check.detail}. "
            "Give it dtype='float32' or upcast inside the layer (compute mean and variance "
            "in float32, cast the result back).",
        )
    ]


def _attention(f: LayerFacts) -> list[Finding]:
    softmax_low = [d for d in f.softmax_computes if d in LOW_FLOATS]
    is_attention = "attention" in f.kinds
    if not is_attention and not ("softmax" in f.kinds and not f.makes_output):
        return []
    if f.compute not in LOW_FLOATS and not softmax_low:
        return []
    out = []
    check = f.mask_check
    if check is not None and check.status == "bad":
        out.append(
            Finding(
                "error",
                "attention-mask-overflow",
                f.path,
                f"with a mask in {f.compute}, measured {check.detail}: a large negative "
                "constant (e.g. -1e9) does not fit in float16 (max 65504) and becomes -inf "
                "or NaN. Build the mask with the dtype's own minimum, or apply it in float32.",
            )
        )
    dtype = f.compute if f.compute in LOW_FLOATS else softmax_low[0]
    soft = "softmax" if not is_attention else "attention scores"
    if is_attention and f.softmax_computes and not softmax_low:
        soft, severity = "attention scores (the softmax itself is float32)", "info"
    else:
        severity = "warning" if dtype == "float16" else "info"
    if dtype == "float16" and severity == "info":
        advice = (
            "the query-key products can overflow past 65504 before the float32 softmax: "
            "scale queries before the product, or train under mixed_bfloat16."
        )
    elif dtype == "float16":
        advice = (
            "float16 overflows past 65504, which large logits reach: keep the softmax in "
            "float32 (a Softmax(dtype='float32') sublayer), scale queries before the "
            "product, or train under mixed_bfloat16. Whether it does on your data is a "
            f"measurement: kmp.probe(model, x, y) on a real batch, then "
            f"kmp.keep_float32(model, *report.keep_float32) ('{f.path}' by hand)."
        )
    else:
        advice = "bfloat16 keeps float32's range, so this only costs a little precision."
    mask = f"Mask check: {check.detail}." if check is not None and check.status != "bad" else ""
    out.append(
        Finding(
            severity,
            "low-precision-attention",
            f.path,
            f"{soft} computed in {dtype}: {advice} {mask}".rstrip(),
        )
    )
    return out


def _embedding(f: LayerFacts) -> list[Finding]:
    low = sorted({d for d in f.consumer_computes if d in LOW_FLOATS})
    if "embedding" not in f.kinds or f.compute != "float32" or not low:
        return []
    return [
        Finding(
            "info" if f.kept_float32 else "warning",
            "float32-embedding",
            f.path,
            f"this embedding outputs float32 into layers computing in {', '.join(low)}: each "
            "consumer casts it down (memory and bandwidth spent for nothing), and a plain op "
            "mixing it with a 16-bit tensor promotes the rest to float32. Build it under the "
            "mixed policy (no dtype='float32').",
        )
    ]


def _float32_layer(f: LayerFacts, ctx: AuditContext) -> list[Finding]:
    skip = {"head", "input", "model", "norm", "softmax"}
    if f.compute != "float32" or f.kinds & skip or f.in_float32_parent:
        return []
    low_neighbours = sorted({d for d in f.neighbour_computes if d in LOW_FLOATS})
    if _embedding(f) or not (ctx.mixed or low_neighbours):
        return []
    share = f.params / max(ctx.total_params, 1)
    large = f.params >= _LARGE_LAYER_PARAMS and share >= _LARGE_LAYER_FRACTION
    custom = "keras" not in f.kinds and bool(low_neighbours)
    if not large and not custom:
        return []
    where = (
        f"next to layers computing in {', '.join(low_neighbours)}"
        if low_neighbours
        else "under a mixed policy"
    )
    cost = (
        "this layer does not get the mixed-precision speed-up and its inputs and outputs are cast."
    )
    if f.kept_float32:  # chosen with kmp.keep_float32: its cost, for information
        advice = "It was kept in float32 with kmp.keep_float32, on purpose."
    else:
        advice = (
            "Keep only the output activation in float32 (Float32Output), or build it under "
            "the mixed policy."
        )
    return [
        Finding(
            "warning" if large and not f.kept_float32 else "info",
            "float32-large-layer",
            f.path,
            f"{f.params:,} parameters ({share:.0%} of the model) computed in float32 {where}: "
            f"{cost} {advice}",
        )
    ]


def _policy(f: LayerFacts, ctx: AuditContext) -> list[Finding]:
    if f.policy in (ctx.global_policy, UNKNOWN) or "head" in f.kinds or f.kept_float32:
        return []  # a kmp.keep_float32 layer differs on purpose
    if f.parent_policy is not None and f.parent_policy in (ctx.global_policy, f.policy):
        return []  # chosen by the author of the layer it sits in, or that layer's (told there)
    return [
        Finding(
            "warning",
            "policy-mismatch",
            f.path,
            f"dtype policy {f.policy!r} differs from the global {ctx.global_policy!r}: built "
            "before kmp.enable() (call kmp.enable() before building the model), or given "
            "dtype=... on purpose.",
        )
    ]


def layer_findings(f: LayerFacts, ctx: AuditContext) -> list[Finding]:
    """Every finding for one layer.

    Args:
        f: The layer's facts, measured checks included.
        ctx: The model-wide context.

    Returns:
        The findings, in rule order.
    """
    if "input" in f.kinds:
        return []
    return [
        *_not_checked(f),
        *_activation(f),
        *_variables(f, ctx),
        *_norm(f),
        *_attention(f),
        *_embedding(f),
        *_policy(f, ctx),
        *_float32_layer(f, ctx),
    ]


def output_findings(index: int, layer: str, dtype: str, last_dim: int | None) -> list[Finding]:
    """The findings for the model's output number ``index``.

    Args:
        index: The output's position.
        layer: The name of the layer producing it.
        dtype: Its dtype.
        last_dim: Its last dimension (classes), None when unknown.

    Returns:
        ``large-vocab-16bit`` (error) for a 16-bit output with more than 2,048 classes,
        ``low-precision-output`` (error) for another 16-bit output, else nothing.
    """
    if dtype not in LOW_FLOATS:
        return []
    if last_dim is not None and not math.isnan(last_dim) and last_dim > LARGE_VOCAB:
        return [
            Finding(
                "error",
                "large-vocab-16bit",
                layer,
                f"model output {index} has {last_dim:,} classes in {dtype}: over "
                f"{LARGE_VOCAB:,} classes, 16-bit logits cannot tell close scores apart and "
                f"the softmax's sum loses the small ones. {_FIX_OUTPUTS}.",
            )
        ]
    return [
        Finding(
            "error",
            "low-precision-output",
            layer,
            f"model output {index} is {dtype}: the loss would be computed in low precision. "
            f"{_FIX_OUTPUTS}.",
        )
    ]
