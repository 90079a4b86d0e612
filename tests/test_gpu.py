"""kmp.configure_gpus: the decisions (plan_gpus) and the tf.config calls they make.

This machine has no GPU, so the calls are checked against a recording stand-in for
``tf.config`` fed with described devices; the real function is also run here, where it
must do nothing.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest

import kmp
import kmp._launcher_env as launcher_env
from kmp import gpu
from tests._support import FakeTFConfig, gpus, patch_tf_gpus

# ------------------------------------------------------------------ plan_gpus


def test_no_gpu_plans_nothing():
    plan = gpu.plan_gpus([], visible="local_rank", local_rank=1)
    assert plan.visible == () and plan.physical == ()
    assert plan.memory_growth is False and plan.memory_limit_mb is None
    assert "no GPU" in plan.reason
    fake = FakeTFConfig()
    gpu._apply(plan, [], fake)
    assert fake.calls == []


def test_local_rank_picks_its_gpu_with_growth():
    devs = gpus(4)
    plan = gpu.plan_gpus(devs, local_rank=2)
    assert plan.visible == (2,) and plan.memory_growth and plan.local_rank == 2
    fake = FakeTFConfig()
    gpu._apply(plan, devs, fake)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:2"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:2", True),
    ]


def test_single_process_local_rank_means_all_gpus():
    devs = gpus(2)
    plan = gpu.plan_gpus(devs, visible="local_rank", local_rank=None)
    assert plan.visible == (0, 1)
    fake = FakeTFConfig()
    gpu._apply(plan, devs, fake)
    assert fake.calls[0] == ("set_visible_devices", [d.name for d in devs], "GPU")
    assert [c[0] for c in fake.calls[1:]] == ["set_memory_growth"] * 2


@pytest.mark.parametrize(
    ("visible", "expected"), [("all", (0, 1, 2)), (1, (1,)), ([2, 0], (2, 0)), ("ALL", (0, 1, 2))]
)
def test_explicit_visible(visible, expected):
    assert gpu.plan_gpus(gpus(3), visible=visible, local_rank=1).visible == expected


def test_memory_limit_replaces_growth():
    devs = gpus(2)
    plan = gpu.plan_gpus(devs, memory_limit_mb=4096, visible=1)
    assert plan.memory_growth is False and plan.memory_limit_mb == 4096
    fake = FakeTFConfig()
    gpu._apply(plan, devs, fake)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        (
            "set_logical_device_configuration",
            "/physical_device:GPU:1",
            [FakeTFConfig.LogicalDeviceConfiguration(memory_limit=4096)],
        ),
    ]


def test_growth_off_makes_no_growth_call():
    devs = gpus(1)
    fake = FakeTFConfig()
    gpu._apply(gpu.plan_gpus(devs, memory_growth=False), devs, fake)
    assert fake.calls == [("set_visible_devices", [devs[0].name], "GPU")]


def test_to_dict_is_json_ready():
    import json

    d = gpu.plan_gpus(gpus(2), local_rank=1).to_dict()
    assert json.loads(json.dumps(d))["visible"] == [1]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("visible", [2, [0, 5], -1])
def test_index_beyond_gpus_is_an_error(visible):
    with pytest.raises(ValueError, match=r"sees 2 GPU\(s\).*CUDA_VISIBLE_DEVICES"):
        gpu.plan_gpus(gpus(2), visible=visible)


def test_index_without_any_gpu_is_an_error():
    with pytest.raises(ValueError, match=r"asks for GPU 0, but this process sees 0 GPU"):
        gpu.plan_gpus([], visible=0)


@pytest.mark.parametrize(("local_rank", "shared_gpu"), [(2, 0), (3, 1), (5, 1)])
def test_local_rank_without_its_own_gpu_shares_one(local_rank, shared_gpu):
    # More ranks on the host than GPUs: local_rank % n_gpus, memory growth on, said so.
    devs = gpus(2)
    plan = gpu.plan_gpus(devs, local_rank=local_rank)
    assert plan.shared is True
    assert plan.visible == (shared_gpu,) and plan.local_rank == local_rank
    assert plan.memory_growth is True and plan.memory_limit_mb is None
    assert f"shares GPU {shared_gpu}" in plan.reason and "no GPU of its own" in plan.reason
    fake = FakeTFConfig()
    gpu._apply(plan, devs, fake)
    assert fake.calls == [
        ("set_visible_devices", [f"/physical_device:GPU:{shared_gpu}"], "GPU"),
        ("set_memory_growth", f"/physical_device:GPU:{shared_gpu}", True),
    ]


def test_a_shared_gpu_always_grows_or_is_capped():
    # Two processes cannot each take a whole GPU: growth is on even if asked off ...
    assert gpu.plan_gpus(gpus(1), memory_growth=False, local_rank=1).memory_growth is True
    # ... unless a memory limit caps each of them.
    plan = gpu.plan_gpus(gpus(1), memory_limit_mb=2048, local_rank=1)
    assert plan.shared and plan.memory_growth is False and plan.memory_limit_mb == 2048


@pytest.mark.parametrize(
    ("visible", "local_rank"), [("local_rank", 1), ("local_rank", None), ("all", 3), (0, 3)]
)
def test_plans_with_a_gpu_of_their_own_are_not_shared(visible, local_rank):
    assert gpu.plan_gpus(gpus(2), visible=visible, local_rank=local_rank).shared is False


def test_resolve_visible_keeps_its_two_tuple_and_shares_too():
    # kmp.compat.v1.build_session_config unpacks `indices, _ = resolve_visible(...)`.
    indices, reason = gpu.resolve_visible("local_rank", 2, 3, what="visible_devices")
    assert indices == (1,) and "shares GPU 1" in reason
    assert gpu.resolve_visible("local_rank", 4, 3) == ((3,), "Horovod local rank 3")
    assert gpu.resolve_visible("local_rank", 0, 3)[0] == ()


@pytest.mark.parametrize(("local_rank", "error"), [(-1, ValueError), ("1", TypeError)])
def test_bad_local_rank(local_rank, error):
    with pytest.raises(error, match="`local_rank` must be an integer >= 0"):
        gpu.plan_gpus(gpus(2), local_rank=local_rank)
    with pytest.raises(error, match="`local_rank`"):
        gpu.resolve_visible("local_rank", 2, local_rank)


def test_bad_gpu_count():
    with pytest.raises(ValueError, match="`n_gpus`"):
        gpu.resolve_visible("all", -1, None)
    with pytest.raises(TypeError, match="`n_gpus`"):
        gpu.resolve_visible("all", 2.0, None)


def test_numpy_indices_are_accepted():
    plan = gpu.plan_gpus(gpus(3), visible=[np.int64(2)], local_rank=np.int32(0))
    assert plan.visible == (2,) and type(plan.visible[0]) is int and plan.local_rank == 0


def test_repeated_index_is_an_error():
    with pytest.raises(ValueError, match="more than once"):
        gpu.plan_gpus(gpus(2), visible=[1, 1])


@pytest.mark.parametrize("visible", [1.0, [0, "1"], None, True])
def test_visible_of_wrong_type(visible):
    with pytest.raises(TypeError, match="'local_rank', 'all', an int or a list of ints"):
        gpu.plan_gpus(gpus(2), visible=visible)


def test_unknown_visible_name():
    with pytest.raises(ValueError, match="'local_rank'"):
        gpu.plan_gpus(gpus(2), visible="first")


def test_growth_and_limit_together_is_an_error():
    with pytest.raises(ValueError, match="cannot both be set"):
        gpu.plan_gpus(gpus(1), memory_growth=True, memory_limit_mb=1024)


@pytest.mark.parametrize("limit", [0, -5, 0.5, float("inf")])
def test_bad_memory_limit(limit):
    with pytest.raises(ValueError, match=r"`memory_limit_mb` must be .*number of MiB"):
        gpu.plan_gpus(gpus(1), memory_limit_mb=limit)


@pytest.mark.parametrize("limit", ["4096", True])
def test_memory_limit_of_the_wrong_type(limit):
    with pytest.raises(TypeError, match=r"`memory_limit_mb` must be .*number of MiB"):
        gpu.plan_gpus(gpus(1), memory_limit_mb=limit)


def test_bad_memory_growth_type():
    with pytest.raises(TypeError, match="`memory_growth` must be True or False"):
        gpu.plan_gpus(gpus(1), memory_growth="yes")
    # Checked before it is compared with memory_limit_mb.
    with pytest.raises(TypeError, match="`memory_growth`"):
        gpu.plan_gpus(gpus(1), memory_growth="yes", memory_limit_mb=1024)


def test_configuring_after_initialisation_says_what_to_do():
    devs = gpus(2)
    fake = FakeTFConfig(raise_on="set_visible_devices")
    with pytest.raises(gpu.GPUConfigurationError, match="before any TensorFlow op") as info:
        gpu._apply(gpu.plan_gpus(devs, local_rank=0), devs, fake)
    assert isinstance(info.value, RuntimeError)
    assert "cannot be modified after being initialized" in str(info.value)


# ------------------------------------------------------------------ local rank


def test_current_local_rank_reads_only_the_launcher(monkeypatch):
    for var in launcher_env.LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    assert gpu._current_local_rank() is None
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert gpu._current_local_rank() == 3


def test_gpu_does_not_import_kmp_distributed():
    tree = ast.parse(Path(gpu.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    assert not [m for m in imported if m.startswith("kmp.distributed")], imported


# ------------------------------------------------------------------ the real function


@pytest.fixture
def no_launcher(monkeypatch):
    for var in launcher_env.LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)


def test_configure_gpus_is_harmless_without_gpus(no_launcher):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this test describes a machine without GPUs")
    result = kmp.configure_gpus()
    assert isinstance(result, gpu.GPUConfig)
    assert result.physical == () and result.visible == ()
    with pytest.raises(ValueError, match="sees 0 GPU"):
        kmp.configure_gpus(visible=0)


def test_configure_gpus_uses_tf_config_and_launcher_rank(monkeypatch):
    """The public function with TensorFlow's device list and tf.config calls replaced."""
    fake = patch_tf_gpus(monkeypatch, 2)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    result = kmp.configure_gpus()
    assert result.visible == (1,) and result.local_rank == 1
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]


