"""kmp.cluster.slurm_daemons: each host's SLURM files (pure), and the checks before ``up``."""

from __future__ import annotations

import pytest

from kmp.cluster import blueprint as cp
from kmp.cluster import slurm_daemons as sd
from kmp.cluster.state import ClusterError


def conf_lines(plan: cp.ClusterPlan, host: str) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for line in sd.slurm_conf(plan, plan.host(host)).splitlines():
        key, _, value = line.partition("=")
        lines.setdefault(key, []).append(value)
    return lines


def test_every_host_is_a_node_with_its_address_and_slots(tmp_path):
    plan = cp.plan_cluster(3, slots=2, name="demo", root=tmp_path, slurm=True)
    conf = conf_lines(plan, "h2")
    assert conf["NodeName"] == [
        f"h{i} NodeAddr=10.77.0.{i} CPUs=2 State=UNKNOWN" for i in (1, 2, 3)
    ]
    assert conf["SlurmctldHost"] == ["h1(10.77.0.1)"]  # slurmctld runs on h1
    assert conf["ClusterName"] == ["demo"]
    assert conf["ProctrackType"] == ["proctrack/linuxproc"]  # no cgroups in the namespaces


def test_the_hosts_files_differ_only_in_their_munge_socket(tmp_path):
    plan = cp.plan_cluster(2, name="demo", root=tmp_path, slurm=True)
    one, two = (sd.slurm_conf(plan, h).splitlines() for h in plan.hosts)
    differ = [(a, b) for a, b in zip(one, two, strict=True) if a != b]
    socket = tmp_path / "demo" / "slurm" / "{}" / "munge.socket"
    expected = tuple(
        f"AuthInfo=socket={str(socket).format(h)},cred_expire=10" for h in ("h1", "h2")
    )
    assert differ == [expected]
    assert sd.conf_path(plan, plan.host("h2")) == tmp_path / "demo" / "slurm" / "h2" / "slurm.conf"
    assert "DebugFlags=NO_CONF_HASH" in one  # so slurmctld accepts the difference
    assert sd.mpi_conf(plan, plan.host("h2")).strip().endswith("slurm/h2/pmix")


def test_slurm_is_a_flag_of_the_plan(tmp_path):
    assert not cp.plan_cluster(1, root=tmp_path).slurm
    with pytest.raises(TypeError, match="True or False"):
        cp.plan_cluster(1, root=tmp_path, slurm="yes")


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setattr(sd.os, "access", lambda path, mode: "munge" not in path)
    with pytest.raises(ClusterError, match=r"needs munge.*apt-get install -y slurmctld slurmd"):
        sd.require_slurm()
