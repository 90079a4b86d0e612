"""bfloat16 weights with compensated updates: kmp.master_weights and kmp.compensated.

One process here, on the TensorFlow backend and (tests/test_backends.py) on JAX, whose
stateless path this exercises; the 2-rank fits on both engines are at the bottom.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import kmp
from kmp import master_weights as mw
from kmp.elastic import KerasState
from tests._support import ROOT, requires_horovod, run_workers

MODES = ("kahan", "stochastic", "none")


@pytest.fixture(autouse=True)
def _float32_after():
    yield
    kmp.disable()


def as_float(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), dtype=np.float64)


def bf16_weight(value, shape=()) -> keras.Variable:
    return keras.Variable(np.full(shape, value, "float32"), dtype="bfloat16")


def sgd_steps(mode: str, steps: int = 100, shape=(), lr: float = 1e-3, **kwargs):
    """``steps`` SGD steps of ``lr`` (gradient 1) on a bfloat16 weight of 1.0."""
    v = bf16_weight(1.0, shape)
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(lr), master_weights=mode, **kwargs)
    grad = ops.ones(shape, "bfloat16")
    for _ in range(steps):
        opt.apply([grad], [v])
    return v, opt


# ------------------------------------------------------------------- the rule (pure)


@pytest.mark.parametrize(
    ("setting", "dtype", "mode"),
    [
        ("auto", "bfloat16", "kahan"),
        ("auto", "float16", "kahan"),
        ("auto", "float32", "exact"),
        ("kahan", "float32", "exact"),
        ("stochastic", "bfloat16", "stochastic"),
        ("none", "bfloat16", "none"),
        ("float32", "float32", "exact"),
    ],
)
def test_update_mode_per_weight_dtype(setting, dtype, mode):
    assert mw.update_mode(setting, dtype) == mode


@pytest.mark.parametrize(
    ("setting", "dtype", "match"),
    [("float32", "bfloat16", "mixed_bfloat16"), ("stochastic", "float16", "kahan")],
)
def test_update_mode_refuses_what_cannot_work(setting, dtype, match):
    with pytest.raises(ValueError, match=match):
        mw.update_mode(setting, dtype)


@pytest.mark.parametrize(("bad", "error"), [("fp32", ValueError), (32, TypeError)])
def test_bad_settings_are_refused_at_wrap_time(bad, error):
    with pytest.raises(error, match="master_weights"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), master_weights=bad)
    with pytest.raises(ValueError, match="rounding_seed"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), rounding_seed=-1)


def test_float32_master_weights_under_the_bfloat16_policy_is_refused_with_the_fix():
    kmp.enable("bfloat16")
    with pytest.raises(ValueError, match=r"kmp.enable\('mixed_bfloat16'\)"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), master_weights="float32")


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    step = 2.0**-7  # bfloat16's spacing in [1, 2)
    exact = ops.full((20000,), 1.0 + 0.3 * step, "float32")
    bits = mw.random_bits((20000,), seed=0, step=0, index=0)
    rounded = as_float(mw.stochastic_round(exact, bits))
    assert set(np.unique(rounded)) == {1.0, 1.0 + step}
    assert abs(rounded.mean() - (1.0 + 0.3 * step)) < 0.02 * step
    negative = as_float(mw.stochastic_round(ops.negative(exact), bits))
    np.testing.assert_array_equal(negative, -rounded)  # magnitude rounding: symmetric


def test_random_bits_are_a_pure_function_of_seed_step_and_index():
    def draw(seed, step, index):
        return np.asarray(ops.convert_to_numpy(mw.random_bits((64, 8), seed, step, index)))

    a = draw(0, 5, 2)
    assert a.min() >= 0 and a.max() < 2**16 and len(np.unique(a)) > 400
    np.testing.assert_array_equal(a, draw(0, 5, 2))
    for other in (draw(1, 5, 2), draw(0, 6, 2), draw(0, 5, 3)):
        assert np.mean(a == other) < 0.01


def test_compensated_add_keeps_what_rounding_loses():
    w, c = ops.ones((3,), "bfloat16"), ops.zeros((3,), "bfloat16")
    for _ in range(100):
        w, c = mw.compensated_add(w, c, ops.full((3,), -1e-3, "float32"))
    dtypes = {keras.backend.standardize_dtype(t.dtype) for t in (w, c)}
    assert dtypes == {"bfloat16"}
    np.testing.assert_allclose(as_float(w) + as_float(c), 0.9, atol=1e-4)


# ---------------------------------------------------------- in the wrapped optimizer


def test_100_sgd_steps_of_1e3_end_at_0_9_with_kahan_and_stay_at_1_with_none():
    v, opt = sgd_steps("kahan")
    assert str(v.dtype) == "bfloat16"
    assert abs(float(as_float(v)) - 0.9) <= 0.01
    owed = float(as_float(opt.compensated.buffers[0]))
    assert abs(float(as_float(v)) + owed - 0.9) < 1e-4  # the buffer holds the rest
    v, _ = sgd_steps("none")
    assert float(as_float(v)) == 1.0  # every 1e-3 step is below half a bfloat16 step


def test_100_sgd_steps_of_1e3_end_at_0_9_with_stochastic_rounding():
    """Stochastic: each weight is a random walk on the bfloat16 grid (its spread over
    100 steps is about 0.016); their mean is 0.9, and every value is a bfloat16."""
    v, _ = sgd_steps("stochastic", shape=(4096,))
    values = as_float(v)
    assert abs(values.mean() - 0.9) <= 0.002
    assert 0.005 < values.std() < 0.03
    assert set(np.round(values * 256) / 256) == set(values)  # on the grid below 1
    one, _ = sgd_steps("stochastic")
    assert abs(float(as_float(one)) - 0.9) <= 0.05


def test_stochastic_runs_are_reproducible_from_their_seed():
    a, _ = sgd_steps("stochastic", steps=20, shape=(256,), rounding_seed=7)
    b, _ = sgd_steps("stochastic", steps=20, shape=(256,), rounding_seed=7)
    c, _ = sgd_steps("stochastic", steps=20, shape=(256,), rounding_seed=8)
    np.testing.assert_array_equal(as_float(a), as_float(b))
    assert not np.array_equal(as_float(a), as_float(c))


def test_adam_learns_on_bfloat16_weights_only_through_kmp():
    """Keras's Adam on a bfloat16 weight never moves (beta_2 = 0.999 rounds to 1.0 in
    bfloat16, so its bias correction is 0); kmp hands it a float32 view."""
    v = bf16_weight(1.0, (4,))
    keras.optimizers.Adam(1e-3).apply([ops.ones((4,), "bfloat16")], [v])
    assert np.all(as_float(v) == 1.0)
    for mode in ("kahan", "stochastic"):
        v = bf16_weight(1.0, (256,))
        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), master_weights=mode)
        for _ in range(50):
            opt.apply([ops.ones((256,), "bfloat16")], [v])
        if mode == "kahan":  # each weight, within a bfloat16 step
            assert np.all(np.abs(as_float(v) - 0.95) < 0.004)
        else:  # a random walk per weight, unbiased
            assert abs(as_float(v).mean() - 0.95) < 0.004


def test_the_optimizers_bfloat16_slots_keep_their_small_steps():
    """Adam's second moment decays by 0.1 % a step, below half a bfloat16 step: rounded to
    nearest it would never decay; rounded stochastically it follows float32 on average."""

    def second_moment(dtype, mode):
        v = keras.Variable(np.ones((512,), "float32"), dtype=dtype)
        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-4), master_weights=mode)
        for g in [1.0] * 5 + [0.0] * 300:
            opt.apply([ops.full((512,), g, dtype)], [v])
        return as_float(opt.inner_optimizer.variables[-2 if mode == "kahan" else -1])

    exact = second_moment("float32", "auto")
    assert exact.mean() < 0.75 * 5e-3  # it decayed (5 steps of 1.0 gave about 5e-3)
    for mode in ("kahan", "stochastic"):
        assert abs(second_moment("bfloat16", mode).mean() / exact.mean() - 1) < 0.05, mode
    assert second_moment("bfloat16", "none").mean() > 1.2 * exact.mean()  # stuck near 5e-3


def test_float16_weights_take_kahan_and_keep_float16_slots():
    v = keras.Variable(np.ones((4,), "float32"), dtype="float16")
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), master_weights="auto")
    opt.apply([ops.full((4,), 1.0 / 3.0, "float16")], [v])
    assert opt.compensated.modes[v.path] == "kahan"
    momentum = as_float(opt.inner_optimizer.variables[2])  # 0.1 x 1/3, in float16's 11 bits
    assert str(opt.inner_optimizer.variables[2].dtype) == "float16"
    np.testing.assert_allclose(momentum, 1.0 / 30.0, atol=3e-5)


# The compensation wraps the same optimizer hooks for every Keras optimizer; on the JAX
# rerun (test_backends) four of them stand for the rest: plain, with slots, with decoupled
# weight decay, with a sign update.
_ON_BOTH = ("SGD", "Adam", "AdamW", "Lion")
OPTIMIZERS = [
    pytest.param(n, marks=() if n in _ON_BOTH else pytest.mark.backend_agnostic, id=n)
    for n in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "Nadam", "Lion", "Lamb",
              "Adafactor")
]  # fmt: skip


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_keras_optimizer_tracks_float32_with_kahan(name):
    """100 steps of a consistent gradient: float32 moves the weights by about 0.1 (far
    more than one bfloat16 step, far less per step than half of one)."""
    rng = np.random.default_rng(0)
    start = (1.0 + rng.normal(size=(8, 8)) * 0.1).astype("float32")
    grads = [(0.5 + rng.normal(size=(8, 8)) * 0.1).astype("float32") for _ in range(100)]

    def run(dtype, mode):
        opt = kmp.wrap_optimizer(getattr(keras.optimizers, name)(1e-3), master_weights=mode)
        v = keras.Variable(start, dtype=dtype)
        for g in grads:
            opt.apply([ops.cast(g, dtype)], [v])
        slots = {str(s.dtype) for s in opt.inner_optimizer.variables if len(s.shape) == 2}
        extra = opt.compensated.buffers if mode == "kahan" else []
        return as_float(v) + sum(as_float(b) for b in extra), slots

    exact, _ = run("float32", "auto")
    moved = np.abs(exact - start).mean()
    kahan, slots = run("bfloat16", "kahan")
    assert slots == {"bfloat16"}  # the optimizer's slots take the weights' dtype
    assert np.abs(kahan - exact).mean() < 0.1 * moved
    stochastic, _ = run("bfloat16", "stochastic")
    assert abs((stochastic - start).mean() / (exact - start).mean() - 1) < 0.1
    none, _ = run("bfloat16", "none")
    assert np.abs(none - exact).mean() > 0.5 * moved or name in ("SGD", "Adagrad", "RMSprop")


def test_weight_decay_is_compensated_too():
    v = bf16_weight(1.0, (4,))
    opt = kmp.wrap_optimizer(keras.optimizers.AdamW(1e-3, weight_decay=0.5), master_weights="kahan")
    for _ in range(40):
        opt.apply([ops.zeros((4,), "bfloat16")], [v])
    effective = as_float(v) + as_float(opt.compensated.buffers[0])
    np.testing.assert_allclose(effective, (1 - 5e-4) ** 40, atol=1e-4)


def state_bytes_per_param(model) -> float:
    params = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    return mw.state_bytes(model) / params


def compiled(policy: str, mode: str, seed: int = 0):
    kmp.enable(policy)
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)]
    )
    model = kmp.float32_outputs(model)
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), master_weights=mode)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, (x[:, :4].argmax(axis=1)).astype("int32")


@pytest.mark.backend_agnostic  # variables' dtypes: the same bytes on every backend
@pytest.mark.parametrize(
    ("policy", "mode", "per_param"),
    [("mixed_bfloat16", "auto", 12.0), ("bfloat16", "kahan", 8.0), ("bfloat16", "stochastic", 6.0),
     ("bfloat16", "none", 6.0)],
)  # fmt: skip
def test_bytes_held_per_parameter_with_adam(policy, mode, per_param):
    model = compiled(policy, mode)
    x, y = batch()
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    assert state_bytes_per_param(model) == pytest.approx(per_param, rel=0.01)


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_a_saved_model_resumes_exactly(mode, tmp_path):
    model = compiled("bfloat16", mode)
    x, y = batch()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = kmp.load_model(path)
    assert loaded.optimizer.settings.master_weights == mode
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for m in (model, loaded):
        m.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(model.weights + model.optimizer.variables,
                    loaded.weights + loaded.optimizer.variables, strict=True):  # fmt: skip
        np.testing.assert_array_equal(as_float(a), as_float(b))


def test_elastic_state_holds_and_restores_the_compensation():
    model = compiled("bfloat16", "kahan")
    state = KerasState(model)
    held = {v.path for v in state._variables}
    buffers = model.optimizer.compensated.buffers
    assert buffers and {b.path for b in buffers} <= held
    committed = [as_float(b) for b in buffers]
    x, y = batch()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert any(not np.array_equal(a, as_float(b)) for a, b in zip(committed, buffers, strict=True))
    state.restore()
    for a, b in zip(committed, buffers, strict=True):
        np.testing.assert_array_equal(a, as_float(b))


def test_the_audit_says_whether_bfloat16_weights_are_compensated():
    def finding(model):
        report = kmp.audit(model)
        return {f.severity for f in report.findings if f.code == "low-precision-variables"}

    assert finding(compiled("bfloat16", "kahan")) == {"info"}
    assert finding(compiled("bfloat16", "stochastic")) == {"info"}
    assert finding(compiled("bfloat16", "none")) == {"error"}
    model = compiled("bfloat16", "kahan")
    model.compile(keras.optimizers.Adam(), "mse")  # a plain Keras optimizer: lossy
    assert finding(model) == {"error"}
    assert finding(compiled("mixed_bfloat16", "auto")) == set()


def test_fit_learns_with_every_compensating_mode_and_not_without():
    """Small learning rate: float32 learns; plain bfloat16 rounding loses the updates."""
    x, y = batch(256)
    losses = {}
    for policy, mode in [("float32", "auto"), ("bfloat16", "kahan"), ("bfloat16", "stochastic"),
                         ("bfloat16", "none")]:  # fmt: skip
        model = compiled(policy, mode)
        model.optimizer.inner_optimizer.learning_rate.assign(1e-4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = model.fit(x, y, epochs=8, batch_size=32, verbose=0, shuffle=False)
        losses[mode if policy == "bfloat16" else policy] = h.history["loss"]
    drop = {k: v[0] - v[-1] for k, v in losses.items()}
    # Measured: kahan and stochastic 0.87-1.15 of float32's drop, none 0.14-0.19.
    assert drop["kahan"] > 0.7 * drop["float32"] and drop["stochastic"] > 0.7 * drop["float32"]
    assert drop["none"] < 0.4 * drop["float32"]


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow's allocator and graph order (JAX's compiler schedules its buffers)",
)
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_a_compiled_step_never_holds_every_gradient_and_float32_copies_at_once(mode):
    """In a ``tf.function`` each weight's update is one compiled computation; op by op, in
    the same order, each update holds several float32 copies of its weight. Both are
    measured side by side, each in a child process that starts TensorFlow with its BFC
    allocator (tests/_step_peak.py), so the answer does not depend on what ran before.

    The bound is the gap, in float32 copies of the largest layer (F, here half the bfloat16
    gradients' size), between the best of five steps of each path. The children run
    TensorFlow with one inter-op thread, so a peak is what the step holds by construction:
    with TensorFlow's thread pool, two updates that happen to overlap raised the fused peak
    at random (kahan fused 2.04-2.52 against op by op 2.52-3.27 on issue 58's AVX2-only
    EPYC: the ranges met). Measured (peak / the bfloat16 gradients' bytes, five steps):

    - AMD EPYC, AVX2 only (no AVX-512), one inter-op thread: kahan fused 1.52 every step,
      op by op 3.01-3.26 (gap 3.0 F); stochastic fused 1.52, op by op 2.52-2.77 (gap 2.0 F).
    - Earlier, with TensorFlow's pool: AVX512_BF16 EPYC, oneDNN on: kahan fused 1.51, op by
      op 2.50-2.76; stochastic fused 0.80-1.01, op by op 2.51. oneDNN off: kahan fused
      1.76-2.02, op by op 2.77-3.02; stochastic fused 1.28, op by op 2.52-2.77.
    """
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "PYTHONPATH": str(ROOT),
           "KERAS_BACKEND": "tensorflow"}  # fmt: skip
    children = {
        path: subprocess.Popen(
            [sys.executable, "-m", "tests._step_peak", mode, path, "5"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in ("fused", "op-by-op")
    }
    runs = {}
    try:
        for path, child in children.items():
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err[-3000:]
            runs[path] = json.loads(out.strip().splitlines()[-1])
    finally:
        for child in children.values():
            child.kill()
    best = {path: min(run["peaks"]) for path, run in runs.items()}
    layer = runs["fused"]["layer_float32_bytes"]
    ratios = {path: [p / runs[path]["gradient_bytes"] for p in run["peaks"]]
              for path, run in runs.items()}  # fmt: skip
    assert best["op-by-op"] - best["fused"] >= layer, ratios  # 2.0-3.0 F measured
    assert best["fused"] < 0.75 * best["op-by-op"], ratios  # 0.50-0.60 measured


# ------------------------------------------------------------------ 2 ranks, 2 engines


def _check_ranks(ranks: list[dict], engine: str) -> None:
    for res in ranks:
        assert res["engine"] == engine
        for name, run in res["runs"].items():
            assert run["max_diff"] == 0.0, name  # weights and optimizer state, bit for bit
            assert run["moved"] > 1e-3 and run["dtype"] == "bfloat16", name
    runs = ranks[0]["runs"]
    assert "kahan-scaled" in runs  # loss scaling (and on Horovod accumulation, compression)
    assert runs["stochastic"]["weights"] == runs["stochastic-again"]["weights"]  # seeded
    assert runs["stochastic"]["weights"] != runs["kahan"]["weights"]


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_two_horovod_ranks_end_bit_identical_in_every_mode(tmp_path):
    ranks = run_workers("worker_master_weights.py", out_dir=tmp_path, timeout=300)
    _check_ranks(ranks, "horovod")


@pytest.mark.distributed
@pytest.mark.slow  # kmp's own launcher: no Horovod needed
def test_two_jax_engine_processes_end_bit_identical_in_every_mode(tmp_path):
    pytest.importorskip("jax")
    ranks = run_workers("worker_master_weights.py", out_dir=tmp_path, engine="jax", timeout=300)
    _check_ranks(ranks, "jax")
