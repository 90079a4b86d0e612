"""The inputs and outputs an export serves: :func:`signature_of`, :func:`feed`, names.

A model takes one tensor, a list of them, or a dict of named ones (every KerasHub task
takes ``{"token_ids": ..., "padding_mask": ...}``), and returns the same kinds. An export
serves each input under a name, with a free batch axis (and the model's other free axes,
such as a sequence length), and each output under a name:

* inputs: a dict's keys; a list's Keras input names (``keras.Input(name=...)``); one
  tensor is ``"inputs"``;
* outputs: a dict's keys, in sorted order (the order Keras and TensorFlow flatten them);
  a list's ``"output_0"``, ``"output_1"``, ...; one tensor is ``"output_0"``.

Float inputs are served as float32, integer and boolean inputs (token ids, masks) keep
their dtype. :func:`feed` turns the caller's sample (an array, a tuple or list in the
model's input order, or a dict by name) into one array per input, and says which input is
missing or has the wrong kind of values. Pure apart from reading the model's inputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

__all__ = [
    "InputSpec",
    "Runner",
    "Signature",
    "align_outputs",
    "dtypes",
    "feed",
    "name_outputs",
    "output_items",
    "signature_of",
    "tensor_specs",
]

# The one input of a single-input model, as kmp has always served it.
SINGLE_INPUT = "inputs"


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One served input: its name, shape (None for a free axis) and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Signature:
    """The served inputs, and how the model takes them.

    Attributes:
        inputs: One :class:`InputSpec` per input, in the model's order.
        structure: ``"single"`` (one tensor), ``"list"`` or ``"dict"``.
    """

    inputs: tuple[InputSpec, ...]
    structure: str

    @property
    def names(self) -> tuple[str, ...]:
        """The inputs' names, in order."""
        return tuple(spec.name for spec in self.inputs)

    def with_lengths(self, arrays: Mapping[str, np.ndarray]) -> Signature:
        """The signature with each free axis but the batch fixed to the arrays' sizes.

        Args:
            arrays: One batch per input, by name (:func:`feed`'s output).

        Returns:
            A signature whose only free axis is each input's batch.
        """

        def fixed(spec: InputSpec) -> InputSpec:
            sizes = arrays[spec.name].shape[1:]
            rest = (size if d is None else d for d, size in zip(spec.shape[1:], sizes, strict=True))
            return dataclasses.replace(spec, shape=(None, *rest))

        return dataclasses.replace(self, inputs=tuple(fixed(spec) for spec in self.inputs))

    def pack(self, values: Sequence[Any]) -> Any:
        """``values`` (one per input, in order) as the model takes them.

        Args:
            values: One tensor or array per input.

        Returns:
            One tensor, a list, or a dict by name.
        """
        if self.structure == "single":
            return values[0]
        if self.structure == "list":
            return list(values)
        return dict(zip(self.names, values, strict=True))


def _served_dtype(dtype: Any) -> str:
    name = keras.backend.standardize_dtype(dtype)
    return "float32" if "float" in name else name


def _safe(name: str, index: int, taken: set[str]) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", name.split(":")[0]) or f"input_{index}"
    if name[0].isdigit() or name in taken:
        name = f"input_{index}"
    taken.add(name)
    return name


def _structure(value: Any, what: str) -> tuple[str, list[tuple[str | None, Any]]]:
    """``(structure, [(key, leaf)])`` of a model's inputs or a sample; nesting refused."""
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
        kind = "dict"
    elif isinstance(value, list | tuple):
        items = [(None, v) for v in value]
        kind = "single" if len(items) == 1 else "list"
    else:
        return "single", [(None, value)]
    if not items:
        raise ValueError(f"kmp.export: the {what} is empty; pass at least one input.")
    for key, leaf in items:
        if isinstance(leaf, Mapping | list | tuple):
            raise ValueError(
                f"kmp.export serves inputs that are one tensor, a list or a dict of tensors; "
                f"the {what}'s input {key!r} is itself a {type(leaf).__name__}. Wrap the "
                "model in one that takes a flat list or dict."
            )
    return kind, items


