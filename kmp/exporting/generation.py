"""Greedy decoding from an exported causal language model: :func:`greedy`, :func:`cached_step`.

Two ways to serve a KerasHub causal LM (``GPT2CausalLM`` and kin) for generation:

* **The task as it is** (``kmp.export(task, ...)``): ``token_ids`` and ``padding_mask``
  in, next-token logits for every position out. It holds no key/value cache, so
  :func:`greedy` runs the whole window (prompt plus new tokens, filled left to right, the
  mask marking what is filled) once per new token. The positions after the filled ones
  never change the logits before them (a causal model looks back only), so the window
  keeps one shape and each runtime plans it once. Every format holds it.
* **A cached step** (``kmp.export(cached_step(task, length), ...)``): the task's
  ``call_with_cache`` as a model of ``token_ids`` (the new tokens), ``kv_cache`` and
  ``index`` (where they go), returning ``logits`` and the updated ``kv_cache``; then
  :func:`greedy_cached` feeds the prompt once and each new token alone, as Keras's own
  ``generate`` does. SavedModel and LiteRT hold it; ONNX does not (tf2onnx has no
  ``XlaDynamicUpdateSlice``, the cache's update: kmp.export names the layer).

docs/exporting.md measures both against Keras's ``generate``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from kmp._checks import check_int
from kmp._keras_internals import compute_output_spec
from kmp.exporting.signature import Runner, align_outputs

__all__ = ["CachedStep", "cached_step", "greedy", "greedy_cached"]

# The cached step's served names.
CACHE, INDEX, LOGITS = "kv_cache", "index", "logits"
# KerasHub's causal LMs lay their cache out [batch, layers, 2 (key, value), length, heads,
# head size] (GPT-2, Gemma, Llama, Mistral): the sequence is its axis 3.
CACHE_LENGTH_AXIS = 3


def _prompt(prompt: object) -> np.ndarray:
    try:
        ids = np.asarray(prompt)
    except Exception as exc:
        raise TypeError(
            f"kmp.exporting.greedy: prompt must be an array of token ids; got "
            f"{type(prompt).__name__}."
        ) from exc
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(
            f"kmp.exporting.greedy: prompt must be token ids of shape [batch, length] with "
            f"at least one token; got shape {ids.shape}."
        )
    if ids.dtype.kind not in "iu":
        raise ValueError(
            f"kmp.exporting.greedy: prompt must hold integer token ids; got {ids.dtype}. "
            "Tokenize the text first (a KerasHub task's preprocessor.tokenizer)."
        )
    return ids


def greedy(
    runner: Runner,
    prompt: object,
    new_tokens: int,
    *,
    token_ids: str = "token_ids",
    padding_mask: str = "padding_mask",
) -> np.ndarray:
    """Extend ``prompt`` by ``new_tokens`` tokens, each the exported model's most likely.

    Args:
        runner: The exported causal LM opened in its runtime
            (:func:`kmp.exporting.runners.open_runner`).
        prompt: Token ids, ``[batch, length]`` (or ``[length]``), every row as long.
        new_tokens: How many tokens to add.
        token_ids: The served input holding the ids.
        padding_mask: The served input marking the filled positions (left out when the
            model has no such input).

    Returns:
        ``[batch, length + new_tokens]`` int32 ids: the prompt, then the new tokens.

    Raises:
        TypeError: ``prompt`` is not array-like, or ``new_tokens`` not an int.
        ValueError: The prompt is empty or not integers, ``new_tokens`` is not positive,
            or the model serves no ``token_ids`` input.
    """
    ids = _prompt(prompt)
    new_tokens = check_int("new_tokens", new_tokens)
    if token_ids not in runner.input_names:
        raise ValueError(
            f"kmp.exporting.greedy: the exported model serves {runner.input_names}, no "
            f"{token_ids!r}; pass token_ids= (and padding_mask=) with its input names."
        )
    batch, length = ids.shape
    window = np.zeros((batch, length + new_tokens), np.int32)
    window[:, :length] = ids
    mask = np.zeros_like(window)
    mask[:, :length] = 1
    for filled in range(length, length + new_tokens):
        feed = {token_ids: window}
        if padding_mask in runner.input_names:
            feed[padding_mask] = mask
        logits = runner.run(feed)[0]
        window[:, filled] = logits[:, filled - 1].argmax(-1)
        mask[:, filled] = 1
    return window


@keras.saving.register_keras_serializable(package="kmp")
class CachedStep(keras.layers.Layer):
    """A KerasHub causal LM's ``call_with_cache`` as a layer: one decoding step.

    Args:
        task: The causal LM (it has ``call_with_cache(token_ids, cache, index)``).
        **kwargs: Layer arguments.
    """

    def __init__(self, task: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.task = task

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

    def get_config(self) -> dict[str, Any]:
        """The layer's config, the task serialized inside it."""
        return {**super().get_config(), "task": keras.saving.serialize_keras_object(self.task)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CachedStep:
        """The layer from :meth:`get_config`'s output."""
        config = dict(config)
        config["task"] = keras.saving.deserialize_keras_object(config["task"])
        return cls(**config)


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
    if not callable(getattr(task, "call_with_cache", None)):
        raise TypeError(
            f"kmp.exporting.cached_step needs a KerasHub causal LM (a model with "
            f"call_with_cache, such as GPT2CausalLM); got {type(task).__name__}. Export "
            "other models with kmp.export(model, ...) as they are."
        )
    length = check_int("length", length)
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    kv_cache = keras.Input(cache_shape(task, length), name=CACHE)
    index = keras.Input((), dtype="int32", name=INDEX)
    step = CachedStep(task, name="cached_step", dtype=task.dtype_policy)  # computes as it does
    outputs = step(token_ids, kv_cache, index)
    inputs = {"token_ids": token_ids, CACHE: kv_cache, INDEX: index}
    return keras.Model(inputs, outputs, name=f"{task.name}_cached_step")


def _served_cache_shape(runner: Runner, batch: int) -> tuple[int, ...]:
    shape = runner.input_shapes[CACHE]
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"kmp.exporting.greedy_cached: the exported cache has free axes {shape}; export "
            "kmp.exporting.cached_step(task, length), whose cache has a fixed length."
        )
    return (batch, *shape[1:])


