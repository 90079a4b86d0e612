"""kmp.compat.v1: the ConfigProto fields, the TF1 distributed optimizer, bad input, real ranks."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from kmp._launcher_env import LOCAL_RANK_VARS
from kmp.compat import v1 as kv1
from kmp.compat.v1.optimizer import DistributedOptimizer
from kmp.compat.v1.sessions import MIXED_PRECISION_REWRITES, build_session_config
from tests._support import requires_horovod, run_workers

v1 = tf.compat.v1
ON = rewriter_config_pb2.RewriterConfig.ON
DEFAULT = rewriter_config_pb2.RewriterConfig.DEFAULT


def build(**kwargs):
    kwargs.setdefault("n_gpus", 0)
    kwargs.setdefault("local_rank", None)
    return build_session_config(**kwargs)


@pytest.fixture
def no_launcher(monkeypatch):
    for var in LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------ ConfigProto fields


def test_defaults_set_every_field():
    c = build(n_gpus=2, local_rank=None)
    assert isinstance(c, v1.ConfigProto)
    assert c.gpu_options.allow_growth is True
    assert c.gpu_options.per_process_gpu_memory_fraction == 0.0  # TF's default: unset
    assert c.gpu_options.visible_device_list == ""  # single process: all GPUs
    assert c.allow_soft_placement is True
    assert c.log_device_placement is False
    assert c.intra_op_parallelism_threads == 0
    assert c.inter_op_parallelism_threads == 0
    ro = c.graph_options.rewrite_options
    assert ro.auto_mixed_precision == DEFAULT
    assert ro.auto_mixed_precision_onednn_bfloat16 == DEFAULT


def test_every_argument_reaches_its_field():
    c = build(
        allow_growth=False,
        memory_fraction=0.5,
        visible_devices=[0, 2],
        allow_soft_placement=False,
        log_device_placement=True,
        intra_op_threads=4,
        inter_op_threads=2,
        mixed_precision="float16",
        n_gpus=4,
    )
    assert c.gpu_options.allow_growth is False
    assert c.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.5)
    assert c.gpu_options.visible_device_list == "0,2"
    assert c.allow_soft_placement is False
    assert c.log_device_placement is True
    assert c.intra_op_parallelism_threads == 4
    assert c.inter_op_parallelism_threads == 2
    assert c.graph_options.rewrite_options.auto_mixed_precision == ON
    assert c.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 == DEFAULT


@pytest.mark.parametrize("name", ["bfloat16", "mixed_bfloat16"])
def test_bfloat16_rewrite_field(name):
    ro = build(mixed_precision=name).graph_options.rewrite_options
    assert ro.auto_mixed_precision_onednn_bfloat16 == ON
    assert ro.auto_mixed_precision == DEFAULT


def test_matches_the_canonical_horovod_config():
    """What Horovod's TF1 examples wrote by hand, for local rank 1 on a 2-GPU host."""
    expected = v1.ConfigProto()
    expected.allow_soft_placement = True
    expected.gpu_options.allow_growth = True
    expected.gpu_options.per_process_gpu_memory_fraction = 0.9
    expected.gpu_options.visible_device_list = "1"
    assert build(memory_fraction=0.9, n_gpus=2, local_rank=1) == expected


@pytest.mark.parametrize(
    ("visible", "n_gpus", "local_rank", "listed"),
    [
        ("local_rank", 4, 3, "3"),
        ("local_rank", 0, 1, ""),  # CPU-only host: nothing to pin
        ("all", 4, 1, ""),
        (1, 2, None, "1"),
        (None, 4, 1, ""),
    ],
)
def test_visible_device_list(visible, n_gpus, local_rank, listed):
    c = build(visible_devices=visible, n_gpus=n_gpus, local_rank=local_rank)
    assert c.gpu_options.visible_device_list == listed


def test_session_config_on_this_machine(no_launcher):
    c = kv1.session_config(memory_fraction=0.25, intra_op_threads=1)
    n = len(tf.config.list_physical_devices("GPU"))
    assert c.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.25)
    assert c.intra_op_parallelism_threads == 1
    assert c.gpu_options.visible_device_list == ""
    with pytest.raises(ValueError, match=f"asks for GPU {n}, but this process sees {n} GPU"):
        kv1.session_config(visible_devices=n)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.01, 2, float("nan")])
def test_memory_fraction_outside_0_1(fraction):
    with pytest.raises(ValueError, match=r"`memory_fraction` must be a finite number > 0 and <= 1"):
        build(memory_fraction=fraction)


@pytest.mark.parametrize("fraction", ["0.5", True])
def test_memory_fraction_must_be_a_number(fraction):
    with pytest.raises(TypeError, match=r"`memory_fraction` must be .*fraction of each GPU"):
        build(memory_fraction=fraction)


