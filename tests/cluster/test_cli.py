"""kmp cluster: the plan (pure), the CLI's errors, and a real up / status / exec / down."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from kmp.cluster import blueprint as cp
from kmp.cluster import ops
from kmp.cluster import state as cs
from kmp.commands import cluster as cli
from tests.cluster._cluster_harness import (
    NAME,
    ROOT,
    cluster,
    kmp,
    leftovers,
    on_host,
    requires_cluster,
    status,
)

# ------------------------------------------------------------------ the plan (pure)


def test_plan_names_addresses_and_interfaces(tmp_path):
    plan = cp.plan_cluster(3, slots=2, rate="1gbit", name="demo", root=tmp_path)
    assert [h.name for h in plan.hosts] == ["h1", "h2", "h3"]
    assert [h.address for h in plan.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert [h.netns for h in plan.hosts] == ["demo-h1", "demo-h2", "demo-h3"]
    assert plan.switch_netns == "demo-sw" and plan.state_dir == tmp_path / "demo"
    names = [n for h in plan.hosts for n in (h.veth_host, h.veth_switch)]
    assert len(set(names)) == 6 and all(len(n) <= 15 for n in names)  # Linux's limit
    assert plan.host_list() == "h1:2,h2:2,h3:2"
    assert plan.hostfile_text() == "h1 slots=2\nh2 slots=2\nh3 slots=2\n"
    assert plan.etc_hosts_lines()[1] == "10.77.0.2 h2  # kmp-cluster:demo"
    tc = plan.tc_args()
    assert tc[:8] == ["qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1gbit"]
    assert int(tc[tc.index("burst") + 1]) == 1_250_000  # 10 ms at 1 Gbit/s
    assert cp.plan_cluster(1, root=tmp_path).tc_args() is None


def test_sshd_listens_on_its_address_only_and_takes_only_the_key(tmp_path):
    plan = cp.plan_cluster(2, name="demo", root=tmp_path)
    h2 = plan.host("h2")
    conf = plan.sshd_config(h2, tmp_path / "authorized_keys")
    lines = conf.splitlines()
    assert [ln for ln in lines if ln.startswith("ListenAddress")] == ["ListenAddress 10.77.0.2:22"]
    for line in (
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}",
        f"HostKey {h2.host_key}",
        f"PidFile {h2.pid_file}",
    ):
        assert line in lines
    client = plan.ssh_client_config()
    assert "Host h1 h2 10.77.0.1 10.77.0.2" in client
    assert f"IdentityFile {plan.client_key}" in client
    assert f"UserKnownHostsFile {plan.known_hosts}" in client
    assert "StrictHostKeyChecking yes" in client


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hosts": 0}, "--hosts must be from 1 to 32"),
        ({"hosts": 33}, "--hosts must be from 1 to 32"),
        ({"hosts": "3"}, "--hosts must be an integer"),
        ({"hosts": 2, "slots": 0}, "--slots must be from 1"),
        ({"hosts": 2, "rate": "fast"}, r"--rate 'fast' is not a tc rate.*1gbit"),
        ({"hosts": 2, "name": "My-Cluster"}, "--name 'My-Cluster': use 1 to 12 lower-case"),
        ({"hosts": 2, "name": "x" * 13}, "--name"),
    ],
)
def test_bad_plans_are_clear_errors(kwargs, match):
    with pytest.raises(cp.ClusterPlanError, match=match):
        cp.plan_cluster(**kwargs)


def test_rates():
    assert cp.rate_bits_per_s("1gbit") == 1e9
    assert cp.rate_bits_per_s("100mbit") == 1e8
    assert cp.rate_bits_per_s("125mbps") == 1e9  # tc's bps are bytes per second


def test_unknown_host_names_the_hosts(tmp_path):
    with pytest.raises(cp.ClusterPlanError, match="no host 'h4'; its hosts: h1, h2, h3"):
        cp.plan_cluster(3, root=tmp_path).host("h4")


def test_host_command_keeps_argv_intact():
    host = cp.plan_cluster(2).host("h2")
    argv = ops.host_argv(host, ["echo", "a b", "$HOME"])
    assert argv[:4] == ["ip", "netns", "exec", "kmp-h2"]
    assert argv[-4:] == ["h2", "echo", "a b", "$HOME"]  # no shell quoting of the command


# ------------------------------------------------------------------ CLI errors


def test_without_root_every_action_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for argv in (["up", "--hosts", "2"], ["down"], ["status"], ["exec", "h1", "--", "true"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "kmp cluster: error: kmp cluster needs root" in err and "sudo" in err


def test_missing_tools_name_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(cs, "SSHD", "/nonexistent/sshd")
    assert cli.main(["up", "--hosts", "2"]) == 2
    err = capsys.readouterr().err
    assert "openssh-server" in err and "apt-get install -y" in err and "launch/setup.sh" in err


def test_exec_options_before_the_separator():
    assert cli._split_exec("kmp", ["--name", "other", "--", "hostname", "-f"]) == (
        "other",
        ["hostname", "-f"],
    )
    assert cli._split_exec("kmp", ["hostname"]) == ("kmp", ["hostname"])
    # The command's own `--` stays (argparse already took exec's): `ls -- -f`, `git diff -- x`.
    assert cli._split_exec("kmp", ["ls", "--", "-f"]) == ("kmp", ["ls", "--", "-f"])
    assert cli._split_exec("kmp", ["--name=x", "--", "a", "--", "b"]) == ("x", ["a", "--", "b"])
    with pytest.raises(cp.ClusterPlanError, match="--name 'X'"):
        cli._split_exec("kmp", ["--name", "X", "--", "true"])


@requires_cluster
def test_status_and_exec_without_a_cluster(capsys):
    kmp("cluster", "down", "--name", "nonesuch")
    proc = kmp("cluster", "status", "--json", "--name", "nonesuch", check=False)
    assert proc.returncode == 1 and json.loads(proc.stdout) == {
        "name": "nonesuch",
        "up": False,
        "hosts": [],
    }
    proc = kmp("cluster", "exec", "h1", "--name", "nonesuch", "--", "true", check=False)
    assert proc.returncode == 2 and "no cluster 'nonesuch' is up" in proc.stderr
    second = kmp("cluster", "down", "--name", "nonesuch")
    assert "nothing to remove" in second.stdout


# ------------------------------------------------------------------ a real cluster


@pytest.mark.cluster
@requires_cluster
def test_up_status_exec_down():
    with cluster(3, slots=2, rate="1gbit") as info:
        assert info["up"] and info["hosts_arg"] == "h1:2,h2:2,h3:2"
        assert [(h["name"], h["address"], h["netns"]) for h in info["hosts"]] == [
            ("h1", "10.77.0.1", f"{NAME}-h1"),
            ("h2", "10.77.0.2", f"{NAME}-h2"),
            ("h3", "10.77.0.3", f"{NAME}-h3"),
        ]
        assert all(h["sshd_alive"] and h["sshd_pid"] > 1 for h in info["hosts"])
        # Each host has its own name, its own eth0 and the shaped link.
        out = on_host("h2", "sh", "-c", "hostname; cat /sys/class/net/eth0/operstate")
        assert out.returncode == 0 and out.stdout.split() == ["h2", "up"], out.stderr
        tc = on_host("h3", "tc", "qdisc", "show", "dev", "eth0")
        assert "tbf" in tc.stdout and "rate 1Gbit" in tc.stdout
        # ssh works between hosts with nothing more to set up, and the environment and
        # working directory are the caller's.
        hop = on_host("h1", "ssh", "h3", "hostname", env={"KMP_PROBE": "seen"})
        assert hop.returncode == 0 and hop.stdout.strip() == "h3", hop.stderr
        here = on_host("h2", "sh", "-c", 'pwd; echo "$KMP_PROBE"', env={"KMP_PROBE": "seen"})
        dashes = on_host("h1", "sh", "-c", 'echo "$@"', "sh", "--", "-f")  # its own `--` kept
        assert dashes.returncode == 0 and dashes.stdout.strip() == "-- -f", dashes.stderr
        assert here.stdout.split() == [str(ROOT), "seen"]  # the harness runs kmp in ROOT
        # Only the cluster's key gets in: a fresh key is refused, and passwords are off.
        key = Path(info["state_dir"]).parent / "probe-key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        try:
            probe = on_host(
                "h1", "ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes",
                "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "h2", "true",
            )  # fmt: skip
        finally:
            for path in (key, key.with_name("probe-key.pub")):
                path.unlink(missing_ok=True)
        assert probe.returncode == 255 and "Permission denied" in probe.stderr, probe.stderr
        state = Path(info["state_dir"])
        assert stat.S_IMODE((state / "id_ed25519").stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "h1" / "ssh_host_ed25519_key").stat().st_mode) == 0o600
        # sshd listens on the cluster address only.
        listen = on_host("h1", "sh", "-c", "cat /proc/net/tcp")
        local = {ln.split()[1] for ln in listen.stdout.splitlines()[1:] if ln.split()[3] == "0A"}
        assert local == {"01004D0A:0016"}, local  # 10.77.0.1:22, little-endian hex
        # A second `up`, under this name or another, is refused with what to do.
        again = kmp("cluster", "up", "--hosts", "2", "--name", NAME, check=False)
        assert again.returncode == 2 and f"kmp cluster down --name {NAME}" in again.stderr
        other = kmp("cluster", "up", "--hosts", "2", "--name", "other", check=False)
        assert other.returncode == 2 and "would clash" in other.stderr
        assert not leftovers("other")
    assert status()["up"] is False
    assert "nothing to remove" in kmp("cluster", "down", "--name", NAME).stdout


@pytest.mark.cluster
@requires_cluster
def test_down_cleans_up_after_a_failing_test_body():
    class BoomError(Exception):
        pass

    with pytest.raises(BoomError), cluster(2):
        assert status()["up"]
        raise BoomError  # the harness still takes everything down (and checks it)
    assert not leftovers()


@pytest.mark.cluster
@requires_cluster
def test_a_failed_up_removes_what_it_made(monkeypatch):
    """A step failing after namespaces, sshd, /etc/hosts and keys exist rolls all of it back."""
    kmp("cluster", "down", "--name", NAME)

    def broken_verify(plan):
        assert len(ops.status(NAME)["hosts"]) == 2 and leftovers()  # all made by now
        raise ops.ClusterError("injected failure")

    monkeypatch.setattr(ops, "_verify", broken_verify)
    with pytest.raises(ops.ClusterError, match=r"injected failure \(cleaned up: \d+ item"):
        ops.up(cp.plan_cluster(2, name=NAME))
    assert not leftovers()


@pytest.mark.cluster
@requires_cluster
def test_up_refuses_a_namespace_it_did_not_make():
    kmp("cluster", "down", "--name", NAME)
    subprocess.run(["ip", "netns", "add", f"{NAME}-h2"], check=True)
    try:
        proc = kmp("cluster", "up", "--hosts", "2", "--name", NAME, check=False)
        assert proc.returncode == 2
        assert f"network namespace '{NAME}-h2' already exists" in proc.stderr
        assert (
            f"{NAME}-h2"
            in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )  # not ours: left alone
    finally:
        subprocess.run(["ip", "netns", "del", f"{NAME}-h2"], check=False)
    assert not leftovers()
