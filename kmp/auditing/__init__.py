"""``kmp.audit(model)``: which layers compute in which dtype, and what is risky.

The report has one row per layer (recursing into nested models and into the sublayers
of any layer, so the attention and norms inside a KerasHub transformer block are seen)
and a list of findings, each with a severity. Normalisation layers and attention masks
are not judged by their class: a clone is run in 16 bits and in float32 and compared
(:mod:`kmp.auditing.measured`). The layers and their paths are those of
:func:`kmp.layer_walk.walk`, which ``kmp.probe`` and ``kmp.keep_float32`` take too.

=======================  ========  =====================================================
code                     severity  meaning
=======================  ========  =====================================================
low-precision-output     error     a model output is float16/bfloat16
large-vocab-16bit        error     a 16-bit model output with more than 2,048 classes
                                   (use ``kmp.float32_outputs(model)``)
low-precision-activation error     a softmax/sigmoid producing a model output is
                                   computed in float16/bfloat16
low-precision-variables  error     a layer keeps float16/bfloat16 variables whose
                         / info    updates are not compensated (info when the
                                   model's kmp optimizer compensates them:
                                   ``master_weights`` "kahan" or "stochastic")
attention-mask-overflow  error     measured: with a mask, a 16-bit attention/softmax
                                   gives non-finite output or weight on masked keys
low-precision-norm       warning   measured: a normalisation layer's 16-bit output
                                   differs from float32's on an input whose float16
                                   statistics overflow (it does not upcast)
low-precision-attention  warning   attention scores/softmax computed in float16
                         / info    (info under bfloat16, or when only the scores
                                   are 16-bit and the softmax is float32)
float32-embedding        warning   an embedding outputs float32 into 16-bit layers
                         / info    (info when kept with ``kmp.keep_float32``)
float32-head-matmul      warning   a tied ReversibleEmbedding head (KerasHub LMs) runs its
                                   vocabulary matmul in float32 (Keras upcasts)
policy-mismatch          warning   a layer's dtype policy differs from the global one
                                   (not for a layer kept with ``kmp.keep_float32``)
float32-large-layer      warning   a layer computing in float32 in a 16-bit context
                         / info    (mixed policy or 16-bit neighbours): correct, but it
                                   costs speed; warning when large, info for a small
                                   custom layer between 16-bit layers or a layer kept
                                   with ``kmp.keep_float32``
not-checked              info      something the audit could not read or measure
                                   (unknown activation, check that could not run,
                                   outputs of a subclassed model)
=======================  ========  =====================================================

``report.ok`` is False when any error-level finding exists. The audit changes neither
the model nor the global dtype policy.
"""

from __future__ import annotations

import keras

from kmp._keras_local import local_variables
from kmp.auditing.facts import consumer_map, layer_facts, layer_row, model_output_layers
from kmp.auditing.measured import MeasuredChecks
from kmp.auditing.report import AuditReport, Finding, LayerRow, sort_findings
from kmp.auditing.rules import AuditContext, layer_findings, output_findings
from kmp.layer_walk import walk
from kmp.layers import has_float32_outputs, upcasting_reverse_head

__all__ = ["AuditReport", "audit"]


def _model_outputs(model: keras.Model) -> list | None:
    """The model's symbolic outputs, flattened; None for a subclassed model."""
    try:
        return keras.tree.flatten(model.outputs)
    except Exception:
        return None


def _last_dim(t: object) -> int | None:
    try:
        dim = t.shape[-1]  # type: ignore[attr-defined]
    except Exception:
        return None
    return int(dim) if dim is not None else None


def _output_layer_name(t: object) -> str:
    try:
        return t._keras_history.operation.name  # type: ignore[attr-defined]
    except Exception:
        return "?"


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
    # The measured checks build throw-away layers; one process may audit alone (rank 0).
    with local_variables():
        return _audit(model)


def _audit(model: keras.Model) -> AuditReport:
    if not isinstance(model, keras.Model):
        raise TypeError(f"kmp.audit expects a Keras model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: give it an input shape (keras.Input) or "
            "call it on a batch of data, then audit it."
        )
    global_policy = keras.config.dtype_policy().name
    try:
        total = model.count_params()
    except Exception:
        total = sum(int(keras.ops.size(v)) for v in model.weights)
    settings = getattr(getattr(model, "optimizer", None), "settings", None)
    setting = getattr(settings, "master_weights", None)
    ctx = AuditContext(global_policy, max(int(total), 1), setting)
    outputs = _model_outputs(model)
    output_ids = model_output_layers(outputs or [])
    visits = [v for v in walk(model) if not v.is_nested_model]  # its layers have rows
    consumers = consumer_map(visits)
    checks = MeasuredChecks()
    rows: list[LayerRow] = []
    findings: list[Finding] = []
    for v in visits:
        rows.append(layer_row(v))
        try:
            facts = layer_facts(v, consumers, output_ids, checks)
        except Exception as exc:
            findings.append(
                Finding(
                    "info",
                    "not-checked",
                    v.path,
                    f"{type(v.layer).__name__} could not be inspected "
                    f"({type(exc).__name__}: {exc}); no rule checked it.",
                )
            )
            continue
        findings.extend(layer_findings(facts, ctx))

    # A model moved to kmp.layers.Float32Outputs casts its 16-bit outputs in call().
    cast = has_float32_outputs(model)
    if outputs is None and not cast:
        findings.append(
            Finding(
                "info",
                "not-checked",
                model.name,
                "the model has no symbolic outputs (a subclassed model): their dtype was not "
                "checked; check model(x).dtype is float32.",
            )
        )
    for i, t in enumerate(outputs or []):
        dtype = "float32" if cast else str(t.dtype)
        head = getattr(getattr(t, "_keras_history", None), "operation", None)
        if upcasting_reverse_head(head):  # really computes, and outputs, in float32
            dtype = "float32"
            findings.append(
                Finding(
                    "warning",
                    "float32-head-matmul",
                    head.name,
                    f"this tied ReversibleEmbedding has no reverse_dtype, so Keras multiplies "
                    f"the {head.compute_dtype} hidden states by its float32 table: the whole "
                    "vocabulary matmul runs in float32 (its symbolic output says "
                    f"{t.dtype}). kmp.float32_outputs(model) runs it in {head.compute_dtype} "
                    "and casts the logits to float32.",
                )
            )
        findings.extend(output_findings(i, _output_layer_name(t), dtype, _last_dim(t)))
    # The global policy is never changed, but a measured check restores it: make sure of it.
    if keras.config.dtype_policy().name != global_policy:  # pragma: no cover - defensive
        keras.config.set_dtype_policy(global_policy)
    return AuditReport(model.name, global_policy, tuple(rows), sort_findings(findings))
