import pytest

from kmp.hardware import CPU, GPU, Hardware
from kmp.install import plan as ip

CPU_BOX = Hardware(cpu=CPU("AMD EPYC", 2))
H200_BOX = Hardware(cpu=CPU("Intel Xeon", 16), gpus=(GPU("NVIDIA H200", (9, 0), 143771),) * 8)


def test_cpu_machine_gets_tensorflow_cpu_and_no_gpu_collectives():
    plan = ip.plan_install(CPU_BOX, mpi_available=False)
    assert plan.device == "cpu" and "no NVIDIA GPU" in plan.reason
    assert plan.tensorflow == "tensorflow-cpu==2.21.0"
    assert plan.gpu_operations is None
    assert "HOROVOD_GPU_OPERATIONS" not in plan.build_env
    assert plan.build_env["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert plan.build_env["HOROVOD_WITH_GLOO"] == "1"
    assert plan.build_env["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in plan.build_env
    assert not plan.mpi and plan.system_packages == ()


def test_gpu_machine_gets_cuda_tensorflow_and_nccl():
    plan = ip.plan_install(H200_BOX, mpi_available=True)
    assert plan.device == "cuda" and "8 NVIDIA GPU(s)" in plan.reason and "H200" in plan.reason
    assert plan.tensorflow == "tensorflow[and-cuda]==2.21.0"
    assert plan.gpu_operations == "NCCL"
    assert plan.build_env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert plan.build_env["HOROVOD_NCCL_LINK"] == "SHARED"  # the nvidia-nccl wheel is shared only
    assert plan.build_env["HOROVOD_WITH_MPI"] == "1" and plan.mpi
    assert plan.system_packages == ("openmpi-bin", "libopenmpi-dev")
    assert "gpu_operations=NCCL" in plan.summary() and "device=cuda" in plan.summary()


def test_kmp_device_overrides_the_detection_both_ways():
    assert ip.device_override({}) is None
    assert ip.device_override({"KMP_DEVICE": " CUDA "}) == "cuda"
    cuda_on_cpu = ip.plan_install(CPU_BOX, device=ip.device_override({"KMP_DEVICE": "cuda"}))
    assert cuda_on_cpu.device == "cuda" and cuda_on_cpu.reason == "KMP_DEVICE=cuda"
    assert cuda_on_cpu.tensorflow.startswith("tensorflow[and-cuda]")
    cpu_on_gpu = ip.plan_install(H200_BOX, device="cpu")
    assert cpu_on_gpu.tensorflow == "tensorflow-cpu==2.21.0" and cpu_on_gpu.gpu_operations is None


def test_bad_choices_are_value_errors_that_list_the_choices():
    with pytest.raises(ValueError, match="KMP_DEVICE must be one of cpu, cuda; got 'gpu'"):
        ip.device_override({"KMP_DEVICE": "gpu"})
    with pytest.raises(ValueError, match="gpu must be one of nccl, none"):
        ip.plan_install(H200_BOX, gpu="mpi")
    with pytest.raises(ValueError, match="device must be one of"):
        ip.plan_install(CPU_BOX, device="tpu")


def test_gpu_none_and_mpi_flags_are_followed():
    plan = ip.plan_install(H200_BOX, gpu="none", mpi=False, mpi_available=True)
    assert plan.tensorflow.startswith("tensorflow[and-cuda]")  # the GPUs still serve TensorFlow
    assert plan.gpu_operations is None and "HOROVOD_GPU_OPERATIONS" not in plan.build_env
    assert not plan.mpi and plan.build_env["HOROVOD_WITHOUT_MPI"] == "1"
    nccl_on_cpu = ip.plan_install(CPU_BOX, gpu="nccl", mpi=True, mpi_available=False)
    assert nccl_on_cpu.gpu_operations == "NCCL" and nccl_on_cpu.mpi


def test_source_fixes_from_tensorflow_2_19_and_the_gpu_one_only_for_gpu_builds():
    assert ip.source_fixes("2.18.1", gpu=True) == ()
    assert ip.source_fixes("2.19.0", gpu=False) == ("xla-ops",)
    assert ip.source_fixes("2.21.0", gpu=True) == ("xla-ops", "gpu-stream")
    assert ip.source_fixes("2.22.0rc1", gpu=False) == ("xla-ops",)
    assert ip.plan_install(CPU_BOX, tensorflow_version="2.17.1").fixes == ()
    assert ip.plan_install(CPU_BOX).fixes == ("xla-ops",)
    assert ip.plan_install(H200_BOX).fixes == ("xla-ops", "gpu-stream")
    assert ip.plan_install(CPU_BOX).to_dict()["fixes"] == {"xla-ops": ip.XLA_FIX}


def test_gpu_kernels_are_built_for_the_gpus_found():
    mixed = Hardware(gpus=(GPU("A100", (8, 0)), GPU("H200", (9, 0)), GPU("A100", (8, 0))))
    assert ip.plan_install(mixed).build_env["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"
    # Described as cuda without GPUs: Horovod's default, every architecture nvcc knows.
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in ip.plan_install(CPU_BOX, device="cuda").build_env
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in ip.plan_install(H200_BOX, gpu="none").build_env


MPI_OPS_CC = """#if HAVE_GPU
#include <cuda_runtime.h>
using GpuStreamHandle = cudaStream_t;
// Forward declaration of AsGpuStreamValue
namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream* stream);
} // namespace stream_executor
} // namespace gpu
#if TENSORFLOW_VERSION >= 2011000000
#include "tensorflow/compiler/xla/stream_executor/stream.h"
#else
#include "tensorflow/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
#endif // HAVE_GPU
  auto stream = stream_executor::gpu::AsGpuStreamValue(device_context->stream());
  auto other = (c != nullptr) ? stream_executor::gpu::AsGpuStreamValue(c->stream()) : 0;
"""


def test_patch_gpu_stream_uses_the_stream_handle():
    patched = ip.fix_source("gpu-stream", MPI_OPS_CC)
    assert "AsGpuStreamValue(" not in patched.replace("// kmp: TensorFlow >= 2.19 does not", "")
    assert patched.count("KmpGpuStream(") == 3  # the definition and both calls
    helper = patched.index("static inline GpuStreamHandle KmpGpuStream")
    assert patched.index("stream_executor/stream.h") < helper < patched.index("#endif // HAVE_GPU")
    assert "platform_specific_handle().stream" in patched
    with pytest.raises(ValueError, match="not its sources"):
        ip.patch_gpu_stream(patched)


def test_patch_cmakelists_removes_only_the_xla_source():
    text = (
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc")\n'
        f"{ip.XLA_OPS_LINE}\n"
        "add_library(${TF_TARGET_LIB} SHARED ${SOURCES} ${TF_SOURCES})\n"
    )
    patched = ip.fix_source("xla-ops", text)
    assert "xla_mpi_ops.cc" not in patched and "mpi_ops.cc" in patched
    assert patched.count("\n") == 2
    with pytest.raises(ValueError, match=r"not Horovod 0\.28\.1's sources"):
        ip.patch_cmakelists(patched)


def test_cache_key_changes_with_everything_that_changes_the_build():
    plan = ip.plan_install(CPU_BOX)
    base = dict(
        tensorflow="tensorflow-cpu==2.21.0", python_tag="cp311", platform_tag="linux-x86_64"
    )
    key = ip.cache_key(plan, **base)
    assert key == ip.cache_key(ip.plan_install(CPU_BOX), **base)  # stable
    assert key.startswith("horovod-0.28.1-cp311-")
    others = {
        ip.cache_key(plan, **{**base, "tensorflow": "tensorflow-cpu==2.20.0"}),
        ip.cache_key(plan, **{**base, "python_tag": "cp312"}),
        ip.cache_key(plan, **{**base, "platform_tag": "linux-aarch64"}),
        ip.cache_key(ip.plan_install(CPU_BOX, mpi=True), **base),
        ip.cache_key(ip.plan_install(H200_BOX), **base),
        ip.cache_key(ip.plan_install(H200_BOX), **base, cuda_version="12.9"),
    }
    assert key not in others and len(others) == 6
