"""DistributedLossScaleOptimizer (kmp/scaling_optimizer.py, kmp/accumulation.py): the step.

Scaling, skipping, accumulation, saved state and old names in one process; the JAX
backend; and two real Horovod ranks (two horovodrun jobs, marked slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import kmp
from kmp._launcher_env import LAUNCH_SIZE_VARS
from kmp.optimizer import DistributedLossScaleOptimizer, wrap_optimizer
from tests._support import ROOT, requires_horovod, run_workers
from tests._training import Weights, data, fit, max_diff, model_for

# ----------------------------------------------------------- bad input


def test_apply_before_build_needs_variables():
    opt = wrap_optimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="pass the variables on the first call"):
        opt.apply([np.ones(2, "float32")])


def test_gradient_count_must_match():
    v = [keras.Variable(np.zeros(2, "float32")), keras.Variable(np.zeros(3, "float32"))]
    opt = wrap_optimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="2 gradients for 1 variables"):
        opt.apply([np.ones(2, "float32"), np.ones(3, "float32")], v[:1])


# ------------------------------------------------------------ training


def test_same_training_as_hand_wired_keras_loss_scaling():
    """Loss scaled once, not twice: identical to Keras's LossScaleOptimizer, step for step.

    ``underflow_threshold=None`` is Keras's rule (kmp's default also grows on underflow).
    """
    x, y = data()
    ours = model_for("mixed_float16")
    start = ours.get_weights()
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), growth_interval=3, underflow_threshold=None)
    fit(ours, opt, x, y, epochs=2)
    ref = model_for("mixed_float16")
    ref.set_weights(start)
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=3)
    fit(ref, lso, x, y, epochs=2)
    assert max_diff(ours.get_weights(), ref.get_weights()) == 0.0
    assert opt.loss_scale == float(lso.dynamic_scale.numpy()) == 2.0**15 * 4
    assert max_diff(ours.get_weights(), start) > 1e-3


def test_no_scaling_is_free():
    opt = wrap_optimizer(keras.optimizers.SGD(), loss_scale=None)
    loss = keras.ops.convert_to_tensor(2.5)
    assert opt.scale_loss(loss) is loss
    assert (
        keras.ops.convert_to_numpy(
            wrap_optimizer(keras.optimizers.SGD(), loss_scale=4.0).scale_loss(loss)
        )
        == 10.0
    )


def test_unscaled_training_is_exactly_the_inner_optimizer():
    x, y = data()
    a = model_for("float32")
    start = a.get_weights()
    fit(a, wrap_optimizer(keras.optimizers.Adam(1e-2)), x, y, epochs=2)
    b = model_for("float32")
    b.set_weights(start)
    fit(b, keras.optimizers.Adam(1e-2), x, y, epochs=2)
    assert max_diff(a.get_weights(), b.get_weights()) == 0.0


def test_static_scale_stays_and_skips_non_finite_steps():
    x, y = data()
    x[16:32] = 1e30  # overflows float16: the second step is not finite
    model = model_for("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), loss_scale=128)
    rec = Weights()
    fit(model, opt, x, y, callbacks=[rec])
    assert opt.loss_scale == 128.0
    assert opt.skipped_steps == 1
    assert int(opt.iterations) == 3
    assert max_diff(rec.rows[2], rec.rows[1]) == 0.0
    assert max_diff(rec.rows[3], rec.rows[2]) > 0.0


def test_dynamic_scale_grows_and_halves():
    x, y = data(96)
    x[48:64] = 1e30  # step 4 of 6 overflows
    model = model_for("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), initial_scale=64, growth_interval=2)
    scales = []

    class Scale(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            scales.append(opt.loss_scale)

    fit(model, opt, x, y, callbacks=[Scale()])
    # finite, finite (x2), finite, overflow (/2, counter reset), finite, finite (x2)
    assert scales == [64.0, 128.0, 128.0, 64.0, 64.0, 128.0]
    assert opt.skipped_steps == 1
    assert int(opt.iterations) == 5
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# -------------------------------------------------------- accumulation


def test_accumulation_equals_the_doubled_batch():
    x, y = data()
    a = model_for("float32")
    start = a.get_weights()
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    fit(a, opt, x, y, batch=8)
    b = model_for("float32")
    b.set_weights(start)
    fit(b, wrap_optimizer(keras.optimizers.Adam(1e-2)), x, y, batch=16)
    assert int(opt.iterations) == 4
    assert max_diff(a.get_weights(), b.get_weights()) < 1e-6
    assert max_diff(a.get_weights(), start) > 1e-3


def test_a_bad_micro_batch_skips_its_window_only():
    x, y = data()
    x[8:16] = np.inf  # micro-batch 2 = second half of window 1
    model = model_for("float32")
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    rec = Weights()
    fit(model, opt, x, y, batch=8, callbacks=[rec])
    rows = rec.rows  # rows[k] = weights after k micro-batches
    assert max_diff(rows[2], rows[0]) == 0.0  # window 1 skipped
    assert max_diff(rows[4], rows[2]) > 0.0  # window 2 applied
    assert opt.skipped_steps == 1 and int(opt.iterations) == 3
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert all(float(np.abs(a.numpy()).max()) == 0.0 for a in opt._accumulators)
    # Window 2 onwards is exactly a clean run that starts after the bad window.
    clean = model_for("float32")
    clean.set_weights(rows[2])
    fit(
        clean,
        wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2),
        x[16:],
        y[16:],
        batch=8,
    )
    assert max_diff(clean.get_weights(), model.get_weights()) == 0.0


def test_accumulation_with_scaling_in_a_custom_loop():
    import tensorflow as tf

    keras.config.set_dtype_policy("mixed_float16")
    x, y = data()
    model = model_for("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4, growth_interval=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    for i in range(0, 64, 8):
        step(x[i : i + 8], y[i : i + 8])
    assert int(opt.iterations) == 2
    assert opt.loss_scale == 2.0**17  # grew once per update, not per micro-batch


# --------------------------------------------------------- saved state


def test_save_and_load_keep_loss_scale_state(tmp_path):
    x, y = data()
    x[16:32] = 1e30
    model = model_for("mixed_float16")
    opt = wrap_optimizer(
        keras.optimizers.Adam(1e-2), initial_scale=1024, growth_interval=2, compression="fp16"
    )
    fit(model, opt, x, y, epochs=2)
    state = (opt.loss_scale, opt.skipped_steps, int(opt.iterations))
    assert state == (1024.0, 2, 6)
    path = tmp_path / "m.keras"
    model.save(path)
    keras.config.set_dtype_policy("float32")  # the mode saved with the model wins
    loaded = keras.saving.load_model(path)
    lo = loaded.optimizer
    assert isinstance(lo, DistributedLossScaleOptimizer)
    assert (lo.loss_scale, lo.skipped_steps, int(lo.iterations)) == state
    assert lo.loss_scale_mode == "dynamic"
    assert lo.settings == opt.settings
    # Both continue identically.
    fit(model, opt, x, y)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert max_diff(model.get_weights(), loaded.get_weights()) == 0.0
    assert (lo.loss_scale, lo.skipped_steps) == (opt.loss_scale, opt.skipped_steps)


def test_a_save_from_before_the_underflow_rule_loads_into_it():
    """An optimizer saved without the underflow reading restores into one that keeps it."""
    x, y = data()
    model = model_for("mixed_float16")
    knobs = {"initial_scale": 1024, "growth_interval": 2}
    old = wrap_optimizer(keras.optimizers.Adam(1e-2), underflow_threshold=None, **knobs)
    fit(model, old, x, y)
    store: dict = {}
    old.save_own_variables(store)
    new = wrap_optimizer(keras.optimizers.Adam(1e-2), **knobs)
    new.build(model.trainable_variables)
    assert len(new.variables) == len(store) + 1
    new.load_own_variables(store)
    share = new.underflow_share_variable
    kept = [v for v in new.variables if v is not share]
    assert max_diff([np.asarray(v) for v in kept], [np.asarray(v) for v in old.variables]) == 0
    assert new.underflow_share == 0.0 and new.loss_scale == old.loss_scale == 4096.0
    with pytest.warns(UserWarning, match="Skipping variable loading"):  # anything else: Keras's
        new.load_own_variables({"0": np.int64(0)})


def test_tf_checkpoint_keeps_loss_scale_state(tmp_path):
    import tensorflow as tf

    x, y = data()
    x[0:16] = 1e30
    model = model_for("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    fit(model, opt, x, y)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    saved = ckpt.write(str(tmp_path / "ckpt"))
    state = (opt.loss_scale, opt.skipped_steps, int(opt.iterations))
    assert state == (2.0**14, 1, 1)
    other = model_for("mixed_float16", seed=2)
    opt2 = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    opt2.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=opt2).read(saved).assert_consumed()
    assert (opt2.loss_scale, opt2.skipped_steps, int(opt2.iterations)) == state
    assert max_diff(other.get_weights(), model.get_weights()) == 0.0


def test_config_round_trip():
    keras.config.set_dtype_policy("mixed_bfloat16")
    opt = wrap_optimizer(
        keras.optimizers.Adam(3e-3), compression="bf16", backward_passes_per_step=3
    )
    assert opt.loss_scale_mode == "none"
    cfg = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    keras.config.set_dtype_policy("mixed_float16")
    again = keras.saving.deserialize_keras_object(cfg)
    assert isinstance(again, DistributedLossScaleOptimizer)
    assert again.settings == opt.settings
    assert again.loss_scale_mode == "none"  # decided once, kept
    assert float(again.learning_rate.numpy()) == pytest.approx(3e-3)


def test_keras_names_do_not_warn(recwarn):
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data()
    x[16:32] = 1e30
    opt = wrap_optimizer(keras.optimizers.SGD(), growth_interval=2)
    fit(model_for("mixed_float16"), opt, x, y)
    # Keras's LossScaleOptimizer names: the finite steps since the scale moved, the scale.
    assert (int(keras.ops.convert_to_numpy(opt.step_counter)), opt.skipped_steps) == (0, 1)
    assert float(keras.ops.convert_to_numpy(opt.dynamic_scale)) == opt.loss_scale
    package = Path(kmp.__file__).resolve().parent  # kmp's own files, not any path naming kmp
    assert not [(w.filename, w.lineno, str(w.message)) for w in recwarn
                if issubclass(w.category, DeprecationWarning)
                and Path(w.filename).resolve().is_relative_to(package)]  # fmt: skip


# ----------------------------------------------------------------- JAX


JAX_SCRIPT = r"""
import json, numpy as np, keras
from kmp.optimizer import wrap_optimizer
assert keras.backend.backend() == "jax"
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype("float32"); y = x[:, :4].argmax(1).astype("int32")
x[48:64] = 1e30
out = {}
for policy, ls in (("mixed_float16", "dynamic"), ("mixed_float16", 64.0), ("float32", "dynamic")):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(4),
                          keras.layers.Activation("softmax", dtype="float32")])
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), loss_scale=ls, initial_scale=64,
                         growth_interval=2)
    m.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    scales = []
    class Rec(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # self.model syncs the JAX training state back into the variables.
            scales.append(self.model.optimizer.loss_scale)
    cb = Rec()
    m.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    out[f"{policy}/{ls}"] = {"mode": opt.loss_scale_mode, "scales": scales,
        "skipped": opt.skipped_steps, "iterations": int(opt.iterations),
        "finite": bool(all(np.isfinite(w).all() for w in m.get_weights()))}
    if ls == "dynamic" and policy == "mixed_float16":
        m.save("/tmp/kmp_jax_model.keras")
        lo = keras.saving.load_model("/tmp/kmp_jax_model.keras").optimizer
        out["loaded"] = [lo.loss_scale, lo.skipped_steps, int(lo.iterations)]
try:
    wrap_optimizer(keras.optimizers.SGD(), backward_passes_per_step=2).stateless_apply
    o = wrap_optimizer(keras.optimizers.SGD(), backward_passes_per_step=2)
    v = [keras.Variable(np.zeros(2, "float32"))]
    o.build(v)
    o.stateless_apply([w.value for w in o.variables], [np.ones(2, "float32")], [v[0].value])
    out["accumulate_error"] = None
except NotImplementedError as e:
    out["accumulate_error"] = str(e)
print("RESULT" + json.dumps(out))
"""


def test_jax_backend_single_process_loss_scaling(tmp_path):
    pytest.importorskip("jax")
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
    }
    for var in LAUNCH_SIZE_VARS:
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", JAX_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    dyn = out["mixed_float16/dynamic"]
    assert dyn["mode"] == "dynamic"
    assert dyn["scales"] == [64.0, 128.0, 128.0, 64.0, 64.0, 128.0]
    assert (dyn["skipped"], dyn["iterations"], dyn["finite"]) == (1, 5, True)
    static = out["mixed_float16/64.0"]
    assert static["mode"] == "static" and set(static["scales"]) == {64.0}
    assert (static["skipped"], static["iterations"], static["finite"]) == (1, 5, True)
    off = out["float32/dynamic"]
    assert off["mode"] == "none" and set(off["scales"]) == {1.0} and off["skipped"] == 0
    assert out["loaded"] == [128.0, 1, 5]
    assert "gradient_accumulation_steps" in out["accumulate_error"]


# -------------------------------------------------- real Horovod ranks


@pytest.fixture(scope="module")
def training_job():
    """One horovodrun job: bit-identical ranks, concatenated batch, custom loop."""
    r0, r1 = run_workers("worker_opt_train.py", "identical", "concat", "loop", timeout=600)
    return r0, r1


@pytest.fixture(scope="module")
def state_job():
    """One horovodrun job: compression, overflow on one rank, accumulation, resume."""
    return run_workers(
        "worker_opt_train.py",
        "compression",
        "overflow",
        "accumulate",
        "resume",
        "buckets",
        env={"HOROVOD_TIMELINE": "DYNAMIC"},
        timeout=600,
    )


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_ranks_fed_different_data_end_bit_identical(training_job, policy):
    for res in training_job:
        got = res["identical"][policy]
        assert got["spread_before_broadcast"] > 0.1  # they really started apart
        assert got["spread"] == 0.0  # allgather max difference
        assert got["moved"] > 1e-2  # and they really trained
        assert got["iterations"] == 18
        assert got["bytes_per_step"] == 4 * (8 * 32 + 32 + 32 * 4 + 4)
    compute = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
    assert training_job[0]["identical"][policy]["compute_dtype"] == compute[policy]
    mode = "dynamic" if policy == "mixed_float16" else "none"
    assert training_job[0]["identical"][policy]["mode"] == mode


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_plain_keras_optimizer_lets_ranks_drift(training_job):
    """The control that shows the bit-identity check can fail."""
    assert training_job[0]["identical"]["plain_keras_spread"] > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_two_ranks_match_one_process_on_the_concatenated_batch(training_job):
    for res in training_job:
        got = res["concat"]
        assert got["vs_reference"] < 1e-5
        assert got["own_shard_vs_reference"] > 1e-2  # training on one shard alone differs
        assert got["moved"] > 1e-2


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_custom_loop_matches_model_fit(training_job):
    for res in training_job:
        got = res["loop"]
        assert got["loop_vs_fit"] < 1e-6
        assert got["spread"] == 0.0
        assert got["scales"][0] == got["scales"][1] == 2.0**17
        assert got["iterations"] == [8, 8]
        assert got["moved"] > 1e-2


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_compression_halves_the_bytes_and_trains_the_same(state_job):
    full = 4 * (8 * 32 + 32 + 32 * 4 + 4)
    timeline = state_job[0]["compression"]
    assert timeline["None"]["timeline"] == {"float32": 2 * full}  # 2 steps recorded
    assert timeline["fp16"]["timeline"] == {"float16": full}  # half the bytes, as float16
    assert timeline["bf16"]["timeline"] == {"int16": full}  # bfloat16 bits, half the bytes
    for res in state_job:
        got = res["compression"]
        assert got["None"]["bytes_per_step"] == full
        assert got["fp16"]["bytes_per_step"] == got["bf16"]["bytes_per_step"] == full // 2
        for comp in ("fp16", "bf16"):
            assert got[comp]["loss"] == pytest.approx(got["None"]["loss"], rel=1e-3)
            assert got[comp]["spread"] == 0.0
    assert state_job[0]["compression"]["None"]["loss"] < 1.2  # it did learn (chance: 1.39)


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_inf_on_one_rank_makes_every_rank_skip_and_halve(state_job):
    for res in state_job:
        got = res["overflow"]
        assert got["unchanged_by_bad_step"] == 0.0
        assert min(got["changed_by_good_steps"]) > 0.0
        assert got["scales"] == [32768.0, 32768.0, 16384.0, 16384.0]
        assert got["skipped"] == [0, 0, 1, 1]
        assert got["iterations"] == [1, 2, 2, 3]
        assert got["spread"] == 0.0
    assert state_job[0]["overflow"] == state_job[1]["overflow"]


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_gradients_reduced_in_buckets_give_the_one_bucket_result(state_job):
    for res in state_job:
        got = res["buckets"]
        # Gradients of 1024, 128, 512 and 16 bytes: one op, two buckets of >= 200 B, four.
        assert got["ops"] == {"None": 1, "200": 2, "1": 4}
        assert got["ops_fp16"] == 2  # buckets are measured in the bytes sent
        assert got["bucketed_mean"] == [1.5]  # ranks sent 1 and 2
        assert all(got[f"spread/{b}"] == 0.0 for b in ("None", "200", "1"))
        assert got["vs_one_bucket"] < 1e-6
        over = got["overflow"]  # inf on rank 1 in step 3, every gradient its own bucket
        assert over["skipped"] == [0, 0, 1, 1]
        assert over["scales"] == [32768.0, 32768.0, 16384.0, 16384.0]
        assert over["spread"] == 0.0
        assert got["accumulate_spread/None"] == got["accumulate_spread/200"] == 0.0
        assert got["accumulate_iterations/200"] == 4
        assert got["accumulate_vs_one_bucket"] < 1e-6
        # kmp.xla.jit_gradients: the allreduce runs outside the XLA cluster, on every rank.
        assert got["xla_spread/True"] == got["xla_spread/False"] == 0.0
        assert got["xla_vs_plain"] < 1e-4 and got["xla_moved"] > 1e-2
    assert state_job[0]["buckets"]["overflow"] == state_job[1]["buckets"]["overflow"]


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_accumulation_across_ranks(state_job):
    for res in state_job:
        got = res["accumulate"]
        assert got["vs_double_batch"] < 1e-6
        assert got["iterations"] == 4 and got["spread"] == 0.0
        bad = got["bad_window"]
        assert (bad["skipped"], bad["iterations"]) == (1, 3)
        assert bad["window1_unchanged"] == 0.0 and bad["later_windows_moved"] > 0.0
        assert bad["finite"] and bad["spread"] == 0.0


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_save_load_resume_equals_training_straight_through(state_job):
    for res in state_job:
        got = res["resume"]
        assert got["type"] == "DistributedLossScaleOptimizer"
        assert got["state_after_load"] == got["state_saved"]
        assert got["state_saved"][1] == 2  # the saved state includes skipped steps
        assert got["resumed"] == got["straight"]
        assert got["weights_diff"] == 0.0
        assert got["spread"] == 0.0
