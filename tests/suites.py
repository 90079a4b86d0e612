"""Named sets of test modules that more than one runner uses (one home for each list).

* ``JAX_RERUN``: the core modules test_backends.py runs again in a child pytest on Keras's
  JAX backend (policies, float32 outputs, the audit, master weights' stateless path).
* ``CORE_TESTS``: the in-process core suite that the version matrix (launch/matrix.sh) runs
  in the oldest and the newest supported environments: ``JAX_RERUN`` plus the optimizer,
  loss scaling, saving and checkpoint modules and the version checks. Their multi-process
  tests (marker ``distributed``) and CLI tests are left out there.
"""

JAX_RERUN = (
    "tests/test_policy.py",
    "tests/test_layers.py",
    "tests/test_float32_layers.py",
    "tests/test_layer_walk.py",
    "tests/test_auditing.py",
    "tests/test_probing.py",
    "tests/test_master_weights.py",  # the stateless path (its 2-process runs: not here)
    "tests/test_scale_guard.py",  # keras.io's JAX train_step
)

CORE_TESTS = (
    *JAX_RERUN,
    "tests/test_loss_scale.py",
    "tests/test_optimizer.py",
    "tests/test_optimizer_settings.py",
    "tests/test_scaling_optimizer.py",
    "tests/test_saving.py",
    "tests/test_load_precision.py",
    "tests/callbacks/test_step_checkpoint.py",
    "tests/test_versions.py",
    "tests/test_keras_internals.py",
    "tests/test_public_api.py",
)
