"""BroadcastInitialState: every rank starts from the same weights and optimizer state."""

from __future__ import annotations

import warnings
from typing import Any

import keras

from kmp import distributed
from kmp._checks import check_int
from kmp.callbacks._ranks import model_optimizer, world_size
from kmp.callbacks.resume import warn_unclaimed
from kmp.distributed.collectives import gradients_need_allreduce, unique_variables
from kmp.rank_weights import rank_local
from kmp.scaling_optimizer import DistributedLossScaleOptimizer

__all__ = ["BroadcastInitialState", "check_horovod_fit"]


class BroadcastInitialState(keras.callbacks.Callback):
    """Copy the model's weights and optimizer state from ``root`` to all ranks.

    Runs at the start of every ``fit``: ranks that built their models from
    different random seeds, or where only the chief restored a checkpoint,
    start the first step identical. The optimizer's variables are built first
    when Keras has not built them yet (Keras 3 creates them lazily), so that
    slots such as Adam's moments, the iteration count and the loss scale are
    broadcast as well. In a single process it only builds the optimizer.

    On several Horovod ranks it also checks the fit it starts (:func:`check_horovod_fit`):
    an optimizer that does not average the gradients is refused, and a train step
    compiled with XLA (``jit_compile=True``, or Keras's ``"auto"`` on a GPU) is compiled
    again without it, with a warning.

    Args:
        root: Rank whose state is copied to the others.

    Raises:
        TypeError: ``root`` is not an int.
        ValueError: ``root`` is negative.
    """

    def __init__(self, root: int = 0):
        super().__init__()
        self.root = check_int(
            "BroadcastInitialState(root)",
            root,
            minimum=0,
            hint="Pass the rank whose state every rank starts from, e.g. root=0.",
        )

    def state_variables(self) -> list[keras.Variable]:
        """Return the variables broadcast: the model's weights, then the optimizer's.

        Builds the optimizer on the model's trainable variables if needed. Weights
        that a checkpoint restored per rank (:func:`kmp.rank_weights.rank_local`:
        BatchNormalization's moving statistics under Horovod) keep each rank's value.
        """
        model = self.model
        optimizer = model_optimizer(self, "BroadcastInitialState")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        local = rank_local(model)
        weights = [w for w in model.weights if w.path not in local]
        return unique_variables([*weights, *optimizer.variables])

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Broadcast the state from ``root``."""
        variables = self.state_variables()
        size = world_size()
        if size == 1:
            return
        check_horovod_fit(self.model)
        if self.root >= size:
            raise ValueError(
                f"BroadcastInitialState(root={self.root}) but only {size} ranks run: "
                f"use a root between 0 and {size - 1}."
            )
        distributed.broadcast_variables(variables, root=self.root)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Warn if the model holds a position inside an epoch that nothing resumes."""
        warn_unclaimed(self.model)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {"root": self.root}


def check_horovod_fit(model: keras.Model) -> None:
    """Refuse a multi-rank Horovod ``fit`` whose ranks would drift apart; keep XLA off its step.

    Only kmp's optimizer averages the gradients over Horovod ranks: with any other (a plain
    Keras optimizer, which ``compile(auto_scale_loss=True)`` wraps in Keras's own
    ``LossScaleOptimizer``) each rank trains on its own data alone and the ranks diverge
    while the averaged logs hide it. Horovod's collectives have no XLA kernels, so a train
    step compiled with XLA cannot hold the optimizer's allreduce: it is compiled again
    without XLA (what :func:`kmp.xla.step_jit_compile` gives on TensorFlow), with a
    warning naming :func:`kmp.xla.jit_gradients` for XLA on the forward and backward pass.
    Nothing to check on the JAX engine, which averages in its own step.

    Raises:
        TypeError: The model's optimizer is not kmp's.
    """
    if not gradients_need_allreduce():
        return
    optimizer = model.optimizer
    if not isinstance(optimizer, DistributedLossScaleOptimizer):
        raise TypeError(
            f"model.fit on {distributed.size()} Horovod ranks with a "
            f"{type(optimizer).__name__}, which does not average the gradients over the ranks: "
            "each rank would train alone on its shard and the ranks would drift apart "
            "(the averaged logs would hide it). Compile with kmp's optimizer: "
            "model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(...)), ...)."
        )
    if getattr(model, "jit_compile", False):
        warnings.warn(
            "model.compile(jit_compile=True) (Keras's 'auto' is True on a GPU): Horovod's "
            "allreduce has no XLA kernels, so kmp compiles the train step again without XLA "
            "(kmp.xla.step_jit_compile() gives False on TensorFlow; pass it to compile to "
            "silence this). For XLA on the forward and backward pass, use "
            "kmp.xla.jit_gradients(model).",
            UserWarning,
            stacklevel=2,
        )
        model.jit_compile = False
        model.make_train_function(force=True)
