"""The model zoo: models people train, under both 16-bit policies, through kmp.

Tiny KerasHub task models built from code (skipped, with the reason, without keras-hub)
and keras.applications models (weights=None): the audit runs, ``kmp.float32_outputs``
gives float32 outputs, the audit afterwards has no error, and a few ``fit`` steps with
``kmp.wrap_optimizer`` stay finite.
"""

from __future__ import annotations

import importlib.util

import keras
import numpy as np
import pytest
from _zoo import APPLICATIONS, HUB
from conftest import requires_horovod, run_workers

import kmp
from kmp.hardware import GPU, Hardware

GPU_HW = Hardware(gpus=(GPU("v100", (7, 0)),))  # float16 without the CPU warning
HAS_HUB = importlib.util.find_spec("keras_hub") is not None
needs_hub = pytest.mark.skipif(
    not HAS_HUB,
    reason="keras-hub is not installed (launch/setup.sh installs it: requirements-hub.txt)",
)

CASES = [pytest.param(name, *HUB[name], marks=needs_hub, id=name) for name in HUB] + [
    pytest.param(name, *APPLICATIONS[name], id=name) for name in APPLICATIONS
]


def _floating_outputs(out) -> list:
    dtypes = [keras.backend.standardize_dtype(t.dtype) for t in keras.tree.flatten(out)]
    return [d for d in dtypes if "float" in d]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(("name", "build", "make_batch"), CASES)
def test_zoo_model_trains_with_float32_outputs(name, build, make_batch, policy):
    kmp.enable(policy, hardware=GPU_HW)
    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(0)
    x, y = make_batch(rng)
    model(x)  # built (subclassed models build on their first call)

    before = kmp.audit(model)  # runs on every model; its findings are the audit tests' concern
    assert before.rows

    model = kmp.float32_outputs(model)
    dtypes = _floating_outputs(model(x))
    assert dtypes and set(dtypes) == {"float32"}, (name, dtypes)
    after = kmp.audit(model)
    assert after.ok, after.summary()

    from_logits = name in HUB  # KerasHub heads produce logits; applications end in softmax
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
    )
    history = model.fit(x, y, epochs=1, batch_size=len(y) // 2, verbose=0)  # 2 steps, 1 trace
    losses = history.history["loss"]
    assert np.isfinite(losses).all(), (name, policy, losses)
    assert all(np.isfinite(keras.ops.convert_to_numpy(w)).all() for w in model.weights)
    opt = model.optimizer
    # Every step is applied or skipped, and a skip is counted, never hidden.
    assert int(opt.iterations.numpy()) + opt.skipped_steps == 2
    assert opt.skipped_steps <= 1, (name, policy, opt.skipped_steps)


@needs_hub
@requires_horovod
def test_keras_hub_lm_on_two_ranks_ends_identical_under_every_policy():
    policies = ["float32", "mixed_bfloat16", "mixed_float16"]
    ranks = run_workers("worker_hub_lm.py", *policies, timeout=600)
    for policy in policies:
        r0, r1 = (r[policy] for r in ranks)
        assert r0["class"] == "GPT2CausalLM"
        assert r0["logits_dtype"] == "float32"
        assert r0["spread"] == 0.0, (policy, r0["spread"])  # bit-identical weights
        assert np.isfinite(r0["losses"]).all()
        assert r0["applied"] + r0["skipped"] == 4  # 16 examples, batch 4
        assert (r0["skipped"], r0["scale"]) == (r1["skipped"], r1["scale"])  # they skip together
        if policy != "mixed_float16":
            assert r0["skipped"] == 0 and r0["scale"] == 1.0