def test_configure_gpus_takes_the_local_rank_as_an_input(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 2)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")  # ignored: the caller's local rank wins
    result = kmp.configure_gpus(local_rank=1)
    assert result.visible == (1,) and result.local_rank == 1 and not result.shared
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:1"], "GPU")


def test_configure_gpus_local_rank_none_means_a_single_process(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 2)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "garbage")  # not read when local_rank is given
    result = kmp.configure_gpus(local_rank=None)
    assert result.visible == (0, 1) and result.local_rank is None
    assert fake.calls[0] == ("set_visible_devices", [d.name for d in gpus(2)], "GPU")


def test_configure_gpus_shares_a_gpu_with_a_warning(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning) as record:
        result = kmp.configure_gpus(local_rank=3)
    assert result.shared and result.visible == (1,) and result.memory_growth
    message = str(record[0].message)
    assert "Local rank 3 has no GPU of its own (this host shows 2)" in message
    assert "shares GPU 1" in message and "memory growth" in message
    assert "horovodrun -H host:2" in message and "visible=" in message
    assert record[0].filename == __file__  # points at the caller
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]


def test_configure_gpus_shares_by_the_launcher_rank_too(monkeypatch):
    patch_tf_gpus(monkeypatch, 1)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    with pytest.warns(RuntimeWarning, match="shares GPU 0"):
        assert kmp.configure_gpus().visible == (0,)


