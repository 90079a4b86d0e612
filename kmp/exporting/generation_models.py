"""Models of a causal LM's decoding to export: :func:`greedy_loop`, :func:`cached_step`.

A KerasHub causal LM (``GPT2CausalLM`` and kin) exported as it is computes logits over a
window and holds no key/value cache. Two models built around the task serve generation
faster; :mod:`kmp.exporting.generation` decodes with whichever was exported:

* :func:`greedy_loop` is the whole of Keras's greedy ``generate`` (the task's own
  ``generate_step``: its cache, its loop) as one model: ``token_ids`` and ``padding_mask``
  (the prompt, marked) in, the filled ``token_ids`` and ``padding_mask`` out. The runtime
  runs the loop, so one call gives every new token. SavedModel and LiteRT hold it.
* :func:`cached_step` is one step of it (``call_with_cache``): the caller's loop passes
  the cache in and out once per token. SavedModel and LiteRT hold it.

ONNX holds neither: tf2onnx has no ``XlaDynamicUpdateSlice`` (the cache's update), and
kmp.export names the layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import keras

from kmp._checks import check_int
from kmp._keras_internals import compute_output_spec
from kmp.layer_walk import sublayers

__all__ = [
    "CachedStep",
    "GreedyLoop",
    "cache_shape",
    "cached_step",
    "compiled_when_served",
    "greedy_loop",
]

# The served names.
TOKEN_IDS, PADDING_MASK = "token_ids", "padding_mask"
CACHE, INDEX, LOGITS = "kv_cache", "index", "logits"
# KerasHub's causal LMs lay their cache out [batch, layers, 2 (key, value), length, heads,
# head size] (GPT-2, Gemma, Llama, Mistral): the sequence is its axis 3.
CACHE_LENGTH_AXIS = 3


def _check_causal_lm(task: Any, what: str, needs: str) -> None:
    if not callable(getattr(task, needs, None)):
        raise TypeError(
            f"kmp.exporting.{what} needs a KerasHub causal LM (a model with {needs}, such as "
            f"GPT2CausalLM); got {type(task).__name__}. Export other models with "
            "kmp.export(model, ...) as they are."
        )


class _HoldsTask(keras.layers.Layer):
    """A layer around a KerasHub task, saved with the task inside its config."""

    def __init__(self, task: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.task = task

    def get_config(self) -> dict[str, Any]:
        """The layer's config, the task serialized inside it."""
        return {**super().get_config(), "task": keras.saving.serialize_keras_object(self.task)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _HoldsTask:
        """The layer from :meth:`get_config`'s output."""
        config = dict(config)
        config["task"] = keras.saving.deserialize_keras_object(config["task"])
        return cls(**config)


def _most_likely(probabilities: Any) -> Any:
    """The most likely token of each row, as ``argmax`` gives it (ties: the first).

    Without ``argmax``'s negative-zero handling, whose ``BitwiseAnd`` LiteRT lacks
    (probabilities are never negative).
    """
    return keras.ops.top_k(probabilities, 1)[1][:, 0]


@contextmanager
def _greedy_sampler(task: keras.Model) -> Iterator[None]:
    """KerasHub's ``generate_step`` reads ``task.sampler``: greedy while it is traced."""
    from keras_hub.samplers import GreedySampler

    saved = getattr(task, "sampler", None)
    task.sampler = GreedySampler()
    if keras.backend.backend() == "tensorflow":  # JAX's top_k is a composite TF cannot load
        task.sampler.get_next_token = _most_likely
    try:
        yield
    finally:
        task.sampler = saved


@keras.saving.register_keras_serializable(package="kmp")
class GreedyLoop(_HoldsTask):
    """A KerasHub causal LM's greedy ``generate_step`` as a layer: the whole decoding loop.

    Args:
        task: The causal LM (it has ``generate_step``).
        stop_token_ids: Token ids that end a row (generation stops when every row has
            made one), or None to fill every row.
        **kwargs: Layer arguments.
    """

    def __init__(
        self, task: keras.Model, stop_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(task, **kwargs)
        self.stop_token_ids = None if stop_token_ids is None else tuple(stop_token_ids)

    def call(self, token_ids: Any, padding_mask: Any) -> dict[str, Any]:
        """The window filled greedily after the prompt, and the mask of what is filled."""
        inputs = {TOKEN_IDS: token_ids, PADDING_MASK: keras.ops.cast(padding_mask, "bool")}
        with _greedy_sampler(self.task):
            out = self.task.generate_step(inputs, stop_token_ids=self.stop_token_ids)
        return {name: keras.ops.cast(out[name], "int32") for name in (TOKEN_IDS, PADDING_MASK)}

    def compute_output_spec(self, token_ids: Any, padding_mask: Any) -> dict[str, Any]:
        """Both outputs are int32 of the window's shape (the loop is not traced for it)."""
        shape = token_ids.shape
        return {name: keras.KerasTensor(shape, "int32") for name in (TOKEN_IDS, PADDING_MASK)}

    def get_config(self) -> dict[str, Any]:
        """The layer's config, with the stop tokens."""
        stop = None if self.stop_token_ids is None else list(self.stop_token_ids)
        return {**super().get_config(), "stop_token_ids": stop}


def _stop_tokens(stop_token_ids: Any) -> tuple[int, ...] | None:
    if stop_token_ids is None:
        return None
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
        raise TypeError(
            f"kmp.exporting.greedy_loop: stop_token_ids must be a list of token ids, e.g. "
            f"[50256], or None; got {type(stop_token_ids).__name__}."
        )
    stop = tuple(check_int("stop_token_ids", t, minimum=0) for t in stop_token_ids)
    if not stop:
        raise ValueError(
            "kmp.exporting.greedy_loop: stop_token_ids is empty; pass None to fill every row, "
            "or the ids that end one (an end-of-text token)."
        )
    return stop


def greedy_loop(task: keras.Model, stop_token_ids: Sequence[int] | None = None) -> keras.Model:
    """A model of Keras's greedy ``generate`` on ``task``, cache and loop inside, to export.

    Args:
        task: A KerasHub causal LM (``GPT2CausalLM``, ...), any policy.
        stop_token_ids: Token ids that end a row (an end-of-text token), or None (the
            default) to fill every row.

    Returns:
        A functional model of ``{"token_ids": [b, n], "padding_mask": [b, n]}`` (the prompt
        at the start of each row, marked 1 in the mask; the rest 0) returning the same
        names: the row filled with the most likely tokens after the prompt, and 1 where a
        position holds the prompt or a generated token (0 after a row's stop token).

    Raises:
        TypeError: ``task`` has no ``generate_step`` (it is no KerasHub causal LM), or
            ``stop_token_ids`` is not a list of ints.
    """
    _check_causal_lm(task, "greedy_loop", "generate_step")
    stop = _stop_tokens(stop_token_ids)
    token_ids = keras.Input((None,), dtype="int32", name=TOKEN_IDS)
    padding_mask = keras.Input((None,), dtype="int32", name=PADDING_MASK)
    loop = GreedyLoop(task, stop, name="greedy_loop", dtype=task.dtype_policy)
    outputs = loop(token_ids, padding_mask)
    inputs = {TOKEN_IDS: token_ids, PADDING_MASK: padding_mask}
    return keras.Model(inputs, outputs, name=f"{task.name}_greedy_loop")


@keras.saving.register_keras_serializable(package="kmp")
class CachedStep(_HoldsTask):
    """A KerasHub causal LM's ``call_with_cache`` as a layer: one decoding step.

    Args:
        task: The causal LM (it has ``call_with_cache(token_ids, cache, index)``).
        **kwargs: Layer arguments.
    """

    def call(self, token_ids: Any, kv_cache: Any, index: Any) -> dict[str, Any]:
        """Logits of the new tokens and the cache with their keys and values written."""
        logits, _, cache = self.task.call_with_cache(token_ids, kv_cache, index[0])
        return {LOGITS: logits, CACHE: cache}

    def compute_output_spec(self, token_ids: Any, kv_cache: Any, index: Any) -> dict[str, Any]:
        """The outputs' specs, traced on one token (then widened to the given count).

        A free token count would be compared with the position table's length, which JAX's
        symbolic shapes cannot decide.
        """
        one = keras.KerasTensor((token_ids.shape[0], 1), token_ids.dtype)
        traced = compute_output_spec(self.call, one, kv_cache, index)
        logits = traced[LOGITS]
        shape = (*token_ids.shape[:2], logits.shape[-1])
        return {LOGITS: keras.KerasTensor(shape, logits.dtype), CACHE: traced[CACHE]}


def cache_shape(task: keras.Model, length: int) -> tuple[int, ...]:
    """The task's key/value cache for one sequence of ``length`` tokens, without the batch.

    Args:
        task: A KerasHub causal LM.
        length: The longest sequence the cache holds (prompt plus new tokens).

    Returns:
        The cache's shape after the batch axis (GPT-2: layers, 2, length, heads, head size).
    """
    ids = keras.ops.zeros((1, length), "int32")
    _, cache = task._build_cache(ids)  # KerasHub's own cache (its shape and dtype)
    return tuple(int(d) for d in cache.shape[1:])


def cached_step(task: keras.Model, length: int) -> keras.Model:
    """A model of one decoding step of ``task`` with its key/value cache, for ``kmp.export``.

    Args:
        task: A KerasHub causal LM (``GPT2CausalLM``, ...), any policy.
        length: The longest sequence it will serve (prompt plus new tokens).

    Returns:
        A functional model of ``{"token_ids": [b, n], "kv_cache": [b, ...], "index":
        [b]}`` (``index``: where the ``n`` tokens go, the same in every row) returning
        ``{"logits": [b, n, vocabulary], "kv_cache": ...}``.

    Raises:
        TypeError: ``task`` has no ``call_with_cache`` (it is no KerasHub causal LM).
    """
    _check_causal_lm(task, "cached_step", "call_with_cache")
    length = check_int("length", length)
    token_ids = keras.Input((None,), dtype="int32", name=TOKEN_IDS)
    kv_cache = keras.Input(cache_shape(task, length), name=CACHE)
    index = keras.Input((), dtype="int32", name=INDEX)
    step = CachedStep(task, name="cached_step", dtype=task.dtype_policy)  # computes as it does
    outputs = step(token_ids, kv_cache, index)
    inputs = {TOKEN_IDS: token_ids, CACHE: kv_cache, INDEX: index}
    return keras.Model(inputs, outputs, name=f"{task.name}_cached_step")


def compiled_when_served(model: keras.Model) -> bool:
    """Whether a SavedModel of ``model`` should serve its call compiled by XLA.

    True for the decoding models above (:func:`greedy_loop`, :func:`cached_step`): XLA fuses
    the loop's many small ops, which TensorFlow's graph executor runs one by one (the loop
    served compiled made 5-7x Keras's own ``generate``, which TensorFlow runs uncompiled).
    Other models are served as TensorFlow runs them, as they were verified.

    Args:
        model: The model to be exported.

    Returns:
        Whether it holds a :class:`GreedyLoop` or :class:`CachedStep` at its top level.
    """
    return any(isinstance(layer, (GreedyLoop, CachedStep)) for layer in sublayers(model))
