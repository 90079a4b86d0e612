"""Gradient accumulation for :class:`kmp.scaling_optimizer.DistributedLossScaleOptimizer`.

With ``backward_passes_per_step = n > 1`` each call of ``apply`` adds one micro-batch
to per-variable accumulators; the n-th averages them, allreduces once and updates::

    micro-batch 1 .. n-1:  accumulators += gradients (a non-finite one adds nothing
                           and marks the window bad)
    micro-batch n:         total = (accumulators + gradients) / n -> one allreduce,
                           with the window's "bad" flag -> update (a bad window on any
                           rank is skipped by every rank) -> accumulators = 0

A sparse gradient is scatter-added, so the window is dense (and allreduced dense).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from kmp.distributed import sparse

__all__ = ["GradientAccumulation"]


def _zero_unless(finite: Any) -> Callable[[Any], Any]:
    return lambda x: ops.where(finite, x, ops.zeros_like(x))


class GradientAccumulation:
    """The accumulation half of the optimizer (a mixin; the optimizer provides the rest).

    The optimizer it is mixed into has ``settings`` (an :class:`~kmp.OptimizerSettings`,
    read for ``backward_passes_per_step``), ``check_finite``,
    ``_allreduce(grads, variables)`` and ``_update(grads, variables, poisoned)``, and is a
    Keras optimizer (``add_variable_from_reference``, ``assign_add``, ``_get_variable_index``).
    """

    settings: Any

    def _build_accumulation(
        self, scalar: Callable[[str, str, float], keras.Variable], var_list: list
    ) -> None:
        """Create the window's counter, its "bad" flag and one accumulator per variable."""
        self._accumulators: list = []
        if self.settings.backward_passes_per_step > 1:
            self._micro_step = scalar("micro_step", "int", 0)
            self._window_bad = scalar("window_bad", "int", 0)
            self._accumulators = [
                self.add_variable_from_reference(v, name="grad_accumulator") for v in var_list
            ]

    def _accumulate(self, grads: list, variables: list) -> None:
        """Add one micro-batch; on the last one, average, allreduce once and update."""
        n = self.settings.backward_passes_per_step
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        finite_here = self.check_finite(grads)
        # A non-finite micro-batch adds nothing and marks the window as bad.
        safe = [
            None if g is None else sparse.map_values(g, _zero_unless(finite_here)) for g in grads
        ]
        bad_here = ops.cast(ops.logical_not(finite_here), self._window_bad.dtype)

        def last() -> None:
            total = [
                None if s is None else ops.divide(ops.add(a, s), float(n))
                for a, s in zip(accs, sparse.densify_like(safe, accs), strict=True)
            ]
            bad = ops.maximum(ops.convert_to_tensor(self._window_bad), bad_here)
            reduced = self._allreduce([*total, ops.cast(bad, "float32")], [*accs, self._window_bad])
            poisoned = ops.greater(reduced[-1], 0.0)
            for a in self._accumulators:
                a.assign(ops.zeros(a.shape, a.dtype))
            self._window_bad.assign(0)
            self._micro_step.assign(0)
            self._update(reduced[:-1], variables, poisoned=poisoned)

        def not_last() -> None:
            for a, s in zip(accs, safe, strict=True):
                if s is not None:
                    self.assign_add(a, s)  # a tf.IndexedSlices is scatter-added
            self._window_bad.assign(ops.maximum(self._window_bad, bad_here))
            self._micro_step.assign_add(1)

        ops.cond(ops.equal(self._micro_step, n - 1), last, not_last)
