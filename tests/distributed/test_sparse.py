"""Sparse gradients (tf.IndexedSlices): the knob, the bytes, every step of the optimizer.

One process here (a fake two-rank Horovod where the collectives are under test); the
real 2-rank jobs are ``tests/distributed/worker_sparse.py`` and ``worker_jax_sparse.py``.
"""

from __future__ import annotations

import sys
import types
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp.distributed as dist
from kmp._names import SPARSE_GRADIENTS
from kmp.compat import v1 as kv1
from kmp.distributed import _horovod, sparse
from kmp.distributed.buckets import payload_bytes
from kmp.optimizer import DistributedLossScaleOptimizer, wrap_optimizer
from tests._support import requires_horovod, run_workers

VOCAB, DIM = 12, 3
VOCAB_GPT, SEQ_GPT, DIM_GPT = 64, 16, 32  # tests/distributed/worker_sparse.py


def slices(rows=(1, 4, 4, 7), seed=0) -> tf.IndexedSlices:
    values = np.random.default_rng(seed).normal(size=(len(rows), DIM)).astype("float32")
    return tf.IndexedSlices(
        tf.constant(values), tf.constant(rows, tf.int64), tf.constant([VOCAB, DIM], tf.int64)
    )


# ------------------------------------------------------------ the knob and the bytes


def test_the_knob_is_checked_in_kmps_style():
    assert sparse.check_sparse_gradients(" GATHER ") == "gather"
    assert SPARSE_GRADIENTS == ("dense", "gather")
    with pytest.raises(TypeError, match="`sparse_gradients` must be one of 'dense', 'gather'"):
        wrap_optimizer(keras.optimizers.SGD(), sparse_gradients=True)
    with pytest.raises(ValueError, match=r"Pass 'dense' .* or 'gather'"):
        wrap_optimizer(keras.optimizers.SGD(), sparse_gradients="sparse")
    with pytest.raises(ValueError, match="sparse_gradients"):
        kv1.distributed_optimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), sparse_gradients="allgather"
        )
    with pytest.raises(TypeError, match="sparse_gradients"):
        payload_bytes([], sparse_gradients=None)


def test_payload_bytes_of_a_sparse_gradient():
    g = slices()  # 4 rows of 3 float32 values, int64 indices; dense 12 x 3
    assert payload_bytes([g], sparse_gradients="dense") == 4 * VOCAB * DIM
    assert payload_bytes([g], sparse_gradients="gather") == 4 * 4 * DIM + 8 * 4
    assert payload_bytes([g], "fp16", "dense") == 2 * VOCAB * DIM
    assert payload_bytes([g], "bf16", "gather") == 2 * 4 * DIM + 8 * 4  # indices as they are
    # While tracing, the rows are unknown: they count 0; the dense shape is still known.
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, DIM]), tf.TensorSpec([None], tf.int64)])
    def traced(values, indices):
        g = tf.IndexedSlices(values, indices, tf.constant([VOCAB, DIM], tf.int64))
        seen["gather"] = payload_bytes([g, None], sparse_gradients="gather")
        seen["dense"] = payload_bytes([g], sparse_gradients="dense")
        unknown = tf.IndexedSlices(values, indices, tf.shape(values, out_type=tf.int64))
        seen["unknown_dense_shape"] = payload_bytes([unknown], sparse_gradients="dense")
        return values

    traced.get_concrete_function()
    assert seen == {"gather": 0, "dense": 4 * VOCAB * DIM, "unknown_dense_shape": 0}


def test_densify_adds_repeated_rows():
    g = slices()
    dense = sparse.densify(g).numpy()
    assert dense.shape == (VOCAB, DIM)
    np.testing.assert_allclose(dense[4], g.values.numpy()[1] + g.values.numpy()[2], rtol=1e-6)
    assert not dense[0].any() and not sparse.is_sparse(dense) and sparse.is_sparse(g)


# ---------------------------------------- the collectives on a fake two-rank Horovod


class TwinHorovod:
    """Horovod for two ranks holding the same values, recording which ops ran."""

    Average, Sum, Min, Max, Product = "average", "sum", "min", "max", "product"

    def __init__(self):
        self.calls: list[str] = []

    def size(self) -> int:
        return 2

    def grouped_allreduce(self, tensors, op, prescale_factor=1.0):
        self.calls.append("allreduce")
        k = (2.0 if op == "sum" else 1.0) * prescale_factor
        return [t * tf.cast(k, t.dtype) for t in tensors]

    def grouped_allgather(self, tensors):
        self.calls.append(f"allgather:{','.join(sorted({t.dtype.name for t in tensors}))}")
        return [tf.concat([t, t], 0) for t in tensors]