def test_memory_fraction_of_one_is_allowed():
    assert build(memory_fraction=1).gpu_options.per_process_gpu_memory_fraction == 1.0


@pytest.mark.parametrize(("visible", "n_gpus"), [(2, 2), ([0, 3], 2), (0, 0)])
def test_visible_device_beyond_gpus(visible, n_gpus):
    with pytest.raises(ValueError, match=r"visible_devices=.*asks for GPU .*CUDA_VISIBLE_DEVICES"):
        build(visible_devices=visible, n_gpus=n_gpus)


def test_local_rank_beyond_gpus_shares_a_gpu():
    # kmp.gpu's one rule: more ranks than GPUs share GPU local_rank % n.
    assert build(n_gpus=2, local_rank=2).gpu_options.visible_device_list == "0"
    assert build(n_gpus=2, local_rank=3).gpu_options.visible_device_list == "1"


def test_session_config_warns_when_ranks_share_a_gpu(monkeypatch, no_launcher):
    from tests._support import patch_tf_gpus

    patch_tf_gpus(monkeypatch, 1)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    with pytest.warns(RuntimeWarning, match=r"Local rank 1 has no GPU of its own.*shares GPU 0"):
        config = kv1.session_config(allow_growth=False)
    assert config.gpu_options.allow_growth  # sharing turns growth on
    assert config.gpu_options.visible_device_list == ""  # the one GPU there is: all


@pytest.mark.parametrize("arg", ["intra_op_threads", "inter_op_threads"])
@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_thread_counts(arg, value, error):
    with pytest.raises(error, match=f"`{arg}` must be an integer >= 0"):
        build(**{arg: value})


def test_unknown_mixed_precision():
    with pytest.raises(ValueError, match="'float16' \\(NVIDIA GPUs\\) or 'bfloat16'"):
        build(mixed_precision="fp8")


@pytest.mark.parametrize("arg", ["allow_growth", "allow_soft_placement", "log_device_placement"])
def test_flags_must_be_bools(arg):
    with pytest.raises(TypeError, match=f"`{arg}` must be True or False"):
        build(**{arg: "yes"})


def test_bfloat16_without_onednn_is_an_error(monkeypatch, no_launcher):
    monkeypatch.setattr(kv1.sessions, "_onednn_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="TF_ENABLE_ONEDNN_OPTS=1"):
        kv1.session_config(mixed_precision="bfloat16")
    monkeypatch.setattr(kv1.sessions, "_onednn_enabled", lambda: True)
    ro = kv1.session_config(mixed_precision="bfloat16").graph_options.rewrite_options
    assert ro.auto_mixed_precision_onednn_bfloat16 == ON


def test_float16_without_gpu_warns(no_launcher):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("describes a machine without GPUs")
    with pytest.warns(UserWarning, match="only converts ops placed on NVIDIA GPUs"):
        c = kv1.session_config(mixed_precision="float16")
    assert c.graph_options.rewrite_options.auto_mixed_precision == ON


# ------------------------------------------------------------------ session


def test_session_runs_with_kmp_config(no_launcher):
    g = tf.Graph()
    with g.as_default():
        out = tf.constant(2.0) * 3.0
    with kv1.session(graph=g, intra_op_threads=1) as sess:
        assert sess.run(out) == 6.0
        assert sess._config.intra_op_parallelism_threads == 1
        assert sess._config.gpu_options.allow_growth is True


def test_session_bad_arguments():
    config = build()
    with pytest.raises(TypeError, match="either config= or session_config arguments"):
        kv1.session(config, allow_growth=False)
    with pytest.raises(TypeError, match=r"must be a tf\.compat\.v1\.ConfigProto"):
        kv1.session({"allow_growth": True})


# ------------------------------------------------------------------ optimizer (one process)


def _graph_step(make_opt, x_val, steps=1):
    """Train a 4->1 linear model on ``x_val``; return (weights, optimizer, per-step records).

    The optimizer's ``variable_names`` attribute lists ``opt.variables()`` of the graph.
    """
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4])
        w = v1.get_variable("w", [4, 1], initializer=v1.constant_initializer(0.5))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        step = v1.train.get_or_create_global_step()
        opt = make_opt()
        train = opt.minimize(loss, global_step=step)
        init = v1.global_variables_initializer()
        opt.variable_names = sorted(v.name for v in opt.variables())
    records = []
    with v1.Session(graph=g) as sess:
        sess.run(init)
        for i in range(steps):
            xv = x_val(i) if callable(x_val) else x_val
            sess.run(train, {x: xv})
            scale = opt.loss_scale if isinstance(opt, DistributedOptimizer) else None
            records.append((int(sess.run(step)), None if scale is None else float(sess.run(scale))))
        return sess.run(w).ravel(), opt, records


