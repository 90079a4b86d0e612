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

import kmp
from kmp.hardware import GPU, Hardware
from tests._support import requires_horovod, run_workers
from tests._zoo import APPLICATIONS, HUB

GPU_HW = Hardware(gpus=(GPU("v100", (7, 0)),))  # float16 without the CPU warning
HAS_HUB = importlib.util.find_spec("keras_hub") is not None
needs_hub = pytest.mark.skipif(
    not HAS_HUB,
    reason="keras-hub is not installed (launch/setup.sh installs it: requirements-hub.txt)",
)

CASES = [pytest.param(name, *HUB[name], marks=needs_hub, id=name) for name in HUB] + [
    # keras.applications models: 5-40 CPU-s each (tracing a full-size network: _eagerly)
    pytest.param(name, *APPLICATIONS[name], marks=pytest.mark.slow, id=name)
    for name in APPLICATIONS
]


def _optimizer(name: str) -> keras.optimizers.Optimizer:
    """Each model's usual optimizer: Adam for the KerasHub models, SGD with momentum for the
    keras.applications CNNs (how ResNets are trained, and a third less graph to trace)."""
    if name in HUB:
        return keras.optimizers.Adam(1e-3)
    return keras.optimizers.SGD(1e-3, momentum=0.9)


# keras.applications models whose mixed_bfloat16 steps run eagerly (see _eagerly). Not
# ConvNeXtTiny: eagerly, Keras compiles its depthwise convolutions with XLA call by call,
# slower than tracing the step once (49 s against 36 measured).
EAGER_BFLOAT16 = ("ResNet50", "MobileNetV3Small")


def _eagerly(name: str, policy: str) -> bool:
    """Whether ``fit`` runs eagerly rather than as a traced step.

    Tracing a full-size network's training step is most of these tests' time (ResNet50:
    30 CPU-s traced, 4 run eagerly). Every model is traced under mixed_float16 (kmp's
    loss-scale update and skip inside the compiled step); under mixed_bfloat16 the models
    of ``EAGER_BFLOAT16`` run the same two steps eagerly, through the same kmp code.
    """
    return name in EAGER_BFLOAT16 and policy == "mixed_bfloat16"


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
    x, y = make_batch(rng, 16)  # 2 steps of 8: batch norm needs more than 2 examples
    model(x[:2] if not isinstance(x, dict) else {k: v[:2] for k, v in x.items()})

    before = kmp.audit(model)  # runs on every model; its findings are the audit tests' concern
    assert before.rows

    model = kmp.float32_outputs(model)
    dtypes = _floating_outputs(model(x))
    assert dtypes and set(dtypes) == {"float32"}, (name, dtypes)
    after = kmp.audit(model)
    assert after.ok, after.summary()

    from_logits = name in HUB  # KerasHub heads produce logits; applications end in softmax
    model.compile(
        optimizer=kmp.wrap_optimizer(_optimizer(name)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
        run_eagerly=_eagerly(name, policy),
    )
    start = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    # 2 steps: one trace, or none (_eagerly)
    history = model.fit(x, y, epochs=1, batch_size=len(y) // 2, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all(), (name, policy, losses)
    assert all(np.isfinite(keras.ops.convert_to_numpy(w)).all() for w in model.weights)
    opt = model.optimizer
    # Every step is applied or skipped, and a skip is counted, never hidden.
    applied = int(opt.iterations.numpy())
    assert applied + opt.skipped_steps == 2
    if policy == "mixed_bfloat16":  # no scaling, nothing to skip: the weights moved
        assert opt.skipped_steps == 0
        moved = [
            np.abs(keras.ops.convert_to_numpy(w) - s).max()
            for w, s in zip(model.trainable_weights, start, strict=True)
        ]
        assert max(moved) > 0
    else:  # float16 starts at 2**15; a randomly initialised ResNet50 needs about 2**7, so
        # its first steps overflow and are skipped while the scale comes down, as designed.
        assert opt.loss_scale == 2.0**15 / 2**opt.skipped_steps


@needs_hub
@pytest.mark.distributed
@pytest.mark.slow
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


@needs_hub
def test_keras_hub_lm_with_float32_outputs_generates_saves_and_loads(tmp_path):
    import keras_hub

    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    keras.utils.set_random_seed(0)
    build, make_batch = HUB["GPT2CausalLM"]
    lm = kmp.float32_outputs(build())
    assert isinstance(lm, keras_hub.models.GPT2CausalLM) and kmp.layers.has_float32_outputs(lm)
    x, _ = make_batch(np.random.default_rng(0))
    x["padding_mask"][:, 8:] = 0  # a prompt of 8 tokens, 8 to generate
    out = lm.generate(x, max_length=x["token_ids"].shape[1], stop_token_ids=None)
    assert out["token_ids"].shape == x["token_ids"].shape
    np.testing.assert_array_equal(out["token_ids"][:, :8], x["token_ids"][:, :8])

    path = tmp_path / "lm.keras"
    lm.save(path)
    loaded = kmp.load_model(path)
    assert isinstance(loaded, keras_hub.models.GPT2CausalLM)
    assert kmp.layers.has_float32_outputs(loaded)
    assert loaded.backbone.token_embedding.reverse_dtype == "bfloat16"
    logits = keras.ops.convert_to_numpy(loaded(x))
    assert logits.dtype == np.float32
    np.testing.assert_array_equal(logits, keras.ops.convert_to_numpy(lm(x)))
