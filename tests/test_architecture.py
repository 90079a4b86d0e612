"""The shape of kmp/: imports flow one way, no cycles, small modules, private names kept home.

The layers are those of docs/architecture.md; a module may import its own layer
and the layers below it, never one above. Every ``import`` counts, also the lazy
ones inside functions, read from the source with ``ast``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

KMP = Path(__file__).resolve().parents[1] / "kmp"
ARCHITECTURE = KMP.parent / "docs" / "architecture.md"

# Lowest first. A module belongs to the first layer with a matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground",
        (
            "kmp._version",
            "kmp._names",
            "kmp._checks",
            "kmp._imports",
            "kmp._legacy_keras",
            "kmp._launcher_env",
            "kmp._files",
            "kmp._outputs",
            "kmp._keras_local",
            "kmp.hardware",
            "kmp.versions",
            "kmp._keras_internals",
            "kmp._model_mixins",
        ),
    ),
    (
        "core rules",
        (
            "kmp.policy",
            "kmp.loss_scale",
            "kmp.layers",
            "kmp.layer_walk",
            "kmp.float32_layers",
            "kmp.load_precision",
            "kmp.master_weights",
            "kmp.auditing",
            "kmp.probing",
        ),
    ),
    ("runtime", ("kmp.distributed", "kmp.gpu")),
    (
        "training",
        (
            "kmp.learning_rate",
            "kmp.compensated",
            "kmp.optimizer_settings",
            "kmp.accumulation",
            "kmp.scale_guard",
            "kmp.scaling_optimizer",
            "kmp.optimizer",
            "kmp.xla",
            "kmp.callbacks",
            "kmp.elastic",
            "kmp.sharding",
            "kmp.data",
            "kmp.datasets",
            "kmp.training_state",
            "kmp.rank_weights",
            "kmp.policy_load",
            "kmp.saving",
        ),
    ),
    ("serving", ("kmp.exporting", "kmp.quantizing")),
    ("compat", ("kmp.compat",)),
    ("tools", ("kmp.launching", "kmp.cluster", "kmp.install")),
    ("commands", ("kmp.cli", "kmp.commands")),
    ("face", ("kmp._dispatch", "kmp")),
]
MAX_LINES = 450
# Module names two packages may share: each holds the same kind of thing for its package
# (docs/architecture.md, "Module names"). Any other shared name misleads.
SHARED_NAMES = {
    "data": {"kmp.data", "kmp.elastic.data"},
    "optimizer": {"kmp.optimizer", "kmp.compat.v1.optimizer"},
    "report": {"kmp.auditing.report", "kmp.probing.report"},
    "state": {"kmp.cluster.state", "kmp.elastic.state"},
}
# kmp/commands/ holds thin command lines (parser, run, main); the machinery they drive
# lives in the tools layer. Lines after the module docstring.
MAX_COMMAND_LINES = 160


def module_name(path: Path) -> str:
    parts = list(path.relative_to(KMP.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(KMP.rglob("*.py"))}


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "kmp" and module.startswith(prefix + ".")):
                return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def resolve(module: str, name: str) -> str:
    """``from module import name``: the submodule if there is one, else the module."""
    candidate = f"{module}.{name}"
    return candidate if candidate in MODULES else module


def package_of(path: Path, here: str) -> str:
    """The package that relative imports in ``path`` (module ``here``) start from."""
    return here if path.name == "__init__.py" else here.rpartition(".")[0]


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from BASE import ...``, relative imports resolved."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def imports_of(path: Path, here: str | None = None) -> Iterator[tuple[str, int]]:
    """Yield ``(imported kmp module, line)`` for every import in ``path`` (module ``here``)."""
    here = here or module_name(path)
    package = package_of(path, here)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kmp" or alias.name.startswith("kmp."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            if base == "kmp" or base.startswith("kmp."):
                for alias in node.names:
                    yield resolve(base, alias.name), node.lineno
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("kmp")
        ):  # importlib.import_module("kmp.x"): an import by name
            yield str(node.args[0].value), node.lineno


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, _ in imports_of(path):
            if target != mod and target in MODULES:
                graph[mod].add(target)
    return graph


def test_every_module_is_in_a_layer():
    for mod in MODULES:
        layer_of(mod)


def test_imports_flow_downward_only():
    wrong = []
    for mod, path in MODULES.items():
        for target, line in imports_of(path):
            if target in MODULES and layer_of(target) > layer_of(mod):
                wrong.append(
                    f"{path.relative_to(KMP.parent)}:{line}: {mod} ({LAYERS[layer_of(mod)][0]}) "
                    f"imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not wrong, "imports that flow upward:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "core", ["kmp.policy", "kmp.loss_scale", "kmp.optimizer", "kmp.layers", "kmp.auditing"]
)
def test_core_never_imports_compat_commands_or_the_cli(core):
    for target, line in imports_of(MODULES[core]):
        assert not target.startswith(("kmp.compat", "kmp.commands", "kmp.cli")), (core, line)


def test_no_import_cycles():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: imports inside functions and relative ones are found."""
    src = tmp_path / "probe.py"
    src.write_text(
        "import os\n"
        "def f():\n"
        "    from kmp.compat import keras2\n"
        "    from kmp import _checks, gpu as g\n"
        "    from . import layers\n"
        "    import kmp.cli\n"
        "    importlib.import_module('kmp.commands.launch')\n"
    )
    found = {t for t, _ in imports_of(src, here="kmp.policy")}
    assert found == {
        "kmp.compat.keras2",
        "kmp._checks",
        "kmp.gpu",
        "kmp.layers",
        "kmp.cli",
        "kmp.commands.launch",
    }
    assert layer_of("kmp.compat.keras2") > layer_of("kmp.policy")