X = np.arange(8, dtype="float32").reshape(2, 4) / 8.0


def test_without_loss_scale_matches_the_plain_optimizer():
    plain, _, _ = _graph_step(lambda: v1.train.AdamOptimizer(0.1), X, steps=3)
    wrapped, opt, rec = _graph_step(
        lambda: kv1.distributed_optimizer(v1.train.AdamOptimizer(0.1)), X, steps=3
    )
    np.testing.assert_array_equal(wrapped, plain)
    assert opt.loss_scale is None and [r[0] for r in rec] == [1, 2, 3]
    assert not np.allclose(plain, 0.5)  # it trained


@pytest.mark.parametrize("loss_scale", ["force_dynamic", 128.0])
def test_loss_scaling_gives_the_same_update(loss_scale):
    plain, _, _ = _graph_step(lambda: v1.train.GradientDescentOptimizer(0.1), X, steps=2)
    scaled, _, rec = _graph_step(
        lambda: kv1.distributed_optimizer(
            v1.train.GradientDescentOptimizer(0.1), loss_scale=loss_scale
        ),
        X,
        steps=2,
    )
    np.testing.assert_allclose(scaled, plain, rtol=1e-6)
    assert rec[-1][1] == (2.0**15 if loss_scale == "force_dynamic" else 128.0)


def test_dynamic_scale_skips_non_finite_steps_and_grows():
    def x_at(i):
        x = X.copy()
        if i in (2, 3):
            x[0, 0] = np.inf
        return x

    w, opt, rec = _graph_step(
        lambda: kv1.distributed_optimizer(
            v1.train.AdamOptimizer(0.01),
            loss_scale="force_dynamic",
            initial_scale=8,
            growth_interval=2,
        ),
        x_at,
        steps=6,
    )
    assert rec == [(1, 8.0), (2, 16.0), (2, 8.0), (2, 4.0), (3, 4.0), (4, 8.0)]
    assert np.all(np.isfinite(w))
    names = opt.variable_names
    assert any("loss_scale" in n for n in names) and any("good_steps" in n for n in names)
    assert opt.get_slot_names() == ["m", "v"]


def test_dynamic_scale_never_drops_below_one():
    _, _, rec = _graph_step(
        lambda: kv1.distributed_optimizer(
            v1.train.GradientDescentOptimizer(0.1), loss_scale="force_dynamic", initial_scale=2
        ),
        np.full((2, 4), np.nan, "float32"),
        steps=3,
    )
    assert rec == [(0, 1.0), (0, 1.0), (0, 1.0)]


def test_scale_lr_multiplies_each_kind_of_learning_rate():
    gd = v1.train.GradientDescentOptimizer(0.1)
    kv1.optimizer._scale_learning_rate(gd, 4)
    assert gd._learning_rate == pytest.approx(0.4)
    adam = v1.train.AdamOptimizer(0.01)
    kv1.optimizer._scale_learning_rate(adam, 2)
    assert adam._lr == pytest.approx(0.02)
    sched = v1.train.MomentumOptimizer(lambda: 0.5, momentum=0.9)
    kv1.optimizer._scale_learning_rate(sched, 3)
    assert sched._learning_rate() == pytest.approx(1.5)


def test_scale_lr_in_one_process_keeps_the_rate():
    opt = kv1.distributed_optimizer(v1.train.GradientDescentOptimizer(0.1), scale_lr=True)
    assert opt.optimizer._learning_rate == pytest.approx(0.1)


def test_compression_names_and_horovod_classes():
    from kmp._names import normalize_compression

    hvd = pytest.importorskip("horovod.tensorflow")
    gd = v1.train.GradientDescentOptimizer(0.1)
    for given, name in [
        (None, None),
        ("fp16", "fp16"),
        ("bfloat16", "bf16"),
        (hvd.Compression.fp16, "fp16"),
        (hvd.Compression.none, None),
    ]:
        assert normalize_compression(given) == name
        assert kv1.distributed_optimizer(gd, compression=given).settings.compression == name
    with pytest.raises(TypeError, match="compression must be None, 'fp16' or 'bf16'"):
        kv1.distributed_optimizer(gd, compression=3)


