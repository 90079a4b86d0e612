import warnings

import keras
import numpy as np
import pytest

import kmp
from kmp import policy
from kmp.hardware import CPU, GPU, Hardware

NO_ACCEL = Hardware(cpu=CPU(model="plain", cores=2))
BF16_CPU = Hardware(cpu=CPU(model="sapphire", cores=2, avx512_bf16=True))
AMX_CPU = Hardware(cpu=CPU(model="amx", cores=2, amx=True))


def gpu(cc):
    return Hardware(cpu=CPU(), gpus=(GPU(f"cc{cc}", cc, 16000),))


@pytest.mark.parametrize(
    ("hw", "expected"),
    [
        (gpu((7, 0)), "mixed_float16"),
        (gpu((7, 5)), "mixed_float16"),
        (gpu((8, 0)), "mixed_bfloat16"),
        (gpu((9, 0)), "mixed_bfloat16"),
        (gpu((6, 1)), "float32"),
        (BF16_CPU, "mixed_bfloat16"),
        (AMX_CPU, "mixed_bfloat16"),
        (NO_ACCEL, "float32"),
        (Hardware(tpu=True), "mixed_bfloat16"),
    ],
)
def test_auto_rule_for_described_hardware(hw, expected):
    name, reason = policy.choose_policy(hw)  # TensorFlow's
    assert name == expected
    assert reason
    # enable follows the backend it runs on: a CPU keeps float32 on JAX (test_backends.py)
    if keras.backend.backend() == "jax" and not (hw.gpus or hw.tpu):
        expected = "float32"
    choice = kmp.enable("auto", hardware=hw)
    assert choice.name == expected
    assert keras.config.dtype_policy().name == expected
    assert choice.reason.startswith("auto:")


def test_auto_keeps_float32_for_a_bfloat16_cpu_on_the_jax_backend():
    # XLA:CPU's bfloat16 products are slower than float32 there; a GPU or TPU still decides.
    name, reason = policy.choose_policy(BF16_CPU, "jax")
    assert name == "float32" and "JAX backend" in reason
    assert policy.choose_policy(AMX_CPU, "jax")[0] == "float32"
    assert policy.choose_policy(gpu((8, 0)), "jax")[0] == "mixed_bfloat16"
    assert policy.choose_policy(Hardware(tpu=True), "jax")[0] == "mixed_bfloat16"
    assert policy.choose_policy(BF16_CPU, "tensorflow")[0] == "mixed_bfloat16"


def test_auto_never_float16_on_cpu():
    for cpu in (CPU(), CPU(avx512_fp16=True), CPU(avx512_bf16=True, avx512_fp16=True)):
        assert policy.choose_policy(Hardware(cpu=cpu))[0] != "mixed_float16"


def test_mixed_gpus_follow_the_slowest():
    hw = Hardware(gpus=(GPU("a", (8, 0)), GPU("v", (7, 0))))
    assert policy.choose_policy(hw)[0] == "mixed_float16"


def test_enable_mixed_float16_dense_dtypes_and_float32_outputs():
    with pytest.warns(UserWarning, match="no GPU"):
        choice = kmp.enable("mixed_float16", hardware=NO_ACCEL)
    assert choice == policy.PolicyChoice("mixed_float16", "float16", "float32", True, "requested")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    dense = model.layers[0]
    assert dense.compute_dtype == "float16"
    assert dense.kernel.dtype == "float32"
    assert dense(np.ones((2, 8), "float32")).dtype == "float16"
    assert model.outputs[0].dtype == "float16"
    fixed = kmp.float32_outputs(model)
    assert fixed.outputs[0].dtype == "float32"
    assert fixed(np.ones((2, 8), "float32")).dtype == "float32"


@pytest.mark.parametrize("name", ["mixed_bfloat16", "float32"])
def test_enable_named_policies(name):
    choice = kmp.enable(name, hardware=BF16_CPU)
    assert choice.name == name
    assert choice.loss_scaling is False
    assert kmp.current_policy().name == name


def test_enable_accepts_dtype_policy_object():
    choice = kmp.enable(keras.DTypePolicy("mixed_bfloat16"), hardware=BF16_CPU)
    assert choice.compute_dtype == "bfloat16" and choice.variable_dtype == "float32"


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"mixed_float16.*mixed_bfloat16"):
        kmp.enable("mixed_float8")
    assert keras.config.dtype_policy().name == "float32"


def test_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"keras\.DTypePolicy"):
        kmp.enable(16)


def test_env_var_overrides_argument(monkeypatch):
    monkeypatch.setenv("KMP_POLICY", "mixed_bfloat16")
    choice = kmp.enable("float32", hardware=BF16_CPU)
    assert choice.name == "mixed_bfloat16"
    assert "KMP_POLICY" in choice.reason


def test_bad_env_var_is_an_error(monkeypatch):
    monkeypatch.setenv("KMP_POLICY", "fp8")
    with pytest.raises(ValueError, match="Valid names"):
        kmp.enable()


def test_float16_on_cpu_warns_and_suggests_bfloat16():
    with pytest.warns(UserWarning, match="slower.*mixed_bfloat16"):
        kmp.enable("mixed_float16", hardware=BF16_CPU)


def test_float16_on_gpu_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kmp.enable("mixed_float16", hardware=gpu((7, 0)))


def test_enable_does_not_scan_the_heap(monkeypatch):
    """Its cost must not grow with the program: no gc walk (the audit reports stale layers)."""
    import gc

    def forbidden(*args, **kwargs):
        raise AssertionError("kmp.enable() walked the heap")

    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    monkeypatch.setattr(gc, "get_objects", forbidden)
    monkeypatch.setattr(gc, "collect", forbidden)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = kmp.enable("mixed_bfloat16", hardware=BF16_CPU)
        with kmp.policy_scope("float32"):
            pass
    assert choice.name == "mixed_bfloat16"
    assert layer.compute_dtype == "float32"  # built before: keeps its policy


def test_disable_restores_float32():
    kmp.enable("mixed_bfloat16", hardware=BF16_CPU)
    choice = kmp.disable()
    assert choice.name == "float32"
    assert keras.config.dtype_policy().name == "float32"


def test_policy_scope_restores_on_exit_and_on_error():
    kmp.enable("mixed_bfloat16", hardware=BF16_CPU)
    with kmp.policy_scope("float32") as choice:
        assert choice.name == "float32"
        assert keras.config.dtype_policy().name == "float32"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    with pytest.raises(RuntimeError), kmp.policy_scope("float32"):
        raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_policy_choice_is_frozen():
    choice = kmp.current_policy()
    with pytest.raises(AttributeError):
        choice.name = "x"
    assert choice.to_dict()["name"] == "float32"