@pytest.fixture
def twin(monkeypatch):
    """kmp.distributed's engine is Horovod's, on a :class:`TwinHorovod` of two ranks."""
    hvd = TwinHorovod()
    world_mod = sys.modules["kmp.distributed.world"]  # kmp.distributed.world is the function
    two = dist.World(0, 2, 0, 2, True, engine="horovod")
    monkeypatch.setattr(world_mod, "_STATE", world_mod._State(_horovod.HorovodEngine(hvd), two))
    return hvd


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_both_strategies_average_a_sparse_gradient_alike(twin, compression):
    g, other = slices(), tf.ones([5])
    want = sparse.densify(g).numpy()
    tolerance = 0 if compression is None else 1e-2
    how = {"compression": compression}
    dense, rest = dist.grouped_allreduce([g, other], sparse_gradients="dense", **how)
    assert not sparse.is_sparse(dense) and dense.shape == (VOCAB, DIM)
    np.testing.assert_allclose(dense.numpy(), want, atol=tolerance)
    gathered, rest2 = dist.grouped_allreduce([g, other], sparse_gradients="gather", **how)
    assert sparse.is_sparse(gathered) and gathered.values.shape[0] == 8  # both ranks' rows
    assert gathered.values.dtype == tf.float32
    np.testing.assert_allclose(sparse.densify(gathered).numpy(), want, atol=tolerance)
    np.testing.assert_array_equal(rest.numpy(), rest2.numpy())
    values = {None: "float32", "fp16": "float16", "bf16": "int16"}[compression]
    assert twin.calls[-2:] == [f"allgather:{values}", "allgather:int64"]  # values compressed


def test_gathering_needs_average_or_sum(twin):
    with pytest.raises(ValueError, match=r"op='average' or 'sum', not 'max'.*'dense'"):
        dist.grouped_allreduce([slices()], op="max", sparse_gradients="gather")
    assert dist.grouped_allreduce([slices()], op="max", sparse_gradients="dense")[0].shape == (
        VOCAB,
        DIM,
    )


# ------------------------------------------------- the optimizer (one process)


def embedding_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )


def grads_of(model, x, y, scale=1.0):
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        loss = tf.reduce_mean(loss) * scale
    return tape.gradient(loss, model.trainable_variables)


X = np.array([[1, 2, 2, 3], [4, 5, 6, 1], [7, 7, 7, 7], [0, 11, 3, 9]], "int32")
Y = np.array([0, 1, 1, 0], "int32")


