from kmp import hardware
from kmp.hardware import CPU, GPU, Hardware

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""


def test_parse_cpuinfo_reads_model_and_flags():
    cpu = hardware.parse_cpuinfo(CPUINFO, cores=2)
    assert cpu == CPU("Intel(R) Xeon(R) Platinum 8480+", 2, True, True, True)
    assert cpu.fast_bfloat16


def test_parse_cpuinfo_without_bf16():
    cpu = hardware.parse_cpuinfo("model name : AMD EPYC\nflags : sse2 avx2 fma\n", cores=4)
    assert (cpu.model, cpu.avx512_bf16, cpu.amx, cpu.avx512_fp16) == (
        "AMD EPYC",
        False,
        False,
        False,
    )
    assert not cpu.fast_bfloat16


def test_parse_nvidia_smi():
    gpus = hardware.parse_nvidia_smi("NVIDIA H200, 9.0, 143771\nTesla V100-SXM2-16GB, 7.0, 16384\n")
    assert gpus == (GPU("NVIDIA H200", (9, 0), 143771), GPU("Tesla V100-SXM2-16GB", (7, 0), 16384))
    assert gpus[0].fast_bfloat16 and gpus[1].has_tensor_cores and not gpus[1].fast_bfloat16
    assert hardware.parse_nvidia_smi("garbage\n") == ()


def test_detect_on_this_machine_matches_proc_cpuinfo():
    hw = hardware.detect()
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert hw.cpu.avx512_bf16 == ("avx512_bf16" in flags)
    assert hw.cpu.cores >= 1
    assert isinstance(hw.gpus, tuple)


def test_to_dict_is_plain_data():
    hw = Hardware(cpu=CPU("x", 2, True), gpus=(GPU("a", (8, 0), 100),))
    d = hw.to_dict()
    assert d["cpu"]["avx512_bf16"] is True
    assert d["gpus"] == [{"name": "a", "compute_capability": "8.0", "memory_mib": 100}]
