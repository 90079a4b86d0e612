"""The suite's own scheduling hint: the longest modules first, or all reversed
(tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import conftest
from tests._support import ROOT


def test_every_longest_first_module_exists():
    missing = [p for p in conftest.LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names modules that are gone: {missing}"
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)


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
    items = [SimpleNamespace(nodeid=i) for i in ids]
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


def test_reverse_order_runs_everything_backwards_and_a_bad_order_is_named(monkeypatch):
    ids = [f"{conftest.LONGEST_FIRST[0]}::test_y", "tests/test_a.py::test_1", "tests/test_a.py::t2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    monkeypatch.setenv("KMP_TEST_ORDER", "reverse")
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ids[::-1]
    monkeypatch.setenv("KMP_TEST_ORDER", "random")
    with pytest.raises(pytest.UsageError, match="KMP_TEST_ORDER='random': use one of"):
        conftest.pytest_collection_modifyitems(None, items)
