"""Compensated updates of 16-bit weights inside any Keras optimizer.

:class:`CompensatedUpdates` attaches :mod:`kmp.master_weights`'s rule to a built Keras
optimizer (the one :func:`kmp.wrap_optimizer` wraps), on that instance only:

* Keras optimizers compute an update in the weight's dtype. For a bfloat16 weight that
  breaks them outright: Adam's ``beta_2=0.999`` rounds to 1.0, so its bias correction
  ``1 - beta_2**t`` is 0 and every update is exactly zero. So ``update_step`` is given a
  float32 view of each 16-bit weight instead of the weight: the optimizer computes in
  float32 (its slots stay in the weight's dtype, the memory saving) and hands back the
  exact float32 change.
* That change reaches the weight through the rule: Kahan summation, stochastic rounding
  or round-to-nearest (``"none"``). Weight decay (``_apply_weight_decay``) too.
* The optimizer's bfloat16 slots lose their small steps the same way (Adam's second moment
  decays by 0.1 % a step: rounded to nearest in bfloat16 it never decays), so under
  ``"kahan"`` and ``"stochastic"`` their new values are rounded stochastically (no extra
  memory); under ``"none"`` Keras rounds them to nearest.

Float32 weights and their slots go to Keras unchanged. The Kahan buffers
are variables *of that optimizer* (``add_variable_from_reference``, in the weight's
dtype), so they are part of its state everywhere Keras and kmp read it: checkpoints,
``stateless_apply`` on JAX, ``kmp.elastic``'s state.

An optimizer that sets a weight outright (``assign``: Ftrl, ScheduleFreeAdamW) gets the
difference from the weight's current value added by the rule. One whose ``update_step``
reads a weight's ``path`` (Muon) cannot take the view: use float32 weights with it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import keras
from keras import ops

from kmp import master_weights as _mw
from kmp import xla
from kmp.distributed import sparse

__all__ = ["CompensatedUpdates"]

SLOT = "slot"  # an optimizer variable in bfloat16 (rounded stochastically)


class CompensatedUpdates:
    """The master-weights rule, installed on one built Keras optimizer.

    Args:
        optimizer: The inner Keras optimizer, already built on ``variables``.
        variables: The trainable variables it updates.
        setting: A canonical ``master_weights`` setting.
        seed: The stochastic rounding's seed.

    Attributes:
        fuse_updates: In a TensorFlow graph, each weight's whole update is one compiled
            computation (True, the default). False runs it op by op, in the same order:
            the reference the step-memory test compares against (each update then holds
            several float32 copies of its weight). Read when a step is traced.

    Raises:
        ValueError: A weight's dtype does not allow ``setting``
            (:func:`kmp.master_weights.update_mode`).
    """

    def __init__(self, optimizer: Any, variables: list, setting: str, seed: int):
        self.optimizer = optimizer
        # Each update's elementwise chain as one compiled computation (xla.fused).
        self._kahan_add = xla.fused(_kahan_add)
        self._stochastic_add = xla.fused(_stochastic_add)
        self._nearest_add = xla.fused(_nearest_add)
        self._stochastic = xla.fused(_stochastic_round)
        self.seed = int(seed)
        self.modes: dict[str, str] = {}  # variable path -> mode, for reports
        self._entries: dict[Any, tuple[str, int, Any]] = {}  # key -> (mode, index, buffer)
        self._views: dict[int, tuple[Any, tuple[str, int, Any]]] = {}  # id(view) -> (var, entry)
        self._last: Any = None  # the latest update's value (TensorFlow graphs: the order)
        self._fused_updates: dict[Any, Any] = {}  # var key -> its compiled update (TensorFlow)
        self.fuse_updates = True
        for index, v in enumerate(variables):
            mode = _mw.update_mode(setting, str(v.dtype))
            self.modes[v.path] = mode
            if mode != _mw.EXACT:
                buffer = None
                if mode == "kahan":
                    buffer = optimizer.add_variable_from_reference(v, name="kahan_compensation")
                self._entries[optimizer._var_key(v)] = (mode, index, buffer)
        if any(m in ("kahan", "stochastic") for m, _, _ in self._entries.values()):
            # The optimizer's bfloat16 slots (Adam's moments) are rounded stochastically: plain
            # rounding loses their small steps too (Adam's second moment would never decay).
            # float16 slots keep Keras's rounding (11 bits; stochastic rounding is bfloat16's).
            buffers = {id(b) for b in self.buffers}
            slots = [s for s in optimizer.variables if str(s.dtype) == "bfloat16"]
            for j, s in enumerate(x for x in slots if id(x) not in buffers):
                self._entries[optimizer._var_key(s)] = (SLOT, len(variables) + j, None)
        if self._entries:
            self._install()

    @property
    def buffers(self) -> list:
        """The Kahan compensation buffers (optimizer variables), in variable order."""
        return [b for _, _, b in self._entries.values() if b is not None]

    def _install(self) -> None:
        opt = self.optimizer
        original = {
            name: getattr(opt, name)
            for name in ("apply", "update_step", "_var_key", "assign", "assign_add", "assign_sub")
        }
        keras_decay = opt._apply_weight_decay
        self._keras_assign = original["assign"]

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            if not _in_tf_graph():
                return original["apply"](grads, trainable_variables)
            # The updates run one after the other (_after_previous), in the order they are
            # given: the last weights first, whose gradients backpropagation computes
            # first, so each gradient is consumed (and freed) as soon as it is ready.
            grads = list(grads)
            variables = list(
                opt._trainable_variables if trainable_variables is None else trainable_variables
            )
            return original["apply"](grads[::-1], variables[::-1])

        def var_key(variable: Any) -> Any:
            view = self._views.get(id(variable))
            return original["_var_key"](view[0] if view else variable)

        def on_view(gradient: Any, variable: Any, entry: Any, learning_rate: Any) -> Any:
            view = ops.cast(variable, "float32")  # the optimizer computes in float32
            self._views[id(view)] = (variable, entry)
            try:
                return original["update_step"](gradient, view, learning_rate)
            finally:
                del self._views[id(view)]

        def fused_update(variable: Any, entry: Any, gradient: Any, learning_rate: Any) -> Any:
            on_view(gradient, variable, entry, learning_rate)
            return ops.convert_to_tensor(0, "int32")  # done: the point the next update waits on

        def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
            entry = self._entry(variable)
            if entry is None:
                return original["update_step"](gradient, variable, learning_rate)
            with self._after_previous():
                if not (_in_tf_graph() and self.fuse_updates) or sparse.is_sparse(gradient):
                    return on_view(gradient, variable, entry, learning_rate)
                # The whole update of this weight (the optimizer's arithmetic, its slots'
                # and the weight's rounding) as one XLA computation: its float32
                # temporaries are fused away instead of living a layer's size each.
                key = self.optimizer._var_key(variable)
                if key not in self._fused_updates:
                    self._fused_updates[key] = xla.fused(
                        functools.partial(fused_update, variable, entry)
                    )
                self._last = self._fused_updates[key](gradient, learning_rate)
                return None

        def change(name: str, sign: float | None) -> Any:
            def assign(variable: Any, value: Any) -> Any:
                view = self._views.get(id(variable))
                if view is None:
                    entry = self._entry(variable)
                    if entry is None:
                        return original[name](variable, value)
                    view = (variable, entry)
                target, entry = view
                value = self._dense(target, value)
                if sign is not None:
                    return self._add(target, value, sign, entry)
                if entry[0] == SLOT:  # the optimizer's own state set outright: rounded
                    return self._round_into(target, value, entry)
                # A weight set outright: the change from its current value, by the rule.
                delta = ops.subtract(ops.cast(value, "float32"), ops.cast(target, "float32"))
                return self._add(target, delta, 1.0, entry)

            return assign

        def apply_weight_decay(variables: list) -> None:
            if opt.weight_decay is None:
                return
            entries = [(v, self._entry(v)) for v in variables]
            keras_decay([v for v, entry in entries if entry is None])
            rate = ops.multiply(
                ops.cast(opt.learning_rate, "float32"), ops.cast(opt.weight_decay, "float32")
            )
            for v, entry in entries:
                if entry is not None and opt._use_weight_decay(v):
                    self._add(v, ops.multiply(ops.cast(v, "float32"), rate), -1.0, entry)

        opt.apply, opt.update_step, opt._var_key = apply, update_step, var_key
        opt.assign, opt.assign_add, opt.assign_sub = (
            change("assign", None),
            change("assign_add", 1.0),
            change("assign_sub", -1.0),
        )
        opt._apply_weight_decay = apply_weight_decay

    def _after_previous(self) -> Any:
        """In a TensorFlow graph, order this weight's update after the previous one's.

        Without an order TensorFlow runs every weight's update at once, so the float32
        temporaries of all of them (the view, the update, the exact sum) are alive
        together: more than the 16-bit state saves. One after the other, only one
        weight's are. The order is the reverse of the variables' (``apply``): the order
        backpropagation hands out their gradients, so no gradient waits for an earlier
        layer's to be computed (in the variables' order every gradient of the step was
        alive at once). (JAX's compiler schedules its buffers itself.)
        """
        if not _in_tf_graph():
            return contextlib.nullcontext()
        import tensorflow as tf

        last = self._last
        if last is None or last.graph is not tf.compat.v1.get_default_graph():
            return contextlib.nullcontext()
        return tf.control_dependencies([last])

    def _entry(self, variable: Any) -> tuple[str, int, Any] | None:
        try:
            return self._entries.get(self.optimizer._var_key(variable))
        except (AttributeError, TypeError):  # not a variable this optimizer knows
            return None

    @staticmethod
    def _dense(variable: Any, value: Any) -> Any:
        """A sparse update (``tf.IndexedSlices``) as a dense tensor of the weight's shape."""
        return sparse.densify(value, tuple(variable.shape)) if sparse.is_sparse(value) else value

    def _add(self, variable: Any, value: Any, scale: float, entry: tuple[str, int, Any]) -> None:
        """Add ``value * scale`` (``scale`` is 1 or -1) to the 16-bit ``variable`` by its mode.

        One compiled computation per update (:func:`kmp.xla.fused`): the sum, the rounding
        and, for Kahan, the new compensation, in one pass over the weight.
        """
        mode, _, buffer = entry
        if mode == "kahan":
            new, owed = self._kahan_add(variable, buffer, value, scale)
            self._keras_assign(buffer, owed)
        elif mode in ("stochastic", SLOT):
            new = self._stochastic_add(variable, value, scale, *self._bits_of(entry))
        else:  # "none": round to nearest
            new = self._nearest_add(variable, value, scale)
        self._keras_assign(variable, new)
        self._last = new

    def _round_into(self, variable: Any, value: Any, entry: tuple[str, int, Any]) -> None:
        """Store ``value`` in the bfloat16 ``variable``, rounded stochastically."""
        new = self._stochastic(value, *self._bits_of(entry))
        self._keras_assign(variable, new)
        self._last = new

    def _bits_of(self, entry: tuple[str, int, Any]) -> tuple[Any, Any]:
        """The ``(key, step)`` of a variable's random bits this step."""
        key = ops.convert_to_tensor(_mw.rounding_key(self.seed, entry[1]), "int32")
        return key, self.optimizer.iterations


def _in_tf_graph() -> bool:
    """True while TensorFlow traces a graph (a ``tf.function``), where kmp orders updates."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def _exact_sum(base: Any, value: Any, scale: Any) -> Any:
    return ops.add(ops.cast(base, "float32"), ops.multiply(ops.cast(value, "float32"), scale))


def _kahan_add(weight: Any, compensation: Any, value: Any, scale: Any) -> tuple[Any, Any]:
    """:func:`kmp.master_weights.compensated_add` of ``value * scale``."""
    delta = ops.multiply(ops.cast(value, "float32"), scale)
    return _mw.compensated_add(weight, compensation, delta)


def _stochastic_add(base: Any, value: Any, scale: Any, key: Any, step: Any) -> Any:
    """``base + value * scale``, rounded stochastically to bfloat16."""
    return _stochastic_round(_exact_sum(base, value, scale), key, step)


def _nearest_add(base: Any, value: Any, scale: Any) -> Any:
    """``base + value * scale``, rounded to nearest in ``base``'s dtype."""
    return ops.cast(_exact_sum(base, value, scale), base.dtype)


def _stochastic_round(exact: Any, key: Any, step: Any) -> Any:
    """``exact`` rounded stochastically to bfloat16 with the bits of ``(key, step)``."""
    bits = _mw.keyed_random_bits(tuple(exact.shape), key, step)
    return _mw.stochastic_round(ops.cast(exact, "float32"), bits)