def private_names_used(path: Path, here: str | None = None) -> Iterator[tuple[str, int]]:
    """Yield ``(module._name, line)`` for each private name ``path`` takes from another module.

    ``from kmp.x import _y`` and ``x._y`` (``x`` a kmp module it imported) count; private
    modules (``kmp._names``) and dunders (``__version__``) do not.
    """
    here = here or module_name(path)
    package = package_of(path, here)
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}  # local name -> the kmp module it is
    for node in ast.walk(tree):
        base = from_base(node, package) if isinstance(node, ast.ImportFrom) else ""
        if base == "kmp" or base.startswith("kmp."):
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    modules[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield full, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kmp.") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            full = f"{modules[node.value.id]}.{node.attr}"
            if full not in MODULES and modules[node.value.id] != here:
                yield full, node.lineno


def test_no_private_name_crosses_modules():
    crossing = [
        f"{path.relative_to(KMP.parent)}:{line}: uses {name}"
        for mod, path in MODULES.items()
        for name, line in private_names_used(path, mod)
    ]
    assert not crossing, (
        "private names used outside their module (give them a public name, or move them to "
        "the module that uses them):\n" + "\n".join(crossing)
    )


def test_the_private_name_check_can_fail(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text(
        "from kmp import _checks, data as d\n"
        "from kmp.layers import _hidden, __doc__\n"
        "from .loss_scale import _rule\n"
        "def f():\n"
        "    return d._epoch_seed(1, 2), _checks._private\n"
    )
    assert {n for n, _ in private_names_used(src, here="kmp.policy")} == {
        "kmp.layers._hidden",
        "kmp.loss_scale._rule",
        "kmp.data._epoch_seed",
        "kmp._checks._private",
    }


def test_modules_are_small():
    long = []
    for path in MODULES.values():
        rel = str(path.relative_to(KMP.parent))
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, "modules over the size limit:\n" + "\n".join(long)


def test_commands_are_thin():
    thick = []
    for mod, path in MODULES.items():
        if not mod.startswith("kmp.commands"):
            continue
        tree = ast.parse(path.read_text())
        first = tree.body[0] if tree.body else None
        docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        n = len(path.read_text().splitlines()) - (first.end_lineno if docstring else 0)
        if n > MAX_COMMAND_LINES:
            thick.append(f"{path.relative_to(KMP.parent)}: {n} lines after its docstring")
    assert not thick, (
        "command modules over the limit (move the machinery to kmp/launching, kmp/cluster or "
        "kmp/install):\n" + "\n".join(thick)
    )


def test_module_names_do_not_collide():
    by_name: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, set()).add(mod)
    shared = {name: mods for name, mods in by_name.items() if len(mods) > 1}
    assert shared == SHARED_NAMES, (
        "modules of one name in several packages (rename one so each name says what it "
        "holds, or list a pair that holds the same kind of thing in SHARED_NAMES and "
        f"docs/architecture.md): {shared}"
    )


def test_architecture_doc_names_every_module():
    text = ARCHITECTURE.read_text()
    missing = [
        str(p.relative_to(KMP.parent))
        for m, p in MODULES.items()
        if m != "kmp" and str(p.relative_to(KMP.parent)) not in text
    ]
    assert not missing, "docs/architecture.md does not mention: " + ", ".join(missing)
