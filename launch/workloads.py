"""The real workloads of ``launch/train.py`` with published references: models and metrics.

``train.py`` loads this file beside it for these models:

* ``gpt``: a small causal transformer language model in plain Keras layers, over bytes
  (vocabulary 256). Token embedding plus a learned position embedding, ``depth`` pre-norm
  blocks (LayerNorm -> ``MultiHeadAttention`` called with ``use_causal_mask=True`` ->
  residual; LayerNorm -> Dense ``4 * width``, GELU -> Dense ``width`` -> residual), a final
  LayerNorm and an **untied** Dense head that gives the logits (untied: a plain functional
  model that ``kmp.float32_outputs`` can rebuild, and no shared matrix whose gradient would
  be half sparse, half dense). Defaults (:data:`GPT_CONFIG`): 2 blocks, width 128, 4 heads,
  sequence 128 bytes, dropout 0: about 0.47 M parameters.
* ``gpt2-hub``: KerasHub's ``GPT2CausalLM`` with a tiny ``GPT2Backbone`` built from code
  (the same sizes, vocabulary 256 for bytes, ``preprocessor=None``); it takes
  ``{"token_ids", "padding_mask"}``. Needs ``pip install keras-hub``.
* ``mnist1d_cnn``: the CNN of Greydanus's MNIST-1D paper (``ConvBase`` in the mnist1d
  repository's ``models.py``): three Conv1D layers of 25 channels, kernels 5, 3, 3, stride 2,
  padding 1 (a ``ZeroPadding1D(1)`` before each ``valid`` convolution), ReLU, then
  flatten (5 x 25 = 125) and a Dense layer to the 10 classes. The paper trains it with Adam
  at 1e-2, batch 100, no weight decay, constant rate (6,000 steps in the 2020 code,
  8,000 in the 2024 code) and reports 94 % test accuracy.
* ``mnist1d_gru``: the paper's recurrent baseline (``GRUBase``): a bidirectional GRU of 6
  units a direction over the 40 steps of the signal, every step's output flattened
  (40 x 12 = 480) into a Dense layer to the 10 classes; trained like the CNN. Its
  recurrent gradients are small: the workload where float16 underflow shows first.

The language models are built under the global dtype policy (16-bit compute under a mixed
policy); ``train.py`` then applies ``kmp.float32_outputs``. They output logits, so their
loss is ``SparseCategoricalCrossentropy(from_logits=True)``: the mean negative
log-likelihood in nats per byte. :func:`lm_metrics` measures it on the whole validation
split, over all ranks, and its bits per byte (``nats / ln 2``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

LM_MODELS = ("gpt", "gpt2-hub")
MNIST1D_MODELS = ("mnist1d_cnn", "mnist1d_gru")
MODELS = (*LM_MODELS, *MNIST1D_MODELS)
GPT_CONFIG = {"seq_len": 64, "width": 128, "depth": 2, "heads": 4, "dropout": 0.0}


@functools.cache
def position_embedding_class() -> type:
    """Return (defined and registered once) the ``PositionEmbedding`` layer class."""
    import keras

    @keras.saving.register_keras_serializable(package="kmp_launch")
    class PositionEmbedding(keras.layers.Layer):
        """Add a learned embedding of positions ``0..length-1`` to ``[batch, length, width]``."""

        def __init__(self, length: int, **kwargs):
            super().__init__(**kwargs)
            self.length = length

        def build(self, input_shape):
            self.positions = self.add_weight(
                shape=(self.length, input_shape[-1]),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
                name="positions",
            )

        def call(self, x):
            n = keras.ops.shape(x)[1]
            return x + keras.ops.cast(self.positions[:n], x.dtype)

        def get_config(self):
            return {**super().get_config(), "length": self.length}

    return PositionEmbedding


def build_gpt(
    seq_len: int = GPT_CONFIG["seq_len"],
    vocab_size: int = 256,
    width: int = GPT_CONFIG["width"],
    depth: int = GPT_CONFIG["depth"],
    heads: int = GPT_CONFIG["heads"],
    dropout: float = GPT_CONFIG["dropout"],
) -> Any:
    """Return the causal transformer LM (logits ``[batch, seq_len, vocab_size]``)."""
    import keras

    if width % heads:
        raise ValueError(f"width {width} must be a multiple of heads {heads}.")
    tokens = keras.Input(shape=(seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, width, name="token_embedding")(tokens)
    x = position_embedding_class()(seq_len, name="position_embedding")(x)
    for i in range(depth):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(
            heads, width // heads, dropout=dropout, name=f"block{i}_attention"
        )(h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"block{i}_add1")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(4 * width, activation="gelu", name=f"block{i}_mlp_in")(h)
        h = keras.layers.Dense(width, name=f"block{i}_mlp_out")(h)
        if dropout:
            h = keras.layers.Dropout(dropout, name=f"block{i}_dropout")(h)
        x = keras.layers.Add(name=f"block{i}_add2")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = keras.layers.Dense(vocab_size, name="logits")(x)
    return keras.Model(tokens, logits, name="gpt")


def build_gpt2_hub(seq_len: int = GPT_CONFIG["seq_len"], vocab_size: int = 256) -> Any:
    """Return KerasHub's ``GPT2CausalLM`` with a tiny byte-level backbone (no preprocessor).

    Raises:
        SystemExit: keras-hub is not installed (the message says how to install it).
    """
    try:
        import keras_hub
    except ImportError:
        raise SystemExit(
            "--model gpt2-hub needs KerasHub: pip install keras-hub (or use --model gpt, "
            "the same kind of model in plain Keras layers)."
        ) from None
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab_size,
        num_layers=GPT_CONFIG["depth"],
        num_heads=GPT_CONFIG["heads"],
        hidden_dim=GPT_CONFIG["width"],
        intermediate_dim=4 * GPT_CONFIG["width"],
        dropout=GPT_CONFIG["dropout"],
        max_sequence_length=seq_len,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def build_mnist1d_cnn(input_shape: tuple, num_classes: int, input_dtype: str) -> Any:
    """Return the MNIST-1D paper's CNN (softmax head: ``train.py``'s classification loss)."""
    import keras

    inputs = keras.Input(shape=input_shape, dtype=input_dtype, name="signals")
    x = keras.layers.Reshape((input_shape[0], 1))(inputs)
    for i, kernel in enumerate((5, 3, 3)):
        x = keras.layers.ZeroPadding1D(1)(x)
        x = keras.layers.Conv1D(25, kernel, strides=2, activation="relu", name=f"conv{i + 1}")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(x)
    return keras.Model(inputs, outputs, name="mnist1d_cnn")


def build_mnist1d_gru(input_shape: tuple, num_classes: int, input_dtype: str) -> Any:
    """Return the MNIST-1D paper's bidirectional GRU (softmax head, as the CNN's)."""
    import keras

    inputs = keras.Input(shape=input_shape, dtype=input_dtype, name="signals")
    x = keras.layers.Reshape((input_shape[0], 1))(inputs)
    gru = keras.layers.GRU(6, return_sequences=True, name="gru")
    x = keras.layers.Bidirectional(gru, name="bigru")(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(x)
    return keras.Model(inputs, outputs, name="mnist1d_gru")


def build(name: str, input_shape: tuple, num_classes: int, input_dtype: str) -> Any:
    """Build one of :data:`MODELS` (language models take int32 bytes whatever ``input_dtype``)."""
    if name == "gpt":
        return build_gpt(seq_len=input_shape[0], vocab_size=num_classes)
    if name == "gpt2-hub":
        return build_gpt2_hub(seq_len=input_shape[0], vocab_size=num_classes)
    if name == "mnist1d_cnn":
        return build_mnist1d_cnn(input_shape, num_classes, input_dtype)
    if name == "mnist1d_gru":
        return build_mnist1d_gru(input_shape, num_classes, input_dtype)
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def compile_args(name: str, elastic: bool = False) -> dict:
    """The loss and metrics ``model.compile`` gets for model ``name``."""
    import keras

    if name in LM_MODELS:
        return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    # Elastic batches may end in empty slots of weight 0: weighted metrics skip them.
    key = "weighted_metrics" if elastic else "metrics"
    return {"loss": "sparse_categorical_crossentropy", key: ["accuracy"]}


def model_inputs(name: str, dataset):
    """Map ``dataset``'s ``(tokens, targets)`` to what model ``name`` takes."""
    if name != "gpt2-hub":
        return dataset
    import tensorflow as tf

    def to_dict(tokens, *rest):
        return ({"token_ids": tokens, "padding_mask": tf.ones_like(tokens, tf.bool)}, *rest)

    return dataset.map(to_dict)


