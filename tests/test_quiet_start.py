"""A quiet start (issue 42): kmp's programs print their own lines, not TensorFlow's notices.

The rule: TensorFlow's C++ log level, ``TF_CPP_MIN_LOG_LEVEL=1`` unless the user set it
(``kmp._launcher_env.quiet_env``), set by the ``kmp`` program before anything imports
TensorFlow; and, around kmp's own TensorFlow imports, the notices TensorFlow 2.21 prints
before it applies that level (oneDNN's) left out (``kmp.commands.tensorflow_notices_dropped``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kmp import _launcher_env, cli
from kmp.commands import is_tensorflow_notice, tensorflow_notices_dropped
from tests._support import ROOT

VAR = "TF_CPP_MIN_LOG_LEVEL"
BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = (
    "I0000 00:00:1796374048.701077   13205 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors."
)
CPU_GUARD = (
    "I0000 00:00:1796374048.838994   13205 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations."
)
CPU_GUARD_2 = (
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other "
    "operations, rebuild TensorFlow with the appropriate compiler flags."
)
OLD_FORMAT_INFO = (
    "2025-07-24 10:38:25.697969: I tensorflow/core/util/port.cc:153] oneDNN custom operations "
    "are on."
)
CUDNN_TWICE = (
    "E0000 00:00:1765464952.116801  640792 cuda_dnn.cc:8579] Unable to register cuDNN factory: "
    "Attempting to register factory for plugin cuDNN when one has already been registered"
)
WARNING = "W0000 00:00:1765464952.139944  640792 dso_loader.cc:77] Could not load libcudart.so.12"
ERROR = "E0000 00:00:1765464952.2  640792 cuda_driver.cc:152] failed call to cuInit: UNKNOWN ERROR"
OLD_FORMAT_ERROR = "2025-07-24 10:38:25.7: E tensorflow/core/common_runtime/x.cc:12] real trouble"


# ------------------------------------------------------------------ the environment rule


@pytest.mark.parametrize(
    ("environ", "added"),
    [
        ({}, {VAR: "1"}),
        ({VAR: ""}, {VAR: "1"}),  # empty means unset
        ({VAR: "0"}, {}),  # the user's level wins, everything included
        ({VAR: "3"}, {}),
        ({"OTHER": "x"}, {VAR: "1"}),
    ],
)
def test_quiet_env_sets_the_level_unless_the_user_did(environ, added):
    assert _launcher_env.quiet_env(environ) == added


@pytest.mark.parametrize(
    ("value", "level"), [(None, 0), ("", 0), ("1", 1), (" 2 ", 2), ("3", 3), ("x", 0)]
)
def test_tf_log_level_reads_as_tensorflow_does(value, level):
    assert _launcher_env.tf_log_level({} if value is None else {VAR: value}) == level


def test_the_kmp_program_sets_the_level_first(monkeypatch, capsys):
    monkeypatch.delenv(VAR, raising=False)
    assert cli.main([]) == 2  # no command: the help
    assert os.environ[VAR] == _launcher_env.QUIET_TF_LOG_LEVEL


def test_the_users_level_wins(monkeypatch, capsys):
    monkeypatch.setenv(VAR, "0")
    cli.main([])
    assert os.environ[VAR] == "0"


# ------------------------------------------------------------------ which lines are notices


@pytest.mark.parametrize("line", [BANNER, ONEDNN, CPU_GUARD, CPU_GUARD_2, OLD_FORMAT_INFO])
def test_info_notices_are_left_out_from_level_1(line):
    assert is_tensorflow_notice(line + "\n", 1)
    assert is_tensorflow_notice(line, 3)
    assert not is_tensorflow_notice(line, 0)  # level 0: the user asked for everything


@pytest.mark.parametrize("line", [WARNING, ERROR, OLD_FORMAT_ERROR])
def test_warnings_and_errors_stay_at_level_1(line):
    assert not is_tensorflow_notice(line, 1)


def test_higher_levels_leave_out_what_tensorflow_would():
    assert is_tensorflow_notice(WARNING, 2) and not is_tensorflow_notice(ERROR, 2)
    assert is_tensorflow_notice(ERROR, 3) and is_tensorflow_notice(OLD_FORMAT_ERROR, 3)


def test_cuda_plugins_registered_twice_are_a_notice_at_any_level_but_0():
    assert is_tensorflow_notice(CUDNN_TWICE, 1)
    assert not is_tensorflow_notice(CUDNN_TWICE, 0)


@pytest.mark.parametrize(
    "line",
    [
        "kmp                 0.2.0",
        "Traceback (most recent call last):",
        "/x/keras/src/ops.py:12: UserWarning: something I0000 00:00:1.0 1 x.cc:1] quoted",
        "I0000 is not a log line",
        "2025-07-24 and so on: I said so",
        "To enable them, pass --flag",  # not TensorFlow's CPU-instructions line
    ],
)
def test_other_lines_are_never_notices(line):
    assert not is_tensorflow_notice(line, 3)


# ------------------------------------------------------------------ the filter around an import


def _write(*lines: str | bytes) -> None:
    for line in lines:
        os.write(2, (line if isinstance(line, bytes) else line.encode()) + b"\n")


def test_notices_are_dropped_and_every_other_line_kept_in_order(monkeypatch, capfdbinary):
    monkeypatch.setenv(VAR, "1")
    with tensorflow_notices_dropped():
        _write(BANNER, ONEDNN, "first own line", CPU_GUARD, CPU_GUARD_2, CUDNN_TWICE)
        _write(WARNING, b"bytes \xff kept as they are", ERROR, BANNER, ONEDNN)
        os.write(2, b"no newline at the end")
        assert capfdbinary.readouterr().err == b""  # held until the import is done
    err = capfdbinary.readouterr().err
    assert err == b"\n".join(
        [
            b"first own line",
            WARNING.encode(),
            b"bytes \xff kept as they are",
            ERROR.encode(),
            b"no newline at the end",
        ]
    )


def test_level_0_holds_nothing(monkeypatch, capfd):
    monkeypatch.setenv(VAR, "0")
    with tensorflow_notices_dropped():
        _write(ONEDNN)
        assert capfd.readouterr().err == ONEDNN + "\n"  # live


def test_an_error_inside_still_gives_back_stderr_and_the_lines(monkeypatch, capfd):
    monkeypatch.setenv(VAR, "1")
    with pytest.raises(ImportError, match="no such module"), tensorflow_notices_dropped():
        _write(ONEDNN, "why it failed")
        raise ImportError("no such module")
    _write("after")
    assert capfd.readouterr().err == "why it failed\nafter\n"


# ------------------------------------------------------------------ a real kmp command

NOTICE_MARKS = ("oneDNN custom operations", "absl::InitializeLog", "cpu_feature_guard")
INFO_LINE = re.compile(r"^(I\d{4} \d\d:\d\d:|\d{4}-\d\d-\d\d [\d:.]+: I )")


def test_kmp_doctor_prints_its_own_lines_and_no_tensorflow_notice():
    """``kmp doctor`` imports TensorFlow and Horovod; only its report comes out."""
    pytest.importorskip("tensorflow")
    env = {k: v for k, v in os.environ.items() if k != VAR}  # kmp's default level
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "kmp.cli", "doctor"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    own = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert own[:4] == ["kmp", "Python", "TensorFlow", "Keras"]
    assert "auto" in own and "warnings" in own
    lines = (proc.stdout + proc.stderr).splitlines()
    noise = [ln for ln in lines if any(m in ln for m in NOTICE_MARKS) or INFO_LINE.match(ln)]
    assert noise == [], "TensorFlow's start-up notices in kmp doctor's output:\n" + "\n".join(noise)
