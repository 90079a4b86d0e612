"""kmp.versions: the supported ranges, their agreement with pyproject.toml and the matrix's
requirement files, and the warning an environment outside them gets."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kmp import versions

ROOT = Path(__file__).resolve().parents[1]


def _rule(name: str) -> versions.Supported:
    return next(r for r in versions.SUPPORTED if r.name == name)


def _pins(path: Path) -> dict[str, str]:
    """Name -> pinned version of a requirements file (``# python: 3.X`` included)."""
    pins = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"# python: *([0-9.]+)", line):
            pins["python"] = m.group(1)
        elif m := re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+)", line):
            name = m.group(1).lower().replace("_", "-")
            pins["tensorflow" if name.startswith("tensorflow-cpu") else name] = m.group(2)
    return pins


def test_parse_reads_release_numbers_and_refuses_what_is_not_a_version():
    assert versions.parse("2.21.0rc1") == (2, 21)
    assert versions.parse("3.10.0") == versions.parse("3.10") == (3, 10)
    assert versions.parse("0.12.0.1") == (0, 12, 0, 1)
    with pytest.raises(ValueError, match="not a version number"):
        versions.parse("latest")


def test_pyproject_declares_exactly_the_supported_ranges():
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest brings tomli, the same parser
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == _rule("python").specifier
    assert f"keras{_rule('keras').specifier}" in project["dependencies"]
    extras = project["optional-dependencies"]
    assert extras["tensorflow"] == [_rule("tensorflow").requirement]
    assert extras["jax"] == [f"jax[cpu]{_rule('jax').specifier}"]
    # One classifier per supported Python minor version, no other.
    declared = {c.rsplit(" ", 1)[-1] for c in project["classifiers"] if ":: Python :: 3." in c}
    low, below = versions.parse(_rule("python").lowest), versions.parse(_rule("python").below)
    assert declared == {f"3.{m}" for m in range(low[1], below[1])}


@pytest.mark.parametrize("edge", ["oldest", "newest"])
def test_the_matrix_environments_sit_at_the_ends_of_every_range(edge):
    pins = _pins(ROOT / f"requirements-{edge}.txt")
    for rule in versions.SUPPORTED:
        pinned = pins[rule.name]
        assert rule.holds(pinned), (edge, rule, pinned)
        if edge == "oldest":
            assert versions.parse(pinned)[:2] == versions.parse(rule.lowest)[:2], (rule, pinned)
        else:  # the newest minor release below the range's end
            below = versions.parse(rule.below)
            assert versions.parse(pinned)[:2] == (below[0], below[1] - 1), (rule, pinned)
    # The pinned default environment lies inside the ranges too.
    pinned = _pins(ROOT / "requirements.txt")
    assert _rule("keras").holds(pinned["keras"]) and _rule("jax").holds(pinned["jax"])


def test_untested_names_each_version_outside_its_range_and_the_fix():
    inside = {"python": "3.12.1", "keras": "3.15.1", "tensorflow": "2.18.1", "jax": None}
    assert versions.untested(inside) == []
    found = versions.untested({"python": "3.9.18", "keras": "3.6.0", "tensorflow": "2.22.0"})
    assert [problem for problem, _ in found] == [
        "python 3.9.18 is outside kmp's tested range >=3.10,<3.14",
        "keras 3.6.0 is outside kmp's tested range >=3.10,<3.16",
        "tensorflow 2.22.0 is outside kmp's tested range >=2.18,<2.22",
    ]
    assert found[1][1] == "pip install 'keras>=3.10,<3.16'"
    assert "KMP_PYTHON" in found[0][1]


def test_installed_reads_this_environment_and_it_is_tested():
    here = versions.installed()
    assert here["python"] == ".".join(map(str, sys.version_info[:3]))
    import keras

    assert here["keras"] == keras.__version__
    assert versions.untested(here) == []


def test_import_kmp_warns_outside_the_ranges_and_is_silent_inside(monkeypatch):
    monkeypatch.setattr(
        versions, "installed", lambda: {"python": "3.12.0", "keras": "3.9.2", "jax": None}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problems = versions.warn_if_untested()
    assert len(problems) == 1
    [warning] = caught
    assert warning.category is versions.UntestedVersionWarning
    assert "keras 3.9.2" in str(warning.message) and "pip install" in str(warning.message)
    # A fresh interpreter importing kmp here: no warning at all.
    r = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import kmp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def _matrix(tmp_path: Path, name: str, requirements: str | None) -> subprocess.CompletedProcess:
    """launch/matrix.sh run from a copy of the repository's layout with one requirements file."""
    (tmp_path / "launch").mkdir(exist_ok=True)
    (tmp_path / "launch" / "matrix.sh").write_text((ROOT / "launch" / "matrix.sh").read_text())
    if requirements is not None:
        (tmp_path / f"requirements-{name}.txt").write_text(requirements)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KMP_CACHE_DIR": str(tmp_path / "c")}
    return subprocess.run(
        ["bash", str(tmp_path / "launch" / "matrix.sh"), name],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_matrix_skips_a_missing_python_and_refuses_a_bad_file(tmp_path):
    r = _matrix(tmp_path, "future", "# python: 3.99\nkeras==9.0\n")
    assert r.returncode == 0 and "SKIPPED future: no Python 3.99" in r.stderr
    assert not (tmp_path / "c" / "envs").exists()  # nothing built
    r = _matrix(tmp_path, "nameless", "keras==3.10.0\n")
    assert r.returncode == 2 and "has no '# python: 3.X' line" in r.stderr
    r = _matrix(tmp_path, "missing", None)
    assert r.returncode == 2 and "requirements-missing.txt" in r.stderr
