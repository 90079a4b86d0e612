"""kmp.launching.preflight and kmp launch's multi-host options (pure parts, plus local runs)."""

from __future__ import annotations

import socket
import sys

import pytest

from kmp.commands import launch
from kmp.launching import job as lp
from kmp.launching import preflight as pf
from kmp.launching.hosts import LaunchError, parse_hosts


def test_nothing_to_check_for_a_one_machine_job():
    assert pf.plan_checks(["localhost"], [], python="py") == ()
    assert pf.plan_checks(["me"], [], python="py", hostname="me.example.org") == ()


def test_every_host_is_checked_when_one_is_remote_or_a_nic_is_named():
    checks = pf.plan_checks(
        ["me", "node2"], ["eth0"], python="/venv/bin/python", ssh_port=2222,
        identity_file="/k/id", hostname="me",
    )  # fmt: skip
    assert [c.host for c in checks] == ["me", "node2"]
    assert checks[0].argv is None and checks[0].nics == ("eth0",)  # this host: in process
    argv = checks[1].argv
    assert argv[:5] == ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
    assert argv[5:7] == ("-o", "StrictHostKeyChecking=accept-new")
    assert argv[7:11] == ("-p", "2222", "-i", "/k/id") and argv[11] == "node2"
    # The remote command is one quoted string that runs the job's Python with the NICs.
    assert argv[12].startswith("/venv/bin/python -c ") and argv[12].endswith(" eth0")
    only_local_nic = pf.plan_checks(["localhost"], ["eth0"], python="py")
    assert len(only_local_nic) == 1 and only_local_nic[0].argv is None


def test_local_check_finds_a_missing_interface():
    have = sorted(n for _, n in socket.if_nameindex())
    assert pf.run_checks([pf.Check("localhost", (have[0],), None)]) == []
    problems = pf.run_checks([pf.Check("localhost", ("nope0",), None)])
    assert problems == [
        f"network interface 'nope0' does not exist on host 'localhost' (it has: "
        f"{', '.join(have)}). Pass --network-interface with an interface that exists on "
        "every host."
    ]


def _fake_ssh(code: str) -> tuple[str, ...]:
    """A check whose 'ssh' is a local Python that behaves as ssh would."""
    return (sys.executable, "-c", code)


def test_remote_outcomes_are_worded_for_the_user():
    unreachable = pf.Check(
        "h9", ("eth0",),
        _fake_ssh("import sys; sys.stderr.write('ssh: Could not resolve hostname h9\\n'); "
                  "sys.exit(255)"),
        "py",
    )  # fmt: skip
    missing = pf.Check(
        "h2", ("eth0", "ib0"), _fake_ssh("print('eth0 lo'); raise SystemExit(3)"), "py"
    )
    no_python = pf.Check(
        "h3", (), _fake_ssh("import sys; sys.stderr.write('py: not found\\n'); sys.exit(127)"),
        "/venv/bin/python",
    )  # fmt: skip
    fine = pf.Check("h4", ("eth0",), _fake_ssh("print('eth0 lo')"), "py")
    problems = pf.run_checks([unreachable, missing, no_python, fine])
    assert len(problems) == 3
    assert problems[0].startswith(
        "host 'h9' cannot be reached by ssh (ssh: Could not resolve hostname h9)"
    )
    assert problems[1].startswith(
        "network interface 'ib0' does not exist on host 'h2' (it has: eth0, lo)"
    )
    assert "the job's Python (/venv/bin/python) did not run there (exit 127" in problems[2]


def test_a_silent_host_times_out(monkeypatch):
    slow = pf.Check("h5", (), _fake_ssh("import time; time.sleep(30)"), "py")
    assert pf.run_checks([slow], timeout=1) == ["host 'h5' did not answer within 1 s (ssh h5)."]


# ------------------------------------------------------------------ kmp launch options


def test_identity_file_interface_and_mpi_channel(script, tmp_path):
    key = tmp_path / "id"
    key.write_text("key")
    plan = lp.build_command(
        4, script, hosts=parse_hosts("h1:2,h2:2"), controller="mpi", ssh_port=2222,
        ssh_identity_file=key, network_interfaces="eth0", horovodrun="horovodrun",
        python="/venv/bin/python",
    )  # fmt: skip
    argv = list(plan.argv)
    assert argv[argv.index("--ssh-identity-file") + 1] == str(key)
    assert argv[argv.index("--network-interfaces") + 1] == "eth0"
    assert "--mpi-args=-mca oob_tcp_if_include eth0" in argv
    assert [c.host for c in plan.checks] == ["h1", "h2"]
    assert all(c.nics == ("eth0",) and c.python == "/venv/bin/python" for c in plan.checks)


def test_a_local_job_plans_no_checks(script):
    plan = lp.build_command(2, script, horovodrun="horovodrun")
    assert plan.checks == ()
    gloo = lp.build_command(2, script, controller="gloo", horovodrun="horovodrun",
                                network_interfaces="eth0")  # fmt: skip
    assert not any(a.startswith("--mpi-args") for a in gloo.argv)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ssh_identity_file": "/nonexistent/key"}, "--ssh-identity-file '/nonexistent/key'"),
        ({"ssh_port": 0}, "--ssh-port must be a TCP port"),
        ({"ssh_port": 70000}, "--ssh-port must be a TCP port"),
        ({"network_interfaces": "eth0;rm"}, "'eth0;rm' is not an interface name"),
        ({"policy": "fp8"}, "--policy: Unknown dtype policy 'fp8'"),
    ],
)
def test_bad_multi_host_options(script, kwargs, message):
    with pytest.raises(LaunchError, match=message):
        lp.build_command(2, script, horovodrun="horovodrun", **kwargs)


def test_policy_names_are_normalised(script):
    plan = lp.build_command(2, script, horovodrun="horovodrun", policy=" Mixed_BFloat16 ")
    assert plan.env["KMP_POLICY"] == "mixed_bfloat16"


def test_failed_checks_start_nothing(script, capsys, monkeypatch):
    plan = lp.build_command(2, script, horovodrun="/bin/false",
                                network_interfaces="nope0")  # fmt: skip
    ran = []
    monkeypatch.setattr(lp, "run_forwarding_signals", lambda *a, **k: ran.append(a))
    assert lp.execute(plan) == 2
    assert ran == []
    assert "kmp launch: error: network interface 'nope0' does not exist on host 'localhost'" in (
        capsys.readouterr().err
    )


def test_cli_network_interface_spellings(script, capsys):
    for flag in ("--network-interface", "--network-interfaces"):
        assert launch.main(["-np", "2", flag, "lo", "--dry-run", str(script)]) == 0
        assert "--network-interfaces lo" in capsys.readouterr().out
