"""``kmp.wrap_optimizer``: loss scaling and Horovod gradient averaging in one fixed order.

One training step with a wrapped optimizer, on every rank::

    loss -> scale_loss (float16 only) -> gradients -> [accumulate N micro-batches]
         -> ONE grouped allreduce of the still-scaled gradients (optionally fp16/bf16)
         -> unscale -> finite check (the same answer on every rank)
         -> apply, or skip the step and halve the scale (every rank alike)

Because gradients are averaged before they are checked, an overflow on any rank
makes every rank skip the same step and lower its scale the same way, so the
ranks never drift apart.

The wrapped optimizer is a :class:`keras.optimizers.LossScaleOptimizer`, so
``model.compile(auto_scale_loss=True)`` under ``mixed_float16`` does not wrap it
a second time. It works in ``model.fit`` and in a custom loop::

    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3))
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled = opt.scale_loss(loss)          # identity when not scaling
    grads = tape.gradient(scaled, model.trainable_variables)
    opt.apply(grads, model.trainable_variables)  # allreduce, unscale, check, apply

Multi-process averaging needs the TensorFlow backend (Horovod's collectives are
TensorFlow ops) and ``jit_compile=False`` (this Horovod build has no XLA
kernels). On the JAX and PyTorch backends a single process gets the loss scaling.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import keras
from keras import ops

from kmp import distributed

__all__ = [
    "LOSS_SCALE_MODES",
    "DistributedLossScaleOptimizer",
    "ScaledLearningRate",
    "wrap_optimizer",
]

# String values accepted for ``loss_scale``.
LOSS_SCALE_MODES = ("dynamic", "force_dynamic")

_DEFAULTS: dict[str, Any] = {
    "loss_scale": "dynamic",
    "initial_scale": 2.0**15,
    "growth_interval": 2000,
    "compression": None,
    "backward_passes_per_step": 1,
    "scale_lr": False,
}


@keras.saving.register_keras_serializable(package="kmp")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant (``scale_lr`` on a schedule).

    Args:
        schedule: The wrapped schedule.
        factor: The multiplier, e.g. the number of ranks.
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, factor: float):
        self.schedule = schedule
        self.factor = float(factor)

    def __call__(self, step: Any) -> Any:
        """Return the scaled learning rate at ``step``."""
        return ops.multiply(self.schedule(step), self.factor)

    def get_config(self) -> dict:
        """Return the serializable config."""
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "factor": self.factor,
        }

    @classmethod
    def from_config(cls, config: dict) -> ScaledLearningRate:
        """Rebuild from :meth:`get_config` output."""
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="kmp")
class DistributedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Loss scaling plus one grouped Horovod allreduce per step, around an inner optimizer.

    Build it with :func:`wrap_optimizer`, which validates the arguments and scales
    the learning rate; the constructor takes them as they are.

    Args:
        inner_optimizer: The Keras optimizer that updates the weights.
        loss_scale: ``"dynamic"`` (dynamic scaling when the global policy computes in
            float16, none otherwise; decided on first use), ``"force_dynamic"``
            (dynamic scaling whatever the policy), a positive number (static
            scale) or None (no scaling).
        initial_scale: Starting value of a dynamic scale.
        growth_interval: A dynamic scale doubles after this many finite steps.
        compression: None, ``"fp16"`` or ``"bf16"``.
        backward_passes_per_step: Micro-batches accumulated locally per update.
        scale_lr: Whether :func:`wrap_optimizer` scaled the learning rate.
        lr_scale: The factor it scaled it by (kept for the config).
        resolved_mode: ``"dynamic"``, ``"static"`` or ``"none"`` once decided
            (restored from a saved config).
        name: Optimizer name.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        loss_scale: str | float | None = "dynamic",
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        compression: str | None = None,
        backward_passes_per_step: int = 1,
        scale_lr: bool = False,
        lr_scale: float = 1.0,
        resolved_mode: str | None = None,
        name: str | None = None,
    ):
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(growth_interval),
            name=name,
        )
        self.loss_scale_arg = loss_scale
        self.compression = distributed.normalize_compression(compression)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.scale_lr = bool(scale_lr)
        self.lr_scale = float(lr_scale)
        self._mode = resolved_mode
        self._payload_bytes = 0
        self._own_index: dict[int, int] = {}

    # ------------------------------------------------------------------ settings

    @property
    def loss_scale_mode(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"none"`` (decided on first use)."""
        if self._mode is None:
            arg = self.loss_scale_arg
            if arg == "dynamic":
                compute = keras.config.dtype_policy().compute_dtype
                self._mode = "dynamic" if compute == "float16" else "none"
            elif arg == "force_dynamic":
                self._mode = "dynamic"
            elif arg is None:
                self._mode = "none"
            else:
                self._mode = "static"
        return self._mode

    def _start_scale(self) -> float:
        mode = self.loss_scale_mode
        if mode == "static":
            return float(self.loss_scale_arg)
        return self.initial_scale if mode == "dynamic" else 1.0

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when not scaling)."""
        if not self.built:
            return self._start_scale()
        return float(self._read(self.dynamic_scale))

    @property
    def skipped_steps(self) -> int:
        """How many updates were skipped because the gradients were not finite."""
        if not self.built:
            return 0
        return int(self._read(self.skipped_steps_counter))

    @staticmethod
    def _read(variable: keras.Variable) -> Any:
        try:
            return ops.convert_to_numpy(variable)
        except TypeError as exc:  # JAX mid-epoch: the state lives in the train step.
            raise RuntimeError(
                "The optimizer state is not attached to its variables right now (JAX, in the "
                "middle of model.fit). Read it in a callback through self.model.optimizer, "
                "which syncs the state, or after fit() returns."
            ) from exc

    @property
    def allreduce_bytes_per_step(self) -> int:
        """Bytes this rank hands to the allreduce per update (0 in a single process)."""
        return self._payload_bytes

    def settings(self) -> dict[str, Any]:
        """Return the :func:`wrap_optimizer` arguments this optimizer was made with."""
        return {
            "loss_scale": self.loss_scale_arg,
            "initial_scale": self.initial_scale,
            "growth_interval": self.dynamic_growth_steps,
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "scale_lr": self.scale_lr,
        }

    # --------------------------------------------------------------------- build

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def build(self, var_list: list) -> None:
        """Create the loss-scale state, the accumulators and the inner optimizer's variables."""
        start = self._start_scale()
        self.step_counter = self.add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="none", name="step_counter"
        )
        self.dynamic_scale = self.add_variable(
            shape=(),
            dtype="float32",
            initializer=keras.initializers.Constant(start),
            aggregation="none",
            name="dynamic_scale",
        )
        self.skipped_steps_counter = self.add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="none", name="skipped_steps"
        )
        self._accumulators: list = []
        if self.backward_passes_per_step > 1:
            self._micro_step = self.add_variable(
                shape=(), dtype="int", initializer="zeros", aggregation="none", name="micro_step"
            )
            self._window_bad = self.add_variable(
                shape=(), dtype="int", initializer="zeros", aggregation="none", name="window_bad"
            )
            self._accumulators = [
                self.add_variable_from_reference(v, name="grad_accumulator") for v in var_list
            ]
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        # Skip LossScaleOptimizer.build (it would create its variables again).
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        self._own_index = {id(v): i for i, v in enumerate(self._variables)}

    # --------------------------------------------------------------------- scale

    def scale_loss(self, loss: Any) -> Any:
        """Multiply ``loss`` by the current loss scale (returned unchanged when not scaling)."""
        mode = self.loss_scale_mode
        if mode == "none":
            return loss
        if mode == "static":
            return ops.multiply(loss, float(self.loss_scale_arg))
        scale = self.dynamic_scale if self.built else self.initial_scale
        return ops.multiply(loss, scale)

    def _unscale(self, grads: list, variables: list) -> list:
        mode = self.loss_scale_mode
        if mode == "none":
            return grads
        if mode == "static":
            scale = float(self.loss_scale_arg)
        else:
            scale = ops.convert_to_tensor(self.dynamic_scale)  # read once
        return [
            g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ]

    # --------------------------------------------------------------------- apply

    def _check_runtime(self, world_size: int) -> None:
        if world_size == 1:
            return
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError(
                f"Averaging gradients over {world_size} Horovod ranks needs the TensorFlow "
                f"backend (Horovod's collectives are TensorFlow ops), but KERAS_BACKEND is "
                f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow, or run one process."
            )
        import tensorflow as tf

        if tf.distribute.has_strategy():
            raise RuntimeError(
                "kmp.wrap_optimizer averages gradients with Horovod; do not also use a "
                "tf.distribute strategy. Build and fit the model outside strategy.scope()."
            )

    def _allreduce(self, grads: list) -> list:
        world_size = distributed.size()
        self._check_runtime(world_size)
        if world_size == 1:
            self._payload_bytes = 0
            return grads
        self._payload_bytes = distributed.payload_bytes(grads, self.compression)
        return distributed.grouped_allreduce(grads, op="average", compression=self.compression)

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Average ``grads`` over ranks, unscale, check them and update (or skip).

        Args:
            grads: Gradients of the scaled loss, one per variable (None allowed).
            trainable_variables: The variables; needed on the first call, which
                builds the optimizer.
        """
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "The optimizer is not built yet: pass the variables on the first call, "
                    "`opt.apply(grads, model.trainable_variables)`."
                )
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(variables)} variables; pass one gradient "
                "per variable, in the same order."
            )
        if not grads:
            return
        if self.backward_passes_per_step == 1:
            self._update(self._allreduce(grads), variables, poisoned=None)
        else:
            self._accumulate(grads, variables)

    def _update(self, grads: list, variables: list, poisoned: Any) -> None:
        """Check the averaged (still scaled) gradients, then unscale and apply, or skip."""
        if self.loss_scale_mode == "none" and poisoned is None:
            # No scaling: no finite check, no cond, exactly the inner optimizer.
            self.inner_optimizer.apply(grads, variables)
            return
        finite = self.check_finite(grads)
        if poisoned is not None:
            finite = ops.logical_and(finite, ops.logical_not(poisoned))
        ops.cond(finite, lambda: self._apply_finite(grads, variables), self._skip_step)

    def _apply_finite(self, grads: list, variables: list) -> None:
        self.inner_optimizer.apply(self._unscale(grads, variables), variables)
        if self.loss_scale_mode != "dynamic":
            return

        def grow() -> None:
            self.step_counter.assign(0)
            self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 2.0))

        def count() -> None:
            self.step_counter.assign_add(1)

        ops.cond(ops.greater_equal(self.step_counter, self.dynamic_growth_steps - 1), grow, count)

    def _skip_step(self) -> None:
        self.skipped_steps_counter.assign_add(1)
        if self.loss_scale_mode == "dynamic":
            self.step_counter.assign(0)
            self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 0.5))

    def _accumulate(self, grads: list, variables: list) -> None:
        """Add one micro-batch; on the last one, average, allreduce once and update."""
        n = self.backward_passes_per_step
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        finite_here = self.check_finite(grads)
        # A non-finite micro-batch adds nothing and marks the window as bad.
        safe = [None if g is None else ops.where(finite_here, g, ops.zeros_like(g)) for g in grads]
        bad_here = ops.cast(ops.logical_not(finite_here), self._window_bad.dtype)

        def last() -> None:
            total = [
                None if s is None else ops.divide(ops.add(a, s), float(n))
                for a, s in zip(accs, safe, strict=True)
            ]
            bad = ops.maximum(ops.convert_to_tensor(self._window_bad), bad_here)
            reduced = self._allreduce([*total, ops.cast(bad, "float32")])
            poisoned = ops.greater(reduced[-1], 0.0)
            for a in self._accumulators:
                a.assign(ops.zeros(a.shape, a.dtype))
            self._window_bad.assign(0)
            self._micro_step.assign(0)
            self._update(reduced[:-1], variables, poisoned=poisoned)

        def not_last() -> None:
            for a, s in zip(accs, safe, strict=True):
                if s is not None:
                    a.assign_add(s)
            self._window_bad.assign(ops.maximum(self._window_bad, bad_here))
            self._micro_step.assign_add(1)

        ops.cond(ops.equal(self._micro_step, n - 1), last, not_last)

    def stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list):
        """Functional :meth:`apply` for JAX (one process): returns new variable values."""
        if not self.built:
            raise ValueError(
                "Build the optimizer before stateless_apply: "
                "`opt.build(model.trainable_variables)`."
            )
        self._check_runtime(distributed.size())
        if self.backward_passes_per_step > 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is implemented for stateful backends "
                "(TensorFlow, PyTorch). On JAX, set `gradient_accumulation_steps` on the inner "
                "optimizer instead."
            )
        grads = list(grads)
        n_own = len(self._variables)
        own = list(optimizer_variables[:n_own])
        inner = list(optimizer_variables[n_own:])
        mode = self.loss_scale_mode
        if mode == "none":
            new_t, new_inner = self.inner_optimizer.stateless_apply(
                inner, grads, trainable_variables
            )
            return new_t, own + list(new_inner)
        i_scale = self._own_index[id(self.dynamic_scale)]
        i_count = self._own_index[id(self.step_counter)]
        i_skip = self._own_index[id(self.skipped_steps_counter)]
        scale = own[i_scale] if mode == "dynamic" else float(self.loss_scale_arg)
        finite = self.check_finite(grads)

        def on_finite():
            unscaled = [
                g
                if g is None or self._overwrite_variable_with_gradient(v)
                else ops.divide(g, scale)
                for g, v in zip(grads, self._trainable_variables, strict=True)
            ]
            new_t, new_inner = self.inner_optimizer.stateless_apply(
                inner, unscaled, trainable_variables
            )
            new_own = list(own)
            if mode == "dynamic":
                nxt = ops.add(own[i_count], 1)
                grow = ops.greater_equal(nxt, self.dynamic_growth_steps)
                new_own[i_count] = ops.where(grow, ops.zeros_like(nxt), nxt)
                new_own[i_scale] = ops.where(grow, ops.multiply(scale, 2.0), scale)
            return list(new_t), new_own + list(new_inner)

        def on_skip():
            new_own = list(own)
            new_own[i_skip] = ops.add(own[i_skip], 1)
            if mode == "dynamic":
                new_own[i_count] = ops.zeros_like(own[i_count])
                new_own[i_scale] = ops.multiply(scale, 0.5)
            return [ops.convert_to_tensor(t) for t in trainable_variables], new_own + inner

        return ops.cond(finite, on_finite, on_skip)

    # -------------------------------------------------------------------- config

    def get_config(self) -> dict:
        """Return the config, including the resolved loss-scale mode."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": self.loss_scale_arg,
            "initial_scale": self.initial_scale,
            "growth_interval": self.dynamic_growth_steps,
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "scale_lr": self.scale_lr,
            "lr_scale": self.lr_scale,
            "resolved_mode": self._mode,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None):
        """Rebuild from :meth:`get_config` output (the learning rate is not scaled again)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


# ---------------------------------------------------------------------- wrapping


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_positive(name: str, value: Any, *, integer: bool) -> None:
    ok = (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if integer
        else _is_number(value) and math.isfinite(float(value))
    )
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"`{name}` must be {kind}; got {value!r}.")


def _validate(
    loss_scale: Any,
    initial_scale: Any,
    growth_interval: Any,
    backward_passes_per_step: Any,
    scale_lr: Any,
) -> None:
    if isinstance(loss_scale, str):
        if loss_scale not in LOSS_SCALE_MODES:
            raise ValueError(
                f"Unknown loss_scale {loss_scale!r}. Use 'dynamic' (float16 policies only), "
                "'force_dynamic' (any policy), a positive number (static scale) or None (off)."
            )
    elif loss_scale is not None:
        if not _is_number(loss_scale):
            raise TypeError(
                f"loss_scale must be 'dynamic', 'force_dynamic', a positive number or None; "
                f"got {type(loss_scale).__name__} {loss_scale!r}."
            )
        if not math.isfinite(float(loss_scale)) or loss_scale <= 0:
            raise ValueError(
                f"A static loss_scale must be a positive finite number; got {loss_scale!r}. "
                "Use None to turn loss scaling off."
            )
    _check_positive("initial_scale", initial_scale, integer=False)
    _check_positive("growth_interval", growth_interval, integer=True)
    _check_positive("backward_passes_per_step", backward_passes_per_step, integer=True)
    if not isinstance(scale_lr, bool):
        raise TypeError(f"scale_lr must be True or False; got {scale_lr!r}.")


def _is_horovod_optimizer(optimizer: Any) -> bool:
    return any(
        (c.__module__ or "").startswith("horovod") or c.__name__ == "_DistributedOptimizer"
        for c in type(optimizer).__mro__
    )


def _is_tf_keras_optimizer(optimizer: Any) -> bool:
    return any((c.__module__ or "").startswith("tf_keras") for c in type(optimizer).__mro__)


def _scale_learning_rate(optimizer: keras.optimizers.Optimizer, factor: float) -> None:
    lr = optimizer._learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = ScaledLearningRate(lr, factor)
    elif callable(lr) and not isinstance(lr, keras.Variable):
        optimizer.learning_rate = lambda: ops.multiply(lr(), factor)
    else:
        optimizer.learning_rate = float(ops.convert_to_numpy(lr)) * factor


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    *,
    loss_scale: str | float | None = "dynamic",
    initial_scale: float = 2**15,
    growth_interval: int = 2000,
    compression: str | None = None,
    backward_passes_per_step: int = 1,
    scale_lr: bool = False,
) -> keras.optimizers.Optimizer:
    """Return one Keras optimizer that scales the loss and averages gradients over ranks.

    Args:
        optimizer: A Keras 3 optimizer instance, e.g. ``keras.optimizers.Adam(1e-3)``.
            A Keras ``LossScaleOptimizer`` is unwrapped and rewrapped; an optimizer
            already returned by this function is returned as it is. A ``tf_keras``
            (Keras 2) optimizer is handed to :mod:`kmp.compat.keras2`.
        loss_scale: ``"dynamic"``: dynamic loss scaling when the global dtype policy
            computes in float16 (decided when the optimizer is first used), no
            scaling for bfloat16 and float32. ``"force_dynamic"``: dynamic scaling
            under any policy. A positive number: a static scale (non-finite steps
            are still skipped). None: no loss scaling.
        initial_scale: Starting dynamic scale.
        growth_interval: Finite steps after which a dynamic scale doubles.
        compression: None, ``"fp16"`` or ``"bf16"``: the dtype gradients travel in
            through the allreduce (half the bytes of float32); they are cast back after.
        backward_passes_per_step: Accumulate this many micro-batches locally, then
            average them, allreduce once and update. A window with a non-finite
            micro-batch is skipped as a whole (and lowers a dynamic scale); the
            accumulators are cleared either way.
        scale_lr: Multiply the learning rate by the number of ranks.

    Returns:
        A :class:`DistributedLossScaleOptimizer` (a Keras ``LossScaleOptimizer``),
        or for a ``tf_keras`` optimizer what :mod:`kmp.compat.keras2` returns.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer instance, or an argument
            has the wrong type.
        ValueError: An argument is out of range or unknown, the optimizer is
            Horovod's own ``DistributedOptimizer``, or it is already wrapped with
            different settings.
        RuntimeError: More than one rank is running on a backend other than TensorFlow.
    """
    if _is_tf_keras_optimizer(optimizer):
        from kmp.compat.keras2 import wrap_optimizer as _wrap2

        return _wrap2(
            optimizer,
            loss_scale=loss_scale,
            initial_scale=initial_scale,
            growth_interval=growth_interval,
            compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            scale_lr=scale_lr,
        )
    if _is_horovod_optimizer(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__} is Horovod's DistributedOptimizer, which does not "
            "average gradients under Keras 3. Pass the plain Keras optimizer (for example "
            "keras.optimizers.Adam(1e-3)) to kmp.wrap_optimizer, which averages them itself."
        )
    if isinstance(optimizer, type) and issubclass(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs an optimizer instance, got the class {optimizer.__name__}; "
            f"call it first: kmp.wrap_optimizer({optimizer.__name__}(...))."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs a Keras 3 optimizer instance such as "
            f"keras.optimizers.Adam(1e-3); got {type(optimizer).__name__} {optimizer!r}."
        )
    _validate(loss_scale, initial_scale, growth_interval, backward_passes_per_step, scale_lr)
    compression = distributed.normalize_compression(compression)
    requested = {
        "loss_scale": loss_scale,
        "initial_scale": float(initial_scale),
        "growth_interval": int(growth_interval),
        "compression": compression,
        "backward_passes_per_step": int(backward_passes_per_step),
        "scale_lr": scale_lr,
    }

    if isinstance(optimizer, DistributedLossScaleOptimizer):
        have = optimizer.settings()
        clashes = [
            f"{k}={v!r} (it has {have[k]!r})"
            for k, v in requested.items()
            if v != have[k] and v != _DEFAULTS[k]
        ]
        if clashes:
            raise ValueError(
                "This optimizer is already wrapped by kmp with other settings: "
                f"{', '.join(clashes)}. Wrap its inner optimizer instead: "
                "kmp.wrap_optimizer(opt.inner_optimizer, ...)."
            )
        return optimizer

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Keras's own loss scaling: keep its settings unless asked otherwise, rewrap the inner.
        if requested["initial_scale"] == _DEFAULTS["initial_scale"]:
            requested["initial_scale"] = _current_keras_scale(optimizer)
        if requested["growth_interval"] == _DEFAULTS["growth_interval"]:
            requested["growth_interval"] = int(optimizer.dynamic_growth_steps)
        return wrap_optimizer(optimizer.inner_optimizer, **requested)
    if getattr(optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor}; kmp scales "
            f"the loss itself. Create it without loss_scale_factor and pass "
            f"loss_scale={optimizer.loss_scale_factor} to kmp.wrap_optimizer for a static scale."
        )

    world_size = distributed.size()
    if world_size > 1 and keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"{world_size} Horovod ranks are running, but kmp averages gradients only on the "
            f"TensorFlow backend (KERAS_BACKEND is {keras.backend.backend()!r}). Set "
            "KERAS_BACKEND=tensorflow, or run one process."
        )
    lr_scale = float(world_size) if scale_lr else 1.0
    if lr_scale != 1.0:
        _scale_learning_rate(optimizer, lr_scale)
    return DistributedLossScaleOptimizer(
        optimizer,
        loss_scale=requested["loss_scale"],
        initial_scale=requested["initial_scale"],
        growth_interval=requested["growth_interval"],
        compression=compression,
        backward_passes_per_step=requested["backward_passes_per_step"],
        scale_lr=scale_lr,
        lr_scale=lr_scale,
    )


def _current_keras_scale(lso: keras.optimizers.LossScaleOptimizer) -> float:
    """The current scale of a Keras LossScaleOptimizer (its initial scale if unbuilt)."""
    if lso.built:
        return float(ops.convert_to_numpy(lso.dynamic_scale))
    return float(lso.initial_scale)
