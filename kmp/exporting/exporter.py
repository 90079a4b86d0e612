"""``kmp.export``: write a model for serving, then run the file in its own runtime.

The steps, in order, so that a bad request fails before anything is written and a failed
export leaves nothing behind:

1. :func:`kmp.exporting.export_plan.plan_export` checks the request and picks the route;
2. the converter and runtime modules are imported (an ImportError names the install
   command);
3. the float32 reference is made (:mod:`kmp.exporting.keras_copies`) and run on the
   sample;
4. the file is written into a temporary folder beside ``path`` by the format's route;
5. it is run in its runtime on the sample and compared (:mod:`kmp.exporting.comparison`);
6. it is moved to ``path`` (an old one, with ``overwrite=True``, is removed only then).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import keras
import numpy as np

from kmp._checks import check_bool
from kmp._imports import SERVE_INSTALL, optional_import
from kmp.exporting.comparison import compare
from kmp.exporting.export_plan import ExportPlan, plan_export
from kmp.exporting.export_result import ExportResult
from kmp.exporting.keras_copies import ModelCopies
from kmp.exporting.runners import open_runner
from kmp.exporting.signature import Signature, align_outputs, feed, name_outputs, signature_of
from kmp.layer_walk import walk

__all__ = ["export", "require_modules"]


def require_modules(plan: ExportPlan) -> None:
    """Import every module ``plan`` needs, or raise an ImportError naming the install command.

    Args:
        plan: The export's plan (its ``modules``).

    Raises:
        ImportError: A converter or runtime is not installed.
    """
    for module, purpose in plan.modules:
        try:
            optional_import(module, feature=f"kmp.export ({purpose})")
        except ImportError as exc:
            if module == "tensorflow":
                raise
            raise ImportError(
                f"kmp.export(format={plan.format!r}) needs `{module}` for {purpose}, and it "
                f"is not installed. Install the export converters and runtimes with: "
                f"{SERVE_INSTALL}"
            ) from exc


def _beside(path: str) -> list[str]:
    """The files written with ``path``: an ONNX file's external data, where it has one."""
    from kmp.exporting.onnx_route import data_file

    return [data_file(path)] if path.endswith(".onnx") else []


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return sum(os.path.getsize(p) for p in [path, *_beside(path)] if os.path.exists(p))
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )


def _write(plan: ExportPlan, model: keras.Model, target: str, spec: Signature) -> int | None:
    """Write the file by the plan's route; return the float32 file's size where measured."""
    layers = {v.path: type(v.layer).__name__ for v in walk(model, inputs=False)}
    half = plan.half_pass is not None
    if plan.format == "onnx":
        from kmp.exporting.onnx_route import write_onnx

        return write_onnx(model, target, spec, layers, half)
    if plan.format == "litert":
        from kmp.exporting.litert_route import write_litert

        return write_litert(model, target, spec, layers, half)
    from kmp.exporting.saved_model_route import write_saved_model

    write_saved_model(model, target, spec)
    return None


def _run(
    plan: ExportPlan, target: str, inputs: dict[str, np.ndarray], names: list[str]
) -> tuple[dict[str, np.ndarray], str, str]:
    """Run the written file once in its runtime: ``(outputs by name, input and output dtypes)``."""
    try:
        runner = open_runner(target, plan.format)
        outputs = align_outputs(names, runner.output_names, runner.run(inputs))
        return outputs, runner.input_dtype, runner.output_dtype
    except Exception as exc:
        raise RuntimeError(
            f"kmp.export: {plan.runtime} could not run the {plan.format} file it wrote "
            f"({type(exc).__name__}: {exc}); nothing was written to {plan.path!r}."
        ) from exc


def _move_into_place(staged: str, path: str, staging: str) -> None:
    for i, old in enumerate([path, *_beside(path)]):
        if os.path.lexists(old):  # overwrite=True: the old one goes only now
            os.replace(old, os.path.join(staging, f".replaced{i}"))
    for new, final in zip([staged, *_beside(staged)], [path, *_beside(path)], strict=True):
        if os.path.lexists(new):
            os.replace(new, final)


def _check_model(model: Any) -> None:
    if isinstance(model, keras.Model):
        return
    names = [klass.__name__ for klass in type(model).__mro__]
    if "Preprocessor" in names:
        raise TypeError(
            f"kmp.export got {type(model).__name__}, a KerasHub preprocessor: export the task "
            "model itself (e.g. the GPT2CausalLM or BertTextClassifier), and make its sample "
            "with the preprocessor: sample = task.preprocessor(texts) (the features, without "
            "labels). The file serves token ids; tokenize before calling it."
        )
    raise TypeError(f"kmp.export needs a keras.Model; got {type(model).__name__}.")


