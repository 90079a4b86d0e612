"""Tables that keep their columns (issue 42): kmp.commands.format_table and the demo's table."""

from __future__ import annotations

import importlib.util
import re

import pytest

from kmp.commands import format_table
from tests._support import ROOT

# A cell: words with single spaces between them ("mixed_bfloat16 (auto)"); cells are two or
# more spaces apart.
CELL = re.compile(r"\S+(?: \S+)*")


def spans(line: str) -> list[tuple[int, int]]:
    """Where each cell of ``line`` starts and ends."""
    return [m.span() for m in CELL.finditer(line)]


def test_columns_are_as_wide_as_their_widest_cell():
    text = format_table(
        [("mixed_bfloat16 (auto)", "0.9861", "473"), ("float32", "0.9833", "1,531")],
        ("policy", "test accuracy", "images/s"),
        right=(1, 2),
    )
    assert text.splitlines() == [
        "policy                 test accuracy  images/s",
        "mixed_bfloat16 (auto)         0.9861       473",
        "float32                       0.9833     1,531",
    ]


def test_left_columns_start_together_and_right_columns_end_together():
    lines = format_table(
        [("a", 1, "x"), ("a much longer first cell", 123456, "yy")], ("name", "n", "z"), right=(1,)
    ).splitlines()
    assert len({spans(line)[0][0] for line in lines}) == 1  # left: the starts
    assert len({spans(line)[2][0] for line in lines}) == 1
    assert len({spans(line)[1][1] for line in lines}) == 1  # right: the ends


def test_no_trailing_spaces_and_an_indent():
    text = format_table([("a", "b"), ("long cell", "")], indent="  ")
    assert text.splitlines() == ["  a          b", "  long cell"]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_rows_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="different lengths"):
        format_table([("a", "b"), ("c",)])


def test_nothing_gives_nothing():
    assert format_table([]) == ""
    assert format_table([], ("only", "header")) == "only  header"


# ------------------------------------------------------------------ the demo's closing table


@pytest.fixture(scope="module")
def demo():
    """launch/demo.py as a module (it imports no TensorFlow)."""
    spec = importlib.util.spec_from_file_location("kmp_demo", ROOT / "launch" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "a_long_policy_name_32"])
def test_the_demos_table_keeps_its_columns_with_the_auto_tag(demo, policy):
    runs = [
        {"policy": policy, "test_accuracy": 0.98611, "images_per_sec": 473.2},
        {"policy": "float32", "test_accuracy": 0.98333, "images_per_sec": 531.0},
    ]
    lines = demo.closing_table(runs, auto_run=runs[0]).splitlines()
    cells = [[line[a:b] for a, b in spans(line)] for line in lines]
    assert [row[0] for row in cells] == ["policy", f"{policy} (auto)", "float32"]
    assert cells[0] == ["policy", "test accuracy", "images/s", "vs float32"]
    assert cells[1][1:] == ["0.9861", "473", f"{473.2 / 531:.2f}x"]
    assert cells[2][1:] == ["0.9833", "531", "1.00x"]
    # Every line has four cells; the policies start together, the numbers end together.
    assert all(len(spans(line)) == 4 for line in lines)
    assert len({spans(line)[0][0] for line in lines}) == 1
    for column in (1, 2, 3):
        assert len({spans(line)[column][1] for line in lines}) == 1, "\n".join(lines)


def test_the_demos_table_without_float32_or_auto(demo):
    runs = [
        {"policy": "mixed_bfloat16", "test_accuracy": 0.97, "images_per_sec": 400.0},
        {"policy": "mixed_float16", "test_accuracy": 0.96, "images_per_sec": 380.0},
    ]
    lines = demo.closing_table(runs).splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["mixed_bfloat16", "mixed_float16"]
    assert all(line.endswith("-") for line in lines[1:])
    assert "(auto)" not in "\n".join(lines)
