"""kmp.loss_scale: the one loss-scale rule, checked against an independent reference.

The reference below is plain Python, written from the rule's description (not
from kmp's code). The same sequence of steps (each a 3-value gradient at loss scale 1:
finite, overflowing, or with a value float16 holds only as a subnormal once scaled) is
run through:

* ``kmp.loss_scale.update`` on NumPy;
* the stateful Keras 3 path (TensorFlow, inside ``tf.function``);
* the stateless Keras 3 path (JAX, ``stateless_apply`` under ``jax.jit``, in a
  subprocess with ``KERAS_BACKEND=jax``);
* ``kmp.compat.v1.distributed_optimizer`` in a TF1 graph and session.

Every path must produce the identical trajectory: scale, skipped count, growth
counter, overflow (hysteresis) counter, and how many steps were applied.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp import loss_scale as ls
from kmp._checks import NOT_GIVEN
from kmp._launcher_env import LAUNCH_SIZE_VARS
from tests._support import ROOT

# A step's gradient at loss scale 1 (the paths feed it times the scale in use): finite,
# overflowing, a third of it a float16 subnormal below scale 64 (U), the same with a
# large value that leaves no headroom for a doubling above scale 8 (C).
F, N = (1.0, 1.0, 1.0), (math.inf,) * 3
U, C = (1.0, 1e-6, 2.0), (1.0, 1e-6, 300.0)
SEQUENCE = [F, F, F, N, F, F, F, F, F, F, N, N, N, N, N, N, F, N, F, F, F, F, F, F, N, F, F]
STARVED = [U, U, U, U, C, C, C, C, U, U, U, U, U, N, U, U, U, U, F, U]
UNDERFLOW = {"initial_scale": 2.0, "growth_interval": 1000, "max_scale": 2.0**20}
UNDERFLOW |= {"underflow_threshold": 0.25, "underflow_patience": 2}

# (kind, knobs): each exercises other knobs; the sequence reaches min_scale and max_scale.
SETTINGS = [
    ("dynamic", {"initial_scale": 2.0**15, "growth_interval": 2}),
    (
        "dynamic",
        {
            "initial_scale": 8.0,
            "growth_interval": 3,
            "growth_factor": 4.0,
            "backoff_factor": 0.25,
            "min_scale": 0.5,
            "max_scale": 64.0,
        },
    ),
    ("dynamic", {"initial_scale": 4.0, "growth_interval": 2, "hysteresis": 3, "max_scale": 16.0}),
    ("dynamic", {"initial_scale": 2.0, "growth_interval": 1, "hysteresis": 2, "min_scale": 2.0}),
    ("static", {"initial_scale": 128.0}),
]
IDS = ["defaults-fast-growth", "all-knobs", "hysteresis-3", "interval-1-at-min", "static"]
# Each case: (kind, knobs, steps); the underflow rule, and Keras's rule on the same steps.
CASES = [(kind, knobs, SEQUENCE) for kind, knobs in SETTINGS]
CASES += [
    ("dynamic", UNDERFLOW, STARVED),
    ("dynamic", {**UNDERFLOW, "underflow_threshold": None}, STARVED),
]
CASE_IDS = [*IDS, "underflow", "underflow-off"]


def reference_shares(knobs: dict, steps: list[tuple]) -> list[float]:
    """The underflow share each step's scaled gradient had (the reading the rule keeps)."""
    return [row[5] for row in _reference("dynamic", knobs, steps)]


def reference(kind: str, knobs: dict, steps: list[tuple]) -> list[tuple]:
    """The rule as documented, in plain Python: one row per step after it ran."""
    return [row[:5] for row in _reference(kind, knobs, steps)]


def _reference(kind: str, knobs: dict, steps: list[tuple]) -> list[tuple]:
    k = {**ls.DEFAULTS, **knobs}
    scale, good, streak, skipped, applied = float(k["initial_scale"]), 0, 0, 0, 0
    rows = []
    for gradient in steps:
        finite = all(math.isfinite(v) for v in gradient)
        scaled = [abs(v * scale) for v in gradient]
        share = sum(0 < v < 2**-14 for v in scaled) / len(scaled)  # float16 subnormals
        roomy = max(scaled) * k["growth_factor"] * 8 <= 65504  # the probe's margin
        if finite:
            applied += 1
        else:
            skipped += 1
        if kind == "dynamic":
            if finite:
                good, streak = good + 1, 0
                starved = k["underflow_threshold"] is not None and share > k["underflow_threshold"]
                early = starved and good >= k["underflow_patience"] and roomy
                if good == k["growth_interval"] or early:
                    scale, good = min(scale * k["growth_factor"], k["max_scale"]), 0
            else:
                good, streak = 0, streak + 1
                if streak >= k["hysteresis"]:
                    scale = max(scale * k["backoff_factor"], k["min_scale"])
        rows.append((scale, skipped, good, streak, applied, share))
    return rows


