"""``kmp.export``: train mixed, serve anywhere: SavedModel, ONNX and LiteRT, verified.

One call writes a model for serving in the format and weight precision asked for, then
runs the written file in that format's own runtime (TensorFlow, onnxruntime, the LiteRT
interpreter) on real inputs and compares it with the model in float32::

    result = kmp.export(model, "model.onnx", format="onnx", precision="float16",
                        sample=x_test[:256], labels=y_test[:256])
    result.max_abs_diff, result.top1_agreement, result.size_ratio

Inputs and outputs stay float32 in every format and precision. A model trained under a
mixed policy exports as it is: the reference and the exported weights come from a float32
copy (or, for a 16-bit SavedModel, a copy loaded in that precision by
:func:`kmp.load_model`). Several named inputs and outputs (a KerasHub task's dict) are
served by name. :func:`open_runner` opens a written file in its runtime;
:func:`greedy` generates from an exported causal LM: the task, its :func:`cached_step`
(also :func:`greedy_cached`), or its whole decoding loop, :func:`greedy_loop`.
docs/exporting.md is the guide.
"""

from __future__ import annotations

from kmp.exporting.export_plan import ExportPlan, plan_export
from kmp.exporting.export_result import ExportResult
from kmp.exporting.exporter import export
from kmp.exporting.generation import greedy, greedy_cached
from kmp.exporting.generation_models import cached_step, greedy_loop
from kmp.exporting.runners import open_runner

__all__ = [
    "ExportPlan",
    "ExportResult",
    "cached_step",
    "export",
    "greedy",
    "greedy_cached",
    "greedy_loop",
    "open_runner",
    "plan_export",
]
