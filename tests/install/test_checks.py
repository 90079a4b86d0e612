from kmp.install import stack_report
from kmp.install.checks import diagnose

H200 = {"name": "NVIDIA H200", "compute_capability": "9.0", "memory_mib": 143771}
CPU_TF = {"distribution": "tensorflow-cpu", "version": "2.21.0", "cuda": False, "gpus": 0}
CUDA_TF = {"distribution": "tensorflow", "version": "2.21.0", "cuda": True, "gpus": 8}
HVD = {"installed": True, "version": "0.28.1", "tensorflow_ops": True, "gloo": True, "mpi": True}


def facts(gpus=0, tf=CPU_TF, built_against="tensorflow-cpu==2.21.0", **hvd):
    return {
        "hardware": {"cpu": {}, "gpus": [H200] * gpus, "tpu": False},
        "tensorflow_build": tf,
        "horovod": {**HVD, "nccl": False, "built_against": built_against, "error": None, **hvd},
    }


def codes(info):
    return [f.code for f in diagnose(info)]


def test_a_healthy_cpu_machine_has_no_warnings():
    assert diagnose(facts()) == []
    assert diagnose(facts(built_against=None)) == []  # Horovod built some other way


def test_a_healthy_gpu_machine_has_no_warnings():
    info = facts(8, CUDA_TF, built_against="tensorflow==2.21.0", nccl=True)
    assert diagnose(info) == []


def test_gpus_with_cpu_only_tensorflow():
    (tf_finding, nccl_finding) = diagnose(facts(8))
    assert tf_finding.code == "cpu-tensorflow-on-gpus"
    assert "8 NVIDIA GPU(s)" in tf_finding.problem and "never used" in tf_finding.problem
    assert "pip uninstall -y tensorflow-cpu" in tf_finding.fix
    assert "tensorflow[and-cuda]==2.21.0" in tf_finding.fix
    assert nccl_finding.code == "horovod-without-nccl"
    assert nccl_finding.fix == "kmp install-horovod --gpu nccl --force"


def test_cuda_tensorflow_that_sees_no_gpu():
    tf = {**CUDA_TF, "gpus": 0}
    info = facts(2, tf, built_against="tensorflow==2.21.0", nccl=True)
    (finding,) = diagnose(info)
    assert finding.code == "tensorflow-sees-no-gpu"
    assert "nvidia-smi" in finding.fix and "CUDA_VISIBLE_DEVICES" in finding.fix


def test_gpus_without_tensorflow():
    assert codes(facts(1, None, built_against=None)) == ["no-tensorflow"]
    finding = diagnose(facts(1, None, built_against=None))[0]
    assert "tensorflow[and-cuda]==2.21.0" in finding.fix and "kmp install-horovod" in finding.fix
    assert diagnose(facts(0, None, built_against=None))[0].fix == (
        "pip install 'tensorflow-cpu==2.21.0'"
    )


def test_horovod_built_against_another_tensorflow():
    info = facts(built_against="tensorflow-cpu==2.20.0", tensorflow_ops=False, error="boom")
    (finding,) = diagnose(info)
    assert finding.code == "horovod-tensorflow-mismatch"
    assert (
        "tensorflow-cpu==2.20.0" in finding.problem and "tensorflow-cpu==2.21.0" in finding.problem
    )
    assert "ops fail to load" in finding.problem and finding.fix == "kmp install-horovod --force"
    # Recorded mismatch that still happens to load: warned too.
    assert codes(facts(built_against="tensorflow-cpu==2.20.0")) == ["horovod-tensorflow-mismatch"]


def test_horovod_ops_that_do_not_load_without_a_record():
    error = "NotFoundError: mpi_lib.so: undefined symbol: _ZN10tensorflow8OpKernel"
    (finding,) = diagnose(facts(built_against=None, tensorflow_ops=False, error=error))
    assert finding.code == "horovod-does-not-load"
    assert "built against a different TensorFlow" in finding.problem
    assert finding.fix == "kmp install-horovod --force"


def test_no_horovod():
    info = facts(built_against=None, installed=False, tensorflow_ops=False)
    assert codes(info) == ["no-horovod"]
    assert diagnose(info)[0].fix == "kmp install-horovod"


def test_the_report_prints_each_warning_with_its_fix():
    info = stack_report.collect()
    assert info["warnings"] == []  # this machine: CPU TensorFlow, Horovod built for it
    described = {**info, **facts(8), "hardware": {**info["hardware"], "gpus": [H200] * 8}}
    described["warnings"] = [f.to_dict() for f in diagnose(described)]
    text = stack_report.format_report(described)
    assert "warnings            2" in text
    assert "WARNING: 8 NVIDIA GPU(s), but tensorflow-cpu 2.21.0 is CPU-only" in text
    assert "fix: kmp install-horovod --gpu nccl --force" in text


def test_versions_outside_the_tested_ranges_are_reported_with_their_fix():
    inside = {**facts(), "python": "3.12.1", "keras": {"version": "3.12.0"}, "jax": "0.6.2"}
    assert diagnose({**inside, "tensorflow": "2.20.0"}) == []
    outside = {**inside, "keras": {"version": "3.9.2"}, "tensorflow": "2.17.1", "jax": "0.13.0"}
    found = diagnose(outside)
    assert [f.code for f in found] == ["untested-version"] * 3
    assert [f.problem.split(" is ")[0] for f in found] == [
        "keras 3.9.2",
        "tensorflow 2.17.1",
        "jax 0.13.0",
    ]
    assert found[0].fix == "pip install 'keras>=3.10,<3.16'"
    assert found[2].fix == "pip install 'jax>=0.6.2,<0.13'"
