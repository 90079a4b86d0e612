"""kmp.distributed: single-process fallbacks here, real Horovod ranks under horovodrun."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import kmp
import kmp._launcher_env as launcher_env
import kmp._names as names
import kmp.distributed as dist
from kmp.distributed.world import _configure_local_gpu
from tests._support import patch_tf_gpus, requires_horovod, run_workers

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


def test_launcher_env_and_names_are_re_exported():
    # The launcher variables are read by kmp._launcher_env (see test_launcher_env.py), the
    # vocabularies live in kmp._names; kmp.distributed keeps offering them under the old names.
    assert dist.LAUNCH_SIZE_VARS is launcher_env.LAUNCH_SIZE_VARS
    assert dist.launched_world_size is launcher_env.launched_world_size
    assert dist.COMPRESSIONS is names.COMPRESSIONS
    assert dist.REDUCE_OPS is names.REDUCE_OPS
    assert dist.normalize_compression is names.normalize_compression
    assert dist.launched_world_size({"HOROVOD_SIZE": "4"}) == 4


def test_public_names_resolve_from_the_package():
    assert len(dist.__all__) == len(set(dist.__all__))
    for name in dist.__all__:
        assert getattr(dist, name) is not None, name
    # The submodule world.py does not hide the function world().
    assert callable(dist.world) and dist.world.__name__ == "world"
    assert kmp.distributed is dist


def test_garbage_launcher_size_is_a_value_error(fresh, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "two")
    with pytest.raises(ValueError, match=r"HOROVOD_SIZE='two'.*unset it"):
        dist.init()
    assert not dist.is_initialized()


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


@pytest.mark.parametrize("bad", ["zip", "fp8", "int8"])
def test_unknown_compression_is_rejected(bad):
    with pytest.raises(ValueError, match=r"Unknown compression.*'fp16'"):
        dist.normalize_compression(bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        dist.grouped_allreduce([np.ones(2)], compression=bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        dist.payload_bytes([np.ones(2)], compression=bad)


@pytest.mark.parametrize("bad", [16, 1.5, ["fp16"]])
def test_compression_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="compression must be None, 'fp16' or 'bf16'"):
        dist.normalize_compression(bad)
    with pytest.raises(TypeError, match="compression must be"):
        dist.allreduce(np.ones(2), compression=bad)


def test_compression_aliases():
    assert dist.normalize_compression("FP16") == "fp16"
    assert dist.normalize_compression("bfloat16") == "bf16"
    assert dist.normalize_compression("none") is None
    assert dist.normalize_compression(None) is None


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match=r"Unknown reduction op 'mean'.*average"):
        dist.allreduce(np.ones(2), op="mean")
    with pytest.raises(TypeError, match="reduction op must be a name"):
        dist.grouped_allreduce([np.ones(2)], op=None)


def test_op_names_are_canonicalised(fresh):
    x = np.ones(2)
    assert dist.allreduce(x, op=" SUM ") is x


def test_single_process_ignores_root(fresh):
    # root's range is checked where it matters (more than one rank: see the worker).
    assert dist.broadcast_object(1, root=5) == 1
    assert dist.broadcast_object(1, root=np.int64(0)) == 1


@pytest.mark.parametrize("root", ["0", 1.0, None, True])
def test_root_of_the_wrong_type_is_a_type_error(fresh, root):
    with pytest.raises(TypeError, match=r"`root` must be an integer"):
        dist.broadcast_object(1, root=root)
    with pytest.raises(TypeError, match=r"`root` must be an integer"):
        dist.broadcast_variables([], root=root)


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
        assert res["grouped_sparse_kind"] == "IndexedSlices"  # rows gathered, not densified
        assert res["grouped_dense"] == ["EagerTensor", [[1.0], [2.0]]]
        for comp in ("fp16", "bf16"):
            assert res[f"avg_{comp}"] == [1.0, -3.0, 3.0]
            assert res[f"avg_{comp}_dtype"] == "float32"
            assert res[f"max_{comp}"] == [1.5, -2.0, 3.0]
            assert res[f"scatter_{comp}"] == [[2.0, -6.0, 6.0], [3.0], [3.0, 4.0, 9.0]]
            assert res[f"scatter_{comp}_dtypes"] == ["float32", "int32", "bfloat16"]
        assert res["allgather"] == [0.0, 0.5, 1.0, 1.5]
        assert res["allgather_scalar"] == [0.0, 1.0]
        assert res["bcast_eager"] == [[[1.0, 1.0], [1.0, 1.0]], 7.0]
        assert res["bcast_graph"] == [2.0, 2.0, 2.0]
        assert res["bcast_object"] == {"rank": 1, "list": [1, 1]}
        assert res["payload_fp16"] * 2 == res["payload_fp32"]
        assert "`root` must be an integer from 0 to 1; got 2" in res["bad_root"]
        assert "this job has 2 ranks" in res["bad_root"]


# --------------------------------------------------------------- GPU pinning by init()


def test_init_pins_one_gpu_per_local_rank(monkeypatch, recwarn):
    fake = patch_tf_gpus(monkeypatch, 2)
    _configure_local_gpu(1)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_init_shares_a_gpu_with_a_warning_when_ranks_outnumber_gpus(monkeypatch):
    # -np 3 on a 2-GPU host: local rank 2 shares GPU 0 instead of failing init(); the rule is
    # kmp.gpu's (see test_gpu.py), the same one configure_gpus() applies.
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning, match=r"shares GPU 0 .*horovodrun -H host:2.*visible="):
        _configure_local_gpu(2)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:0"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:0", True),
    ]


def test_init_leaves_a_cpu_only_host_alone(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 0)
    _configure_local_gpu(1)
    assert fake.calls == []


def test_init_gpu_pinning_ignores_the_launcher_variables(monkeypatch):
    # The engine's local rank is what counts; the launcher's is not read a second time.
    import kmp.gpu

    fake = patch_tf_gpus(monkeypatch, 2)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "garbage")
    monkeypatch.setattr(kmp.gpu, "_current_local_rank", pytest.fail)
    _configure_local_gpu(1)
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:1"], "GPU")


def test_init_warns_when_tensorflow_already_set_up_its_gpus(monkeypatch):
    import tensorflow as tf

    patch_tf_gpus(monkeypatch, 2)

    def too_late(devices, kind):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", too_late)
    with pytest.warns(
        RuntimeWarning, match=r"could not pin a GPU to local rank 1.*before building"
    ):
        _configure_local_gpu(1)


class _FakeHorovod:
    """Just enough of horovod.tensorflow for init(): a rank layout, no collectives."""

    def __init__(self, rank, size, local_rank, local_size):
        self.layout = (rank, size, local_rank, local_size)
        self.initialised = False

    def init(self):
        self.initialised = True

    def rank(self):
        return self.layout[0]

    def size(self):
        return self.layout[1]

    def local_rank(self):
        return self.layout[2]

    def local_size(self):
        return self.layout[3]

    def cross_rank(self):
        return self.layout[0] // self.layout[3]

    def cross_size(self):
        return self.layout[1] // self.layout[3]


@pytest.fixture
def fake_horovod(monkeypatch):
    """init() under a launcher, with a stand-in Horovod and a throw-away state."""
    import types

    import kmp.gpu

    # kmp.distributed.world is the function world(); the module is reached through sys.modules.
    world_mod = sys.modules["kmp.distributed.world"]
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())
    monkeypatch.setattr(kmp.gpu, "_current_local_rank", pytest.fail)

    def install(rank, size, local_rank, local_size):
        hvd = _FakeHorovod(rank, size, local_rank, local_size)
        monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
        monkeypatch.setitem(sys.modules, "horovod.tensorflow", hvd)
        monkeypatch.setenv("HOROVOD_SIZE", str(size))
        monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")  # must not be what picks the GPU
        return hvd

    return install


def test_init_under_a_launcher_passes_horovods_local_rank_to_configure_gpus(
    monkeypatch, fake_horovod, recwarn
):
    hvd = fake_horovod(rank=3, size=4, local_rank=1, local_size=2)
    fake = patch_tf_gpus(monkeypatch, 2)
    w = dist.init()
    assert hvd.initialised
    assert w == dist.World(
        rank=3,
        size=4,
        local_rank=1,
        local_size=2,
        horovod=True,
        cross_rank=1,
        cross_size=2,
        engine="horovod",
    )
    assert dist.uses_horovod() and not dist.is_chief() and dist.size() == 4
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]
    assert not [x for x in recwarn if issubclass(x.category, RuntimeWarning)]


def test_init_with_more_local_ranks_than_gpus_shares_with_a_warning(monkeypatch, fake_horovod):
    fake_horovod(rank=2, size=3, local_rank=2, local_size=3)
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning, match=r"Local rank 2 has no GPU of its own.*shares GPU 0"):
        dist.init()
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:0"], "GPU")