def test_sparse_gradients_are_checked_unscaled_and_skipped():
    keras.config.set_dtype_policy("mixed_float16")
    model, ref = embedding_model(), embedding_model()
    opt = wrap_optimizer(keras.optimizers.SGD(0.5))
    plain = keras.optimizers.SGD(0.5)
    grads = grads_of(model, X, Y, scale=opt.loss_scale)
    assert sparse.is_sparse(grads[0])
    opt.scale_guard.scaled()  # grads_of scaled the loss by opt.loss_scale
    opt.apply(grads, model.trainable_variables)
    plain.apply(grads_of(ref, X, Y), ref.trainable_variables)
    for a, b in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)  # unscaled before the update
    before = model.get_weights()
    bad = grads_of(model, X, Y, scale=opt.loss_scale)
    bad[0] = tf.IndexedSlices(bad[0].values + np.inf, bad[0].indices, bad[0].dense_shape)
    assert not bool(opt.check_finite(bad)) and bool(opt.check_finite(grads))
    opt.scale_guard.scaled()
    opt.apply(bad, model.trainable_variables)
    assert (opt.skipped_steps, opt.loss_scale) == (1, 2.0**14)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_accumulated_sparse_gradients_equal_the_doubled_batch():
    model, ref = embedding_model(), embedding_model()
    opt = wrap_optimizer(keras.optimizers.SGD(0.5), backward_passes_per_step=2)
    for half in (slice(0, 2), slice(2, 4)):
        grads = grads_of(model, X[half], Y[half])
        assert sparse.is_sparse(grads[0])
        opt.apply(grads, model.trainable_variables)
    keras.optimizers.SGD(0.5).apply(grads_of(ref, X, Y), ref.trainable_variables)
    assert int(opt.iterations) == 1
    for a, b in zip(model.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_knob_is_saved_and_a_rewrap_may_not_change_it():
    opt = wrap_optimizer(keras.optimizers.SGD(), sparse_gradients="dense")
    assert opt.settings.sparse_gradients == "dense"
    assert wrap_optimizer(opt, sparse_gradients="DENSE") is opt
    with pytest.raises(ValueError, match="sparse_gradients='gather' \\(it has 'dense'\\)"):
        wrap_optimizer(opt, sparse_gradients="gather")
    config = opt.get_config()
    assert config["settings"]["sparse_gradients"] == "dense"
    again = DistributedLossScaleOptimizer.from_config(config)
    assert again.settings.sparse_gradients == "dense"
    assert wrap_optimizer(keras.optimizers.SGD()).settings.sparse_gradients == "gather"


class FakeHorovodKeras:
    """``horovod.tensorflow.keras`` recording what DistributedOptimizer was given."""

    class Compression:
        none, fp16 = "none", "fp16"

    seen: ClassVar[dict] = {}

    @classmethod
    def DistributedOptimizer(cls, optimizer, **kwargs):  # noqa: N802 - Horovod's name
        cls.seen = kwargs
        return optimizer


@pytest.mark.parametrize(
    ("setting", "passes", "as_dense"),
    [("gather", 1, False), ("dense", 1, True), ("gather", 2, True)],  # Horovod sums dense only
)
def test_the_tf_keras_path_hands_the_knob_to_horovod(monkeypatch, setting, passes, as_dense):
    tf_keras = pytest.importorskip("tf_keras")
    from kmp.compat import keras2

    two = types.SimpleNamespace(horovod=True, size=2)
    monkeypatch.setattr(dist, "init", lambda: two)  # what the tf-keras path asks, however it asks
    monkeypatch.setattr(dist, "world", lambda: two)
    monkeypatch.setattr(dist, "engine", lambda: types.SimpleNamespace(name="horovod"))
    monkeypatch.setattr(keras2, "optional_import", lambda name, feature: FakeHorovodKeras)
    opt = tf_keras.optimizers.SGD()
    wrapped = keras2.wrap_optimizer(
        opt, loss_scale=None, sparse_gradients=setting, backward_passes_per_step=passes
    )
    assert wrapped is opt and FakeHorovodKeras.seen["sparse_as_dense"] is as_dense
    with pytest.raises(ValueError, match="sparse_gradients"):
        keras2.wrap_optimizer(tf_keras.optimizers.SGD(), sparse_gradients="rows")


# ------------------------------------------------------- real ranks (horovodrun)


@pytest.fixture(scope="module")
def sparse_job():
    """One horovodrun job: the tiny GPT, the overflow, and the TF1 graph."""
    return run_workers("worker_sparse.py", "train", "overflow", "v1", timeout=420)


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
@pytest.mark.parametrize("strategy", ["dense", "gather"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])  # mixed_float16: overflow
def test_a_tiny_gpt_ends_bit_identical_on_two_ranks(sparse_job, strategy, policy):
    for res in sparse_job:
        got = res["train"][f"{strategy}/{policy}"]
        assert got["kinds"].count("IndexedSlices") == 2  # token and position embeddings
        assert got["spread"] == 0.0 and got["moved"] > 1e-3
        assert got["iterations"] == 4 and got["skipped"] == 0
        assert got["compute_dtype"] == policy.replace("mixed_", "")
        assert np.isfinite(got["loss"])
    # What each strategy hands over: the embeddings whole (dense), or the rows used
    # (gather: 8 x 16 token rows and 16 position rows, int32 indices).
    item = 4 if policy == "float32" else 2  # bf16 compression halves the floats
    train = sparse_job[0]["train"]
    dense, gather = (train[f"{s}/{policy}"]["bytes_per_step"] for s in ("dense", "gather"))
    assert dense == item * train[f"dense/{policy}"]["params"]
    embeddings = item * (VOCAB_GPT + SEQ_GPT) * DIM_GPT
    rows = (8 * SEQ_GPT + SEQ_GPT) * (item * DIM_GPT + 4)
    assert gather == dense - embeddings + rows


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
@pytest.mark.parametrize("strategy", ["dense", "gather"])
def test_an_inf_in_one_ranks_embedding_gradient_skips_every_rank(sparse_job, strategy):
    for res in sparse_job:
        got = res["overflow"][strategy]
        assert got["embedding_gradient"] == "IndexedSlices"
        assert got["unchanged_by_bad_step"] == 0.0
        assert min(got["changed_by_good_steps"]) > 0.0
        assert got["scales"] == [32768.0, 32768.0, 16384.0, 16384.0]
        assert got["skipped"] == [0, 0, 1, 1]
        assert got["iterations"] == [1, 2, 2, 3]
        assert got["spread"] == 0.0 and got["finite"] and got["compute_dtype"] == "float16"
    assert sparse_job[0]["overflow"][strategy] == sparse_job[1]["overflow"][strategy]


@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
@pytest.mark.parametrize("strategy", ["dense", "gather"])
def test_a_tf1_graph_with_gather_keeps_ranks_identical(sparse_job, strategy):
    r0, r1 = (res["v1"][strategy] for res in sparse_job)
    assert (r0["kinds"][0] == "IndexedSlices") is (strategy == "gather")  # dense: densified
    assert r0["weights"] == r1["weights"] and r0["moved"] > 1e-3
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["scale"] == r1["scale"] == 2.0**14


@pytest.mark.distributed
@pytest.mark.slow  # kmp's own launcher: no Horovod needed
def test_an_embedding_model_on_the_jax_engine_ends_identical(tmp_path):
    """JAX gradients are dense: both settings train the same and keep the processes identical."""
    pytest.importorskip("jax")
    ranks = run_workers("worker_jax_sparse.py", out_dir=tmp_path, engine="jax")
    for res in ranks:
        assert res["engine"] == "jax"
        for name, run in res["runs"].items():
            assert run["max_diff"] == 0.0 and run["moved"] > 1e-3, name
            assert run["skipped"] == 0, name
    runs = ranks[0]["runs"]
    assert runs["dense/float32"] == runs["gather/float32"]  # the setting changes nothing on JAX
