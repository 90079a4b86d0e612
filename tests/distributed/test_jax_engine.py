"""The JAX engine: choosing it, launching it, and real 2-process jobs on Keras's JAX backend."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kmp import _launcher_env as env
from kmp.distributed.engines import choose_engine
from kmp.launching.engine_env import jax_env, pick_port, port_is_free
from kmp.launching.hosts import Host, LaunchError
from kmp.launching.job import build_command
from tests._support import ROOT, requires_horovod, run_workers

WORKER = ROOT / "tests" / "distributed" / "worker_jax_engine.py"
SEED_WORKER = ROOT / "tests" / "distributed" / "worker_jax_seed.py"
KMP = [sys.executable, "-m", "kmp.cli"]


# ------------------------------------------------------------ pure decisions


def test_auto_follows_the_backend_and_the_launcher():
    assert choose_engine("auto", "tensorflow") == "horovod"
    assert choose_engine("auto", "jax") == "jax"
    assert choose_engine("AUTO", "jax", "jax") == "jax"
    assert choose_engine("jax", "jax", "jax") == "jax"
    assert choose_engine("horovod", "tensorflow", None) == "horovod"


def test_an_engine_on_the_wrong_backend_says_what_to_set():
    with pytest.raises(ValueError, match="jax engine runs on Keras's jax backend, but KERAS_"):
        choose_engine("jax", "tensorflow")
    with pytest.raises(ValueError, match="Set KERAS_BACKEND=tensorflow"):
        choose_engine("horovod", "jax")
    with pytest.raises(ValueError, match="launched with --engine jax"):
        choose_engine("horovod", "tensorflow", "jax")
    with pytest.raises(ValueError, match="one of 'auto', 'horovod', 'jax'"):
        choose_engine("mpi", "tensorflow")
    with pytest.raises(TypeError):
        choose_engine(None, "tensorflow")


def test_init_refuses_the_jax_engine_on_the_tensorflow_backend():
    import kmp

    with pytest.raises(ValueError, match="KERAS_BACKEND=jax"):
        kmp.distributed.init(engine="jax")


def test_launcher_variables_of_the_jax_engine():
    e = {"KMP_ENGINE": "JAX", "KMP_COORDINATOR": "h1:29500", "HOROVOD_RANK": "3"}
    assert env.launched_engine(e) == "jax" and env.launched_engine({}) is None
    assert env.launched_coordinator(e) == "h1:29500" and env.launched_rank(e) == 3
    assert env.launched_jax_timeouts({}) == env.JaxTimeouts(join=300, heartbeat=600, shutdown=600)
    timeouts = {"KMP_JAX_TIMEOUT": "7", "KMP_JAX_HEARTBEAT_TIMEOUT": "9"}
    assert env.launched_jax_timeouts(timeouts) == env.JaxTimeouts(7, 9, 600)
    assert env.launched_jax_timeouts({"KMP_JAX_SHUTDOWN_TIMEOUT": "5"}).shutdown == 5
    for bad, call, message in [
        ({"KMP_ENGINE": "mpi"}, env.launched_engine, "not an engine"),
        ({"KMP_COORDINATOR": "h1"}, env.launched_coordinator, "not host:port"),
        ({"KMP_COORDINATOR": "h1:99999"}, env.launched_coordinator, "not host:port"),
        ({"HOROVOD_RANK": "-1"}, env.launched_rank, "not a rank"),
        ({"KMP_JAX_TIMEOUT": "0"}, env.launched_jax_timeouts, "number of seconds"),
        ({"KMP_JAX_HEARTBEAT_TIMEOUT": "1m"}, env.launched_jax_timeouts, "HEARTBEAT.*600 s"),
        ({"KMP_JAX_SHUTDOWN_TIMEOUT": "-3"}, env.launched_jax_timeouts, "SHUTDOWN.*600 s"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(bad)


def test_jax_env_for_one_host_and_for_several():
    assert jax_env(None, 29500, {}) == {
        "KERAS_BACKEND": "jax",
        "KMP_ENGINE": "jax",
        "KMP_COORDINATOR": "127.0.0.1:29500",
    }
    several = jax_env([Host("h1", 2), Host("h2", 2)], 29501, {"KERAS_BACKEND": "jax"})
    assert several["KMP_COORDINATOR"] == "h1:29501"  # process 0 runs on the first host
    with pytest.raises(LaunchError, match="KERAS_BACKEND=tensorflow"):
        jax_env(None, 29500, {"KERAS_BACKEND": "tensorflow"})
    with pytest.raises(LaunchError, match="already in use on this machine"):
        jax_env(None, 29500, {}, port_free=False)
    with pytest.raises(LaunchError, match="not localhost"):
        jax_env([Host("localhost", 1), Host("h2", 1)], 29500, {})
    with pytest.raises(LaunchError, match="TCP port"):
        jax_env(None, 0, {})


def test_build_command_for_the_jax_engine(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    plan = build_command(2, script, engine="jax", environ={})
    # On this machine alone: kmp's own launcher, no horovodrun (Horovod need not be installed).
    assert not plan.horovodrun and plan.argv[1:6] == (
        "-m",
        "kmp.launching.local_run",
        "-np",
        "2",
        "--",
    )
    assert plan.argv[6:] == (sys.executable, str(script)) and plan.env["KMP_ENGINE"] == "jax"
    remote = build_command(
        2, script, engine="jax", hosts=[Host("h1", 1), Host("h2", 1)], environ={}
    )
    assert remote.horovodrun and remote.env["KMP_COORDINATOR"].startswith("h1:")
    assert plan.env["KERAS_BACKEND"] == "jax"
    assert plan.env["KMP_COORDINATOR"].startswith("127.0.0.1:")
    with pytest.raises(LaunchError, match="--elastic runs on Horovod"):
        from kmp.launching.elastic import ElasticOptions

        build_command(None, script, engine="jax", elastic=ElasticOptions(min_np=1, max_np=2))
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_is_free(port)
        with pytest.raises(LaunchError, match=f"--coordinator-port {port} is already in use"):
            build_command(2, script, engine="jax", coordinator_port=port, environ={})
    assert port_is_free(pick_port())


def test_horovod_with_the_jax_backend_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(LaunchError, match="launch with --engine jax"):
        build_command(2, script, environ={"KERAS_BACKEND": "jax"})
    assert build_command(2, script, environ={"KERAS_BACKEND": "tensorflow"}).env == {}
    with pytest.raises(LaunchError, match="TCP port"):
        build_command(2, script, engine="jax", coordinator_port=70000, environ={})


def test_the_local_launcher_tags_output_and_stops_the_others_when_one_fails(tmp_path, capfd):
    from kmp.launching import local_run

    assert local_run.rank_env(1, 2) == {
        "KMP_RANK": "1",
        "KMP_SIZE": "2",
        "KMP_LOCAL_RANK": "1",
        "KMP_LOCAL_SIZE": "2",
    }
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['KMP_RANK'])\n"
        "print('hello from', rank, 'of', os.environ['KMP_SIZE'], flush=True)\n"
        "if rank == 1:\n    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    assert local_run.main(["-np", "2", "--", sys.executable, str(script)]) == 3
    assert time.monotonic() - t0 < 30  # rank 0 was stopped, not waited for
    out = capfd.readouterr().out
    assert "[0]<stdout>:hello from 0 of 2" in out and "[1]<stdout>:hello from 1 of 2" in out
    assert local_run.main(["-np", "2", "--", sys.executable, "-c", "pass"]) == 0


def test_horovod_refuses_a_job_of_the_local_launcher(monkeypatch):
    import importlib

    import kmp

    world_mod = importlib.import_module("kmp.distributed.world")
    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())
    monkeypatch.setenv("KMP_SIZE", "2")
    with pytest.raises(ValueError, match="kmp's local launcher"):
        kmp.distributed.init()
    from kmp.launching.job import forwarded_env

    assert forwarded_env({"KMP_RANK": "1", "KMP_SIZE": "2", "KMP_X": "y"}) == {"KMP_X": "y"}


def test_kmp_launch_refuses_jax_with_the_tensorflow_backend(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = subprocess.run(
        [*KMP, "launch", "--engine", "jax", "-np", "2", "--dry-run", str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "tensorflow"},
        timeout=120,
    )
    assert r.returncode == 2 and "--engine jax runs Keras on its JAX backend" in r.stderr


# ------------------------------------------- process 0's initial values (the hook)


def test_the_keras_hook_point_of_the_jax_engine_exists():
    # A Keras upgrade that moves JaxVariable._initialize is caught here, not in a user's job.
    import keras

    from kmp.distributed import _jax

    cls, method = _jax._hook_point()
    assert cls.__name__ == "JaxVariable" and method is cls.__dict__["_initialize"]
    try:
        _jax.install_initial_values_hook()
        _jax.install_initial_values_hook()  # idempotent: wrapped once
        wrapped = cls.__dict__["_initialize"]
        assert wrapped._kmp_original is method and _jax._hook_point() == (cls, wrapped)
    finally:
        _jax.remove_initial_values_hook()
    assert cls.__dict__["_initialize"] is method
    _jax.remove_initial_values_hook()  # nothing installed: nothing to do
    # Without kmp's distribution (here: none) a value passes through untouched.
    value = np.arange(3.0)
    assert _jax._from_process_0(value) is value
    assert issubclass(_jax.data_parallel_class(), keras.distribution.DataParallel)


def test_a_keras_without_the_hook_point_fails_at_engine_start(monkeypatch):
    from kmp.distributed import _jax

    point = ("keras.src.backend.jax.core", ("JaxVariable",), "_gone", ("self", "value"))
    monkeypatch.setattr(_jax, "HOOK_POINT", point)
    with pytest.raises(
        RuntimeError, match=r"JaxVariable\._gone.*keras>=3\.10,<3\.16.*--engine horovod"
    ):
        _jax.start("127.0.0.1:1", 2, 0, timeouts=env.JaxTimeouts(join=1))  # nothing started


def _assert_started_from_process_0(ranks: list[dict], engine: str) -> None:
    assert [r["engine"] for r in ranks] == [engine, engine]
    assert ranks[0]["own_vs_ref0"] == 0.0 and ranks[1]["own_vs_ref0"] > 0.1  # seeds differ
    for r in ranks:
        assert r["started_vs_ref0"] == 0.0, r  # training starts from process 0's model
        assert r["final_spread"] == r["opt_spread"] == 0.0, r
        assert r["trained"] > 0 and r["finite"], r


@pytest.mark.distributed
@pytest.mark.slow
def test_per_process_seeds_build_process_0s_model_on_the_jax_engine(tmp_path):
    # keras.utils.set_random_seed(1000 + rank) after init(): JAX's device_put would refuse
    # the different initial values; kmp gives every variable process 0's value instead.
    ranks = run_workers(SEED_WORKER, out_dir=tmp_path, engine="jax")
    _assert_started_from_process_0(ranks, "jax")
    for rank in ranks:  # already at creation, and dropout's seed state as well
        assert rank["built_vs_ref0"] == rank["seed_spread"] == 0.0, rank


@requires_horovod
@pytest.mark.distributed
@pytest.mark.slow
def test_the_same_per_process_seed_script_under_horovod():
    ranks = run_workers(SEED_WORKER, env={"KERAS_BACKEND": "tensorflow"}, timeout=300)
    _assert_started_from_process_0(ranks, "horovod")  # by BroadcastInitialState
    assert ranks[1]["built_vs_ref0"] > 0.1  # before the broadcast, process 1 had its own


# ----------------------------------------------------------- real processes


def _jax_process(
    rank: int,
    port: int,
    timeout_s: int,
    code: str = "import kmp; kmp.distributed.init(); print('joined')",
    **extra: str,
) -> subprocess.Popen:
    child_env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "KMP_ENGINE": "jax",
        "KMP_COORDINATOR": f"127.0.0.1:{port}",
        "KMP_JAX_TIMEOUT": str(timeout_s),
        "HOROVOD_SIZE": "2",
        "HOROVOD_RANK": str(rank),
        "PYTHONPATH": str(ROOT),
        **extra,
    }
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_process_whose_coordinator_never_starts_fails_in_time():
    t0 = time.monotonic()
    proc = _jax_process(1, pick_port(), timeout_s=3)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and time.monotonic() - t0 < 90
    assert "could not reach the JAX coordinator" in err and "KMP_JAX_TIMEOUT" in err


def test_a_process_nobody_joins_ends_after_the_timeout():
    proc = _jax_process(0, pick_port(), timeout_s=3)
    try:
        out, err = proc.communicate(timeout=120)  # not a hang: JAX ends it after 3 s
    finally:
        proc.kill()
    assert proc.returncode != 0 and "joined" not in out
    assert "process 0 of 2 joins the JAX job" in err and "after 3 s (KMP_JAX_TIMEOUT)" in err


# Process 1 stops (SIGSTOP, as a starved, paused or swapping process would) between two
# all-reduces, for STALL_S seconds, then goes on.
STALL_S = 8
STALLED_JOB = f"""
import os, signal, subprocess
import numpy as np
import kmp
world = kmp.distributed.init()
before = float(kmp.distributed.allreduce(np.float32(world.rank + 1), op="sum"))
if world.rank == 1:
    subprocess.Popen(["sh", "-c", f"sleep {STALL_S}; kill -CONT {{os.getpid()}}"])
    os.kill(os.getpid(), signal.SIGSTOP)
