"""kmp._keras_internals: the one home of Keras's private internals, each route per version.

The version matrix (launch/matrix.sh) runs this module on the oldest and the newest Keras
kmp supports, so every route here is taken on a real Keras of its own."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import keras
import numpy as np
import pytest

from kmp import _keras_internals as internals

ROOT = Path(__file__).resolve().parents[1]


def _private_keras_uses(path: Path) -> list[str]:
    """Where a module imports ``keras.src`` (import statements and importable strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module's dotted name (a prefix such as "keras.src." to classify layers is not)
            names = [node.value] if re.fullmatch(r"keras\.src(\.\w+)+", node.value) else []
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
            for n in names
            if n.startswith("keras.src")
        ]
    return found


def test_no_module_but_the_internals_one_reaches_into_keras_src():
    uses = [
        use
        for path in sorted((ROOT / "kmp").rglob("*.py"))
        if path.name != "_keras_internals.py"
        for use in _private_keras_uses(path)
    ]
    assert uses == [], "import keras.src only in kmp/_keras_internals.py:\n" + "\n".join(uses)
    assert _private_keras_uses(ROOT / "kmp" / "_keras_internals.py")  # the check sees imports


@pytest.mark.parametrize("public_view", [True, False], ids=["ops.view", "backend-bitcast"])
def test_bitcast_reads_the_same_bits_with_and_without_keras_ops_view(monkeypatch, public_view):
    if not public_view:  # Keras 3.10's route, on any Keras
        monkeypatch.delattr(keras.ops, "view", raising=False)
    elif not hasattr(keras.ops, "view"):
        pytest.skip(f"keras.ops.view came with Keras 3.11 (this is {keras.__version__})")
    values = np.array([1.0, -2.5, 3.0e-3, 65504.0], dtype="float32")
    bits = keras.ops.convert_to_numpy(
        internals.bitcast(keras.ops.convert_to_tensor(values), "int32")
    )
    np.testing.assert_array_equal(bits, values.view("int32"))
    back = keras.ops.convert_to_numpy(
        internals.bitcast(keras.ops.convert_to_tensor(bits), "float32")
    )
    np.testing.assert_array_equal(back, values)


def test_the_global_seed_generator_is_read_without_being_made():
    made = internals.new_global_seed_generator()
    assert isinstance(made, keras.random.SeedGenerator)
    assert internals.global_seed_generator() is made
    assert internals.new_global_seed_generator() is made  # made once


def test_the_jax_engines_hook_points_exist_in_this_keras():
    pytest.importorskip("jax")
    module, cls, method = internals.JAX_TRAIN_STEP
    assert callable(getattr(getattr(importlib.import_module(module), cls), method))
    module, classes, method, params = internals.JAX_VARIABLE_INITIALIZE
    core = importlib.import_module(module)
    found = [c for c in classes if hasattr(core, c) and hasattr(getattr(core, c), method)]
    assert found, (keras.__version__, classes)
    code = getattr(getattr(core, found[0]), method).__code__
    assert code.co_varnames[: code.co_argcount] == params


def test_compute_output_spec_and_untracked_attributes():
    spec = internals.compute_output_spec(
        lambda x: keras.ops.concatenate([x, x], axis=-1), keras.KerasTensor((None, 3))
    )
    assert tuple(spec.shape) == (None, 6)

    class Holder(keras.layers.Layer):
        @internals.untracked
        def remember(self, layers):
            self.kept = layers

    holder = Holder()
    holder.remember([keras.layers.Dense(2)])
    assert isinstance(holder.kept, list) and not holder._layers  # not tracked as sublayers


def test_the_stateless_scope_in_force_is_read():
    variable, other = keras.Variable(1.0), keras.Variable(2.0)
    assert internals.stateless_value(variable) is None  # no scope
    with keras.StatelessScope(state_mapping=[(variable, keras.ops.convert_to_tensor(3.0))]):
        assert float(internals.stateless_value(variable)) == 3.0
        assert internals.stateless_value(other) is None  # not in the mapping


def test_a_jax_tracer_is_told_apart():
    assert not internals.is_tracer(keras.ops.ones(2)) and not internals.is_tracer(1.0)
    if keras.backend.backend() == "jax":
        import jax

        seen = []
        jax.jit(lambda x: seen.append(internals.is_tracer(x)) or x)(keras.ops.ones(2))
        assert seen == [True]
