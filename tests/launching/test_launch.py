"""kmp launch: hostfile parsing, the command it builds, --dry-run, and real launches."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from kmp.commands import launch
from kmp.launching import job as lp
from kmp.launching.hosts import Host, LaunchError, parse_hostfile, parse_hosts
from kmp.launching.job import build_command
from tests._support import ROOT, requires_horovod

# How kmp launch starts Horovod's launcher here (kmp.launching.horovodrun: no start-up probe).
LAUNCHER = [sys.executable, "-m", "kmp.launching.horovodrun"]


@pytest.fixture(autouse=True)
def _no_kmp_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("KMP_", "SLURM_")):  # inside a SLURM job, srun would start the ranks
            monkeypatch.delenv(key)


def dry_run(capsys, *argv: str) -> list[str]:
    """Run `kmp launch --dry-run ARGV` in-process and return the printed command as a list."""
    assert launch.main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return shlex.split(out[0])


def error(capsys, *argv: str) -> str:
    assert launch.main(["--dry-run", *argv]) == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ parsing


def test_parse_hosts():
    assert parse_hosts("a:2,b.example.com:4,c") == [
        Host("a", 2),
        Host("b.example.com", 4),
        Host("c", 1),
    ]
    for bad, message in [
        ("a:0", "slots must be a positive integer"),
        ("a:x", "slots must be a positive integer"),
        ("a:2,,b", "entry 2: empty entry"),
        ("a b:2", "not a host name"),
        ("a:1,a:2", "listed twice"),
    ]:
        with pytest.raises(LaunchError, match=message):
            parse_hosts(bad)


def test_parse_hostfile_formats_and_comments():
    text = "# cluster\nnode1 slots=4\n\nnode2:2   # the -H spelling\nnode3\n"
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 slots=4\nnode2 slot=4\n", r"line 2 \('node2 slot=4'\): expected 'HOST slots=N'"),
        ("node1 slots=4\n\nnode2 slots=four\n", r"line 3 \('node2 slots=four'\): slots must"),
        ("node1 slots=4 extra\n", r"line 1 .*expected"),
        ("node1 slots=0\n", r"line 1 .*slots must be a positive integer"),
        ("bad/host slots=1\n", r"line 1 .*not a host name"),
        ("a\na:2\n", "listed twice"),
        ("# only a comment\n\n", "lists no hosts"),
    ],
)
def test_malformed_hostfile_names_the_line(text, message):
    with pytest.raises(LaunchError, match=message):
        parse_hostfile(text, source="hosts.txt")


def test_policies_match_kmp_policy():
    from kmp.policy import VALID_POLICIES

    assert lp.POLICIES == VALID_POLICIES


# ---------------------------------------------------------------- building


def test_build_command_is_an_argument_list(script):
    plan = build_command(
        2, script, ["--lr", "0.1; rm -rf /"], horovodrun="hvdrun", python="py", environ={}
    )
    assert plan.horovodrun
    assert plan.argv == (
        "hvdrun", "-np", "2", "-H", "localhost:2", "--gloo", "py", str(script), "--lr",
        "0.1; rm -rf /",
    )  # fmt: skip
    assert plan.env == {}


def test_kmp_settings_are_forwarded(script):
    environ = {"KMP_DATA_DIR": "/data", "KMP_POLICY": "float32", "HOME": "/root",
               "KMP_AFFINITY": "granularity=fine", "KMP_LAUNCH_ARGS": "--gloo"}  # fmt: skip
    plan = build_command(2, script, environ=environ, policy="mixed_bfloat16")
    # --policy overrides an inherited KMP_POLICY; OpenMP's KMP_AFFINITY and the launch
    # scripts' KMP_LAUNCH_ARGS are not kmp settings.
    assert plan.env == {"KMP_DATA_DIR": "/data", "KMP_POLICY": "mixed_bfloat16"}
    assert build_command(1, script, environ=environ).env == {
        "KMP_DATA_DIR": "/data",
        "KMP_POLICY": "float32",
    }


def test_single_process_runs_without_horovodrun(script):
    plan = build_command(1, script, ["-x"], python="py", environ={})
    assert not plan.horovodrun and plan.argv == ("py", str(script), "-x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"np": 0}, r"-np must be an integer >= 1"),
        ({"np": -3}, r"-np must be an integer >= 1"),
        ({"np": 3, "hosts": [Host("a", 1), Host("b", 1)]}, r"-np 3 needs 3 slots.*provide 2"),
        ({"np": 2, "controller": "ssh"}, r"controller must be"),
        ({"np": 2, "policy": "fp8"}, r"--policy: Unknown dtype policy 'fp8'"),
        ({"np": 2, "gloo_timeout": 0}, r"--gloo-timeout must be an integer >= 1, got 0"),
        ({"np": 2, "gloo_timeout": True}, r"--gloo-timeout must be an integer >= 1, got True"),
        ({"np": 2, "controller": "mpi", "gloo_timeout": 9}, r"Gloo controller, which --mpi does"),
        ({"np": 2, "engine": "jax", "gloo_timeout": 9}, r"which --engine jax does not use"),
    ],
)
def test_build_command_rejects_bad_input(script, kwargs, message):
    np_ = kwargs.pop("np")
    with pytest.raises(LaunchError, match=message):
        build_command(np_, script, environ={}, **kwargs)


def test_missing_script(tmp_path):
    with pytest.raises(LaunchError, match=r"Script '.*nope.py' does not exist"):
        build_command(2, tmp_path / "nope.py", environ={})


# ------------------------------------------------------------ --dry-run, each option


def test_dry_run_defaults(capsys, script):
    assert dry_run(capsys, "-np", "4", str(script)) == [
        *LAUNCHER,
        "-np",
        "4",
        "-H",
        "localhost:4",
        "--gloo",
        sys.executable,
        str(script),
    ]  # fmt: skip  (Gloo is kmp's default controller, also when Horovod has MPI)


def test_dry_run_hosts(capsys, script):
    cmd = dry_run(capsys, "-np", "6", "-H", "n1:4,n2:2", str(script))
    assert cmd[5:7] == ["-H", "n1:4,n2:2"]


def test_dry_run_hostfile(capsys, script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    cmd = dry_run(capsys, "-np", "4", "--hostfile", str(hostfile), str(script))
    assert cmd[5:7] == ["-H", "n1:2,n2:2"]


@pytest.mark.parametrize("flag", ["--gloo", "--mpi"])
def test_dry_run_controller(capsys, script, flag):
    cmd = dry_run(capsys, "-np", "2", flag, str(script))
    assert cmd[7] == flag and cmd.count(flag) == 1


def test_dry_run_policy_sets_kmp_policy(capsys, script):
    cmd = dry_run(capsys, "-np", "2", "--policy", "mixed_bfloat16", str(script))
    assert cmd[0] == "KMP_POLICY=mixed_bfloat16" and cmd[1:4] == LAUNCHER


def test_dry_run_shows_forwarded_kmp_env(capsys, script, monkeypatch):
    monkeypatch.setenv("KMP_DATA_DIR", "/data dir")
    cmd = dry_run(capsys, "-np", "2", str(script))
    assert cmd[0] == "KMP_DATA_DIR=/data dir"


def test_dry_run_ssh_port_and_interfaces(capsys, script):
    cmd = dry_run(capsys, "-np", "2", "-p", "2222", "--network-interfaces", "eth0", str(script))
    assert cmd[7:12] == ["--gloo", "-p", "2222", "--network-interfaces", "eth0"]


def test_dry_run_gloo_timeout(capsys, script):
    cmd = dry_run(capsys, "-np", "2", "--gloo-timeout", "12", str(script))
    assert cmd[7:10] == ["--gloo", "--gloo-timeout-seconds", "12"]
    assert "--gloo-timeout-seconds" not in dry_run(capsys, "-np", "2", str(script))


def test_dry_run_script_arguments_pass_through(capsys, script):
    cmd = dry_run(capsys, "-np", "2", str(script), "--epochs", "3", "-np", "9", "--dry-run")
    assert cmd[-5:] == ["--epochs", "3", "-np", "9", "--dry-run"]
    assert cmd[:5] == [*LAUNCHER, "-np", "2"]


def test_dry_run_single_process(capsys, script):
    assert dry_run(capsys, "-np", "1", str(script), "--x") == [sys.executable, str(script), "--x"]


# ------------------------------------------------------------------ errors


def test_np_defaults_to_the_slots_of_the_hosts(capsys, script):
    cmd = dry_run(capsys, "-H", "a:2,b:3", str(script))
    assert cmd[3:7] == ["-np", "5", "-H", "a:2,b:3"]
    assert "give -np N" in error(capsys, str(script))


def test_cli_errors_are_clear(capsys, script, tmp_path):
    assert "-np must be an integer >= 1" in error(capsys, "-np", "0", str(script))
    assert "does not exist" in error(capsys, "-np", "2", str(tmp_path / "missing.py"))
    assert "provide 2" in error(capsys, "-np", "3", "-H", "a:1,b:1", str(script))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2 gpus=1\n")
    err = error(capsys, "-np", "2", "--hostfile", str(hostfile), str(script))
    assert "line 2 ('n2 slots=2 gpus=1')" in err
    assert "does not exist" in error(capsys, "-np", "2", "--hostfile", str(tmp_path / "x"), "a")
    with pytest.raises(SystemExit):  # argparse: -H and --hostfile together
        launch.main(["-np", "2", "-H", "a:2", "--hostfile", str(hostfile), str(script)])
    with pytest.raises(SystemExit):  # argparse: --gloo and --mpi together
        launch.main(["-np", "2", "--gloo", "--mpi", str(script)])


def test_kmp_cli_dry_run_subprocess(script):
    """The `kmp` program (module form) wires the command in."""
    out = subprocess.run(
        [sys.executable, "-m", "kmp.cli", "launch", "-np", "2", "--gloo", "--dry-run",
         str(script)],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KMP_")},
    )  # fmt: skip
    assert shlex.split(out.stdout) == [
        *LAUNCHER, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(script),
    ]  # fmt: skip


# --------------------------------------------------------------- real launches

RANK_SCRIPT = """
import json, os, sys
import kmp
world = kmp.distributed.init()
total = int(kmp.distributed.allreduce(float(world.rank + 1), op="sum"))
out = os.path.join(os.environ["KMP_TEST_OUT"], f"rank{world.rank}.json")
with open(out, "w") as f:
    json.dump({"rank": world.rank, "size": world.size, "sum": total, "argv": sys.argv[1:],
               "policy": os.environ.get("KMP_POLICY")}, f)
