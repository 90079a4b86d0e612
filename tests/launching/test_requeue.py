"""After a preemption: kmp launch passes the ranks' status 75 on and requeues SLURM jobs.

kmp.launching.requeue (the decision, pure, and scontrol), kmp.launching.processes (the
signals a launcher passes on, with a real child) and kmp.launching.horovodrun (the
status read from Horovod's launcher's error).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from kmp._names import PREEMPTED_EXIT_CODE
from kmp.commands import launch as launch_cmd
from kmp.launching import requeue as rq
from kmp.launching.horovodrun import rank_status
from kmp.launching.processes import FORWARDED_SIGNALS, run_forwarding_signals


def test_only_a_preempted_job_in_slurm_is_requeued_and_only_so_often():
    slurm = {"SLURM_JOB_ID": "42"}
    assert rq.plan_requeue(0, slurm, 20) is None
    assert rq.plan_requeue(1, slurm, 20) is None  # a failure is not a preemption
    assert rq.plan_requeue(PREEMPTED_EXIT_CODE, {}, 20) is None  # outside SLURM
    plan = rq.plan_requeue(75, slurm, 20)
    assert plan.job_id == "42" and "requeue 1 of at most 20" in plan.note
    again = rq.plan_requeue(75, {**slurm, "SLURM_RESTART_COUNT": "3"}, 20)
    assert again.job_id == "42" and "requeue 4" in again.note
    spent = rq.plan_requeue(75, {**slurm, "SLURM_RESTART_COUNT": "20"}, 20)
    assert spent.job_id is None and "--max-requeues 20 reached" in spent.note
    off = rq.plan_requeue(75, slurm, 0)
    assert off.job_id is None and "--max-requeues 0" in off.note


def test_a_job_whose_launcher_got_sigterm_is_ending_and_never_requeued():
    """scancel (and a limit reached unwarned) signal the batch shell, kmp launch, with SIGTERM:
    the ranks still exit 75 after their checkpoint, but a cancelled job must stay cancelled.
    A time limit's warning reaches kmp launch as SIGUSR1 (B:USR1) or not at all."""
    slurm = {"SLURM_JOB_ID": "42"}
    for sig in (signal.SIGTERM, signal.SIGINT):
        plan = rq.plan_requeue(75, slurm, 5, [signal.SIGUSR1, sig])
        assert plan.job_id is None and sig.name in plan.note and "not requeued" in plan.note
    assert rq.plan_requeue(75, slurm, 5, [signal.SIGUSR1]).job_id == "42"  # B:USR1@T
    assert rq.plan_requeue(75, slurm, 5, []).job_id == "42"  # USR1@T: the ranks only
    assert rq.plan_requeue(1, slurm, 5, [signal.SIGTERM]) is None  # not a preemption
    # The ranks died of the warning itself, before fit caught it: the last checkpoint
    # stands, so the job is requeued too; killed by SIGTERM (143) it is not.
    early = rq.plan_requeue(128 + signal.SIGUSR1, slurm, 5, [])
    assert early.job_id == "42" and "died of SIGUSR1" in early.note
    assert rq.plan_requeue(128 + signal.SIGTERM, slurm, 5, []) is None
    assert rq.DEFAULT_MAX_REQUEUES == 5  # on by default, bounded as SLURM's MaxBatchRequeue


def test_the_launcher_requeues_on_a_warning_and_not_after_scancels_sigterm(monkeypatch):
    calls = []
    monkeypatch.setattr(rq, "requeue", calls.append)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    args = launch_cmd.argparse.Namespace(max_requeues=rq.DEFAULT_MAX_REQUEUES)
    assert rq.after_job(75, args, [signal.SIGTERM]) == 75 and calls == []
    assert rq.after_job(75, args, [signal.SIGUSR1]) == 75
    assert [plan.job_id for plan in calls] == ["7"]


def test_the_chiefs_preemption_note_makes_the_status_75_whatever_srun_reported(capsys):
    """srun --kill-on-bad-exit stops the ranks still exiting once the first leaves with 75:
    srun then reports 137 or 143. The chief's note (written after its checkpoint, in the
    file kmp launch names) says what happened."""
    from kmp._names import PREEMPTED_MARKER_ENV
    from kmp.callbacks.preemption import mark_preempted

    with rq.preemption_marker() as marker:
        assert os.environ[PREEMPTED_MARKER_ENV] == str(marker) and not marker.exists()
        assert rq.job_status(137, marker) == 137  # no note: a failure stays a failure
        mark_preempted("/ckpt/ckpt-0003-step-000007.keras")
        assert rq.job_status(137, marker) == rq.job_status(143, marker) == 75
        assert "ckpt-0003-step-000007.keras" in capsys.readouterr().err
        assert rq.job_status(75, marker) == 75
        assert rq.job_status(0, marker) == 0  # the ranks caught Preempted and ended cleanly
    assert PREEMPTED_MARKER_ENV not in os.environ and not marker.parent.exists()
    mark_preempted("/nowhere")  # no launcher asked: nothing written, no error


def test_requeue_runs_scontrol_and_reports_a_refusal(monkeypatch, capsys, tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\necho "$@" >> ' + str(tmp_path / "calls") + "\nexit $RC\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("RC", "0")
    assert rq.requeue(rq.RequeuePlan("42", "")) is True
    monkeypatch.setenv("RC", "1")
    assert rq.requeue(rq.RequeuePlan("42", "")) is False
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["requeue 42", "requeue 42"]
    assert "scontrol requeue 42 failed" in capsys.readouterr().out
    assert rq.requeue(rq.RequeuePlan(None, "")) is False


def test_a_negative_max_requeues_is_refused(capsys, script):
    assert launch_cmd.main(["--max-requeues", "-1", "-np", "2", str(script)]) == 2
    assert "--max-requeues -1" in capsys.readouterr().err


def test_the_first_failed_ranks_status_is_read_from_horovods_error():
    message = (
        "Horovod detected that one or more processes exited with non-zero status, thus "
        "causing the job to be terminated. The first process to do so was:\n"
        "Process name: 1\nExit code: 75\n"
    )
    assert rank_status(message) == 75
    assert rank_status("something else") is None


@pytest.mark.parametrize("sig", FORWARDED_SIGNALS)
def test_a_launcher_passes_each_stop_signal_on_and_returns_the_childs_status(sig):
    assert signal.SIGUSR1 in FORWARDED_SIGNALS
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        f"signal.signal({int(sig)}, lambda *a: sys.exit(75))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    previous = signal.getsignal(sig)
    timer = threading.Timer(2.0, os.kill, (os.getpid(), sig))  # as a scheduler signals it
    timer.start()
    received: list[int] = []
    try:
        code = run_forwarding_signals([sys.executable, "-c", child], grace_s=20, received=received)
    finally:
        timer.cancel()
        signal.signal(sig, previous)
    assert code == 75
    assert received == [sig]  # what the launcher's requeue decision reads
