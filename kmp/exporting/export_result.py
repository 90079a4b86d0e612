"""What :func:`kmp.export` wrote and what its verification measured: :class:`ExportResult`."""

from __future__ import annotations

import dataclasses
from typing import Any

from kmp.exporting.comparison import Comparison

__all__ = ["ExportResult"]


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


class _Measured:
    """A read-only attribute read through to the result's :class:`Comparison` (None without)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, result: Any, owner: type | None = None) -> Any:
        if result is None:
            return self
        return None if result.comparison is None else getattr(result.comparison, self.name)


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """One export: the file, and how its outputs compare with the float32 Keras model's.

    The measures are those of :mod:`kmp.exporting.comparison`, from running the file in
    its own runtime on the inputs given to :func:`kmp.export`; they are None when the
    export was not verified or the measure does not apply (top-1 agreement needs float
    outputs with classes on the last axis, identical values integer outputs; accuracy and
    perplexity need labels).

    Attributes:
        path: The file, or the SavedModel folder.
        format: ``"saved_model"``, ``"onnx"`` or ``"litert"``.
        precision: The weights' dtype in the file.
        runtime: What verified it (``"TensorFlow"``, ``"onnxruntime"``, ``"LiteRT"``), or
            None when not verified.
        size_bytes: The file's size (a folder's: all its files).
        float32_size_bytes: The size of the same format's float32 export, where it was
            measured (ONNX and LiteRT 16-bit exports; the float32 export's own size).
        input_dtype: The input dtype the runtime reports.
        output_dtype: The output dtype the runtime reports.
        comparison: What the verification measured on the (first) output, or None when
            not verified. Its measures read through as attributes of their own (None
            when not verified):
        samples: How many inputs were compared.
        max_abs_diff: Largest absolute output difference from float32 Keras.
        max_rel_diff: Largest relative output difference (see
            :mod:`kmp.exporting.comparison` for its floor).
        top1_agreement: Share of rows (tokens) whose highest class agrees.
        identical: Share of equal values (an integer output: token ids, masks).
        accuracy: The file's accuracy on the labels (classifiers).
        float32_accuracy: Float32 Keras's accuracy on them.
        perplexity: The labels' perplexity under the file (language models).
        float32_perplexity: Their perplexity under float32 Keras.
        perplexity_diff: ``|perplexity - float32_perplexity| / float32_perplexity``.
        outputs: Every output's comparison by served name, in order (the first is
            ``comparison``; labels measure that one), or None when not verified.
    """

    path: str
    format: str
    precision: str
    runtime: str | None
    size_bytes: int
    float32_size_bytes: int | None = None
    input_dtype: str | None = None
    output_dtype: str | None = None
    comparison: Comparison | None = None
    outputs: dict[str, Comparison] | None = None
    # Comparison's fields, read through (not dataclass fields: no annotation).
    samples = _Measured()
    max_abs_diff = _Measured()
    max_rel_diff = _Measured()
    top1_agreement = _Measured()
    identical = _Measured()
    accuracy = _Measured()
    float32_accuracy = _Measured()
    perplexity = _Measured()
    float32_perplexity = _Measured()
    perplexity_diff = _Measured()

    @property
    def size_ratio(self) -> float | None:
        """``size_bytes / float32_size_bytes``, or None where the latter was not measured."""
        if not self.float32_size_bytes:
            return None
        return self.size_bytes / self.float32_size_bytes

    @property
    def verified(self) -> bool:
        """Whether the file was run in its runtime and compared."""
        return self.runtime is not None

    def to_dict(self) -> dict[str, Any]:
        """Every field, the comparison's measures and ``size_ratio``, as plain Python values.

        The measures sit beside the other fields (None when not verified), so the dict is
        flat and JSON-ready.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["comparison"]
        if self.outputs is not None:
            fields["outputs"] = {k: dataclasses.asdict(c) for k, c in self.outputs.items()}
        measures = {f.name: getattr(self, f.name) for f in dataclasses.fields(Comparison)}
        return {**fields, **measures, "size_ratio": self.size_ratio}

    def __str__(self) -> str:
        head = f"kmp.export: {self.path} ({self.format}, {self.precision} weights)"
        size = _size(self.size_bytes)
        if self.size_ratio is not None and self.precision != "float32":
            size += f"  ({self.size_ratio:.3f} of float32's {_size(self.float32_size_bytes)})"
        rows = [("file size", size)]
        if not self.verified:
            return "\n".join([head + ", not verified", *(f"  {k:<26}{v}" for k, v in rows)])
        several = self.outputs is not None and len(self.outputs) > 1
        head += f", verified in {self.runtime} on {self.samples} inputs"
        if several:
            head += f" ({len(self.outputs)} outputs: the first, then each other)"
        rows += [
            ("inputs / outputs", f"{self.input_dtype} / {self.output_dtype}"),
            ("largest abs. difference", f"{self.max_abs_diff:.3g}"),
            ("largest rel. difference", f"{self.max_rel_diff:.3g}"),
        ]
        if self.top1_agreement is not None:
            rows.append(("top-1 agreement", _pct(self.top1_agreement)))
        if self.identical is not None:
            rows.append(("identical values", _pct(self.identical)))
        if self.accuracy is not None:
            rows.append(
                ("accuracy", f"{_pct(self.accuracy)}  (float32 Keras: "
                 f"{_pct(self.float32_accuracy)})")
            )  # fmt: skip
        if self.perplexity is not None:
            rows.append(
                ("perplexity", f"{self.perplexity:.4f}  (float32 Keras: "
                 f"{self.float32_perplexity:.4f}; relative difference "
                 f"{self.perplexity_diff:.2e})")
            )  # fmt: skip
        if several:
            for name, c in list(self.outputs.items())[1:]:
                agree = "" if c.top1_agreement is None else f", top-1 {_pct(c.top1_agreement)}"
                if c.identical is not None:
                    agree += f", identical {_pct(c.identical)}"
                rows.append(
                    (f"output {name!r}", f"abs. {c.max_abs_diff:.3g}, rel. {c.max_rel_diff:.3g}"
                     f"{agree}")
                )  # fmt: skip
        return "\n".join([head, *(f"  {k:<26}{v}" for k, v in rows)])
