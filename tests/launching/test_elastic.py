"""kmp launch --elastic: the horovodrun arguments, kmp's discovery script, bad input refused."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kmp.commands import launch
from kmp.launching import discover
from kmp.launching import job as lp
from kmp.launching.elastic import ElasticOptions, check_discovery, elastic_args
from kmp.launching.hosts import Host, LaunchError, parse_discovery_output
from tests._support import ROOT, requires_horovod

LAUNCHER = [sys.executable, "-m", "kmp.launching.horovodrun"]  # kmp launch's horovodrun


@pytest.fixture
def hostfile(tmp_path) -> Path:
    path = tmp_path / "hosts.txt"
    path.write_text("n1 slots=2\nn2 slots=2\n")
    return path


def dry_run(capsys, *argv: str) -> list[str]:
    assert launch.main(["--dry-run", *argv]) == 0, capsys.readouterr().err
    return shlex.split(capsys.readouterr().out.strip())


def error(capsys, *argv: str) -> str:
    assert launch.main(["--dry-run", *argv]) == 2
    return capsys.readouterr().err


def value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_hostfile_mode_uses_kmps_discovery_of_the_file(capsys, script, hostfile):
    cmd = dry_run(capsys, "--elastic", "--min-np", "2", "--max-np", "3", "--hostfile",
                  str(hostfile), "--network-interface", "eth0", "--elastic-timeout", "30",
                  "--blacklist-cooldown-range", "5", "10", str(script),
                  "--epochs", "2")  # fmt: skip
    assert cmd[:5] == [*LAUNCHER, "-np", "3"]  # the file's 4 slots, capped at --max-np
    assert (value(cmd, "--min-np"), value(cmd, "--max-np")) == ("2", "3")
    assert shlex.split(value(cmd, "--host-discovery-script")) == [
        sys.executable, "-m", "kmp.launching.discover", str(hostfile.resolve())]  # fmt: skip
    assert value(cmd, "--elastic-timeout") == "30"
    assert cmd[cmd.index("--blacklist-cooldown-range") + 1 :][:2] == ["5", "10"]
    assert "-H" not in cmd and "--gloo" in cmd
    assert cmd[-3:] == [str(script), "--epochs", "2"]


def test_the_discovery_script_reads_the_file_each_time(hostfile, capsys):
    assert discover.main([str(hostfile)]) == 0
    assert capsys.readouterr().out == "n1:2\nn2:2\n"
    hostfile.write_text("n1 slots=2\nn2 slots=2\nn3 slots=1\n")  # a host added while running
    assert discover.main([str(hostfile)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "n3:1"
    hostfile.write_text("n1 slots=two\n")  # a bad edit: an error, the driver keeps its hosts
    assert discover.main([str(hostfile)]) == 1
    assert "slots must be a positive integer" in capsys.readouterr().err


def test_as_horovod_runs_it(hostfile):
    cmd = elastic_args(ElasticOptions(min_np=1, hostfile=str(hostfile)), None,
                       python=sys.executable, controller=None)[1]  # fmt: skip
    line = value(cmd, "--host-discovery-script")
    done = subprocess.run(line, shell=True, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "n1:2\nn2:2\n", done.stderr


def test_users_discovery_script_is_passed_and_checked(tmp_path, script):
    own = tmp_path / "discover.sh"
    own.write_text("#!/bin/sh\necho n1:2\necho n2:2\n")
    own.chmod(0o755)
    np_, args, _ = elastic_args(ElasticOptions(min_np=2, max_np=4, discovery_script=str(own)), None,
                             python=sys.executable, controller=None)  # fmt: skip
    assert np_ == 2 and value(args, "--host-discovery-script") == str(own.resolve())
    assert check_discovery(str(own)) == [Host("n1", 2), Host("n2", 2)]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
        (["--min-np", "2"], "needs one source of hosts"),
        (["--max-np", "2"], "needs --min-np"),
        (["--min-np", "1", "--mpi"], "runs on Gloo"),
        (["--min-np", "0"], "--min-np must be an integer >= 1"),
        (["--min-np", "2", "-np", "5", "--max-np", "4"], "-np 5 must be >= --min-np 2 and <= "),
    ],
)
def test_bad_elastic_options_are_refused(capsys, script, hostfile, argv, message):
    extra = [] if "source" in message else ["--hostfile", str(hostfile)]
    assert message in error(capsys, "--elastic", *argv, *extra, str(script))


def test_elastic_flags_without_elastic_and_hosts_with_it(capsys, script, hostfile):
    assert "only apply to an elastic job: add --elastic" in error(
        capsys, "-np", "2", "--min-np", "2", str(script)
    )
    assert "not -H" in error(capsys, "--elastic", "--min-np", "1", "-H", "n1:2", str(script))


def test_a_hostfile_with_too_few_slots(capsys, script, tmp_path):
    small = tmp_path / "one.txt"
    small.write_text("n1 slots=1\n")
    err = error(capsys, "--elastic", "--min-np", "2", "--hostfile", str(small), str(script))
    assert "gives 1 slot(s), fewer than --min-np 2" in err


def test_a_discovery_script_that_is_missing_or_not_executable(capsys, script, tmp_path):
    own = tmp_path / "discover.sh"
    assert "does not exist" in error(capsys, "--elastic", "--min-np", "1",
                                     "--host-discovery-script", str(own), str(script))  # fmt: skip
    own.write_text("#!/bin/sh\necho n1:1\n")
    err = error(capsys, "--elastic", "--min-np", "1", "--host-discovery-script", str(own),
                str(script))  # fmt: skip
    assert "is not executable; run `chmod +x" in err


@pytest.mark.parametrize(
    "output,message",
    [
        ("n1:2\nn2 slots=2\n", "printed line 2 ('n2 slots=2'): expected 'HOST:SLOTS'"),
        ("n1:x\n", "slots must be a positive integer"),
        ("n1\n", "pass --slots-per-host"),
        ("", "printed no hosts"),
        ("n1:1\nn1:2\n", "listed twice"),
    ],
)
def test_malformed_discovery_output_names_the_line(output, message):
    with pytest.raises(LaunchError) as info:
        parse_discovery_output(output, "--host-discovery-script 'd.sh'")
    assert message in str(info.value)


def test_lines_without_slots_take_slots_per_host():
    assert parse_discovery_output("n1\nn2:4\n", "d", 2) == [Host("n1", 2), Host("n2", 4)]


def test_execute_stops_on_a_failing_or_malformed_script(tmp_path, script, capsys):
    own = tmp_path / "discover.sh"
    own.write_text("#!/bin/sh\necho n1:1\necho 'oops not a host'\n")
    own.chmod(0o755)
    plan = lp.build_command(None, script, elastic=ElasticOptions(
        min_np=1, discovery_script=str(own)), horovodrun="/bin/false")  # fmt: skip
    assert lp.execute(plan) == 2
    assert "printed line 2" in capsys.readouterr().err
    own.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    assert lp.execute(plan) == 2
    assert "exited with status 3: broken" in capsys.readouterr().err


@requires_horovod
@pytest.mark.distributed
def test_an_elastic_job_on_this_machine_runs_to_the_end(tmp_path):
    """Two local processes through kmp launch --elastic: every example once per epoch."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=2\n")
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys\n"
        "import keras, numpy as np, kmp\n"
        "w = kmp.distributed.init(); kmp.enable('float32'); keras.utils.set_random_seed(0)\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "m.compile(kmp.wrap_optimizer(keras.optimizers.SGD(0.1), scale_lr=True), 'mse')\n"
        "x = np.random.default_rng(1).random((37, 3)).astype('float32')\n"
        "data = kmp.elastic.ElasticData(x, x[:, :2], batch_size=4)\n"
        "s = kmp.elastic.KerasState(m)\n"
        "kmp.elastic.fit(s, data, epochs=2, commit_every=2, record_examples=True, verbose=0)\n"
        "out = {'rank': w.rank, 'size': w.size, 'examples': s.examples, 'lr_scale': s.lr_scale,\n"
        "       'w': [float(v) for v in np.concatenate([np.ravel(v) for v in m.get_weights()])]}\n"
        "open(os.path.join(sys.argv[1], f'r{w.rank}.json'), 'w').write(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kmp.cli", "launch", "--elastic", "--min-np", "2", "--hostfile",
         str(hosts), str(worker), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3",
             "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in ranks] == [2, 2] and ranks[0]["lr_scale"] == 2.0
    assert ranks[0]["w"] == ranks[1]["w"]
    for r in ranks:
        assert {e: sorted(ids) for e, ids in r["examples"].items()} == {
            "0": list(range(37)), "1": list(range(37))}  # fmt: skip