def test_configure_gpus_does_not_warn_with_a_gpu_per_rank(monkeypatch):
    patch_tf_gpus(monkeypatch, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert kmp.configure_gpus(local_rank=1).visible == (1,)
        assert kmp.configure_gpus(visible=0, local_rank=5).visible == (0,)


@pytest.mark.parametrize(("local_rank", "error"), [(-2, ValueError), (1.0, TypeError)])
def test_configure_gpus_checks_the_local_rank(monkeypatch, local_rank, error):
    patch_tf_gpus(monkeypatch, 2)
    with pytest.raises(error, match="`local_rank`"):
        kmp.configure_gpus(local_rank=local_rank)


def test_configure_gpus_reports_a_bad_launcher_variable(monkeypatch):
    patch_tf_gpus(monkeypatch, 2)
    for var in launcher_env.LOCAL_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_LOCAL_RANK='-1'.*non-negative"):
        kmp.configure_gpus()


def test_a_capped_shared_gpu_says_so(monkeypatch):
    import tensorflow as tf

    fake = patch_tf_gpus(monkeypatch, 1)
    monkeypatch.setattr(
        tf.config, "set_logical_device_configuration", fake.set_logical_device_configuration
    )
    with pytest.warns(RuntimeWarning, match="shares GPU 0 with another rank, capped at 1024 MiB"):
        result = kmp.configure_gpus(memory_limit_mb=1024, local_rank=1)
    assert result.shared and result.memory_limit_mb == 1024 and not result.memory_growth
    assert [c[0] for c in fake.calls] == ["set_visible_devices", "set_logical_device_configuration"]
