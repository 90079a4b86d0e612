"""The JAX engine's own train step: the combine rule, the hook, the setting that picks it.

The step itself runs in real processes: tests/distributed/test_jax_engine.py (one
all-reduce per step, ranks bit-identical, logs equal to one process's on the global batch).
"""

import pytest

from kmp import _launcher_env as env
from kmp.distributed import _jax_step


@pytest.mark.parametrize(
    ("dtype", "aggregation", "rule"),
    [
        ("float32", "none", "mean"),  # BatchNormalization's moving statistics
        ("bfloat16", "mean", "mean"),
        ("float16", "sum", "sum"),  # a metric's total and count
        ("float32", "only_first_replica", "first"),
        ("uint32", "none", "local"),  # a SeedGenerator's state
        ("int64", "sum", "local"),
        ("bool", "mean", "local"),
    ],
)
def test_each_variable_combines_by_its_dtype_and_aggregation(dtype, aggregation, rule):
    assert _jax_step.combine_rule(dtype, aggregation) == rule


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="aggregation must be 'none', 'mean', 'sum'"):
        _jax_step.combine_rule("float32", "max")


def test_the_hook_wraps_keras_train_step_once_and_comes_off():
    # A Keras upgrade that moves JAXTrainer.train_step is caught here, not in a user's job.
    import keras

    cls = _jax_step._hook_class()
    method = cls.__dict__["train_step"]
    try:
        _jax_step.install(keras.distribution.DataParallel)
        _jax_step.install(keras.distribution.DataParallel)  # idempotent: wrapped once
        assert cls.__dict__["train_step"]._kmp_original is method
    finally:
        _jax_step.remove()
    assert cls.__dict__["train_step"] is method
    _jax_step.remove()  # nothing installed: nothing to do


def test_without_kmps_distribution_keras_keeps_the_step():
    import keras

    assert keras.distribution.distribution() is None
    model = keras.Sequential([keras.layers.Dense(1)])
    assert not _jax_step.owns_step(model, keras.distribution.DataParallel)


def test_the_step_setting_defaults_to_kmps_and_refuses_a_typo():
    assert env.launched_jax_step({}) == "flat"
    assert env.launched_jax_step({"KMP_JAX_STEP": " Keras "}) == "keras"
    with pytest.raises(ValueError, match=r"KMP_JAX_STEP='kmp'.*unset it"):
        env.launched_jax_step({"KMP_JAX_STEP": "kmp"})
