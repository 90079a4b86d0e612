"""kmp.distributed: single-process fallbacks here, real Horovod ranks under horovodrun."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import patch_tf_gpus, requires_horovod, run_workers

import kmp.distributed as dist

LAUNCH_VARS = (*dist.LAUNCH_SIZE_VARS, "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@pytest.fixture
def fresh(monkeypatch):
    """A process that was not started by a launcher, with kmp.distributed not yet initialised."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    dist._reset_for_tests()
    yield
    dist._reset_for_tests()


@pytest.fixture
def no_horovod(monkeypatch):
    """Make `import horovod...` fail as if Horovod were not installed."""
    for name in ("horovod", "horovod.tensorflow"):
        monkeypatch.setitem(sys.modules, name, None)


def test_init_without_launcher_is_single_process_and_idempotent(fresh):
    assert not dist.is_initialized()
    hvd_before = sys.modules.get("horovod.tensorflow")
    world = dist.init()
    assert world == dist.World(rank=0, size=1, local_rank=0, local_size=1, horovod=False)
    assert dist.init() is world
    assert dist.is_initialized()
    assert (dist.rank(), dist.size(), dist.local_rank(), dist.local_size()) == (0, 1, 0, 1)
    assert dist.is_chief() and not dist.uses_horovod()
    # init() outside a launcher does not import Horovod (earlier tests in this
    # process may have imported it already).
    assert sys.modules.get("horovod.tensorflow") is hvd_before


def test_accessors_initialise_lazily(fresh):
    assert dist.size() == 1
    assert dist.is_initialized()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"HOROVOD_SIZE": "4"}, 4),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, 2),
        ({"PMI_SIZE": "3"}, 3),
    ],
)
def test_launched_world_size(env, expected):
    assert dist.launched_world_size(env) == expected


def test_launched_world_size_rejects_garbage():
    with pytest.raises(RuntimeError, match="HOROVOD_SIZE"):
        dist.launched_world_size({"HOROVOD_SIZE": "two"})


def test_world_above_one_without_horovod_says_how_to_install(fresh, no_horovod, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(ImportError, match=r"launched as 2 processes.*Install Horovod.*setup\.sh"):
        dist.init()
    assert not dist.is_initialized()


def test_world_of_one_without_horovod_is_a_no_op(fresh, no_horovod, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert dist.init().size == 1


def test_single_process_collectives_are_identities(fresh):
    import keras

    x = np.arange(3.0, dtype="float32")
    assert dist.allreduce(x) is x
    a, none, b = dist.grouped_allreduce([x, None, x], op="sum", compression="fp16")
    assert a is x and none is None and b is x
    np.testing.assert_array_equal(np.asarray(dist.allgather(x)), x)
    assert np.asarray(dist.allgather(np.float32(2.0))).tolist() == [2.0]
    v = keras.Variable(np.ones((2,), "float32"))
    assert dist.broadcast_variables([v]) is None
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    obj = {"a": 1}
    assert dist.broadcast_object(obj) is obj
    dist.barrier()


@pytest.mark.parametrize("bad", ["zip", "fp8", 16, "int8"])
def test_unknown_compression_is_rejected(bad):
    with pytest.raises(ValueError, match=r"Unknown compression.*'fp16'"):
        dist.normalize_compression(bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        dist.grouped_allreduce([np.ones(2)], compression=bad)


def test_compression_aliases():
    assert dist.normalize_compression("FP16") == "fp16"
    assert dist.normalize_compression("bfloat16") == "bf16"
    assert dist.normalize_compression("none") is None
    assert dist.normalize_compression(None) is None


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match=r"Unknown reduction op 'mean'.*average"):
        dist.allreduce(np.ones(2), op="mean")


def test_single_process_ignores_root(fresh):
    # root is checked where it matters (more than one rank: see the worker).
    assert dist.broadcast_object(1, root=5) == 1


def test_payload_bytes_halves_with_compression():
    grads = [np.zeros((10, 4), "float32"), np.zeros((4,), "float32"), np.zeros((3,), "int32")]
    assert dist.payload_bytes(grads) == 4 * (40 + 4 + 3)
    assert dist.payload_bytes(grads, "fp16") == 2 * (40 + 4) + 4 * 3
    assert dist.payload_bytes(grads, "bf16") == dist.payload_bytes(grads, "fp16")


@pytest.mark.distributed
@requires_horovod
def test_collectives_on_two_real_ranks():
    r0, r1 = run_workers("worker_dist_collectives.py")
    for r, res in enumerate((r0, r1)):
        assert res["world"] == [r, 2, r, 2, True]
        assert res["is_chief"] is (r == 0)
        assert res["uses_horovod"] is True
        assert res["average"] == [1.5, 15.0]
        assert res["sum"] == [3.0, 30.0]
        assert res["min"] == [1.0, 10.0]
        assert res["max"] == [2.0, 20.0]
        assert res["product"] == [2.0, 200.0]
        assert res["grouped"] == [[1.0, 1.0, 1.0], None, [3], [[1.0], [2.0]]]
        assert res["grouped_dtypes"] == ["float32", None, "int32", "float32"]
        for comp in ("fp16", "bf16"):
            assert res[f"avg_{comp}"] == [1.0, -3.0, 3.0]
            assert res[f"avg_{comp}_dtype"] == "float32"
            assert res[f"max_{comp}"] == [1.5, -2.0, 3.0]
        assert res["allgather"] == [0.0, 0.5, 1.0, 1.5]
        assert res["allgather_scalar"] == [0.0, 1.0]
        assert res["bcast_eager"] == [[[1.0, 1.0], [1.0, 1.0]], 7.0]
        assert res["bcast_graph"] == [2.0, 2.0, 2.0]
        assert res["bcast_object"] == {"rank": 1, "list": [1, 1]}
        assert res["payload_fp16"] * 2 == res["payload_fp32"]
        assert "root must be a rank between 0 and 1; got 2" in res["bad_root"]


# --------------------------------------------------------------- GPU pinning by init()


def test_init_pins_one_gpu_per_local_rank(monkeypatch, recwarn):
    fake = patch_tf_gpus(monkeypatch, 2)
    dist._configure_local_gpu(1)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_init_shares_a_gpu_with_a_warning_when_ranks_outnumber_gpus(monkeypatch):
    # -np 3 on a 2-GPU host: local rank 2 shares GPU 0 instead of failing init().
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning, match=r"shares GPU 0 .*horovodrun -H host:2"):
        dist._configure_local_gpu(2)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:0"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:0", True),
    ]


def test_init_leaves_a_cpu_only_host_alone(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 0)
    dist._configure_local_gpu(1)
    assert fake.calls == []
