"""Greedy decoding from an exported causal language model: :func:`greedy`.

Three things a KerasHub causal LM (``GPT2CausalLM`` and kin) can be exported as, and how
:func:`greedy` decodes with each (:func:`served_form` tells them apart by their served
names):

* **the loop** (``kmp.export(greedy_loop(task), ...)``): Keras's greedy ``generate``
  whole, cache and loop in the runtime. One run fills the window. SavedModel and LiteRT
  hold it. The fastest.
* **a cached step** (``kmp.export(cached_step(task, length), ...)``): the task's
  ``call_with_cache``: :func:`greedy_cached` feeds the prompt once and then each new token
  alone, passing the cache in and out. SavedModel and LiteRT hold it.
* **the task as it is** (``kmp.export(task, ...)``): next-token logits for every position
  of a window, no cache. The whole window (prompt plus new tokens, filled left to right,
  the mask marking what is filled) runs once per new token; the positions after the
  filled ones never change the logits before them (a causal model looks back only), so
  the window keeps one shape and each runtime plans it once. Every format holds it (ONNX
  holds only this one: tf2onnx has no ``XlaDynamicUpdateSlice``, the cache's update).

docs/exporting.md measures them against Keras's ``generate``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kmp._checks import check_int
from kmp.exporting.generation_models import (
    CACHE,
    CACHE_LENGTH_AXIS,
    INDEX,
    LOGITS,
    PADDING_MASK,
    TOKEN_IDS,
)
from kmp.exporting.signature import Runner, align_outputs

__all__ = ["greedy", "greedy_cached", "served_form"]

Form = Literal["loop", "step", "task"]


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


def served_form(input_names: list[str], output_names: list[str]) -> Form:
    """Which decoding model an exported file serves, from its served names.

    Args:
        input_names: The file's inputs.
        output_names: Its outputs.

    Returns:
        ``"loop"`` (:func:`~kmp.exporting.generation_models.greedy_loop`), ``"step"``
        (:func:`~kmp.exporting.generation_models.cached_step`) or ``"task"`` (the causal
        LM itself, or any other model: logits over a window).
    """
    if {TOKEN_IDS, PADDING_MASK} <= set(output_names):
        return "loop"
    if {TOKEN_IDS, CACHE, INDEX} <= set(input_names):
        return "step"
    return "task"


def _window(ids: np.ndarray, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt followed by ``new_tokens`` zeros, and the mask of the prompt."""
    batch, length = ids.shape
    window = np.zeros((batch, length + new_tokens), np.int32)
    window[:, :length] = ids
    mask = np.zeros_like(window)
    mask[:, :length] = 1
    return window, mask


def greedy(
    runner: Runner,
    prompt: object,
    new_tokens: int,
    *,
    token_ids: str = TOKEN_IDS,
    padding_mask: str = PADDING_MASK,
) -> np.ndarray:
    """Extend ``prompt`` by ``new_tokens`` tokens, each the exported model's most likely.

    Whatever the file serves (:func:`served_form`): an exported loop runs once, a cached
    step goes through :func:`greedy_cached`, and a task runs over the window once per
    token.

    Args:
        runner: The exported model opened in its runtime
            (:func:`kmp.exporting.runners.open_runner`).
        prompt: Token ids, ``[batch, length]`` (or ``[length]``), every row as long.
        new_tokens: How many tokens to add.
        token_ids: The task's served input holding the ids.
        padding_mask: The task's served input marking the filled positions (left out when
            the model has no such input).

    Returns:
        ``[batch, length + new_tokens]`` int32 ids: the prompt, then the new tokens. A loop
        exported with stop tokens leaves 0 after a row's stop token (0 may be a real id:
        run the file yourself for its ``padding_mask`` where that matters).

    Raises:
        TypeError: ``prompt`` is not array-like, or ``new_tokens`` not an int.
        ValueError: The prompt is empty or not integers, ``new_tokens`` is not positive,
            the model serves no ``token_ids`` input, or the tokens do not fit the exported
            loop's window or cache.
    """
    ids = _prompt(prompt)
    new_tokens = check_int("new_tokens", new_tokens)
    form = served_form(runner.input_names, runner.output_names)
    if form == "step":
        return greedy_cached(runner, ids, new_tokens)
    window, mask = _window(ids, new_tokens)
    if form == "loop":
        return _run_loop(runner, window, mask)
    if token_ids not in runner.input_names:
        raise ValueError(
            f"kmp.exporting.greedy: the exported model serves {runner.input_names}, no "
            f"{token_ids!r}; pass token_ids= (and padding_mask=) with its input names."
        )
    for filled in range(ids.shape[1], window.shape[1]):
        feed = {token_ids: window}
        if padding_mask in runner.input_names:
            feed[padding_mask] = mask
        logits = runner.run(feed)[0]
        window[:, filled] = logits[:, filled - 1].argmax(-1)
        mask[:, filled] = 1
    return window


def _run_loop(runner: Runner, window: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One run of an exported loop over ``window``, padded to the length it serves, if fixed.

    A causal model's tokens never depend on the positions after them, so a longer served
    window gives the same tokens; a shorter one cannot hold them.
    """
    length, served = window.shape[1], runner.input_shapes[TOKEN_IDS][1]
    if served is not None and served < length:
        raise ValueError(
            f"kmp.exporting.greedy: the exported loop serves a window of {served} tokens, "
            f"fewer than the {length} asked for (prompt and new tokens); export greedy_loop "
            f"with a sample of {length} tokens or more (under JAX the sample fixes it), or "
            "ask for fewer."
        )
    pad = 0 if served is None else served - length
    feed = {
        TOKEN_IDS: np.pad(window, ((0, 0), (0, pad))),
        PADDING_MASK: np.pad(mask, ((0, 0), (0, pad))),
    }
    got = align_outputs([PADDING_MASK, TOKEN_IDS], runner.output_names, runner.run(feed))
    return np.where(got[PADDING_MASK] != 0, got[TOKEN_IDS], 0)[:, :length].astype(np.int32)


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
    if served_form(runner.input_names, runner.output_names) != "step":
        raise ValueError(
            f"kmp.exporting.greedy_cached: the exported model serves {runner.input_names}; "
            "export kmp.exporting.cached_step(task, length) for it, or decode what it "
            "serves with kmp.exporting.greedy."
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
    out, _ = _window(ids, new_tokens)
    step, at = ids.astype(np.int32), 0
    if runner.input_shapes[TOKEN_IDS][1] == 1:  # a step served one token at a time (JAX)
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
    outputs = runner.run({TOKEN_IDS: ids, CACHE: cache, INDEX: index})
    values = align_outputs([CACHE, LOGITS], runner.output_names, outputs)  # sorted: served
    return values[LOGITS], values[CACHE]