def as_rows(rows) -> list[tuple]:
    return [(float(s), int(k), int(g), int(h), int(a)) for s, k, g, h, a in rows]


def test_reference_reaches_both_bounds():
    """The fixture is strong enough: the sequences hit max_scale and min_scale."""
    rows = reference("dynamic", SETTINGS[1][1], SEQUENCE)
    assert max(r[0] for r in rows) == 64.0 and min(r[0] for r in rows) == 0.5
    hyst = reference("dynamic", SETTINGS[2][1], SEQUENCE)
    # With hysteresis 3 the first two overflows of a run only skip.
    assert hyst[10][0] == hyst[9][0] and hyst[11][0] == hyst[10][0] and hyst[12][0] < hyst[11][0]


def test_reference_grows_on_underflow_within_the_headroom():
    """The underflow fixture: early growths every 2 steps, one held back, none once clear."""
    scales = [r[0] for r in reference("dynamic", UNDERFLOW, STARVED)]
    assert scales[:4] == [2.0, 4.0, 4.0, 8.0]  # patience 2, then a third is subnormal
    assert scales[5:8] == [16.0, 16.0, 16.0]  # C at 16: doubling would leave < 8x headroom
    assert scales[10:13] == [64.0, 64.0, 64.0]  # at 64 nothing is subnormal: it stops
    assert scales[13] == 32.0 and scales[15] == 64.0  # an overflow, then underflow again
    assert set(reference_shares(UNDERFLOW, STARVED)) == {0.0, 1 / 3}
    off = reference("dynamic", {**UNDERFLOW, "underflow_threshold": None}, STARVED)
    assert {r[0] for r in off} == {1.0, 2.0}  # Keras's rule: only the overflow moves it


def _scaled(gradient: tuple, scale: float) -> np.ndarray:
    return np.asarray(gradient, "float32") * np.float32(scale)


@pytest.mark.parametrize(("kind", "knobs", "steps"), CASES, ids=CASE_IDS)
def test_update_on_numpy_matches_reference(kind, knobs, steps):
    rule = ls.LossScale(kind, **knobs)
    state = ls.ScaleState(np.float32(rule.start_scale), np.int64(0), np.int64(0), np.int64(0))
    rows, applied = [], 0
    for gradient in steps:
        g = _scaled(gradient, state.scale)
        finite = np.all(np.isfinite(g))
        applied += bool(finite)
        state = ls.update(rule, state, finite, ls.gradient_stats([g], xp=np), xp=np)
        rows.append((*state[:1], state.skipped, state.good_steps, state.overflow_streak, applied))
    assert as_rows(rows) == reference(kind, knobs, steps)


@pytest.mark.parametrize(("kind", "knobs", "steps"), CASES, ids=CASE_IDS)
def test_stateful_tensorflow_path_matches_reference(kind, knobs, steps):
    import tensorflow as tf

    from kmp.scaling_optimizer import DistributedLossScaleOptimizer

    rule = ls.LossScale(kind, **knobs)
    opt = DistributedLossScaleOptimizer(keras.optimizers.SGD(1.0), loss_scale_rule=rule)
    w = keras.Variable(np.zeros(3, "float32"))
    opt.build([w])

    def step(g):  # the gradients stand for a scaled loss's
        opt.scale_guard.scaled()
        opt.apply([g], [w])

    step = tf.function(step)
    rows, shares = [], []
    for gradient in steps:
        step(tf.constant(_scaled(gradient, opt.loss_scale)))  # the gradient of a scaled loss
        applied = -float(np.asarray(w)[0])  # each applied step moves w by -1 (lr 1, grad 1)
        rows.append(
            (
                opt.loss_scale,
                opt.skipped_steps,
                int(opt.step_counter),
                opt.overflow_streak,
                applied,
            )
        )
        shares.append(opt.underflow_share)
    assert as_rows(rows) == reference(kind, knobs, steps)
    if rule.measures_underflow:  # the reading the monitor reports, step by step
        assert shares == pytest.approx(reference_shares(knobs, steps))
    else:
        assert set(shares) == {None}


