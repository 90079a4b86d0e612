"""Tiny models people train, built from code (no weights, no downloads), for the zoo tests.

KerasHub task models (when keras-hub is installed) and keras.applications models, each
with a batch of inputs and targets that its default loss accepts.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np

SEQ = 16
VOCAB = 256
BATCH = 4


def _tokens(rng: np.random.Generator, batch: int = BATCH) -> np.ndarray:
    return rng.integers(0, VOCAB, size=(batch, SEQ)).astype("int32")


def gpt2_causal_lm():
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gemma_causal_lm():
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=16,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def lm_batch(rng: np.random.Generator, batch: int = BATCH) -> tuple[dict, np.ndarray]:
    """Token ids and next-token targets for a causal LM without a preprocessor."""
    ids = _tokens(rng, batch + 1)
    x = {"token_ids": ids[:batch], "padding_mask": np.ones((batch, SEQ), "int32")}
    return x, np.roll(ids[:batch], -1, axis=1)


def bert_text_classifier():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def bert_batch(rng: np.random.Generator, batch: int = BATCH) -> tuple[dict, np.ndarray]:
    x = {
        "token_ids": _tokens(rng, batch),
        "segment_ids": np.zeros((batch, SEQ), "int32"),
        "padding_mask": np.ones((batch, SEQ), "int32"),
    }
    return x, rng.integers(0, 3, size=(batch,)).astype("int32")


def resnet_image_classifier():
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        image_shape=(32, 32, 3),
    )
    return keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=10)


def image_batch(rng: np.random.Generator, batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    x = rng.uniform(0, 255, size=(batch, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 10, size=(batch,)).astype("int32")


def application(name: str) -> Callable[[], keras.Model]:
    """A keras.applications model, weights=None, 32x32 RGB, 10 classes."""

    def build() -> keras.Model:
        return getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10)

    return build


# name -> (builder, batch maker, needs keras-hub, loss for compile)
HUB = {
    "GPT2CausalLM": (gpt2_causal_lm, lm_batch),
    "GemmaCausalLM": (gemma_causal_lm, lm_batch),
    "BertTextClassifier": (bert_text_classifier, bert_batch),
    "ResNetImageClassifier": (resnet_image_classifier, image_batch),
}
APPLICATIONS = {
    name: (application(name), image_batch)
    for name in ("ResNet50", "MobileNetV3Small", "ConvNeXtTiny")
}
