"""The optimizer :func:`kmp.wrap_optimizer` returns: loss scaling and gradient averaging.

One training step with it, on every rank::

    loss -> scale_loss -> gradients -> [accumulate N micro-batches]
         -> grouped allreduce of the still-scaled gradients (optionally fp16/bf16), in
            buckets of ``bucket_bytes``, last layer first, overlapping the backward pass
         -> finite check and the underflow reading (the same answer on every rank)
         -> unscale and apply, or skip
         -> kmp.loss_scale.update: the next scale, good/overflow counters, skipped count

Gradients are averaged before they are checked, so an overflow on any rank makes
every rank skip the same step and move its scale alike. The rule lives in
:mod:`kmp.loss_scale`; this class keeps its state in four optimizer variables
(Keras's ``dynamic_scale`` and ``step_counter``, and ``overflow_streak_counter``,
``skipped_steps_counter``; a rule that measures underflow adds ``underflow_share``, the
last step's reading) and runs it stateful (:meth:`apply`) and stateless (JAX:
:meth:`stateless_apply`). The accumulation of micro-batches is :mod:`kmp.accumulation`'s.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from kmp import distributed
from kmp import loss_scale as _ls
from kmp._keras_internals import is_tracer, stateless_value, untracked
from kmp._version import __version__
from kmp.accumulation import GradientAccumulation
from kmp.compensated import CompensatedUpdates
from kmp.distributed import sparse
from kmp.distributed.buckets import payload_bytes
from kmp.distributed.collectives import check_averaging_runtime, gradients_need_allreduce
from kmp.learning_rate import rescale_learning_rate
from kmp.optimizer_settings import OptimizerSettings
from kmp.scale_guard import ScaleGuard, refusal, stale_scale

__all__ = ["DistributedLossScaleOptimizer"]

# The config's layout; a config without it was written by kmp 0.1, which this kmp refuses.
CONFIG_FORMAT = 2
# The variable holding the last step's measured underflow share (rules that measure it).
UNDERFLOW_SHARE = "underflow_share"


@keras.saving.register_keras_serializable(package="kmp")
class DistributedLossScaleOptimizer(GradientAccumulation, keras.optimizers.LossScaleOptimizer):
    """Loss scaling plus bucketed Horovod allreduces per step, around an inner optimizer.

    Build it with :func:`kmp.wrap_optimizer`, which resolves the loss scale against the
    global dtype policy, checks the master-weight mode against it and scales the learning
    rate. Keras's ``LossScaleOptimizer`` attributes mean what they mean there:
    ``dynamic_scale`` is the variable holding the scale in use (a static one too),
    ``step_counter`` the finite steps since the scale last moved, ``initial_scale`` and
    ``dynamic_growth_steps`` the rule's first scale and growth interval.

    Args:
        inner_optimizer: The Keras optimizer that updates the weights.
        settings: The :class:`kmp.OptimizerSettings` (None: the defaults), kept as
            :attr:`settings` and saved in the config.
        loss_scale_rule: The resolved :class:`kmp.loss_scale.LossScale`; None resolves
            ``settings.loss_scale`` against the global policy now.
        lr_scale: The factor :func:`kmp.wrap_optimizer` scaled the learning rate by.
        name: Optimizer name.

    Raises:
        TypeError: ``settings`` is not an ``OptimizerSettings``.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        settings: OptimizerSettings | None = None,
        *,
        loss_scale_rule: _ls.LossScale | None = None,
        lr_scale: float = 1.0,
        name: str | None = None,
    ):
        settings = OptimizerSettings.from_arguments(settings, {})[0]
        if loss_scale_rule is None:
            compute = keras.config.dtype_policy().compute_dtype
            loss_scale_rule = settings.loss_scale_rule(compute)
        super().__init__(
            inner_optimizer,
            initial_scale=loss_scale_rule.initial_scale,
            dynamic_growth_steps=loss_scale_rule.growth_interval,
            name=name,
        )
        self.settings = settings
        self.loss_scale_rule = loss_scale_rule
        self.lr_scale = float(lr_scale)
        self.compensated: CompensatedUpdates | None = None
        self.underflow_share_variable: keras.Variable | None = None
        self._payload_bytes = 0
        self._own_index: dict[int, int] = {}
        self.scale_guard = ScaleGuard()  # refuses a step that never called scale_loss

    @property
    def loss_scale_mode(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"none"``: decided when the optimizer was made."""
        return self.loss_scale_rule.kind

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when not scaling)."""
        if not self.built:
            return self.loss_scale_rule.start_scale
        return float(self._read(self.dynamic_scale))

    @property
    def skipped_steps(self) -> int:
        """How many updates were skipped because the gradients were not finite."""
        return int(self._read(self.skipped_steps_counter)) if self.built else 0

    @property
    def overflow_streak(self) -> int:
        """How many of the latest updates in a row overflowed (0 after a finite one)."""
        return int(self._read(self.overflow_streak_counter)) if self.built else 0

    @property
    def underflow_share(self) -> float | None:
        """The last step's share of gradient values that were float16 subnormals once scaled.

        What the loss-scale rule measured (:func:`kmp.loss_scale.gradient_stats`); None
        when the rule does not measure underflow (not float16, or
        ``underflow_threshold=None``).
        """
        if self.underflow_share_variable is None:
            return None
        return float(self._read(self.underflow_share_variable))

    @property
    def can_skip(self) -> bool:
        """True when a step can be skipped: the loss is scaled, or micro-batches accumulate."""
        return self.loss_scale_rule.scaling or self.settings.backward_passes_per_step > 1

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

    def rescale_learning_rate(self, factor: float) -> None:
        """Scale the learning rate by ``factor`` instead of :attr:`lr_scale` (elastic resize).

        Only a rate that ``scale_lr=True`` scaled changes; the train function
        must be traced again for a schedule's new factor to take effect.

        Args:
            factor: The new factor: the new number of ranks.
        """
        if not self.settings.scale_lr or float(factor) == self.lr_scale:
            return
        rescale_learning_rate(self.inner_optimizer, self.lr_scale, factor)
        self.lr_scale = float(factor)

    @untracked
    def build(self, var_list: list) -> None:
        """Create the loss-scale state, the accumulators and the inner optimizer's variables."""
        start = self.loss_scale_rule.start_state()

        def scalar(name: str, dtype: str, value: float) -> keras.Variable:
            init = keras.initializers.Constant(value) if value else "zeros"
            return self.add_variable(
                shape=(), dtype=dtype, initializer=init, aggregation="none", name=name
            )

        self.step_counter = scalar("good_steps", "int", 0)
        self.dynamic_scale = scalar("loss_scale", "float32", start.scale)
        self.skipped_steps_counter = scalar("skipped_steps", "int", 0)
        self.overflow_streak_counter = scalar("overflow_streak", "int", 0)
        if self.loss_scale_rule.measures_underflow:
            self.underflow_share_variable = scalar(UNDERFLOW_SHARE, "float32", 0.0)
        self._build_accumulation(scalar, var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        # Kahan buffers are the inner optimizer's variables: saved and mapped with its state.
        settings = self.settings
        self.compensated = self.compensated or CompensatedUpdates(
            self.inner_optimizer, var_list, settings.master_weights, settings.rounding_seed
        )
        # Skip LossScaleOptimizer.build (it would create its variables again).
        super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        self._own_index = {id(v): i for i, v in enumerate(self._variables)}

    def _state_variables(self) -> tuple[keras.Variable, ...]:
        """The rule's state, in :class:`kmp.loss_scale.ScaleState` order."""
        return (
            self.dynamic_scale,
            self.step_counter,
            self.overflow_streak_counter,
            self.skipped_steps_counter,
        )

    def load_own_variables(self, store: Any) -> None:
        """Load the saved variables; a save from before kmp measured underflow fits too.

        Such a save lacks only ``underflow_share`` (a reading, not state the rule
        needs): every other variable is restored in order and the share starts at 0.
        """
        share = self.underflow_share_variable
        if share is None or len(store.keys()) != len(self.variables) - 1:
            super().load_own_variables(store)
            return
        saved = iter(store[str(i)] for i in range(len(store.keys())))
        for variable in self.variables:
            variable.assign(0.0 if variable is share else next(saved))

    def scale_loss(self, loss: Any) -> Any:
        """Multiply ``loss`` by the current loss scale (returned unchanged when not scaling).

        Call it in every step before taking gradients: :meth:`apply` refuses gradients
        of a step that never did (:mod:`kmp.scale_guard`).
        """
        rule = self.loss_scale_rule
        if not rule.scaling:
            return loss
        stale = stale_scale(
            backend=keras.backend.backend(),
            dynamic=rule.dynamic,
            traced=is_tracer(loss),
            in_state=self.built and stateless_value(self.dynamic_scale) is not None,
        )
        if stale is not None:
            raise RuntimeError(refusal(stale, self._described, rule.initial_scale))
        self.scale_guard.scaled()
        if rule.dynamic and self.built:
            return ops.multiply(loss, self.dynamic_scale)
        return ops.multiply(loss, rule.initial_scale)

    @property
    def _described(self) -> str:
        return f"the loss-scaling optimizer around {self.inner_optimizer.name!r}"

    def _judge_step(self) -> None:
        """Raise when this step's gradients come from a loss :meth:`scale_loss` never scaled."""
        reason = self.scale_guard.applying(scaling=self.loss_scale_rule.scaling)
        if reason is not None:
            raise RuntimeError(refusal(reason, self._described, self.loss_scale_rule.initial_scale))

    def _unscale(self, grads: list, variables: list, scale: Any) -> list:
        if not self.loss_scale_rule.scaling:
            return grads
        return [
            g
            if g is None or self._overwrite_variable_with_gradient(v)
            else sparse.map_values(g, lambda x: ops.divide(x, scale))
            for g, v in zip(grads, variables, strict=True)
        ]

    def check_finite(self, grads: list) -> Any:
        """True when every gradient is finite (a sparse one: its values)."""
        return super().check_finite([sparse.values_of(g) for g in grads])

    def _gradient_stats(self, grads: list) -> _ls.GradientStats | None:
        """What the rule reads from the averaged, still-scaled gradients (None: nothing)."""
        if not self.loss_scale_rule.measures_underflow:
            return None
        return _ls.gradient_stats([sparse.values_of(g) for g in grads])  # None: left out

    def _scale_in_use(self, state_scale: Any) -> Any:
        rule = self.loss_scale_rule
        return state_scale if rule.dynamic else rule.initial_scale

    def _allreduce(self, grads: list, variables: list) -> list:
        check_averaging_runtime(distributed.size())
        if not gradients_need_allreduce():  # one process, or the JAX distribution
            self._payload_bytes = 0
            return grads
        settings = self.settings
        if settings.sparse_gradients == "dense":  # in the variables' shapes, known while tracing
            grads = sparse.densify_like(grads, variables)
        how = {"compression": settings.compression, "sparse_gradients": settings.sparse_gradients}
        self._payload_bytes = payload_bytes(grads, **how)
        return distributed.grouped_allreduce(
            grads, op="average", bucket_bytes=settings.bucket_bytes, **how
        )

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Average ``grads`` over ranks, check them, unscale and update (or skip).

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
        self._judge_step()
        if not grads:
            return
        if self.settings.backward_passes_per_step == 1:
            self._update(self._allreduce(grads, variables), variables, poisoned=None)
        else:
            self._accumulate(grads, variables)

    def _update(self, grads: list, variables: list, poisoned: Any) -> None:
        """Check the averaged (still scaled) gradients, apply or skip, then run the rule."""
        if not self.loss_scale_rule.scaling and poisoned is None:
            # No scaling: no finite check, no cond, exactly the inner optimizer.
            self.inner_optimizer.apply(grads, variables)
            return
        finite = self.check_finite(grads)
        if poisoned is not None:
            finite = ops.logical_and(finite, ops.logical_not(poisoned))
        state = _ls.ScaleState(*(ops.convert_to_tensor(v) for v in self._state_variables()))
        scale = self._scale_in_use(state.scale)

        def apply_step() -> None:
            self.inner_optimizer.apply(self._unscale(grads, variables, scale), variables)

        ops.cond(finite, apply_step, lambda: None)
        stats = self._gradient_stats(grads)
        new = _ls.update(self.loss_scale_rule, state, finite, stats)
        for var, value in zip(self._state_variables(), new, strict=True):
            var.assign(value)
        if stats is not None:
            self.underflow_share_variable.assign(stats.underflow)

    def stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list):
        """Functional :meth:`apply` for JAX: returns new variable values.

        On the JAX engine the gradients arrive averaged over every process
        (the engine's step reduces them: :mod:`kmp.distributed._jax_step`), so
        they are checked and applied as they are, and every process takes the
        same skip decision.
        """
        if not self.built:
            raise ValueError(
                "Build the optimizer before stateless_apply: "
                "`opt.build(model.trainable_variables)`."
            )
        check_averaging_runtime(distributed.size())
        if self.settings.backward_passes_per_step > 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is implemented for stateful backends "
                "(TensorFlow, PyTorch). On JAX, set `gradient_accumulation_steps` on the inner "
                "optimizer instead."
            )
        self._judge_step()
        grads = list(grads)
        n_own = len(self._variables)
        own = list(optimizer_variables[:n_own])
        inner = list(optimizer_variables[n_own:])
        if not self.loss_scale_rule.scaling:
            new_t, new_inner = self.inner_optimizer.stateless_apply(
                inner, grads, trainable_variables
            )
            return new_t, own + list(new_inner)
        slots = [self._own_index[id(v)] for v in self._state_variables()]
        state = _ls.ScaleState(*(own[i] for i in slots))
        scale = self._scale_in_use(state.scale)
        finite = self.check_finite(grads)

        def on_finite() -> tuple[list, list]:
            unscaled = self._unscale(grads, self._trainable_variables, scale)
            new_t, new_inner = self.inner_optimizer.stateless_apply(
                inner, unscaled, trainable_variables
            )
            return list(new_t), list(new_inner)

        def on_skip() -> tuple[list, list]:
            return [ops.convert_to_tensor(t) for t in trainable_variables], inner

        new_t, new_inner = ops.cond(finite, on_finite, on_skip)
        new_own = list(own)
        stats = self._gradient_stats(grads)
        new = _ls.update(self.loss_scale_rule, state, finite, stats)
        for i, value in zip(slots, new, strict=True):
            new_own[i] = value
        if stats is not None:
            new_own[self._own_index[id(self.underflow_share_variable)]] = stats.underflow
        return list(new_t), new_own + list(new_inner)

    def get_config(self) -> dict:
        """Return the config: the settings and the resolved rule, so loading never re-decides it."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "settings": self.settings.to_config(),
            "loss_scale_rule": self.loss_scale_rule.to_config(),
            "lr_scale": self.lr_scale,
            "kmp_format": CONFIG_FORMAT,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None):
        """Rebuild from :meth:`get_config` output (the learning rate is not scaled again).

        Raises:
            ValueError: The config was written by kmp 0.1, whose layout this kmp does not read.
        """
        if config.get("kmp_format") != CONFIG_FORMAT:
            raise ValueError(
                f"This DistributedLossScaleOptimizer was saved by kmp 0.1 (config format "
                f"{config.get('kmp_format', 1)}); kmp {__version__} reads format {CONFIG_FORMAT} "
                "only. Load the model with compile=False and compile it with a new "
                "kmp.wrap_optimizer(...), or load and re-save it with kmp 0.1 first."
            )
        inner = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects
        )
        return cls(
            inner,
            OptimizerSettings.from_config(config["settings"]),
            loss_scale_rule=_ls.LossScale.from_config(config["loss_scale_rule"]),
            lr_scale=config["lr_scale"],
            name=config["name"],
        )
