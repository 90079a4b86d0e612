"""kmp.distributed's collectives: checks and identities in one process, real Horovod ranks."""

from __future__ import annotations

import numpy as np
import pytest

import kmp.distributed as dist
from kmp._names import normalize_compression
from kmp.distributed.buckets import payload_bytes
from tests._support import requires_horovod, run_workers


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
        normalize_compression(bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        dist.grouped_allreduce([np.ones(2)], compression=bad)
    with pytest.raises(ValueError, match="Unknown compression"):
        payload_bytes([np.ones(2)], compression=bad)


@pytest.mark.parametrize("bad", [16, 1.5, ["fp16"]])
def test_compression_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="compression must be None, 'fp16' or 'bf16'"):
        normalize_compression(bad)
    with pytest.raises(TypeError, match="compression must be"):
        dist.allreduce(np.ones(2), compression=bad)


def test_compression_aliases():
    assert normalize_compression("FP16") == "fp16"
    assert normalize_compression("bfloat16") == "bf16"
    assert normalize_compression("none") is None
    assert normalize_compression(None) is None


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
    assert payload_bytes(grads) == 4 * (40 + 4 + 3)
    assert payload_bytes(grads, "fp16") == 2 * (40 + 4) + 4 * 3
    assert payload_bytes(grads, "bf16") == payload_bytes(grads, "fp16")


@pytest.mark.distributed
@pytest.mark.slow
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
        # Before init(): the launcher's rank and size, nothing started, collectives refused.
        assert res["before_init"] == [r, 2, False, False, False]
        assert "kmp.distributed.init() has not run" in res["refused_before_init"]
