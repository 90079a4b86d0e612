"""BroadcastInitialState: every rank starts from the same weights and optimizer state."""

from __future__ import annotations

from typing import Any

import keras

from kmp import distributed
from kmp._checks import check_int
from kmp.callbacks._ranks import model_optimizer, world_size
from kmp.callbacks.resume import warn_unclaimed
from kmp.distributed.collectives import unique_variables
from kmp.rank_weights import rank_local

__all__ = ["BroadcastInitialState"]


class BroadcastInitialState(keras.callbacks.Callback):
    """Copy the model's weights and optimizer state from ``root`` to all ranks.

    Runs at the start of every ``fit``: ranks that built their models from
    different random seeds, or where only the chief restored a checkpoint,
    start the first step identical. The optimizer's variables are built first
    when Keras has not built them yet (Keras 3 creates them lazily), so that
    slots such as Adam's moments, the iteration count and the loss scale are
    broadcast as well. In a single process it only builds the optimizer.

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
