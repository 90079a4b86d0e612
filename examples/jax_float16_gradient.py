"""The JAX float16 gradient of the seed document, with kmp's loss-scale rule.

The original (the seed document, section 4; ``model`` is left to the reader)::

    import jax.numpy as jnp
    from jax import grad, vmap, random
    def loss_fn(params, x, y):
        return jnp.mean((model(params, x) - y) ** 2)
    params = random.normal(random.PRNGKey(0), (10,))
    x = jnp.ones((10,))
    y = jnp.ones((10,))
    grads = grad(loss_fn)(params, x, y)

As written nothing is float16 (``random.normal`` and ``jnp.ones`` give float32). Cast the
parameters and data to float16 and the backward pass runs in float16, whose smallest value is
6e-8: small gradients become 0. Here (inputs near 1e-4) every one of them does.

What kmp changes:

* the parameters stay float32 (the master copy) and are cast to float16 inside the loss, so
  the forward and backward passes compute in float16 and the update is made in float32;
* the loss is multiplied by the scale of a ``kmp.loss_scale.LossScale`` before ``grad``, and
  the gradients are divided by it in float32, checked finite, and applied or skipped;
* the scale moves by ``kmp.loss_scale.update(rule, state, finite, xp=jnp)``, inside
  ``jax.jit``: the one rule every kmp path runs. On Keras's JAX backend
  ``kmp.wrap_optimizer`` does all of this for a Keras model (``stateless_apply``).

With ``growth_interval=2`` the scale doubles after two good steps to 65536, which float16
cannot hold (its largest value is 65504): step 3 overflows, is skipped, and the scale backs
off. Run it with ``python examples/jax_float16_gradient.py``; its last line sums it up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import grad, random

from kmp import loss_scale as kls

STEPS = 5
LEARNING_RATE = 0.1
F16, F32 = jnp.float16, jnp.float32
RULE = kls.LossScale("dynamic", initial_scale=2.0**15, growth_interval=2)


def model(params: jax.Array, x: jax.Array) -> jax.Array:
    """A linear model: one output per row of ``x``."""
    return x @ params


def loss_fn(params: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    """The original's loss."""
    return jnp.mean((model(params, x) - y) ** 2)


def scaled_loss(master: jax.Array, x: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
    """The loss in float16 from float32 parameters, times the loss scale (in float32)."""
    return loss_fn(master.astype(F16), x.astype(F16), y.astype(F16)).astype(F32) * scale


@jax.jit
def train_step(
    master: jax.Array, state: kls.ScaleState, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, kls.ScaleState]:
    """One step: scaled gradients, unscaled in float32, applied if finite; the rule moves."""
    grads = grad(scaled_loss)(master, x, y, state.scale) / state.scale
    finite = jnp.all(jnp.isfinite(grads))
    master = jnp.where(finite, master - LEARNING_RATE * grads, master)
    return master, kls.update(RULE, state, finite, xp=jnp)


def main() -> dict:
    """Compare float16 gradients with and without the scale, then train a few steps."""
    params = random.normal(random.PRNGKey(0), (10,))  # float32, as in the original
    x = 1e-4 * random.uniform(random.PRNGKey(1), (8, 10))  # small inputs
    y = jnp.zeros((8,))
    reference = grad(loss_fn)(params, x, y)  # float32
    plain = grad(loss_fn)(params.astype(F16), x.astype(F16), y.astype(F16))  # the original, f16
    scale = jnp.asarray(RULE.initial_scale, F32)
    scaled = grad(scaled_loss)(params, x, y, scale) / scale
    error = float(jnp.max(jnp.abs(scaled - reference) / jnp.abs(reference)))

    start = RULE.start_state()
    state = kls.ScaleState(
        jnp.asarray(start.scale, F32), *(jnp.asarray(v, jnp.int32) for v in start[1:])
    )
    master, scales, skipped = params, [], []
    for step in range(1, STEPS + 1):
        master, state = train_step(master, state, x, y)
        scales.append(float(state.scale))
        if int(state.skipped) > len(skipped):
            skipped.append(step)
    result = {
        "zero_without_scaling": int(jnp.sum(plain == 0)),
        "zero_with_scaling": int(jnp.sum(scaled == 0)),
        "n": int(params.size),
        "largest_float32_gradient": float(jnp.max(jnp.abs(reference))),
        "relative_error": error,
        "scales": scales,
        "skipped": skipped,
        "finite": bool(np.isfinite(np.asarray(master)).all()),
    }
    r = result
    print(
        f"float16 gradients: {r['zero_without_scaling']} of {r['n']} are 0 without loss scaling "
        f"(float32's largest is {r['largest_float32_gradient']:.1e}); {r['zero_with_scaling']} "
        f"with kmp's scale {RULE.initial_scale:g} (relative error {error:.1e}); {STEPS} steps: "
        f"scale {' -> '.join(f'{s:g}' for s in scales)}, skipped steps {skipped}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
