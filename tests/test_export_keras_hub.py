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
