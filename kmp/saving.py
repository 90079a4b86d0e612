"""Saving and loading the whole training state: :func:`save_model`, :func:`load_model`.

A checkpoint is one ``.keras`` archive: Keras's own entries (config, weights, the
compiled optimizer with every variable) plus kmp's :data:`kmp.training_state.ENTRY`
(the random-number generators' states, where training stood, and a manifest). It is
written atomically (:func:`kmp._files.atomic_write`).

Loading restores all of it on any model. Keras compiles a loaded model from its file
only when the class keeps Keras's own ``compile``; a class that overrides it (every
KerasHub task, many subclassed models) comes back with whatever its constructor
compiled, or uncompiled, and the saved optimizer's state is dropped with a warning.
:func:`load_model` compiles such a model itself, through the model's own ``compile``,
with the saved optimizer, loss and metrics, then loads the optimizer's variables. An
optimizer that still does not come back as saved (its class, or its step count) is an
error, never a silent replacement.

``load_model(path, policy=...)`` loads a model to serve in another precision (the
config's policies rewritten as :mod:`kmp.load_precision` decides, in a temporary copy,
loaded uncompiled). Layers ``kmp.keep_float32`` kept stay float32 on every load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import keras

from kmp import rank_weights as _rw
from kmp import training_state as _ts
from kmp._checks import check_bool
from kmp._files import atomic_write
from kmp.float32_layers import restore_kept
from kmp.load_precision import quantized_layers
from kmp.policy_load import load_in, policy_name
from kmp.scaling_optimizer import DistributedLossScaleOptimizer

# kmp's Keras classes are registered once this module is imported (Keras's loader needs
# them): the optimizer above, and the layers and kept marks through kmp.policy_load's
# import of kmp.layers. "import kmp.saving" is enough before keras.saving.load_model.
REGISTERED = (DistributedLossScaleOptimizer,)

__all__ = ["load_model", "read_state", "save_model"]

# Keras's warnings when it drops a saved optimizer (kmp acts on them instead).
_SKIPPED_COMPILE = "`compile()` was not called as part of model loading"
_SKIPPED_OPTIMIZER = "Skipping variable loading for optimizer"


def save_model(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    epoch: int = 0,
    step: int = 0,
    steps_per_epoch: int | None = None,
    data_seed: int | None = None,
    rank_seed_states: tuple | None = None,
    rank_weights: _rw.RankWeights | None = None,
    temp_prefix: str = ".tmp-",
    state: _ts.TrainingState | None = None,
) -> str:
    """Save ``model`` and its training state to a ``.keras`` file, atomically.

    Args:
        model: The model (compiled, so that its optimizer is saved too).
        path: The file; it must end with ``.keras``.
        epoch: Epochs completed (what ``fit(initial_epoch=...)`` resumes with).
        step: Batches of the next epoch done (0 at an epoch's end).
        steps_per_epoch: Batches per epoch of the ``fit`` it is saved from (checked on resume).
        data_seed: The shuffle seed of the data pipeline (e.g. ``kmp.data.load``'s),
            checked when resuming.
        rank_seed_states: Every rank's random-generator states, from
            :func:`kmp.training_state.gather_seed_states` called on all ranks
            (:class:`kmp.callbacks.AtomicCheckpoint` does); None saves this
            process's, which every rank then resumes with.
        rank_weights: Every rank's values of the non-trainable weights that differ
            between ranks (BatchNormalization's moving statistics under Horovod), from
            :func:`kmp.rank_weights.gather` called on all ranks (``AtomicCheckpoint``
            does); None saves this process's, as Keras does.
        temp_prefix: How the temporary file's name starts (checkpoint finders skip it).
        state: The state to record, captured earlier; None captures it from ``model``.

    Returns:
        ``path`` as a string.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: ``path`` does not end with ``.keras``.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"kmp.save_model needs a keras.Model; got {type(model).__name__}.")
    path = os.fspath(path)
    if not path.endswith(".keras"):
        raise ValueError(
            f"kmp.save_model({path!r}): the file must end with '.keras' (the whole training "
            "state); for the weights alone use model.save_weights('....weights.h5')."
        )
    if state is None:
        state = _ts.capture(
            model,
            epoch=epoch,
            step=step,
            steps_per_epoch=steps_per_epoch,
            data_seed=data_seed,
            rank_seed_states=rank_seed_states,
        )
    if rank_weights is not None:
        state = dataclasses.replace(state, rank_weights=rank_weights.paths)

    def write(tmp: str) -> None:
        model.save(tmp)
        with zipfile.ZipFile(tmp, "a") as archive:
            archive.writestr(_ts.ENTRY, state.to_json())
            if rank_weights is not None:
                archive.writestr(_rw.ENTRY, rank_weights.to_bytes())

    return atomic_write(path, write, temp_prefix=temp_prefix)


def read_state(path: str | os.PathLike) -> _ts.TrainingState | None:
    """Return the training state saved in a ``.keras`` file (None: a plain Keras file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not a ``.keras`` archive, or its state is unreadable.
    """
    with _archive(path) as archive:
        if _ts.ENTRY not in archive.namelist():
            return None
        return _ts.TrainingState.from_json(archive.read(_ts.ENTRY))


def _read_rank_weights(path: str) -> _rw.RankWeights:
    with _archive(path) as archive:
        return _rw.RankWeights.from_bytes(archive.read(_rw.ENTRY))


def _archive(path: str | os.PathLike) -> zipfile.ZipFile:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No saved model at {path!r}.")
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise ValueError(
            f"{path!r} is not a .keras archive ({exc}); kmp.load_model reads files written by "
            "model.save('....keras') or kmp.save_model."
        ) from exc


def _saved_config(path: str) -> dict:
    with _archive(path) as archive:
        return json.loads(archive.read("config.json"))


def _keras_skips_compile(model: keras.Model) -> bool:
    """Keras's rule: a class overriding ``compile`` but not ``compile_from_config`` is skipped."""
    cls = type(model)
    return cls.compile is not keras.Model.compile and (
        cls.compile_from_config is keras.Model.compile_from_config
    )


@contextlib.contextmanager
def _noting(*texts: str) -> Iterator[list[str]]:
    """Take the warnings that contain one of ``texts`` aside (yielded); others pass unchanged."""
    noted: list[str] = []
    with warnings.catch_warnings():
        shown = warnings.showwarning
        for text in texts:
            warnings.filterwarnings("always", message=f".*{re.escape(text)}")

        def show(message, category, filename, lineno, file=None, line=None):
            if any(text in str(message) for text in texts):
                noted.append(str(message))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield noted


def _compile_as_saved(
    model: keras.Model, path: str, compile_config: dict, quantized: bool = False
) -> None:
    """Compile ``model`` with its saved optimizer, loss and metrics, then load their state.

    A quantized model's saved optimizer state is the float model's, from before
    ``kmp.quantize`` changed its variables: it is left out with a warning, not an error.

    Raises:
        ValueError: The saved optimizer's variables still do not fit it (it had been
            built and stepped, so state would be lost).
    """
    config = keras.saving.deserialize_keras_object(compile_config)
    model.compile(**config)  # the model's own compile: a KerasHub task keeps its behaviour
    if model.built:
        model.optimizer.build(model.trainable_variables)
    with _noting(_SKIPPED_OPTIMIZER) as noted:
        model.load_weights(path)  # weights again, and now the optimizer's variables
    counts = [re.search(r"saved optimizer has (\d+) variables", text) for text in noted]
    # More than iterations and the learning rate: the optimizer was built and stepped.
    saved = max((int(found.group(1)) for found in counts if found is not None), default=0)
    if saved > 2 and quantized:
        warnings.warn(
            f"{path!r} holds a quantized model: its saved optimizer state ({saved} "
            "variables) is the float model's from before it was quantized and does not fit "
            f"the quantized variables; {type(model).__name__} is compiled with a fresh "
            f"{type(model.optimizer).__name__}.",
            UserWarning,
            stacklevel=4,
        )
    elif saved > 2:
        raise ValueError(
            f"{path!r}: the saved optimizer {_saved_optimizer_name(compile_config)} has "
            f"{saved} variables, but {type(model).__name__}.compile gave "
            f"{type(model.optimizer).__name__} with {len(model.optimizer.variables)}, so "
            "its state (moments, loss scale) cannot be restored. Load it with "
            "compile=False and compile it yourself."
        )


def _saved_optimizer_name(compile_config: dict | None) -> str | None:
    optimizer = (compile_config or {}).get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    return optimizer.get("registered_name") or optimizer.get("class_name")


def _check_optimizer(
    model: keras.Model, path: str, saved_name: str | None, state: Any, quantized: bool = False
) -> None:
    """Raise when the optimizer did not come back as it was saved (its step: not quantized)."""
    optimizer = getattr(model, "optimizer", None)
    if saved_name is None:
        return
    have = None if optimizer is None else keras.saving.get_registered_name(type(optimizer))
    if have != saved_name and (optimizer is None or type(optimizer).__name__ != saved_name):
        raise ValueError(
            f"{path!r} was saved with the optimizer {saved_name}, but the loaded "
            f"{type(model).__name__} came back with {have}. Load it with compile=False and "
            "compile it yourself, or report this model class to kmp."
        )
    if state is not None and state.iterations is not None and not quantized:
        now = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if now != state.iterations:
            raise ValueError(
                f"{path!r}: the optimizer was saved at step {state.iterations}, but the "
                f"loaded one is at step {now}: its state (moments, loss scale) was not "
                "restored. Load it with compile=False to get the weights alone."
            )


def _follow_world(model: keras.Model, state: Any) -> None:
    """Warn, and rescale a world-size-scaled learning rate, when the world size changed."""
    from kmp import distributed

    optimizer = getattr(model, "optimizer", None)
    scale_lr = bool(getattr(getattr(optimizer, "settings", None), "scale_lr", False))
    change = _ts.world_change(state.world_size, distributed.size(), scale_lr=scale_lr)
    if change is None:
        return
    if change.lr_factor is not None:
        optimizer.rescale_learning_rate(change.lr_factor)
    warnings.warn(change.note, UserWarning, stacklevel=3)


def load_model(
    path: str | os.PathLike,
    policy: str | keras.DTypePolicy | None = None,
    *,
    keep_pinned: bool = True,
    **kwargs: Any,
) -> keras.Model:
    """Load a ``.keras`` model with its whole training state, or to serve in a chosen precision.

    Works on any model: Sequential, Functional, subclassed (also classes that
    override ``compile``), KerasHub tasks, keras.applications. Restored: the
    weights; the optimizer as saved (class, settings, every variable); with a
    file written by :func:`save_model` (or :class:`kmp.callbacks.AtomicCheckpoint`)
    also the random-number generators' states, the non-trainable weights kept
    per rank (:mod:`kmp.rank_weights`), each rank its own, and the layers
    :func:`kmp.keep_float32` kept (float32 again, marked for ``kmp.audit``). kmp's
    layers and optimizer are registered with Keras first, so a fresh process needs
    nothing else.

    A checkpoint written by another number of processes loads with a warning
    that says what changes (:func:`kmp.training_state.world_change`); a
    learning rate scaled by the world size follows the new size.

    With ``policy``, every layer computes and stores its variables as that policy
    says, whatever policy it was saved with (:mod:`kmp.load_precision` decides),
    except the layers ``keep_float32`` kept and those their author pinned (saved in
    float32 in a model that trained in 16 bits, ``dtype="float32"``): they stay
    float32. Outputs that were float32 stay float32 (kmp's float32 head, added where
    needed). The saved weights are cast once, as they are loaded. The saved optimizer
    is not restored (its state, loss scale included, belongs to the precision it trained in): the
    model comes back uncompiled, or with what its constructor compiled (KerasHub
    tasks). docs/serving.md is the guide, with the measured differences between
    precisions.

    Args:
        path: A file written by :func:`save_model` or ``model.save("m.keras")``
            (a legacy ``.h5`` model is passed to Keras as it is).
        policy: None (each layer as saved, with its optimizer), or the policy to
            serve in: ``"float32"``, ``"bfloat16"``, ``"float16"``,
            ``"mixed_float16"``, ``"mixed_bfloat16"``, ``"auto"`` (what
            ``kmp.enable("auto")`` picks for this machine, see
            :func:`kmp.policy.choose_policy`) or a ``keras.DTypePolicy``. The global
            policy and ``KMP_POLICY`` are not read, nor changed.
        keep_pinned: With ``policy``: keep the kept and pinned layers in float32
            (the default); False gives them ``policy`` too (outputs still float32).
        **kwargs: Passed to ``keras.saving.load_model`` (e.g. ``compile=False``:
            the weights without the optimizer).

    Returns:
        The model.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TypeError: ``policy`` is neither a string nor a ``keras.DTypePolicy``;
            ``keep_pinned`` is not a bool.
        ValueError: Not a ``.keras`` archive; an unknown ``policy`` (the message lists
            the valid names), or one with ``compile=True`` or a legacy ``.h5`` file;
            or the saved optimizer or the random state could not be restored (the
            message says what to do).
    """
    path = os.fspath(path)

    check_bool("keep_pinned", keep_pinned)
    name = None if policy is None else policy_name(policy)
    if os.path.exists(path) and not path.endswith(".keras") and not zipfile.is_zipfile(path):
        if name is not None:
            raise ValueError(f"kmp.load_model({path!r}, policy=...) needs a .keras file.")
        return keras.saving.load_model(path, **kwargs)  # a legacy .h5 model: Keras's alone
    saved_config = _saved_config(path)
    compile_config = saved_config.get("compile_config") or None
    quantized = bool(quantized_layers(saved_config.get("config", {})))
    state = read_state(path)

    compiling = name is None and kwargs.get("compile", True) and compile_config is not None
    handled = (_SKIPPED_OPTIMIZER, _SKIPPED_COMPILE) if compiling else ()
    if name is not None:  # served: the saved optimizer is dropped on purpose
        handled = (_SKIPPED_OPTIMIZER,)
    with _noting(*handled) as noted:  # Keras's notes that it dropped the optimizer: acted on
        if name is None:
            model = keras.saving.load_model(path, **kwargs)
        else:
            kept = state.kept_float32 if state is not None else ()
            model = load_in(path, saved_config, name, kept, kwargs, keep_pinned)
    if compiling:
        dropped = any(_SKIPPED_OPTIMIZER in text for text in noted)
        if _keras_skips_compile(model) or dropped:
            _compile_as_saved(model, path, compile_config, quantized)
        _check_optimizer(model, path, _saved_optimizer_name(compile_config), state, quantized)
    if state is not None:
        from kmp import distributed

        _ts.restore_rng(model, state, rank=distributed.rank())
        if state.rank_weights:
            _rw.restore(model, _read_rank_weights(path), distributed.rank())
        if compiling:
            _follow_world(model, state)
            setattr(model, _ts.LOADED_STATE, state)  # AtomicCheckpoint resumes from it
        if name is None or keep_pinned:
            _restore_kept(model, path, state, policy=name)
    elif compiling and _ts.seed_states(model):
        warnings.warn(
            f"{path!r} holds no kmp training state (model.save wrote it, not kmp.save_model "
            f"or AtomicCheckpoint): the {len(_ts.seed_states(model))} random generator(s) of "
            "its Dropout-like layers start afresh, so training resumed from it will not match "
            "an uninterrupted run. Everything else (weights, optimizer) is restored.",
            UserWarning,
            stacklevel=2,
        )
    return model


def _restore_kept(model: keras.Model, path: str, state: Any, policy: str | None) -> None:
    """Keep the layers ``keep_float32`` kept in float32 again; warn about what could not be."""
    missing, low = restore_kept(model, state.kept_float32)
    if missing:
        warnings.warn(
            f"{path!r} records {len(missing)} layer(s) kept in float32 that the loaded "
            f"{type(model).__name__} does not have ({', '.join(missing[:5])}): they were not "
            "restored.",
            UserWarning,
            stacklevel=3,
        )
    if low and policy is not None:  # as saved, they had them too
        warnings.warn(
            f"Loaded in {policy!r}, {len(low)} layer(s) kept in float32 "
            f"({', '.join(low[:5])}) were built by their model with 16-bit variables: they "
            "compute in float32 from 16-bit weights. Load with a mixed policy (float32 "
            "variables) to keep their weights in float32 too.",
            UserWarning,
            stacklevel=3,
        )
