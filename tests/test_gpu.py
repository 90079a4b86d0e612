"""kmp.configure_gpus: the decisions (plan_gpus) and the tf.config calls they make.

This machine has no GPU, so the calls are checked against a recording stand-in for
``tf.config`` fed with described devices; the real function is also run here, where it
must do nothing.
"""

from __future__ import annotations

import pytest
from conftest import FakeTFConfig, gpus, patch_tf_gpus

import kmp
from kmp import gpu

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


def test_local_rank_without_its_own_gpu_is_an_error():
    with pytest.raises(ValueError, match=r"local rank 2.*only 2 GPU.*at most 2 process"):
        gpu.plan_gpus(gpus(2), local_rank=2)


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


@pytest.mark.parametrize("limit", [0, -5, "4096", True])
def test_bad_memory_limit(limit):
    with pytest.raises(ValueError, match="positive number of MiB"):
        gpu.plan_gpus(gpus(1), memory_limit_mb=limit)


def test_bad_memory_growth_type():
    with pytest.raises(TypeError, match="memory_growth"):
        gpu.plan_gpus(gpus(1), memory_growth="yes")


def test_configuring_after_initialisation_says_what_to_do():
    devs = gpus(2)
    fake = FakeTFConfig(raise_on="set_visible_devices")
    with pytest.raises(gpu.GPUConfigurationError, match="before any TensorFlow op") as info:
        gpu._apply(gpu.plan_gpus(devs, local_rank=0), devs, fake)
    assert isinstance(info.value, RuntimeError)
    assert "cannot be modified after being initialized" in str(info.value)


# ------------------------------------------------------------------ local rank


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"HOROVOD_LOCAL_RANK": "1"}, 1),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
        ({"HOROVOD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 0),
        ({"SLURM_LOCALID": "2"}, 2),
        ({"HOROVOD_LOCAL_RANK": ""}, None),
    ],
)
def test_launcher_local_rank(env, expected):
    assert gpu.launcher_local_rank(env) == expected


@pytest.mark.parametrize("value", ["x", "-1"])
def test_bad_launcher_local_rank(value):
    with pytest.raises(ValueError, match="HOROVOD_LOCAL_RANK"):
        gpu.launcher_local_rank({"HOROVOD_LOCAL_RANK": value})


# ------------------------------------------------------------------ the real function


@pytest.fixture
def no_launcher(monkeypatch):
    for var in gpu.LOCAL_RANK_VARS:
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
