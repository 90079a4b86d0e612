"""kmp.launching.slurm: an allocation's hosts, the srun command, and each task's rank."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from kmp.commands import launch
from kmp.launching.hosts import Host, LaunchError
from kmp.launching.job import build_command
from kmp.launching.slurm import (
    HOSTS_VAR,
    allocation_hosts,
    expand_counts,
    expand_nodelist,
    fill,
    slot,
    srun_argv,
    task_env,
)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("h1", ["h1"]),
        ("h1,h2", ["h1", "h2"]),
        ("h[1-3,10]", ["h1", "h2", "h3", "h10"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),  # zero padding kept
        ("n[8-10]x", ["n8x", "n9x", "n10x"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("a[1-2],b,c[5]", ["a1", "a2", "b", "c5"]),
    ],
)
def test_node_lists_expand_as_scontrol_show_hostnames_does(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize(
    ("text", "match"),
    [("h[1-3", "never closed"), ("h1-3]", "closes nothing"), ("h[3-1]", "backwards"),
     ("h[a-b]", "not a number"), ("h1,,h2", "empty name")],
)  # fmt: skip
def test_a_bad_node_list_is_refused_with_what_is_wrong(text, match):
    with pytest.raises(LaunchError, match=match):
        expand_nodelist(text)


def test_task_counts_expand_their_repeats():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(LaunchError, match="N or N"):
        expand_counts("2(3)")


def test_the_allocation_gives_one_slot_per_task_on_each_node():
    env = {"SLURM_JOB_NODELIST": "h[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert allocation_hosts(env) == [Host("h1", 2), Host("h2", 2), Host("h3", 1)]
    assert allocation_hosts({"SLURM_NODELIST": "h[1-2]"}) == [Host("h1", 1), Host("h2", 1)]
    assert allocation_hosts({"PATH": "/bin"}) is None  # not inside an allocation
    with pytest.raises(LaunchError, match="3 counts for the 2 nodes"):
        allocation_hosts({"SLURM_JOB_NODELIST": "h[1-2]", "SLURM_TASKS_PER_NODE": "1(x3)"})


# ------------------------------------------------------------------ ranks of srun's tasks


LAYOUTS = [[Host("a", 2), Host("b", 2)], [Host("a", 1), Host("b", 1), Host("c", 1)],
           [Host("a", 3), Host("b", 1), Host("c", 2)]]  # fmt: skip


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_each_rank_gets_the_slot_horovod_would_give_it(hosts):
    """srun --distribution=block fills the nodes in order; so does Horovod's assignment, whose
    rendezvous server kmp launch runs: both must agree on every rank's host and local rank."""
    pytest.importorskip("horovod.runner")
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    size = sum(h.slots for h in hosts)
    expected = get_host_assignments(parse_hosts(",".join(map(str, hosts))), size, size)
    for info in expected:
        assert slot(hosts, info.rank) == {
            "host": info.hostname, "rank": info.rank, "size": info.size,
            "local_rank": info.local_rank, "local_size": info.local_size,
            "cross_rank": info.cross_rank, "cross_size": info.cross_size,
        }  # fmt: skip


def test_fewer_ranks_than_tasks_fill_the_first_nodes():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
    assert fill(hosts, 3) == (Host("a", 2), Host("b", 1))
    assert fill(hosts, 6) == tuple(hosts)


def task(rank: int, node: str, local: int, **extra: str) -> dict[str, str]:
    return {HOSTS_VAR: "a:2,b:2", "SLURM_PROCID": str(rank), "SLURMD_NODENAME": node,
            "SLURM_LOCALID": str(local), **extra}  # fmt: skip


def test_a_task_becomes_a_horovod_rank():
    assert task_env(task(3, "b", 1)) == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "b",
    }  # fmt: skip


def test_a_task_becomes_a_jax_process():
    env = task_env(task(2, "b", 0, KMP_ENGINE="jax"))
    assert env == {"KMP_RANK": "2", "KMP_SIZE": "4", "KMP_LOCAL_RANK": "0", "KMP_LOCAL_SIZE": "2"}


@pytest.mark.parametrize(
    ("environ", "match"),
    [(task(3, "a", 1), "started rank 3 on a"), (task(1, "a", 0), "local task 0"),
     ({"SLURM_PROCID": "0"}, "KMP_SLURM_HOSTS not set"), (task(4, "b", 2), "outside")],
)  # fmt: skip
def test_a_task_placed_elsewhere_is_a_clear_error(environ, match):
    with pytest.raises(LaunchError, match=match):
        task_env(environ)