JAX_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, keras
from kmp import loss_scale as ls
from kmp.scaling_optimizer import DistributedLossScaleOptimizer
assert keras.backend.backend() == "jax"
cases = json.loads(sys.argv[1])
out = []
for kind, knobs, steps in cases:
    opt = DistributedLossScaleOptimizer(
        keras.optimizers.SGD(1.0), loss_scale_rule=ls.LossScale(kind, **knobs)
    )
    w = keras.Variable(np.zeros(3, "float32"))
    opt.build([w])
    index = {id(v): i for i, v in enumerate(opt.variables)}
    slots = [index[id(v)] for v in (opt.dynamic_scale, opt.skipped_steps_counter,
                                    opt.step_counter, opt.overflow_streak_counter)]
    ov, tv = [v.value for v in opt.variables], [w.value]
    def step(ov, tv, g):  # the gradients stand for a scaled loss's
        opt.scale_guard.scaled()
        return opt.stateless_apply(ov, [g], tv)

    step = jax.jit(step)
    rows = []
    for gradient in steps:
        scale = ov[slots[0]]
        g = jnp.asarray([float(v) for v in gradient], "float32") * scale
        tv, ov = step(ov, tv, g)
        s, k, good, streak = (np.asarray(ov[i]).item() for i in slots)
        rows.append([s, k, good, streak, -float(np.asarray(tv[0])[0])])
    out.append(rows)
