import inspect
import json
import subprocess
import sys

import kmp


def test_version():
    assert isinstance(kmp.__version__, str)
    assert kmp.__version__.count(".") == 2


def test_all_matches_public_names():
    assert len(kmp.__all__) == len(set(kmp.__all__)), "duplicates in __all__"
    for name in kmp.__all__:  # every listed name resolves
        assert getattr(kmp, name) is not None, name
    # Every public non-module name in the namespace is listed, and nothing else.
    public = {
        name
        for name, value in vars(kmp).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    listed = {name for name in kmp.__all__ if not inspect.ismodule(getattr(kmp, name))}
    assert public == listed - {"__version__"}
    # Listed submodules are real kmp modules.
    for name in set(kmp.__all__) - listed:
        assert getattr(kmp, name).__name__ == f"kmp.{name}"
    assert set(dir(kmp)) >= set(kmp.__all__)


def test_public_callables_have_docstrings_and_hints():
    for name in kmp.__all__:
        obj = getattr(kmp, name)
        if inspect.isfunction(obj):
            assert obj.__doc__, name
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        kmp.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_kmp_keeps_optional_packages_out():
    # (Keras itself imports scikit-learn and matplotlib when they are installed.)
    code = (
        "import sys, json, kmp; kmp.enable; kmp.audit; kmp.float32_outputs; "
        "print(json.dumps([m for m in ('horovod', 'tensorflow_datasets') if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
