"""The benchmark models and their synthetic batches, shared by the bench scripts.

``digits_cnn`` and ``resnet50`` are the models of ``launch/train.py`` (built by
its own ``build_model``, so the benchmarks time what the reference script
trains: the digits CNN on 8x8 grey images, ``keras.applications.ResNet50(weights=None)``
at a chosen image size), ``cnn`` is the small 6-convolution CNN of
``STACK.md`` (32x32 RGB), ``mlp`` two 1024-wide dense layers on flattened
28x28 images and ``wide_mlp`` three 2048-wide ones (10.5 M weights, 42 MB of
float32 gradients per step: communication-bound on a 1 Gbit/s link). Every
model is returned with :func:`kmp.float32_outputs` applied, built under the
global dtype policy in force when :func:`build` is called (call ``kmp.enable(...)``
first).

``KMP_BENCH_IMAGE_SIZE`` in the environment sets the image size of every model
whose size is not passed explicitly; ``kmp bench --image-size`` uses it to reach
every benchmark script (and every Horovod rank) it starts.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

MODELS = ("digits_cnn", "cnn", "mlp", "wide_mlp", "resnet50")
# Token models (language models, inputs int32 token ids, targets the next token):
# name -> (sequence length, vocabulary, width, depth). ``gpt`` is launch/train.py's byte-level
# GPT; ``embed_lm`` the same transformer, one block, over a 16,384-token vocabulary, so an
# Embedding (and the logits' Dense) of 8 MB each dominates its gradients.
TOKEN_MODELS = {"gpt": (64, 256, 128, 2), "embed_lm": (16, 16384, 128, 1)}
DEFAULT_IMAGE_SIZE = {"digits_cnn": 8, "cnn": 32, "mlp": 28, "wide_mlp": 28, "resnet50": 64}
CHANNELS = {"digits_cnn": 1, "cnn": 3, "mlp": 1, "wide_mlp": 1, "resnet50": 3}
# Smallest side each model accepts (its pooling must leave at least one pixel).
MIN_IMAGE_SIZE = {"digits_cnn": 2, "cnn": 8, "mlp": 1, "wide_mlp": 1, "resnet50": 32}
IMAGE_SIZE_ENV = "KMP_BENCH_IMAGE_SIZE"
TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "train.py"


@functools.cache
def _train_script() -> ModuleType:
    """Import ``launch/train.py`` (a script, not a package module) for its ``build_model``.

    Loaded once per process: the benchmarks build a model per policy and round.
    """
    spec = importlib.util.spec_from_file_location("kmp_launch_train", TRAIN_SCRIPT)
    if spec is None or spec.loader is None or not TRAIN_SCRIPT.is_file():
        raise FileNotFoundError(
            f"{TRAIN_SCRIPT} is missing: the digits_cnn and resnet50 benchmark models are the "
            "ones of launch/train.py; run the benchmarks from a full kmp checkout."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def image_side(name: str, image_size: int | None = None) -> int:
    """Return the side of model ``name``'s square images, in pixels.

    Args:
        name: One of :data:`MODELS`.
        image_size: Side of the square images (default: ``$KMP_BENCH_IMAGE_SIZE``, else
            the model's own size).

    Raises:
        ValueError: Unknown model, or an image size the model cannot take.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown benchmark model {name!r}: use one of {', '.join(MODELS)}.")
    if image_size is None and os.environ.get(IMAGE_SIZE_ENV):
        try:
            image_size = int(os.environ[IMAGE_SIZE_ENV])
        except ValueError:
            raise ValueError(
                f"{IMAGE_SIZE_ENV}={os.environ[IMAGE_SIZE_ENV]!r} is not an integer: set it "
                "to the side of the images in pixels, or unset it."
            ) from None
    size = DEFAULT_IMAGE_SIZE[name] if image_size is None else int(image_size)
    if size < MIN_IMAGE_SIZE[name]:
        raise ValueError(
            f"{name} needs images of at least {MIN_IMAGE_SIZE[name]}x{MIN_IMAGE_SIZE[name]}, "
            f"got {size}x{size}: pass a larger --image-size."
        )
    return size


def input_shape(name: str, image_size: int | None = None) -> tuple[int, ...]:
    """Return the input shape of model ``name``.

    ``(height, width, channels)``, or ``(height * width,)`` for the ``mlp``,
    which takes flattened images.

    Args:
        name: One of :data:`MODELS`.
        image_size: Side of the square images (as in :func:`image_side`).

    Raises:
        ValueError: Unknown model, or an image size the model cannot take.
    """
    size = image_side(name, image_size)
    if name in ("mlp", "wide_mlp"):
        return (size * size,)
    return (size, size, CHANNELS[name])


def build(name: str, image_size: int | None = None, num_classes: int = 10):
    """Return the uncompiled model ``name`` with float32 outputs.

    Token models end in a softmax (probabilities, as the image models'), so every
    peer of ``peer_worker.py`` trains them with the same loss.

    Args:
        name: One of :data:`MODELS` or :data:`TOKEN_MODELS`.
        image_size: Side of the square input images (default as in :func:`input_shape`).
        num_classes: Number of output classes.
    """
    import keras

    import kmp

    if name in TOKEN_MODELS:
        seq_len, vocab, width, depth = TOKEN_MODELS[name]
        workloads = _train_script().workloads
        model = workloads.build_gpt(seq_len=seq_len, vocab_size=vocab, width=width, depth=depth)
        probs = keras.layers.Activation("softmax", name="probs")(model.output)
        return kmp.float32_outputs(keras.Model(model.input, probs, name=name))
    shape = input_shape(name, image_size)
    if name in ("digits_cnn", "resnet50"):
        model = _train_script().build_model(name, shape, num_classes, "float32")
    elif name == "cnn":
        inputs = keras.Input(shape=shape, name="images")
        x = inputs
        for filters in (32, 64, 128):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
            x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(x)
        model = keras.Model(inputs, outputs, name="cnn")
    else:
        width, depth = (2048, 3) if name == "wide_mlp" else (1024, 2)
        inputs = keras.Input(shape=shape, name="images")
        x = inputs
        for _ in range(depth):
            x = keras.layers.Dense(width, activation="relu")(x)
        outputs = keras.layers.Dense(num_classes, activation="softmax", name="probs")(x)
        model = keras.Model(inputs, outputs, name=name)
    return kmp.float32_outputs(model)


def batch(
    name: str, batch_size: int, image_size: int | None = None, num_classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Return one synthetic ``(images, labels)`` batch for model ``name``.

    For a token model, ``(tokens, next tokens)``: ``[batch_size, seq_len]`` int32 each.

    Args:
        name: One of :data:`MODELS` or :data:`TOKEN_MODELS`.
        batch_size: Number of examples.
        image_size: Side of the square images (default as in :func:`input_shape`).
        num_classes: Labels are drawn from ``0 .. num_classes - 1``.
        seed: Seed of the random generator.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    rng = np.random.default_rng(seed)
    if name in TOKEN_MODELS:
        seq_len, vocab, *_ = TOKEN_MODELS[name]
        tokens = rng.integers(0, vocab, (batch_size, seq_len + 1)).astype("int32")
        return tokens[:, :-1], tokens[:, 1:]
    x = rng.random((batch_size, *input_shape(name, image_size)), dtype=np.float32)
    return x, rng.integers(0, num_classes, batch_size).astype("int32")


def compiled(name: str, policy: str, batch_size: int, warmup: int = 2):
    """``kmp.enable(policy)``, model ``name`` compiled with kmp's wrapped SGD, a batch, warmed up.

    The set-up the timing benchmarks share: ``warmup`` steps trace, build and warm the
    model before anything is measured. The float16-on-CPU warning is silenced (measuring
    that policy is the point).

    Returns:
        ``(model, x, y, choice)``, ``choice`` being what :func:`kmp.enable` returned.
    """
    import warnings

    import keras

    import kmp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice = kmp.enable(policy)
    model = build(name)
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.01)),
        loss="sparse_categorical_crossentropy",
    )
    x, y = batch(name, batch_size)
    for _ in range(warmup):
        model.train_on_batch(x, y)
    return model, x, y, choice