print("RESULT" + json.dumps(out))
"""


def test_stateless_jax_path_matches_reference():
    pytest.importorskip("jax")
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    for var in LAUNCH_SIZE_VARS:
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", JAX_SCRIPT, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    trajectories = json.loads(line[len("RESULT") :])
    for (kind, knobs, steps), rows in zip(CASES, trajectories, strict=True):
        assert as_rows(rows) == reference(kind, knobs, steps), (kind, knobs)


@pytest.mark.parametrize(("kind", "knobs", "steps"), CASES, ids=CASE_IDS)
def test_tf1_graph_path_matches_reference(kind, knobs, steps):
    import tensorflow as tf

    from kmp.compat import v1 as kv1

    v1 = tf.compat.v1
    with tf.Graph().as_default():
        w = v1.Variable([0.0, 0.0, 0.0], dtype=tf.float32)
        g_in = v1.placeholder(tf.float32, [3])
        loss = tf.reduce_sum(w * g_in)  # d loss / d w = g_in, then times the scale
        setting = knobs["initial_scale"] if kind == "static" else "force_dynamic"
        extra = {} if kind == "static" else knobs
        opt = kv1.distributed_optimizer(
            v1.train.GradientDescentOptimizer(1.0), loss_scale=setting, **extra
        )
        train = opt.minimize(loss)
        state = opt._state()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            rows = []
            for gradient in steps:
                sess.run(train, {g_in: np.asarray(gradient, "float32")})
                s, good, streak, skipped, wv = sess.run([*state, w])
                rows.append((s, skipped, good, streak, -float(wv[0])))
    assert as_rows(rows) == reference(kind, knobs, steps)


# ---------------------------------------------------------------- the value


def test_loss_scale_is_frozen_and_round_trips():
    rule = ls.LossScale("dynamic", initial_scale=8, growth_interval=3, hysteresis=2)
    with pytest.raises(AttributeError):
        rule.initial_scale = 16.0
    assert isinstance(rule.initial_scale, float) and rule.initial_scale == 8.0
    again = ls.LossScale.from_config(json.loads(json.dumps(rule.to_config())))
    assert again == rule
    assert rule.start_state() == (8.0, 0, 0, 0)
    assert ls.LossScale("none").start_scale == 1.0 and not ls.LossScale("none").scaling
    # A rule saved before kmp measured underflow comes back as it trained: overflow only.
    before = {k: v for k, v in rule.to_config().items() if not k.startswith("underflow")}
    assert ls.LossScale.from_config(before).underflow_threshold is None
    assert rule.measures_underflow and not ls.LossScale("static").measures_underflow


@pytest.mark.parametrize(
    ("knobs", "error", "match"),
    [
        ({"growth_factor": 1.0}, ValueError, r"`growth_factor` must be a finite number > 1"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"growth_factor": "2"}, TypeError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, r"`backoff_factor` must be .*> 0 and < 1"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor"),
        ({"min_scale": 0.0}, ValueError, "`min_scale` must be a positive"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, ValueError, "min_scale.*<="),
        ({"max_scale": float("inf")}, ValueError, "max_scale"),
        ({"underflow_threshold": 1.0}, ValueError, r"`underflow_threshold` must be .*< 1"),
        ({"underflow_threshold": 0}, ValueError, "underflow_threshold"),
        ({"underflow_threshold": "1%"}, TypeError, "underflow_threshold"),
        ({"underflow_patience": 0}, ValueError, "underflow_patience"),
        ({"initial_scale": 2.0**25}, ValueError, r"outside \[min_scale, max_scale\]"),
        ({"initial_scale": 0.5}, ValueError, r"outside \[min_scale, max_scale\]"),
        ({"initial_scale": 0}, ValueError, "`initial_scale` must be a positive finite number"),
        ({"hysteresis": 0}, ValueError, "`hysteresis` must be a positive integer"),
        ({"hysteresis": 1.5}, TypeError, "hysteresis"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": True}, TypeError, "growth_interval"),
    ],
)
def test_bad_knobs(knobs, error, match):
    with pytest.raises(error, match=match):
        ls.LossScale("dynamic", **knobs)
    # The same check guards every entry point.
    with pytest.raises(error, match=match):
        kmp.wrap_optimizer(keras.optimizers.SGD(), loss_scale="force_dynamic", **knobs)


def test_range_is_checked_for_dynamic_scales_only():
    assert ls.LossScale("static", initial_scale=0.25).initial_scale == 0.25
    with pytest.raises(ValueError, match="kind"):
        ls.LossScale("adaptive")


@pytest.mark.parametrize(
    ("setting", "compute", "kind"),
    [
        ("dynamic", "float16", "dynamic"),
        ("dynamic", "bfloat16", "none"),
        ("dynamic", "float32", "none"),
        ("force_dynamic", "float32", "dynamic"),
        (" Dynamic ", "float16", "dynamic"),
        (256, "float32", "static"),
        (None, "float16", "none"),
    ],
)
def test_from_setting(setting, compute, kind):
    rule = ls.from_setting(setting, compute_dtype=compute, growth_interval=NOT_GIVEN)
    assert rule.kind == kind
    assert rule.growth_interval == ls.DEFAULTS["growth_interval"]  # NOT_GIVEN: the default
    if kind == "static":
        assert rule.initial_scale == 256.0


def test_from_setting_bad_input():
    with pytest.raises(ValueError, match="Unknown loss_scale 'auto'"):
        ls.from_setting("auto", compute_dtype="float16")
    with pytest.raises(TypeError, match="loss_scale must be"):
        ls.from_setting([1.0], compute_dtype="float16")
    with pytest.raises(ValueError, match=r"`loss_scale` must be a positive.*None to turn"):
        ls.from_setting(-1.0, compute_dtype="float16")
    with pytest.raises(TypeError, match=r"Unknown loss-scale knob\(s\) \['growth'\]"):
        ls.from_setting("dynamic", compute_dtype="float16", growth=2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_scale": 1e39}, r"`max_scale` must lie within float32's normal range"),
        ({"min_scale": 1e-50, "initial_scale": 1.0}, r"`min_scale` must lie within float32's"),
        ({"initial_scale": 1e39}, "initial_scale"),
    ],
)
def test_the_scale_stays_a_normal_float32(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ls.LossScale("dynamic", **kwargs)


def test_a_static_scale_and_a_different_initial_scale_conflict():
    with pytest.raises(ValueError, match=r"loss_scale=128\.0 is a static scale.*one or the other"):
        ls.from_setting(128.0, compute_dtype="float16", initial_scale=4.0)
    assert ls.from_setting(128.0, compute_dtype="float16", initial_scale=128).initial_scale == 128
    with pytest.raises(ValueError, match="`loss_scale` must lie within float32's normal range"):
        ls.from_setting(1e39, compute_dtype="float16")
