"""Catching a step that applies the gradients of a loss it never scaled.

A loss-scaling optimizer divides the gradients it is given by the loss scale. When the
step that computed them never called ``optimizer.scale_loss(loss)`` (a ``train_step``
written from keras.io's guide, a custom ``tf.GradientTape`` loop), every update is
divided by the scale (32,768 at first) and nothing trains, without a warning. kmp
refuses such a step instead, at trace time in a compiled step and on the first step
eagerly, with what to write.

kmp does not scale for the user: the gradients were taken by the user's tape before the
optimizer sees them, so the underflow loss scaling exists to prevent has already
happened, and applying them unscaled would silently drop that protection. The fix is one
line in the step (or ``loss_scale=None`` where no scaling is wanted).

The rule, :func:`judge`, is pure: a step may apply when ``scale_loss`` was called since
the optimizer last applied. Python runs once per trace, so in a ``tf.function`` or a
``jax.jit`` step both calls are seen while it is traced. When the loss was scaled in
another compiled function than the one applying (gradients computed in a
``tf.function``, applied eagerly), later steps cannot be seen from Python: such an
optimizer is trusted from then on. Each optimizer keeps its own :class:`ScaleGuard`, so
two optimizers in one step (a GAN's generator and discriminator) are judged each on its
own.

On JAX a stateless step must read the scale from the step's optimizer state (Keras's
trainer scales inside a ``keras.StatelessScope`` mapping the optimizer's variables);
read outside one, the scale is the value frozen when the step was traced, not the one
the optimizer moves (or, inside ``model.fit``, no value at all): :func:`stale_scale`
says so, and ``scale_loss`` refuses it while the step is traced.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ScaleGuard", "judge", "refusal", "stale_scale"]

# Reasons judge gives for refusing a step.
UNSCALED = "unscaled"
STALE_SCALE = "stale-scale"

_EAGER = "eager"


def judge(*, scaling: bool, pending: bool, trusted: bool) -> str | None:
    """Whether a step may apply its gradients: None, or why not (:data:`UNSCALED`).

    Args:
        scaling: The optimizer scales the loss (float16's dynamic or a static scale).
        pending: ``scale_loss`` was called since the optimizer last applied gradients.
        trusted: The loss was once scaled in another compiled function than the one that
            applied (later steps there are invisible to Python).
    """
    if not scaling or pending or trusted:
        return None
    return UNSCALED


def stale_scale(*, backend: str, dynamic: bool, traced: bool, in_state: bool) -> str | None:
    """Whether ``scale_loss`` would read a frozen scale: None, or :data:`STALE_SCALE`.

    Args:
        backend: The Keras backend.
        dynamic: The scale moves (a static one is a constant anyway).
        traced: The loss is a JAX tracer (a compiled step is being traced).
        in_state: A ``keras.StatelessScope`` in force holds the optimizer's scale.
    """
    if backend == "jax" and dynamic and traced and not in_state:
        return STALE_SCALE
    return None


def trace_context() -> Any:
    """Where the code now running is: a TensorFlow function's graph while one is traced, or eager.

    On other backends one context (JAX traces the loss and the update in one step).
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        return _EAGER
    import tensorflow as tf

    return tf.compat.v1.get_default_graph() if tf.inside_function() else _EAGER


class ScaleGuard:
    """One optimizer's record of ``scale_loss`` calls, judged at each ``apply``.

    Python state, read while a step runs (eagerly) or is traced; never saved.
    """

    def __init__(self) -> None:
        self.pending = False
        self.trusted = False
        self._scaled_in: Any = None

    def scaled(self) -> None:
        """Note a ``scale_loss`` call."""
        self.pending, self._scaled_in = True, trace_context()

    def applying(self, *, scaling: bool) -> str | None:
        """Judge the step now applying (:func:`judge`), start the next; why it is refused."""
        if self.pending and self._scaled_in is not trace_context():
            self.trusted = True  # scaled in another compiled function: later steps unseen
        reason = judge(scaling=scaling, pending=self.pending, trusted=self.trusted)
        self.pending = False
        return reason


def refusal(reason: str, name: str, scale: float) -> str:
    """The error text for a refused step: what went wrong and the lines that fix it.

    Args:
        reason: :data:`UNSCALED` or :data:`STALE_SCALE`.
        name: Names the optimizer (``"the loss-scaling optimizer around 'adam'"``).
        scale: The rule's first scale.
    """
    if reason == STALE_SCALE:
        return (
            f"{name[0].upper()}{name[1:]}: scale_loss() was called in a traced JAX step outside "
            "a keras.StatelessScope holding the optimizer's variables, so the loss scale it "
            "reads is the value frozen when the step was traced (inside model.fit, no value "
            "at all), not the one the optimizer moves. Scale the loss as Keras's trainer "
            "does, inside compute_loss_and_updates:\n"
            "    mapping = list(zip(self.optimizer.variables, optimizer_variables))\n"
            "    with keras.StatelessScope(state_mapping=mapping):\n"
            "        loss = self.optimizer.scale_loss(loss)"
        )
    return (
        f"{name[0].upper()}{name[1:]} was asked to apply gradients in a step that never "
        f"called its scale_loss(). It divides the gradients by the loss scale ({scale:g} at "
        "the start), so the gradients of an unscaled loss would be divided by it and "
        "nothing would train. Scale the loss before taking gradients, as Keras's own "
        "train_step does:\n"
        "    loss = self.compute_loss(x=x, y=y, y_pred=y_pred)\n"
        "    scaled = self.optimizer.scale_loss(loss)\n"
        "    grads = tape.gradient(scaled, self.trainable_variables)\n"
        "    self.optimizer.apply(grads, self.trainable_variables)\n"
        "(on JAX: differentiate the scaled loss in compute_loss_and_updates, scaled inside "
        "keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, "
        "optimizer_variables)))). Where no scaling is wanted (float32, bfloat16), wrap the "
        "optimizer with kmp.wrap_optimizer(..., loss_scale=None). docs/keras_conventions.md "
        "shows each pattern."
    )