def test_the_task_module_sets_the_rank_then_becomes_the_command():
    import subprocess
    import sys

    code = "import os; print(os.environ['HOROVOD_RANK'], os.environ['HOROVOD_HOSTNAME'])"
    env = {"PATH": "/usr/bin:/bin", **task(2, "b", 0)}
    argv = [sys.executable, "-m", "kmp.launching.slurm", "--", sys.executable, "-c", code]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "b"]
    bad = subprocess.run(argv, env={**env, "SLURMD_NODENAME": "a"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "started rank 2 on a" in bad.stderr


# ------------------------------------------------------------------ kmp launch in a job


ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


def test_inside_a_step_kmp_launch_refuses_to_start_ranks_again():
    with pytest.raises(LaunchError, match="inside an srun step"):
        allocation_hosts({**ALLOCATION, "SLURM_STEP_ID": "0"})


def test_srun_pins_the_layout_the_ranks_are_given():
    """srun would otherwise take -N and --ntasks-per-node from the job: -np 2 on 2x2 tasks
    would put a rank on each node, where the ranks expect both on the first."""
    argv = srun_argv(2, [Host("n1", 2), Host("n2", 2)], ["py", "t.py"], python="PY")
    assert argv == ("srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                    "--distribution=block", "--kill-on-bad-exit=1", "--export=ALL",
                    "--mpi=none", "PY", "-m", "kmp.launching.slurm", "--", "py",
                    "t.py")  # fmt: skip
    argv = srun_argv(3, [Host("n1", 2), Host("n2", 1)], ["x"], python="PY", cpus_per_task="8")
    assert argv[1:5] == ("--nodes=2", "--ntasks=3", "--ntasks-per-node=2", "--cpus-per-task=8")
    assert "--mpi=pmix" in srun_argv(2, [Host("n1", 2)], ["x"], python="PY", controller="mpi")


@pytest.mark.parametrize(
    ("np", "hosts", "match"),
    [(5, [Host("n1", 2), Host("n2", 2)], "more than the 4 task"),
     (4, [Host("n1", 1), Host("n2", 3)], "unevenly"), ("2", [Host("n1", 2)], "integer")],
)  # fmt: skip
def test_what_srun_cannot_start_is_a_clear_error(np, hosts, match):
    with pytest.raises(LaunchError, match=match):
        srun_argv(np, hosts, ["x"], python="PY")


def test_salloc_s_interactive_step_may_launch():
    interactive = {**ALLOCATION, "SLURM_STEP_ID": "4294967290"}
    assert allocation_hosts(interactive) == [Host("n1", 2), Host("n2", 2)]


@pytest.fixture
def in_job(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("KMP_", "SLURM_")):
            monkeypatch.delenv(key)
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)


def dry_run(capsys, *argv: str) -> tuple[dict[str, str], list[str]]:
    assert launch.main(["--dry-run", *argv]) == 0, capsys.readouterr().err
    words = shlex.split(capsys.readouterr().out.strip())
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    return env, [w for w in words if w.split("=", 1)[0] not in env]


def test_kmp_launch_in_a_job_takes_the_allocation(in_job, capsys, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    env, argv = dry_run(capsys, str(script))  # no -np, no hosts: the allocation's 4 tasks
    assert argv[:3] == ["srun", "--nodes=2", "--ntasks=4"]
    assert argv[-2:] == [sys.executable, str(script)]
    assert env[HOSTS_VAR] == "n1:2,n2:2"
    env, argv = dry_run(capsys, "-np", "3", "--engine", "jax", str(script))
    assert argv[2] == "--ntasks=3" and env[HOSTS_VAR] == "n1:2,n2:1"
    assert env["KMP_COORDINATOR"].startswith("n1:")  # rank 0's node runs the coordinator
    env, argv = dry_run(capsys, "--mpi", "--network-interface", "eth0", str(script))
    assert "--mpi=pmix" in argv and env["HOROVOD_CONTROLLER"] == "mpi"
    assert env["OMPI_MCA_btl_tcp_if_include"] == "eth0"
    env, argv = dry_run(capsys, "-H", "localhost:2", str(script))  # hosts given: horovodrun
    assert "srun" not in argv and "-H" in argv
    env, argv = dry_run(capsys, "-np", "1", str(script))  # one process: plain python
    assert argv == [sys.executable, str(script)]


def test_a_gloo_job_runs_horovods_rendezvous_for_the_ranks(in_job, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    plan = build_command(4, script, allocation=allocation_hosts(os.environ))
    assert plan.rendezvous == (Host("n1", 2), Host("n2", 2)) and not plan.horovodrun
    assert build_command(4, script, allocation=plan.rendezvous, controller="mpi").rendezvous == ()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"hosts": [Host("x", 1)]}, "not both"), ({"ssh_port": 22}, "without ssh"),
     ({"ssh_identity_file": "k"}, "without ssh")],
)  # fmt: skip
def test_what_an_allocation_cannot_take_is_a_clear_error(tmp_path, kwargs, match):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(LaunchError, match=match):
        build_command(2, script, allocation=[Host("n1", 2)], **kwargs)


def test_elastic_in_an_allocation_points_at_requeue(in_job, capsys, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    disc = tmp_path / "d.sh"
    disc.write_text("#!/bin/sh\necho n1:2\n")
    disc.chmod(0o755)
    assert launch.main(["--dry-run", "--elastic", "--host-discovery-script", str(disc),
                        "--min-np", "1", str(script)]) == 2  # fmt: skip
    assert "sbatch --requeue" in capsys.readouterr().err


def test_the_rendezvous_server_listens_while_the_job_runs():
    pytest.importorskip("horovod.runner")
    import socket

    from kmp.launching.slurm import gloo_rendezvous

    with gloo_rendezvous([Host("n1", 2), Host("n2", 1)], nic="lo") as env:
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_GLOO_IFACE"] == "lo"
        port = int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it listens
    # (Horovod's stop() ends the serving thread but leaves the socket to the process's
    # exit, so a connection after the block may still be accepted by the kernel.)
