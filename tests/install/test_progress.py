"""kmp.install.progress: the build's log file and its progress lines (no Horovod compiled)."""

from __future__ import annotations

import sys

import pytest

from kmp.install import progress


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (45.9, "45 s"), (60, "1 min 00 s"), (200, "3 min 20 s"), (3900, "1 h 05 min")],
)
def test_format_elapsed(seconds, text):
    assert progress.format_elapsed(seconds) == text


def test_build_percent_reads_cmake_counters_only():
    assert progress.build_percent("[ 45%] Building CXX object horovod/common/ops.cc.o") == 45
    assert progress.build_percent("  [100%] Linking CXX shared library") == 100
    assert progress.build_percent("[  3%] Built target gloo") == 3
    assert progress.build_percent("copying horovod/__init__.py") is None
    assert progress.build_percent("50% done") is None
    assert progress.build_percent("[250%] nonsense") is None


def test_format_progress():
    line = "[ 45%] Building CXX object horovod/common/ops/collective_operations.cc.o"
    assert progress.format_progress("compiling Horovod", 200, line, 45) == (
        f"still compiling Horovod: 3 min 20 s, 45%, last: {line}"
    )
    assert progress.format_progress("fetching horovod", 31, None) == (
        "still fetching horovod: 31 s, no output yet"
    )
    long = progress.format_progress("compiling Horovod", 5, "x" * 300)
    assert long.endswith("x...") and len(long.split("last: ")[1]) == 100


def test_run_logged_keeps_the_log_and_reports_while_it_runs(tmp_path):
    script = (
        "import sys, time\n"
        "for i in (10, 50, 40):\n"
        "    print(f'[{i:3d}%] Building CXX object part{i}.o', flush=True)\n"
        "    time.sleep(0.3)\n"
        "print('warning: on stderr', file=sys.stderr, flush=True)\n"
        "sys.exit(3)\n"
    )
    log = tmp_path / "logs" / "build.log"
    log.parent.mkdir()
    log.write_text("earlier step\n")
    reports = []
    code = progress.run_logged(
        [sys.executable, "-c", script], log, what="compiling", interval=0.2, report=reports.append
    )
    assert code == 3
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier step" and lines[-1] == "warning: on stderr"  # appended, both
    assert "[ 50%] Building CXX object part50.o" in lines
    assert reports and all(r.startswith("still compiling: ") for r in reports)
    assert any("50%, last: [ 50%] Building CXX object part50.o" in r for r in reports)
    assert not any("40%" in r.split(", last")[0] for r in reports)  # the highest seen is kept