after = float(kmp.distributed.allreduce(np.float32(world.rank + 1), op="sum"))
print("sums", before, after, flush=True)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("heartbeat_s", [30, 2])
def test_a_stalled_process_ends_the_job_only_after_the_heartbeat_timeout(heartbeat_s):
    """KMP_JAX_HEARTBEAT_TIMEOUT reaches JAX's distributed service: an 8 s stall passes
    under 30 s; under 2 s JAX takes the stalled process for dead and ends the job, saying so
    (the failure SLURM jobs on a loaded node met under JAX's default 100 s)."""
    port = pick_port()
    procs = [
        _jax_process(r, port, 60, STALLED_JOB, KMP_JAX_HEARTBEAT_TIMEOUT=str(heartbeat_s))
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    if heartbeat_s > STALL_S:
        assert codes == [0, 0], outs
        assert all("sums 3.0 3.0" in out for out, _ in outs), outs
        assert f"a process silent for {heartbeat_s} s ends the job" in outs[0][1]
    else:
        assert codes[0] != 0 and "sums 3.0 3.0" not in outs[0][0], outs
        assert "heartbeat" in outs[0][1].lower(), outs[0][1][-3000:]


def test_the_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        proc = _jax_process(0, taken.getsockname()[1], timeout_s=3)
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode != 0 and "already in use on this host" in err


def _launch(policy: str, out: Path, *extra: str) -> list[dict]:
    return run_workers(WORKER, policy, "dist", *extra, out_dir=out, engine="jax", timeout=600)


def _single(policy: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    run_env = {**os.environ, "KMP_TEST_OUT": str(out), "KERAS_BACKEND": "jax"}
    r = subprocess.run(
        [sys.executable, str(WORKER), policy, "single"],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "rank0.json").read_text())


POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


@requires_horovod
@pytest.mark.distributed
@pytest.mark.slow
def test_two_jax_processes_end_identical_and_match_one_process(tmp_path):
    # One launch trains the three policies in turn (a process start costs more than a fit).
    ranks = _launch(",".join(POLICIES), tmp_path / "dist", str(tmp_path / "ckpt"))
    single = _single(",".join(POLICIES), tmp_path / "single")
    for r in ranks:
        assert r["engine"] == "jax" and r["size"] == 2
        assert r["collectives"] == {"object": {"from": 1}, "sum": 3.0, "max": 2.0}
    for policy in POLICIES:
        runs = [r["runs"][policy] for r in ranks]
        for run in runs:
            assert run["max_diff"] == 0.0 and run["finite"], (policy, run)
            # kmp's step reduces every gradient, the loss and the metrics in one all-reduce
            assert run.get("all_reduces", 1) == 1, (policy, run["all_reduces"])
        assert runs[0]["weights"] == runs[1]["weights"], policy
        if policy == "mixed_float16":  # process 1's overflow skips the step on both, per epoch
            assert [run["skipped"] for run in runs] == [2, 2]
            assert runs[0]["loss_scale"] == runs[1]["loss_scale"] == 2.0**15 / 4
        else:
            assert [run["skipped"] for run in runs] == [0, 0], policy
        # 2 processes = 1 process on the concatenated batches, within the dtype's precision.
        ref = single["runs"][policy]
        tolerance = {"float32": 1e-5, "mixed_bfloat16": 5e-2, "mixed_float16": 1e-3}[policy]
        diff = np.abs(np.array(ref["weights"]) - np.array(runs[0]["weights"])).max()
        assert diff < tolerance, (policy, diff)
        assert ref["skipped"] == runs[0]["skipped"], policy
        # the logs are the global batch's: each process's metric sums added together
        assert ref["accuracy"] == runs[0]["accuracy"], policy
        assert np.allclose(ref["loss"], runs[0]["loss"], rtol=tolerance, equal_nan=True), policy
    # BatchNormalization's moving statistics are averaged, Dropout's seed state kept:
    # every weight, trainable or not, ends the same on both processes.
    normalized = [r["runs"]["normalized"] for r in ranks]
    assert [n["max_diff"] for n in normalized] == [0.0, 0.0]
    assert normalized[0]["finite"] and normalized[0]["all_reduces"] == 1
    assert ranks[0]["runs"]["float32"]["all_reduces"] == 1
    # Only the chief wrote checkpoints (float32's run), one per epoch.
    written = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len([n for n in written if n.endswith(".keras")]) == 2, written