@functools.cache
def evaluate_every_class() -> type:
    """Return the ``EvaluateEvery`` Keras callback class (Keras imported on first use)."""
    import keras

    class EvaluateEvery(keras.callbacks.Callback):
        """Call ``evaluate()`` every ``every`` epochs and keep its figures in :attr:`points`.

        ``evaluate`` may be collective (every rank calls it at the same epoch end). The
        figures are kept here, not in the epoch's logs, so that the metric averaging and
        the history of ``fit`` stay as they are. ``every=0`` records nothing.
        """

        def __init__(self, evaluate, every: int, steps_per_epoch: int):
            super().__init__()
            self.evaluate, self.every, self.steps_per_epoch = evaluate, every, steps_per_epoch
            self.points: list[dict] = []

        def on_epoch_end(self, epoch, logs=None):
            if self.every and (epoch + 1) % self.every == 0:
                step = (epoch + 1) * self.steps_per_epoch
                self.points.append({"epoch": epoch + 1, "step": step, **self.evaluate()})

    return EvaluateEvery


def evaluate_every(evaluate, every: int, steps_per_epoch: int):
    """Build an ``EvaluateEvery`` callback (see :func:`evaluate_every_class`)."""
    return evaluate_every_class()(evaluate, every, steps_per_epoch)


def lm_metrics(model, name: str, dataset, kmp) -> dict:
    """Validation loss (nats per byte, bits per byte) over every rank's part of ``dataset``.

    ``dataset`` yields this rank's ``(tokens, targets)`` batches; the summed negative
    log-likelihoods and byte counts of all ranks are added up with one allreduce.
    """
    import keras
    import numpy as np

    # Compiled (predict_on_batch: about 3x faster than calling the model op by op), except
    # under a Keras distribution (the JAX engine), where predicting is collective and each
    # rank's shard may hold another number of batches.
    compiled = keras.distribution.distribution() is None
    total = count = 0.0
    for tokens, targets in model_inputs(name, dataset):
        tokens = keras.tree.map_structure(np.asarray, tokens)  # the JAX backend takes no tf.Tensor
        out = model.predict_on_batch(tokens) if compiled else model(tokens, training=False)
        logits = keras.ops.cast(out, "float32")
        nll = keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
        total += float(np.sum(np.asarray(nll, np.float64)))
        count += float(np.prod(targets.shape))
    sums = kmp.distributed.allreduce(np.array([total, count], dtype=np.float64), op="sum")
    total, count = (float(v) for v in np.asarray(sums))
    nats = total / count
    return {"val_loss_nats": nats, "val_bits_per_byte": nats / math.log(2), "val_bytes": count}