def signature_of(model: keras.Model, sample: Any) -> Signature:
    """The served inputs: the model's own defined inputs, else the sample's.

    Args:
        model: The float32 reference model.
        sample: The caller's sample, or None.

    Returns:
        The :class:`Signature`.

    Raises:
        ValueError: The model has neither defined inputs nor a sample, or its inputs
            are nested more deeply than a list or dict.
    """
    if getattr(model, "inputs", None):
        try:
            structure = model.input  # a functional model's inputs as it was built: a dict
        except (AttributeError, ValueError):  # a Sequential model: its one input
            structure = model.inputs
        kind, items = _structure(structure, "model's input")
        specs = [(key or getattr(t, "name", ""), tuple(t.shape), t.dtype) for key, t in items]
    elif sample is not None:
        kind, items = _structure(sample, "sample")
        specs = []
        for key, leaf in items:
            array = _array(leaf, key)
            specs.append((key or "", (None, *array.shape[1:]), array.dtype))
    else:
        raise ValueError(
            f"kmp.export cannot tell the inputs of {type(model).__name__} (it has no defined "
            "inputs): pass sample= (a batch of real inputs)."
        )
    taken: set[str] = set()
    inputs = tuple(
        InputSpec(
            name=SINGLE_INPUT if kind == "single" else _safe(key, i, taken),
            shape=(None, *shape[1:]),
            dtype=_served_dtype(dtype),
        )
        for i, (key, shape, dtype) in enumerate(specs)
    )
    return Signature(inputs=inputs, structure=kind)


def _array(value: Any, name: str | None) -> np.ndarray:
    try:
        array = np.asarray(keras.ops.convert_to_numpy(value))
    except Exception as exc:
        raise TypeError(
            f"kmp.export: sample{'' if name is None else f' input {name!r}'} must be an "
            f"array of inputs (NumPy or a tensor); got {type(value).__name__}."
        ) from exc
    if array.dtype.kind in "OUS":
        raise TypeError(
            f"kmp.export: sample{'' if name is None else f' input {name!r}'} holds strings; "
            "an exported model takes numbers. Run the model's preprocessor first (for a "
            "KerasHub task: sample = task.preprocessor(texts), the features without labels)."
        )
    if array.ndim == 0 or array.shape[0] == 0:
        raise ValueError(
            f"kmp.export: sample{'' if name is None else f' input {name!r}'} must be a batch "
            f"of at least one input; got shape {array.shape}."
        )
    return array


def _kind_fits(array: np.ndarray, spec: InputSpec) -> bool:
    if "float" in spec.dtype:
        return array.dtype.kind in "fiub"
    return array.dtype.kind in "iub"  # integer or boolean inputs: ids, masks


def feed(sample: Any, signature: Signature) -> dict[str, np.ndarray]:
    """The sample as one array per served input, in the signature's dtypes.

    Args:
        sample: One array (a single-input model); a tuple or list in the model's input
            order; or a dict by input name (extra keys are refused).
        signature: The served inputs.

    Returns:
        ``{input name: array}``, in the signature's order.

    Raises:
        TypeError: A value is not array-like, or holds strings.
        ValueError: An input is missing or unknown, the inputs' batch sizes differ, or
            floats are given for an integer input.
    """
    names = signature.names
    if isinstance(sample, Mapping) and signature.structure == "single" and len(sample) == 1:
        sample = next(iter(sample.values()))  # one input, under whatever name it was given
    if isinstance(sample, Mapping):
        unknown = [str(k) for k in sample if str(k) not in names]
        missing = [n for n in names if n not in {str(k) for k in sample}]
        if missing or unknown:
            raise ValueError(
                f"kmp.export: the sample's inputs are {sorted(map(str, sample))}, the model "
                f"takes {list(names)}"
                + (f"; missing: {missing}" if missing else "")
                + (f"; unknown: {unknown}" if unknown else "")
                + ". Pass a dict with one batch per model input."
            )
        values = [sample[next(k for k in sample if str(k) == n)] for n in names]
    elif isinstance(sample, list | tuple) and len(names) > 1:
        if len(sample) != len(names):
            raise ValueError(
                f"kmp.export: the model takes {len(names)} inputs {list(names)}; the sample "
                f"has {len(sample)}. Pass one batch per input (a dict by name, or a tuple "
                "in that order)."
            )
        values = list(sample)
    elif len(names) > 1:
        raise ValueError(
            f"kmp.export: the model takes {len(names)} inputs {list(names)}; the sample is "
            f"one {type(sample).__name__}. Pass a dict with a batch for each."
        )
    else:
        values = [sample[0] if isinstance(sample, list | tuple) and len(sample) == 1 else sample]
    arrays: dict[str, np.ndarray] = {}
    for spec, value in zip(signature.inputs, values, strict=True):
        label = None if signature.structure == "single" else spec.name
        array = _array(value, label)
        if not _kind_fits(array, spec):
            raise ValueError(
                f"kmp.export: input {spec.name!r} takes {spec.dtype}, the sample gives "
                f"{array.dtype}. Pass {spec.dtype} values (token ids and masks are integers)."
            )
        if len(spec.shape) != array.ndim or any(
            d not in (None, size) for d, size in zip(spec.shape[1:], array.shape[1:], strict=True)
        ):
            raise ValueError(
                f"kmp.export: input {spec.name!r} takes shape {spec.shape} (None: any size); "
                f"the sample gives {array.shape}. Pass a batch the model takes."
            )
        arrays[spec.name] = array.astype(spec.dtype, copy=False)
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"kmp.export: the sample's inputs hold different batch sizes {sizes}; pass the "
            "same examples for every input."
        )
    return arrays


