import sys

import pytest

from kmp._imports import INSTALL_HINTS, is_available, optional_import


def test_present_module_is_returned():
    assert optional_import("json").dumps([]) == "[]"


@pytest.mark.parametrize("name", ["horovod.tensorflow", "tensorflow_datasets", "sklearn"])
def test_missing_module_error_names_the_install_command(monkeypatch, name):
    # A None entry in sys.modules makes the import fail, as for a missing package.
    monkeypatch.setitem(sys.modules, name.split(".")[0], None)
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as info:
        optional_import(name, feature="testing")
    message = str(info.value)
    assert "for testing" in message
    assert INSTALL_HINTS[name.split(".")[0]] in message


def test_unknown_package_suggests_pip():
    with pytest.raises(ImportError, match="pip install kmp_no_such_pkg"):
        optional_import("kmp_no_such_pkg.sub")


def test_is_available():
    assert is_available("json")
    assert not is_available("kmp_no_such_pkg")
