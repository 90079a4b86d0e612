"""The versions kmp is tested with, and the check of the ones installed.

The one home of kmp's supported ranges: pyproject.toml declares the same ones (pip refuses
a Python outside them), requirements-oldest.txt and requirements-newest.txt pin their two
ends and the version matrix (launch/matrix.sh) runs the core suite at both, the pinned
environment (requirements.txt) in between; tests/test_versions.py checks that all of them
agree. ``import kmp`` warns (:class:`UntestedVersionWarning`) and ``kmp doctor`` reports
when an installed version is outside its range, naming the ``pip install`` that fixes it.

:func:`untested` is the pure decision; :func:`installed` reads the environment.
:func:`main` prints the ranges, or with ``--python`` returns 1 (saying why) when the
interpreter running it is outside them: launch/setup.sh picks its Python with it, before
anything is installed (this module and ``import kmp`` need only the standard library).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import re
import sys

__all__ = [
    "SUPPORTED",
    "TENSORFLOW_DISTRIBUTIONS",
    "Supported",
    "UntestedVersionWarning",
    "installed",
    "installed_distribution",
    "installed_tensorflow",
    "parse",
    "supported",
    "untested",
    "warn_if_untested",
]


@dataclasses.dataclass(frozen=True)
class Supported:
    """One supported range: ``lowest <= version < below``.

    Attributes:
        name: The project's name as pip knows it (``"python"`` for the interpreter).
        lowest: The oldest version tested (requirements-oldest.txt pins it).
        below: The first version not supported (the newest tested is below it).
    """

    name: str
    lowest: str
    below: str

    @property
    def specifier(self) -> str:
        """The range as pip writes it: ``">=3.10,<3.16"``."""
        return f">={self.lowest},<{self.below}"

    @property
    def requirement(self) -> str:
        """The range as a requirement: ``"keras>=3.10,<3.16"``."""
        return f"{self.name}{self.specifier}"

    def holds(self, version: str) -> bool:
        """Whether ``version`` lies in the range (pre-releases count as their release)."""
        return parse(self.lowest) <= parse(version) < parse(self.below)


# Raised together with requirements-newest.txt when a newer release has passed the matrix.
SUPPORTED: tuple[Supported, ...] = (
    Supported("python", "3.10", "3.14"),
    Supported("keras", "3.10", "3.16"),
    Supported("tensorflow", "2.18", "2.22"),
    Supported("jax", "0.6.2", "0.13"),
)

# The distributions that install the ``tensorflow`` package, in the order they are looked for.
TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-macos",
    "tf-nightly",
)


def supported(name: str) -> Supported:
    """The supported range of ``name`` (``"python"``, ``"keras"``, ``"tensorflow"``, ``"jax"``).

    Raises:
        ValueError: kmp keeps no range for ``name``.
    """
    for rule in SUPPORTED:
        if rule.name == name:
            return rule
    raise ValueError(
        f"kmp keeps no supported range for {name!r}: one of {[r.name for r in SUPPORTED]}."
    )


class UntestedVersionWarning(UserWarning):
    """An installed Python, Keras, TensorFlow or JAX lies outside kmp's tested ranges."""


def parse(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.21.0rc1"`` -> ``(2, 21, 0)``.

    Raises:
        ValueError: ``version`` does not start with a number.
    """
    numbers = re.match(r"\d+(?:\.\d+)*", version.strip())
    if numbers is None:
        raise ValueError(f"{version!r} is not a version number (expected e.g. '3.10.0').")
    parts = [int(p) for p in numbers.group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:  # 3.10.0 == 3.10
        parts.pop()
    return tuple(parts)


def untested(versions: dict[str, str | None]) -> list[tuple[str, str]]:
    """The installed versions outside :data:`SUPPORTED`, each with its fix (pure).

    Args:
        versions: Project name -> installed version, None where not installed (not
            installed is not a problem here: whoever needs it says so).

    Returns:
        One ``(problem, fix)`` per version outside its range: what is installed against
        the tested range, and what installs a tested version; empty when all are in range.
    """
    found = []
    for rule in SUPPORTED:
        version = versions.get(rule.name)
        if version is None or rule.holds(version):
            continue
        if rule.name == "python":
            fix = f"use a Python {rule.specifier} (launch/setup.sh: KMP_PYTHON=python3.X)"
        else:
            fix = f"pip install '{rule.requirement}'"
        found.append((f"{rule.name} {version} is outside kmp's tested range {rule.specifier}", fix))
    return found


def installed_distribution(*names: str) -> tuple[str, str] | None:
    """``(name, version)`` of the first of ``names`` installed, read from metadata (no import)."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_tensorflow() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed TensorFlow, read from metadata (no import)."""
    return installed_distribution(*TENSORFLOW_DISTRIBUTIONS)


def installed() -> dict[str, str | None]:
    """The versions of Python, Keras, TensorFlow and JAX in this environment (no imports)."""

    def version(found: tuple[str, str] | None) -> str | None:
        return None if found is None else found[1]

    return {
        "python": platform.python_version(),
        "keras": version(installed_distribution("keras", "keras-nightly")),
        "tensorflow": version(installed_tensorflow()),
        "jax": version(installed_distribution("jax")),
    }


def warn_if_untested() -> list[tuple[str, str]]:
    """Warn once per problem (:class:`UntestedVersionWarning`); return them (:func:`untested`).

    ``import kmp`` calls it. Silence it as any warning:
    ``warnings.filterwarnings("ignore", category=kmp.versions.UntestedVersionWarning)``.
    """
    import warnings

    problems = untested(installed())
    for problem, fix in problems:
        warnings.warn(
            f"{problem}: {fix}. kmp may still work; docs/install.md lists what was tested.",
            UntestedVersionWarning,
            stacklevel=2,
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Print the supported ranges; with ``["--python"]``, 1 and why when this Python is outside.

    launch/setup.sh calls ``sys.exit(kmp.versions.main(["--python"]))`` with each candidate
    interpreter.
    """
    args = sys.argv[1:] if argv is None else argv
    if args == ["--python"]:
        found = untested({"python": platform.python_version()})
        for problem, fix in found:
            print(f"{problem}: {fix}")
        return 1 if found else 0
    if args:
        print("usage: main([]) or main(['--python'])", file=sys.stderr)
        return 2
    for rule in SUPPORTED:
        print(rule.requirement)
    return 0
