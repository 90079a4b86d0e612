"""kmp.launching.horovodrun: Horovod's launcher, its build probe answered from the record."""

import os
import subprocess
import sys
import types

import pytest

from kmp.install import record
from kmp.launching import horovodrun
from tests._support import ROOT, requires_horovod


def test_the_probes_read_the_recorded_flags():
    launch = types.SimpleNamespace(gloo_built="probe", mpi_built="probe")
    horovodrun.answer_probes(launch, {"gloo": True, "mpi": False, "nccl": False})
    assert launch.gloo_built() is True and launch.gloo_built(verbose=True) is True
    assert launch.mpi_built() is False and launch.mpi_built(verbose=True) is False


@requires_horovod
def test_horovods_launcher_has_the_probes_it_answers():
    from horovod.runner import launch  # pure Python: no TensorFlow

    for name in ("gloo_built", "mpi_built"):
        assert callable(getattr(launch, name)), name  # a renamed probe would go unanswered


# Runs a launcher with Horovod's probe replaced by one that leaves a mark and stops.
_PROBE_MARKED = """
import sys
import horovod.common.util as util

MARK, WHICH, ARGV = sys.argv[1], sys.argv[2], sys.argv[3:]  # the launchers rewrite sys.argv

def probe(*args, **kwargs):
    open(MARK, "w").write("probed")
    raise SystemExit("probed")

util._check_extension_lambda = probe  # what gloo_built and mpi_built fork through
if WHICH == "kmp":
    from kmp.launching import horovodrun
    sys.exit(horovodrun.main(ARGV))
from horovod.runner.launch import run_commandline
sys.argv = ["horovodrun", *ARGV]
run_commandline()
"""


def _launch(tmp_path, which: str) -> tuple[subprocess.CompletedProcess, bool]:
    mark = tmp_path / f"{which}.probed"
    rank = "import os; print('rank', os.environ['HOROVOD_RANK'])"
    r = subprocess.run(
        [sys.executable, "-c", _PROBE_MARKED, str(mark), which,
         "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-c", rank],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return r, mark.exists()


@requires_horovod
@pytest.mark.skipif(record.built_flags() is None, reason="no current build record here")
def test_kmps_entry_launches_without_horovods_probe(tmp_path):
    r, probed = _launch(tmp_path, "kmp")
    assert r.returncode == 0 and not probed, r.stdout + r.stderr
    ranks = sorted(ln.split(">:")[-1] for ln in r.stdout.splitlines() if "rank" in ln)
    assert ranks == ["rank 0", "rank 1"]
    # horovodrun itself probes (a process importing TensorFlow, about 7 s here) first.
    r, probed = _launch(tmp_path, "horovodrun")
    assert probed and "rank" not in r.stdout