def greedy_cached(runner: Runner, prompt: object, new_tokens: int) -> np.ndarray:
    """Extend ``prompt`` greedily with an exported :func:`cached_step`: one token per run.

    The prompt is run once (filling the cache), then each new token alone, reading the
    cache back, as Keras's ``generate`` does.

    Args:
        runner: The exported cached step, opened in its runtime.
        prompt: Token ids, ``[batch, length]`` (or ``[length]``).
        new_tokens: How many tokens to add (the prompt and they must fit the cache).

    Returns:
        ``[batch, length + new_tokens]`` int32 ids.

    Raises:
        TypeError: ``prompt`` is not array-like, or ``new_tokens`` not an int.
        ValueError: The runner serves no cached step, or the tokens do not fit its cache.
    """
    ids = _prompt(prompt)
    new_tokens = check_int("new_tokens", new_tokens)
    if not {"token_ids", CACHE, INDEX} <= set(runner.input_names):
        raise ValueError(
            f"kmp.exporting.greedy_cached: the exported model serves {runner.input_names}; "
            "export kmp.exporting.cached_step(task, length) for it, or decode the task "
            "itself with kmp.exporting.greedy."
        )
    batch, length = ids.shape
    shape = _served_cache_shape(runner, batch)
    if length + new_tokens > shape[CACHE_LENGTH_AXIS]:
        # A cache update past its end is clamped by the runtime, not refused: wrong tokens.
        raise ValueError(
            f"kmp.exporting.greedy_cached: {length} prompt tokens and {new_tokens} new ones "
            f"do not fit the exported cache of {shape[CACHE_LENGTH_AXIS]}; export "
            f"cached_step(task, length={length + new_tokens}) or ask for fewer tokens."
        )
    cache = np.zeros(shape, np.float32)
    out = np.zeros((batch, length + new_tokens), np.int32)
    out[:, :length] = ids
    step, at = ids.astype(np.int32), 0
    if runner.input_shapes["token_ids"][1] == 1:  # a step served one token at a time (JAX)
        for at in range(length - 1):  # the prompt but its last token fills the cache
            _, cache = _run_step(runner, step[:, at : at + 1], cache, at)
        step, at = step[:, -1:], length - 1
    for filled in range(length, length + new_tokens):
        logits, cache = _run_step(runner, step, cache, at)
        out[:, filled] = logits[:, -1].argmax(-1)
        step, at = out[:, filled : filled + 1], filled
    return out


def _run_step(
    runner: Runner, ids: np.ndarray, cache: np.ndarray, at: int
) -> tuple[np.ndarray, np.ndarray]:
    index = np.full((len(ids),), at, np.int32)
    outputs = runner.run({"token_ids": ids, CACHE: cache, INDEX: index})
    values = align_outputs([CACHE, LOGITS], runner.output_names, outputs)  # sorted: served
    return values[LOGITS], values[CACHE]