def output_items(outputs: Any) -> list[tuple[str, Any]]:
    """A model's outputs as ``(served name, tensor)``, in served order.

    Args:
        outputs: One tensor, a list or tuple, or a dict of them.

    Returns:
        A dict's keys sorted, else ``output_0``, ``output_1``, ... with their tensors.
    """
    if isinstance(outputs, Mapping):
        return [(str(k), outputs[k]) for k in sorted(outputs, key=str)]
    if isinstance(outputs, list | tuple):
        return [(f"output_{i}", v) for i, v in enumerate(outputs)]
    return [("output_0", outputs)]


def name_outputs(outputs: Any) -> dict[str, np.ndarray]:
    """A model's outputs by served name, as NumPy arrays (:func:`output_items`).

    Args:
        outputs: One tensor, a list or tuple, or a dict of them.

    Returns:
        ``{name: array}``, in served order.
    """
    return {name: np.asarray(keras.ops.convert_to_numpy(v)) for name, v in output_items(outputs)}


def dtypes(names: Any) -> str:
    """Distinct dtype names in first-seen order, joined with ", " (``"int32"``).

    Args:
        names: Dtype names, one per input or output.

    Returns:
        The joined names, as an export reports its inputs' or outputs' dtypes.
    """
    return ", ".join(dict.fromkeys(names))


def tensor_specs(signature: Signature) -> list[Any]:
    """The signature as Keras's ``model.export(input_signature=...)`` takes it.

    Args:
        signature: The served inputs.

    Returns:
        A one-element list: a ``tf.TensorSpec``, a list of them, or a dict by name.
    """
    import tensorflow as tf

    specs = [tf.TensorSpec(s.shape, s.dtype, name=s.name) for s in signature.inputs]
    return [signature.pack(specs)]


class Runner:
    """What each format's runner shares: its inputs by name, and one-input convenience.

    Subclasses open a file in its runtime and set :attr:`input_names`,
    :attr:`output_names`, :attr:`input_shapes` (None for a free axis), ``input_dtype``
    and ``output_dtype``.
    """

    input_names: list[str]
    output_names: list[str]
    input_shapes: dict[str, tuple[int | None, ...]]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The file's outputs on a batch for each input (by name), in output order."""
        raise NotImplementedError

    def predict_on_batch(self, inputs: np.ndarray) -> np.ndarray:
        """The first output on a batch for the one input (a single-input model).

        Args:
            inputs: A batch of inputs.

        Returns:
            The first output.
        """
        return self.run({self.input_names[0]: inputs})[0]


def align_outputs(
    expected: Sequence[str], names: Sequence[str], values: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """A runtime's outputs under the served names: by name where it kept them, else in order.

    Args:
        expected: The served output names, in order.
        names: The names the runtime gives its outputs (ONNX files name them after
            TensorFlow's graph, ``Identity:0``).
        values: The runtime's outputs, in its order.

    Returns:
        ``{served name: array}``.

    Raises:
        ValueError: The runtime returned a different number of outputs.
    """
    if len(values) != len(expected):
        raise ValueError(
            f"kmp.export: the exported file returned {len(values)} outputs, the Keras model "
            f"{len(expected)} ({list(expected)}): the export is broken; please report it."
        )
    by_name = dict(zip(names, values, strict=True))
    if set(expected) <= set(by_name):
        return {name: np.asarray(by_name[name]) for name in expected}
    return {name: np.asarray(v) for name, v in zip(expected, values, strict=True)}
