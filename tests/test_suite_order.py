"""The suite's own scheduling (tests/conftest.py): the longest modules first, and which tests
run beside the multi-host ones."""

from __future__ import annotations

import subprocess
import sys

from tests import conftest
from tests._support import ROOT


class Item:
    """The little of a pytest item the ordering hook reads and writes."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid = nodeid
        self.marks = list(marks)

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def add_marker(self, name: str) -> None:
        self.marks.append(name)


def test_every_listed_module_and_test_exists():
    for name in ("LONGEST_FIRST", "BESIDE_CLUSTER"):
        listed = getattr(conftest, name)
        assert len(set(listed)) == len(listed), name
        for entry in listed:
            path, _, test = entry.split("[", 1)[0].partition("::")
            assert (ROOT / path).is_file(), f"tests/conftest.py {name}: {path} is gone"
            source = (ROOT / path).read_text()
            assert not test or f"def {test}(" in source, f"tests/conftest.py {name}: {entry}"


def test_longest_modules_go_first_and_every_other_order_is_kept():
    first, second = conftest.LONGEST_FIRST[:2]
    ids = [
        "tests/test_a.py::test_1",
        f"{second}::test_x",
        "tests/test_a.py::test_2",
        f"{first}::test_y[1]",
        "tests/sub/test_b.py::test_3",
        f"{second}::test_z",
        f"{first}::test_y[0]",
    ]
    items = [Item(i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        f"{first}::test_y[1]",
        f"{first}::test_y[0]",
        f"{second}::test_x",
        f"{second}::test_z",
        "tests/test_a.py::test_1",
        "tests/test_a.py::test_2",
        "tests/sub/test_b.py::test_3",
    ]


def test_beside_cluster_marks_modules_and_tests_but_never_rank_processes(monkeypatch):
    module, test = "tests/test_m.py", "tests/test_n.py::test_long"
    one = "tests/test_n.py::test_params[c]"
    monkeypatch.setattr(conftest, "BESIDE_CLUSTER", (module, test, one))
    items = [
        Item(f"{module}::test_alone"),
        Item(f"{module}::test_two_ranks", "distributed"),
        Item(f"{test}[a]"),
        Item(f"{test}[b]"),
        Item(f"{test}_too"),
        Item("tests/test_n.py::test_other"),
        Item("tests/test_n.py::test_params[c]"),
        Item("tests/test_n.py::test_params[d]"),
    ]
    conftest.pytest_collection_modifyitems(None, items)
    marked = [i.nodeid for i in items if i.get_closest_marker(conftest.BESIDE_CLUSTER_MARK)]
    assert marked == [f"{module}::test_alone", f"{test}[a]", f"{test}[b]", one]


def test_the_mark_is_there_when_pytest_selects_by_it():
    """The hook runs before `-m` deselects (launch/test.sh selects phase 2 by the mark)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "beside_cluster", "tests/test_notebooks.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    selected = [line for line in out.stdout.splitlines() if "::" in line]
    assert selected == ["tests/test_notebooks.py::test_notebook_runs[05_transformers]"]