def test_bad_optimizer_arguments():
    gd = v1.train.GradientDescentOptimizer(0.1)
    import keras

    with pytest.raises(TypeError, match=r"tf.compat.v1.train optimizer .* kmp.wrap_optimizer"):
        kv1.distributed_optimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already wrapped"):
        kv1.distributed_optimizer(kv1.distributed_optimizer(gd))
    # TF 2.21 still has TF1's loss-scale wrapper; kmp asks for the plain optimizer instead.
    mplso = v1.mixed_precision.MixedPrecisionLossScaleOptimizer(gd, "dynamic")
    with pytest.raises(ValueError, match=r"MixedPrecisionLossScaleOptimizer.*loss_scale='dynamic'"):
        kv1.distributed_optimizer(mplso)
    for bad in (-1, 0, float("inf")):
        with pytest.raises(ValueError, match="`loss_scale` must be a positive finite number"):
            kv1.distributed_optimizer(gd, loss_scale=bad)
    with pytest.raises(ValueError, match=r"Unknown loss_scale 'static'.*'force_dynamic'"):
        kv1.distributed_optimizer(gd, loss_scale="static")
    with pytest.raises(TypeError, match="loss_scale must be 'dynamic'"):
        kv1.distributed_optimizer(gd, loss_scale=True)
    with pytest.raises(ValueError, match="hysteresis"):
        kv1.distributed_optimizer(gd, loss_scale="force_dynamic", hysteresis=0)
    with pytest.raises(ValueError, match="initial_scale"):
        kv1.distributed_optimizer(gd, loss_scale="force_dynamic", initial_scale=0.5)
    with pytest.raises(ValueError, match="growth_interval"):
        kv1.distributed_optimizer(gd, loss_scale="force_dynamic", growth_interval=0)
    with pytest.raises(ValueError, match="Unknown compression"):
        kv1.distributed_optimizer(gd, compression="zip")
    with pytest.raises(TypeError, match="scale_lr"):
        kv1.distributed_optimizer(gd, scale_lr="yes")


def test_scale_lr_on_an_unknown_optimizer():
    class Custom(v1.train.Optimizer):
        def __init__(self):
            super().__init__(False, "Custom")

    with pytest.raises(ValueError, match="cannot find the learning rate"):
        kv1.optimizer._scale_learning_rate(Custom(), 2)


def test_broadcast_needs_graph_mode():
    with pytest.raises(RuntimeError, match="disable_eager_execution"):
        kv1.broadcast_global_variables()
    with tf.Graph().as_default():
        v1.get_variable("v", [1])
        op = kv1.broadcast_global_variables()  # one process: a no-op
        assert op.type == "NoOp"


def test_graph_rewrite_api_still_in_tf():
    """Documented in docs/legacy.md: these TF1 mixed precision entry points still exist."""
    assert callable(v1.mixed_precision.enable_mixed_precision_graph_rewrite)
    assert callable(v1.mixed_precision.MixedPrecisionLossScaleOptimizer)
    fields = {f.name for f in v1.ConfigProto().graph_options.rewrite_options.DESCRIPTOR.fields}
    assert set(MIXED_PRECISION_REWRITES.values()) <= fields


# ------------------------------------------------------------------ real ranks


@requires_horovod
@pytest.mark.distributed
@pytest.mark.slow  # one horovodrun job: ~40 s on 2 idle cores, more under load
def test_tf1_script_keeps_ranks_identical():
    r0, r1 = run_workers("worker_v1_train.py", timeout=240)
    assert [r0["world"], r1["world"]] == [[0, 2], [1, 2]]
    f0, f1 = r0["float32"], r1["float32"]
    # Different starting variables and different data on each rank ...
    assert f0["start_checksum"] != f1["start_checksum"]
    assert f0["losses"][0] != f1["losses"][0]
    # ... yet identical variables after training: the gradients were averaged.
    assert f0["vars"] == f1["vars"]
    assert f0["global_step"] == f1["global_step"] == 6
    assert f0["learning_rate"] == pytest.approx(0.1)  # scale_lr: 0.05 * 2 ranks
    d0, d1 = r0["dynamic"], r1["dynamic"]
    assert d0["vars"] == d1["vars"] and d0["finite"] and d1["finite"]
    # Rank 1 alone fed an inf at step 2: both ranks skipped it and halved the scale;
    # three finite steps later (growth_interval=3) the scale doubled again.
    expected_scales = [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert d0["scales"] == d1["scales"] == expected_scales
    assert d0["global_steps"] == d1["global_steps"] == [1, 2, 2, 3, 4, 5]
    if d0["onednn"]:  # the bfloat16 graph rewrite really ran
        assert d0["bf16_matmuls"] > 0


def test_force_dynamic_is_dynamic_in_a_graph():
    gd = v1.train.GradientDescentOptimizer(0.1)
    assert kv1.distributed_optimizer(gd, loss_scale="dynamic").loss_scale_rule.kind == "none"
    assert (
        kv1.distributed_optimizer(gd, loss_scale="force_dynamic").loss_scale_rule.kind == "dynamic"
    )
    assert not kv1.distributed_optimizer(gd).loss_scale_rule.scaling  # None: the default