def export(
    model: keras.Model,
    path: str | os.PathLike,
    format: str = "saved_model",
    precision: str = "float32",
    *,
    sample: Any = None,
    labels: Any = None,
    overwrite: bool = False,
    verify: bool = True,
    verbose: bool = True,
) -> ExportResult:
    """Export ``model`` for serving, then verify the file in its own runtime.

    The file is checked against the model **in float32** (a model trained or loaded in
    16 bits is copied to float32 first; the model passed is never changed): it is run in
    TensorFlow, onnxruntime or the LiteRT interpreter on ``sample``, and the result
    says how far its outputs are. docs/exporting.md is the guide, with measured figures.

    Args:
        model: A Keras model (any policy) taking one tensor, a list or a dict of them
            (a KerasHub task: ``{"token_ids": ..., "padding_mask": ...}``) and returning
            the same kinds. Each input is served under its name
            (:mod:`kmp.exporting.signature`) with a free batch axis and the model's other
            free axes (a sequence length).
        path: A folder for ``"saved_model"``; a ``.onnx`` or ``.tflite`` file otherwise.
            It must not exist, unless ``overwrite=True``.
        format: ``"saved_model"`` (TensorFlow SavedModel), ``"onnx"`` or ``"litert"``
            (``"tf_saved_model"`` and ``"tflite"`` are accepted too).
        precision: The weights' dtype in the file: ``"float32"``, ``"float16"``, or
            ``"bfloat16"`` (SavedModel only). Inputs and outputs stay float32.
        sample: A batch of real inputs, run through the file and the float32 model;
            needed to verify. One array (or tensor) for a single-input model; a dict by
            input name, or a tuple in the model's input order, otherwise. Integer inputs
            (token ids, masks) must be integers.
        labels: Optional class indices (or one-hot labels) for ``sample``'s first output
            (a dict's first key, sorted): adds the
            accuracy (classifier outputs ``[batch, classes]``) or the perplexity
            (language-model outputs ``[batch, sequence, vocabulary]``).
        overwrite: Replace an existing ``path`` (once the new export is verified).
        verify: Run the file and compare it (True), or only write it.
        verbose: Print the result.

    Returns:
        The :class:`ExportResult`: the file, its size, and the measured differences.

    Raises:
        TypeError: ``model`` is not a Keras model (a KerasHub preprocessor is named as
            such), the sample holds strings, or an argument has the wrong type.
        ValueError: An unknown format or precision; bfloat16 for ONNX or LiteRT; a path
            that exists (without ``overwrite=True``) or does not suit the format; no
            ``sample`` to verify with; a sample that lacks an input (named) or gives
            floats for an integer one; a layer the format cannot hold (the message
            names it).
        ImportError: The format's converter or runtime is not installed (the message
            gives the install command).
        RuntimeError: Not under the TensorFlow backend, or the runtime could not run
            the written file.
    """
    _check_model(model)
    exists = isinstance(path, str | os.PathLike) and os.path.lexists(os.fspath(path))
    plan = plan_export(
        format,
        precision,
        path,
        overwrite=overwrite,
        verify=verify,
        backend=keras.backend.backend(),
        exists=exists,
    )
    if verify and sample is None:
        raise ValueError(
            "kmp.export verifies the file on real inputs: pass sample= (a batch of them, "
            "e.g. x_test[:256]), or verify=False to only write it."
        )
    verbose = check_bool("verbose", verbose)
    require_modules(plan)
    parent = os.path.dirname(os.path.abspath(plan.path))
    os.makedirs(parent, exist_ok=True)
    with ModelCopies(model) as copies:
        reference = copies.in_policy("float32")
        spec = signature_of(reference, sample)
        if sample is not None:  # checked against the model even when not verified
            inputs = feed(sample, spec)
            if not plan.free_lengths:
                spec = spec.with_lengths(inputs)
        if verify:
            expected = name_outputs(reference(spec.pack(list(inputs.values())), training=False))
        staging = tempfile.mkdtemp(prefix=".kmp-export-", dir=parent)
        try:
            staged = os.path.join(staging, os.path.basename(plan.path.rstrip(os.sep)))
            float32_size = _write(plan, copies.in_policy(plan.keras_policy), staged, spec)
            size = _size(staged)
            if plan.precision == "float32":
                float32_size = size
            measured, in_dtype, out_dtype = None, None, None
            if verify:
                outputs, in_dtype, out_dtype = _run(plan, staged, inputs, list(expected))
                measured = {
                    name: compare(value, outputs[name], labels if i == 0 else None)
                    for i, (name, value) in enumerate(expected.items())
                }
            _move_into_place(staged, plan.path, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    result = ExportResult(
        path=plan.path,
        format=plan.format,
        precision=plan.precision,
        runtime=plan.runtime if verify else None,
        size_bytes=size,
        float32_size_bytes=float32_size,
        input_dtype=in_dtype,
        output_dtype=out_dtype,
        comparison=None if measured is None else next(iter(measured.values())),
        outputs=measured,
    )
    if verbose:
        print(result)
    return result
