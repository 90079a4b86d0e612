import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kmp.commands import install_horovod
from kmp.hardware import CPU, Hardware
from kmp.install import build, cuda, record
from kmp.install import plan as ip
from tests._support import ROOT


def _kmp(*args, env=None, python=sys.executable, flags=()):
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [python, *flags, "-m", "kmp.commands.install_horovod", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
        cwd=ROOT,
    )


def test_dry_run_with_kmp_device_cuda_prints_the_gpu_plan():
    r = _kmp("--dry-run", env={"KMP_DEVICE": "cuda"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tensorflow[and-cuda]==2.21.0" in out
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in out and "HOROVOD_NCCL_LINK=SHARED" in out
    assert "drop xla_mpi_ops.cc" in out
    # This machine has tensorflow-cpu and no CUDA toolkit: the plan says what to do first.
    assert "before it can build:" in out and "pip uninstall -y tensorflow-cpu" in out
    assert "NCCL needs a CUDA toolkit (nvcc) and NCCL" in out and "no NCCL (looked in" in out


def test_dry_run_json_on_this_cpu_machine(tmp_path):
    r = _kmp("--dry-run", "--json", env={"KMP_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["device"] == "cpu" and plan["tensorflow"] == "tensorflow-cpu==2.21.0"
    assert "HOROVOD_GPU_OPERATIONS" not in plan["build_env"]
    assert plan["mpi"] == bool(record.python_facts().mpicxx)
    assert plan["problems"] == [] and plan["cached_wheel"] is None
    assert plan["cache_key"].startswith("horovod-0.28.1-cp311-")


def test_a_bad_kmp_device_is_refused_before_anything_runs():
    r = _kmp("--dry-run", env={"KMP_DEVICE": "gpu"})
    assert r.returncode == 2
    assert "KMP_DEVICE must be one of cpu, cuda; got 'gpu'" in r.stderr


def test_the_summary_needs_only_the_standard_library():
    # setup.sh runs it before anything is installed: no site-packages at all (-S).
    r = _kmp("--summary", python=sys.executable, flags=("-S",), env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("device=cpu tensorflow=tensorflow-cpu==2.21.0 horovod=0.28.1")


def test_cache_root_follows_the_environment(tmp_path):
    assert build.cache_root({"KMP_CACHE_DIR": str(tmp_path)}) == tmp_path
    xdg = build.cache_root({"XDG_CACHE_HOME": "/x"})
    assert xdg == Path("/x/kmp")
    assert build.cache_root({}) == Path.home() / ".cache" / "kmp"


def test_store_and_find_a_cached_wheel(tmp_path):
    built = tmp_path / "build" / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    built.parent.mkdir()
    built.write_bytes(b"wheel bytes")
    root = tmp_path / "cache"
    assert build.cached_wheel(root, "k1") is None
    kept = build.store_wheel(root, "k1", built)
    assert kept == root / "wheels" / "k1" / built.name and kept.read_bytes() == b"wheel bytes"
    assert build.cached_wheel(root, "k1") == kept
    assert build.cached_wheel(root, "k2") is None
    assert [p.name for p in kept.parent.iterdir()] == [built.name]  # no temporary left


def _facts(**kw):
    base = dict(
        python="/env/bin/python",
        prefix="/env",
        tensorflow="tensorflow-cpu==2.21.0",
        tensorflow_version="2.21.0",
        mpicxx="/usr/bin/mpicxx",
        compiler="/usr/bin/c++",
    )
    return record.PythonFacts(**{**base, **kw})


def test_problems_say_what_to_do():
    cpu_plan = ip.plan_install(Hardware(cpu=CPU()), mpi_available=True)
    assert build.problems(cpu_plan, _facts(), None) == []
    (no_tf,) = build.problems(cpu_plan, _facts(tensorflow=None), None)
    assert "no TensorFlow" in no_tf and "pip install 'tensorflow-cpu==2.21.0'" in no_tf
    (no_mpi,) = build.problems(cpu_plan, _facts(mpicxx=None), None)
    assert "apt-get install openmpi-bin libopenmpi-dev" in no_mpi and "--no-mpi" in no_mpi
    (no_cxx,) = build.problems(cpu_plan, _facts(compiler=None), None)
    assert "apt-get install g++" in no_cxx
    gpu_plan = ip.plan_install(Hardware(), device="cuda", mpi=False)
    cpu_tf, no_cuda = build.problems(gpu_plan, _facts(), None)
    assert "CPU-only" in cpu_tf and "tensorflow[and-cuda]==2.21.0" in cpu_tf
    assert "--gpu none" in no_cuda


def test_verify_the_installed_build_against_plans():
    facts = record.python_facts()
    plan = ip.plan_install(Hardware(), mpi_available=bool(facts.mpicxx))
    bad, loaded = record.verify(sys.executable, plan)  # horovodrun --version included
    assert bad == [] and loaded["loaded"] and loaded["version"] == "0.28.1"
    assert loaded["tensorflow"] == facts.tensorflow_version
    nccl_plan = ip.plan_install(Hardware(), device="cuda", mpi=bool(facts.mpicxx))
    bad, _ = record.verify(sys.executable, nccl_plan, check_launcher=False)
    assert bad == ["Horovod was built without NCCL"]


def test_the_build_record_follows_the_installed_library(tmp_path):
    lib = tmp_path / "mpi_lib.so"
    lib.write_bytes(b"x" * 10)
    st = lib.stat()
    loaded = {"library": {"path": str(lib), "size": st.st_size, "mtime_ns": st.st_mtime_ns}}
    plan = ip.plan_install(Hardware())
    facts = _facts(prefix=str(tmp_path))
    path = record.write("key-1", plan, facts, loaded)
    assert path == tmp_path / "share" / "kmp" / "horovod-build.json"
    written = record.read(str(tmp_path))
    assert written["key"] == "key-1" and written["tensorflow"] == "tensorflow-cpu==2.21.0"
    assert record.is_current(written)
    lib.write_bytes(b"y" * 11)  # another build replaced the library
    assert not record.is_current(written)
    assert record.read(str(tmp_path / "none")) is None
    assert not record.is_current(None)


def test_the_record_says_what_the_current_library_was_built_with(tmp_path):
    lib = tmp_path / "mpi_lib.so"
    lib.write_bytes(b"x" * 10)
    st = lib.stat()
    loaded = {"library": {"path": str(lib), "size": st.st_size, "mtime_ns": st.st_mtime_ns},
              "gloo": True, "mpi": False, "nccl": False}  # fmt: skip
    facts = _facts(prefix=str(tmp_path))
    assert record.built_flags(str(tmp_path)) is None  # no record yet: only loading can tell
    path = record.write("key-1", ip.plan_install(Hardware()), facts, loaded)
    assert record.built_flags(str(tmp_path)) == {"gloo": True, "mpi": False, "nccl": False}
    old = json.loads(path.read_text())
    del old["built"]  # a record written before the flags were recorded
    path.write_text(json.dumps(old))
    assert record.built_flags(str(tmp_path)) is None
    record.write("key-1", ip.plan_install(Hardware()), facts, loaded)
    lib.write_bytes(b"y" * 11)  # another build replaced the library: the flags are not its
    assert record.built_flags(str(tmp_path)) is None


def test_a_record_under_another_key_means_a_rebuild(tmp_path):
    facts = record.python_facts()
    plan = ip.plan_install(Hardware(), mpi_available=bool(facts.mpicxx))
    loaded = record.up_to_date("any-key", plan, facts)  # the real record: ours differs
    assert loaded is None
    real = record.read()
    assert real is not None and record.up_to_date(real["key"], plan, facts)["loaded"]


@pytest.fixture
def no_system_cuda(monkeypatch):
    monkeypatch.setattr(cuda, "SYSTEM_HOMES", ())
    monkeypatch.setattr(cuda, "SYSTEM_NCCL", ())


def _toolkit_tree(tmp_path, nccl_in_wheel=True):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (home / "bin" / "nvcc").chmod(0o755)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12040\n")
    site = tmp_path / "site"
    if nccl_in_wheel:
        (site / "nvidia" / "nccl" / "include").mkdir(parents=True)
        (site / "nvidia" / "nccl" / "lib").mkdir()
        (site / "nvidia" / "nccl" / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
        (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"")
    return home, site


def test_cuda_toolkit_found_with_nccl_from_the_wheel(tmp_path, no_system_cuda):
    home, site = _toolkit_tree(tmp_path)
    tk = cuda.find({"CUDA_HOME": str(home), "PATH": ""}, str(site))
    assert tk is not None and tk.home == str(home) and tk.version == "12.4"
    assert tk.nccl_source == "wheel" and tk.nccl_lib == str(site / "nvidia" / "nccl" / "lib")
    assert "CUDA 12.4" in tk.describe()
    env = cuda.build_env(tk, tmp_path / "work")
    assert env["HOROVOD_CUDA_HOME"] == str(home)
    assert env["HOROVOD_NCCL_INCLUDE"] == str(site / "nvidia" / "nccl" / "include")
    link = Path(env["HOROVOD_NCCL_LIB"]) / "libnccl.so"  # the linker's name for the library
    assert link.is_symlink() and os.readlink(link).endswith("libnccl.so.2")
    # Found at run time relative to Horovod's library, in whichever environment has the wheel.
    assert env["LDFLAGS"] == "-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"
    kept = cuda.build_env(tk, tmp_path / "work", {"LDFLAGS": "-O1"})
    assert kept["LDFLAGS"] == "-O1 -Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"
    assert cuda.describe_env(tk)["LDFLAGS"] == env["LDFLAGS"]
    assert cuda.warnings(tk) == []  # CUDA 12, like TensorFlow's wheels


def test_a_toolkit_of_another_cuda_major_is_a_warning(tmp_path, no_system_cuda):
    home, site = _toolkit_tree(tmp_path)
    (home / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    tk = cuda.find({"CUDA_HOME": str(home), "PATH": ""}, str(site))
    (warning,) = cuda.warnings(tk)
    assert "13.0" in warning and "CUDA 12" in warning and "driver" in warning


def test_nvcc_on_the_path_finds_its_toolkit(tmp_path, no_system_cuda):
    home, site = _toolkit_tree(tmp_path)
    tk = cuda.find({"PATH": str(home / "bin")}, str(site))
    assert tk is not None and Path(tk.home).resolve() == home.resolve()


def test_no_nvcc_or_no_nccl_means_no_gpu_build(tmp_path, no_system_cuda):
    home, site = _toolkit_tree(tmp_path, nccl_in_wheel=False)
    assert cuda.find({"CUDA_HOME": str(home), "PATH": ""}, str(site)) is None
    said = cuda.missing({"CUDA_HOME": str(home), "PATH": ""}, str(site))
    assert said.startswith("CUDA 12.4 toolkit at") and "no NCCL (looked in" in said
    said = cuda.missing({"PATH": ""}, str(site))
    assert "no CUDA toolkit with nvcc" in said and "bring no nvcc" in said
    # A folder with an nvcc wrapper script but no CUDA headers is not a toolkit.
    wrapper = tmp_path / "wrapper"
    (wrapper / "bin").mkdir(parents=True)
    (wrapper / "bin" / "nvcc").write_text('#!/bin/sh\nexec /elsewhere/nvcc "$@"\n')
    assert cuda.find_parts({"CUDA_HOME": str(wrapper), "PATH": ""}, str(site))[0] is None
    home, site = _toolkit_tree(tmp_path / "2")
    assert cuda.find({"PATH": ""}, str(site)) is None  # no toolkit anywhere
    (home / "bin" / "nvcc").unlink()
    assert cuda.find({"CUDA_HOME": str(home), "PATH": ""}, str(site)) is None


@pytest.mark.parametrize("header, version", [("12090", "12.9"), ("11080", "11.8")])
def test_cuda_version_from_the_header(tmp_path, header, version):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {header}\n")
    assert cuda.cuda_version(str(tmp_path)) == version
    assert cuda.cuda_version(str(tmp_path / "missing")) is None


def test_setup_sh_leaves_the_build_to_kmp_install_horovod():
    lines = (ROOT / "launch" / "setup.sh").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert '"$VENV/bin/kmp" install-horovod' in text and "install_horovod --summary" in text
    # One home for the build: no build variables, source download or patch in the script.
    for word in ("HOROVOD_WITH", "pip_q download", "xla_mpi_ops", "tensorflow-cpu=="):
        assert word not in text, word
    pins = (ROOT / "requirements.txt").read_text().splitlines()
    assert not [p for p in pins if p.startswith(("tensorflow=", "tensorflow-cpu", "tensorflow["))]


def _no_real_install(monkeypatch, tmp_path, verify_result):
    monkeypatch.setenv("KMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KMP_DEVICE", raising=False)
    monkeypatch.setattr(record, "up_to_date", lambda *a: None)
    monkeypatch.setattr(record, "verify", lambda *a, **k: verify_result)
    monkeypatch.setattr(record, "write", lambda *a: None)
    installed = []
    monkeypatch.setattr(build, "install_wheel", lambda py, w: installed.append(w))
    return installed


def test_only_a_verified_build_is_cached(monkeypatch, tmp_path):
    installed = _no_real_install(monkeypatch, tmp_path, ([], {"library": None}))

    def fake_build(plan, python, workdir, toolkit, log_file=None):
        wheel = workdir / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
        wheel.write_bytes(b"built")
        return wheel

    monkeypatch.setattr(build, "build_wheel", fake_build)
    assert install_horovod.main([]) == 0
    cached = list((tmp_path / "cache" / "wheels").glob("*/horovod-*.whl"))
    assert len(installed) == 1 and [c.read_bytes() for c in cached] == [b"built"]
    # The same plan again (forced): the cached wheel is installed, nothing is compiled.
    monkeypatch.setattr(build, "build_wheel", pytest.fail)
    assert install_horovod.main(["--force"]) == 0
    assert installed[-1] == cached[0]


def test_a_build_that_fails_verification_is_not_cached(monkeypatch, tmp_path, capsys):
    _no_real_install(monkeypatch, tmp_path, (["Horovod was built without MPI"], {}))

    def fake_build(plan, python, workdir, toolkit, log_file=None):
        wheel = workdir / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
        wheel.write_bytes(b"bad")
        return wheel

    monkeypatch.setattr(build, "build_wheel", fake_build)
    assert install_horovod.main([]) == 1
    assert "built without MPI" in capsys.readouterr().err
    assert not list((tmp_path / "cache").glob("wheels/*/*.whl"))


def test_a_cached_wheel_that_fails_verification_is_removed(monkeypatch, tmp_path, capsys):
    _no_real_install(monkeypatch, tmp_path, (["ops do not load"], {}))
    stale = tmp_path / "stale" / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    monkeypatch.setattr(build, "cached_wheel", lambda root, key: stale)
    assert install_horovod.main([]) == 1
    err = capsys.readouterr().err
    assert "ops do not load" in err and "was removed: run again to rebuild it" in err
    assert not stale.exists()
