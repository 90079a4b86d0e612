import json
import subprocess
import sys

from kmp.install import stack_report

KEYS = {
    "kmp",
    "python",
    "platform",
    "tensorflow",
    "tensorflow_build",
    "keras",
    "horovod",
    "tensorflow_datasets",
    "jax",
    "tf_keras",
    "hardware",
    "policy",
    "warnings",
}


def _kmp(*args):
    return subprocess.run(
        [sys.executable, "-m", "kmp.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_doctor_json_reports_stack():
    r = _kmp("doctor", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert set(info) == KEYS
    assert info["tensorflow"].startswith("2.")
    assert info["keras"]["version"].startswith("3.")
    assert info["keras"]["backend"] == "tensorflow"
    hvd = info["horovod"]
    assert hvd["installed"] and hvd["tensorflow_ops"] and hvd["gloo"], hvd
    assert hvd["version"] == "0.28.1"
    # setup.sh installs Horovod through kmp install-horovod, which records what it was built on.
    assert hvd["built_against"] == f"tensorflow-cpu=={info['tensorflow']}"
    tf = info["tensorflow_build"]
    assert tf["distribution"] == "tensorflow-cpu" and tf["cuda"] is False and tf["gpus"] == 0
    assert info["warnings"] == []
    assert set(info["hardware"]["cpu"]) == {"model", "cores", "avx512_bf16", "amx", "avx512_fp16"}
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert info["hardware"]["cpu"]["avx512_bf16"] == ("avx512_bf16" in flags)
    assert info["policy"]["auto"] in ("float32", "mixed_bfloat16", "mixed_float16")
    assert info["policy"]["reason"]


def test_doctor_text():
    r = _kmp("doctor")
    assert r.returncode == 0, r.stderr
    for word in ("TensorFlow", "Keras", "Horovod", "Gloo", "avx512_bf16", "auto policy"):
        assert word in r.stdout


def test_doctor_without_horovod_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    facts = stack_report._horovod_facts()
    assert facts["tensorflow_ops"] is False
    assert "kmp install-horovod" in facts["install"]
    text = stack_report.format_report({**stack_report.collect(), "horovod": facts})
    assert "NOT usable" in text and "install:" in text


def test_cli_without_command_prints_help():
    r = _kmp()
    assert r.returncode == 2
    assert "doctor" in r.stdout
