"""kmp.export of KerasHub task models: a GPT-2 causal LM and a BERT text classifier.

Built from small configs with random weights (no preset can be downloaded here; a preset
takes the same code path), the GPT trained briefly under mixed_float16 on real text (the
Python standard library's sources, byte tokens). Each takes a dict of integer inputs
(``token_ids``, ``padding_mask``, BERT's ``segment_ids``) with a free batch and sequence
length; each file is run in its runtime on real text and compared with float32 Keras.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp
from kmp.datasets import text
from kmp.exporting import export
from tests import _zoo
from tests.test_export import pytestmark as _export_marks
from tests.test_zoo import needs_hub

pytestmark = [*_export_marks, needs_hub]
SUFFIX = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite"}


@pytest.fixture(scope="module")
def windows():
    """Byte windows of real text: 64 for training, 48 held out (token ids < 256)."""
    data = text.read_corpus(max_bytes=200_000).data
    ids = data[: 113 * (_zoo.SEQ + 1)].astype("int32").reshape(113, _zoo.SEQ + 1)
    return ids[:64], ids[64:112]


@pytest.fixture(scope="module")
def gpt(windows):
    """GPT2CausalLM (1 layer, 32 wide, vocabulary 256), 2 epochs under mixed_float16."""
    train, _ = windows
    keras.utils.set_random_seed(0)
    with kmp.policy_scope("mixed_float16"):
        model = _zoo.gpt2_causal_lm()
        model.compile(kmp.wrap_optimizer(keras.optimizers.Adam(3e-3)))
        x = {"token_ids": train[:, :-1], "padding_mask": np.ones_like(train[:, :-1])}
        model.fit(x, train[:, 1:], epochs=2, batch_size=16, verbose=0)
    return model


@pytest.fixture(scope="module")
def bert():
    keras.utils.set_random_seed(0)
    return _zoo.bert_text_classifier()


@pytest.mark.parametrize(
    "fmt, precision",
    [("saved_model", "float16"), ("onnx", "float16"), ("litert", "float16")],
)
def test_gpt2_exports_agree_on_the_next_token(gpt, windows, fmt, precision, tmp_path):
    _, held_out = windows
    sample = {
        "token_ids": held_out[:, :-1],
        "padding_mask": np.ones_like(held_out[:, :-1]),
    }
    result = export(
        gpt, tmp_path / f"gpt{SUFFIX[fmt]}", fmt, precision, sample=sample,
        labels=held_out[:, 1:], verbose=False,
    )  # fmt: skip
    assert result.input_dtype == "int32" and result.output_dtype == "float32"
    assert result.samples == 48
    assert result.top1_agreement >= 0.99  # of 48 x 16 next tokens
    assert result.perplexity_diff < 0.01
    assert result.float32_perplexity < 256  # trained: better than uniform over bytes
    if fmt != "saved_model":  # 27k weights: the graph is a third of the file; halved weights
        assert result.size_ratio < 0.8


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_bert_classifier_exports_keep_its_predictions(bert, windows, fmt, tmp_path):
    _, held_out = windows
    ids = held_out[:, :-1]
    sample = {
        "token_ids": ids,
        "segment_ids": np.zeros_like(ids),
        "padding_mask": np.ones_like(ids),
    }
    result = export(
        bert, tmp_path / f"bert{SUFFIX[fmt]}", fmt, "float16", sample=sample, verbose=False
    )
    assert result.input_dtype == "int32" and result.output_dtype == "float32"
    assert result.top1_agreement >= 0.99
    assert result.max_abs_diff < 2e-2


def test_a_preprocessor_is_refused_with_what_to_pass(tmp_path):
    import keras_hub

    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=[])
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=8)
    with pytest.raises(TypeError, match=r"GPT2CausalLMPreprocessor, a KerasHub preprocessor"):
        export(preprocessor, tmp_path / "p.onnx", "onnx", sample=np.zeros((1, 8), "int32"))
    assert not (tmp_path / "p.onnx").exists()


# ------------------------------------------------------------------ generation

PROMPT, NEW = 16, 32


@pytest.fixture(scope="module")
def gpt32():
    """A float32 GPT2CausalLM with a window of 64 (random weights), greedy sampler."""
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=64,
    )  # fmt: skip
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy")
    return model


@pytest.fixture(scope="module")
def prompt(windows):
    return windows[1][:4, :PROMPT]  # real text


@pytest.fixture(scope="module")
def keras_tokens(gpt32, prompt):
    """Keras's own generate (its cache, its compiled loop): 32 greedy tokens."""
    window = _window(prompt)
    window["padding_mask"] = window["padding_mask"] > 0
    out = gpt32.generate(window, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def test_greedy_from_the_exported_task_is_kerass_generate(gpt32, prompt, keras_tokens, tmp_path):
    from kmp.exporting.generation import greedy
    from kmp.exporting.runners import open_runner

    window = np.zeros((len(prompt), PROMPT + NEW), "int32")
    sample = {"token_ids": window, "padding_mask": np.ones_like(window)}
    export(gpt32, tmp_path / "gpt.onnx", "onnx", sample=sample, verbose=False)
    tokens = greedy(open_runner(tmp_path / "gpt.onnx"), prompt, NEW)
    assert tokens.shape == (4, PROMPT + NEW)
    assert np.array_equal(tokens, keras_tokens)  # all 32 new tokens of every row


@pytest.mark.parametrize("fmt", ["saved_model", "litert"])
def test_the_cached_step_generates_kerass_tokens(gpt32, prompt, keras_tokens, fmt, tmp_path):
    from kmp.exporting import cached_step, greedy_cached
    from kmp.exporting.runners import open_runner

    step = cached_step(gpt32, PROMPT + NEW)
    cache = step.input["kv_cache"].shape[1:]
    assert cache == (1, 2, PROMPT + NEW, 2, 16)  # layers, key/value, length, heads, size
    sample = {
        "token_ids": prompt,
        "kv_cache": np.zeros((4, *cache), "float32"),
        "index": np.zeros(4, "int32"),
    }
    path = tmp_path / ("step.tflite" if fmt == "litert" else "step")
    result = export(step, path, fmt, sample=sample, verbose=False)
    assert set(result.outputs) == {"kv_cache", "logits"} and result.max_abs_diff < 1e-4
    runner = open_runner(path)
    assert np.array_equal(greedy_cached(runner, prompt, NEW), keras_tokens)
    with pytest.raises(ValueError, match=r"do not fit the exported cache of 48"):
        greedy_cached(runner, prompt, NEW + 1)  # the runtime would clamp: wrong tokens


def _window(prompt: np.ndarray) -> dict:
    """The prompt and room for NEW tokens, the mask marking the prompt: a loop's input."""
    window = np.zeros((len(prompt), PROMPT + NEW), "int32")
    window[:, :PROMPT] = prompt
    mask = np.zeros_like(window)
    mask[:, :PROMPT] = 1
    return {"token_ids": window, "padding_mask": mask}


class _LoopFile:
    """An exported loop as a runner serves it (a window of ``length``, None: free), run by
    the Keras loop itself: what kmp.exporting.greedy makes of a file's outputs."""

    def __init__(self, loop: keras.Model, length: int | None = None) -> None:
        self.loop, self.fed = loop, []
        self.input_names = self.output_names = ["padding_mask", "token_ids"]
        self.input_shapes = {name: (None, length) for name in self.input_names}

    def run(self, feed: dict) -> list:
        self.fed.append(feed["token_ids"].shape)
        out = self.loop.predict_on_batch(feed)
        return [out["padding_mask"], out["token_ids"]]


@pytest.mark.parametrize("fmt", ["saved_model", "litert"])
def test_the_exported_loop_generates_kerass_tokens_in_one_run(
    gpt32, prompt, keras_tokens, fmt, tmp_path
):
    from kmp.exporting import greedy, greedy_loop, open_runner

    loop = greedy_loop(gpt32)  # Keras's generate: cache and loop, run by the runtime
    path = tmp_path / ("loop.tflite" if fmt == "litert" else "loop")
    result = export(loop, path, fmt, sample=_window(prompt), verbose=False)
    assert set(result.outputs) == {"padding_mask", "token_ids"}
    tokens = result.outputs["token_ids"]
    assert tokens.identical == 1.0 and tokens.top1_agreement is None  # ids: equal or not
    assert result.output_dtype == "int32"
    runner = open_runner(path)
    assert np.array_equal(greedy(runner, prompt, NEW), keras_tokens)
    if fmt == "saved_model":  # the file serves the loop compiled by XLA
        import tensorflow as tf

        served = tf.saved_model.load(str(path)).signatures["serving_default"]
        library = served.graph.as_graph_def().library.function
        assert any(f.attr["_XlaMustCompile"].b for f in library)


def test_the_loop_is_greedy_stops_where_generate_does_and_saves(gpt32, prompt, keras_tokens):
    from kmp.exporting import greedy, greedy_loop

    stop = int(keras_tokens[0, PROMPT + 3])  # row 0's fourth new token
    gpt32.compile(sampler="top_k")  # the loop decodes greedily whatever the task's sampler
    try:
        loop = greedy_loop(gpt32, stop_token_ids=np.array([stop]))
        served = _LoopFile(loop, length=PROMPT + NEW + 8)  # a longer fixed window (JAX)
        tokens = greedy(served, prompt, NEW)
        assert type(gpt32.sampler).__name__ == "TopKSampler"  # the task's, put back
    finally:
        gpt32.compile(sampler="greedy")
    assert served.fed == [(4, PROMPT + NEW + 8)]  # padded to the served window, one run
    window = _window(prompt)
    window["padding_mask"] = window["padding_mask"] > 0
    want = gpt32.generate(window, stop_token_ids=[stop])
    kept = np.asarray(want["padding_mask"])
    assert np.array_equal(tokens, np.where(kept, np.asarray(want["token_ids"]), 0))
    first = PROMPT + list(keras_tokens[0, PROMPT:]).index(stop)  # its first new stop
    assert tokens[0, first] == stop and not tokens[0, first + 1 :].any()  # 0 after it
    with pytest.raises(ValueError, match=r"serves a window of 40 tokens, fewer than the 48"):
        greedy(_LoopFile(loop, length=40), prompt, NEW)
    again = keras.Model.from_config(loop.get_config())  # as kmp.export reloads it in 16 bits
    assert again.get_layer("greedy_loop").stop_token_ids == (stop,)


def test_generation_says_what_cannot_be_done(gpt32, bert, prompt, tmp_path):
    from kmp.exporting import cached_step, greedy, greedy_cached, greedy_loop
    from kmp.exporting.runners import open_runner

    step = cached_step(gpt32, PROMPT + NEW)
    sample = {
        "token_ids": prompt,
        "kv_cache": np.zeros((4, *step.input["kv_cache"].shape[1:]), "float32"),
        "index": np.zeros(4, "int32"),
    }
    # ONNX cannot hold the cache's update (tf2onnx has no XlaDynamicUpdateSlice): named, or
    # (when tf2onnx loses the cache input to it first) said, with the formats that can.
    with pytest.raises(ValueError, match=r"(?s)XlaDynamicUpdateSlice.*format='saved_model'"):
        export(step, tmp_path / "step.onnx", "onnx", sample=sample, verbose=False)
    with pytest.raises(TypeError, match=r"needs a KerasHub causal LM .*BertTextClassifier"):
        cached_step(bert, 8)
    with pytest.raises(TypeError, match=r"greedy_loop needs a KerasHub causal LM"):
        greedy_loop(bert)
    with pytest.raises(TypeError, match=r"stop_token_ids must be a list of token ids"):
        greedy_loop(gpt32, stop_token_ids="0")
    with pytest.raises(ValueError, match=r"stop_token_ids"):
        greedy_loop(gpt32, stop_token_ids=[-1])
    with pytest.raises(ValueError, match=r"stop_token_ids is empty; pass None"):
        greedy_loop(gpt32, stop_token_ids=[])
    with pytest.raises(ValueError, match=r"(?s)XlaDynamicUpdateSlice.*format='saved_model'"):
        export(greedy_loop(gpt32), tmp_path / "loop.onnx", "onnx", sample=_window(prompt))
    assert not (tmp_path / "loop.onnx").exists()
    ids = np.zeros((2, 8), "int32")
    clf = {"token_ids": ids, "segment_ids": ids, "padding_mask": ids + 1}
    export(bert, tmp_path / "bert.onnx", "onnx", sample=clf, verbose=False)
    runner = open_runner(tmp_path / "bert.onnx")
    with pytest.raises(ValueError, match=r"export kmp.exporting.cached_step"):
        greedy_cached(runner, prompt, 2)
    with pytest.raises(ValueError, match=r"integer token ids"):
        greedy(runner, prompt + 0.5, 2)
    with pytest.raises(ValueError, match=r"not an exported model"):
        open_runner(tmp_path / "model.keras")


def test_served_form_tells_the_exported_decoders_apart(gpt32):
    from kmp.exporting import cached_step, greedy_loop
    from kmp.exporting.generation import served_form
    from kmp.exporting.generation_models import compiled_when_served

    # The decoding models' SavedModels serve their call compiled by XLA; the task does not.
    assert compiled_when_served(greedy_loop(gpt32)) and compiled_when_served(cached_step(gpt32, 8))
    assert not compiled_when_served(gpt32)

    assert served_form(["padding_mask", "token_ids"], ["padding_mask", "token_ids"]) == "loop"
    assert served_form(["index", "kv_cache", "token_ids"], ["kv_cache", "logits"]) == "step"
    assert served_form(["padding_mask", "token_ids"], ["output_0"]) == "task"
    assert served_form(["inputs"], ["output_0"]) == "task"