"""


def _launch(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    worker = tmp_path / "rank_size.py"
    worker.write_text(RANK_SCRIPT)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KMP_")},
        "KMP_TEST_OUT": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "kmp.cli", "launch", *argv, str(worker), "--flag", "a b"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip


@pytest.mark.distributed
@requires_horovod
def test_real_two_rank_launch(tmp_path):
    proc = _launch(tmp_path, "-np", "2", "--gloo", "--policy", "mixed_bfloat16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert {r["sum"] for r in results} == {3}  # a real allreduce between the two ranks
    assert all(r["policy"] == "mixed_bfloat16" for r in results)  # forwarded to every rank
    assert all(r["argv"] == ["--flag", "a b"] for r in results)


def test_real_single_process_launch(tmp_path):
    proc = _launch(tmp_path, "-np", "1", "--policy", "float32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert (result["rank"], result["size"], result["sum"]) == (0, 1, 1)
    assert result["policy"] == "float32"


# ------------------------------------------------------------ launch/ shell scripts


def _script_dry_run(script: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KMP_")}
    full_env.update({"KMP_LAUNCH_ARGS": "--gloo --dry-run", **(env or {})})
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / script), *args],
        capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def test_local_sh(script):
    cmd = _script_dry_run("local.sh", "3", str(script), "--epochs", "2",
                          env={"KMP_POLICY": "float32"})  # fmt: skip
    assert cmd[0] == "KMP_POLICY=float32"
    assert cmd[1:] == [
        *LAUNCHER, "-np", "3", "-H", "localhost:3", "--gloo", sys.executable, str(script),
        "--epochs", "2",
    ]  # fmt: skip


def test_local_sh_defaults_to_train_py():
    cmd = _script_dry_run("local.sh", "2")
    assert cmd[-1] == str(ROOT / "launch" / "train.py")


def test_hostfile_sh_runs_one_process_per_slot(script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=2\nnode2:3\n")
    cmd = _script_dry_run("hostfile.sh", str(hostfile), str(script))
    assert cmd[:8] == [*LAUNCHER, "-np", "5", "-H", "node1:2,node2:3", "--gloo"]
    cmd = _script_dry_run("hostfile.sh", str(hostfile), str(script), env={"KMP_NP": "4"})
    assert cmd[3:5] == ["-np", "4"]


def test_hostfile_sh_reports_a_malformed_line(script, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=two\n")
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "hostfile.sh"), str(hostfile), str(script)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "line 2 ('node2 slots=two')" in proc.stderr


def test_slurm_sbatch_starts_the_ranks_with_srun(script):
    env = {
        "SLURM_JOB_ID": "5",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }
    words = _script_dry_run("slurm.sbatch", str(script), "--epochs", "1", env=env)
    cmd = [w for w in words if not w.split("=")[0].isupper()]  # the variables set first
    assert "KMP_SLURM_HOSTS=gpu01:4,gpu02:4" in words
    assert cmd[:4] == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4"]
    assert cmd[-3:] == [str(script), "--epochs", "1"]


def test_slurm_sbatch_outside_slurm_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "not inside a SLURM job" in proc.stderr
