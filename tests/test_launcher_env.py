"""kmp._launcher_env: the world size and local rank a launcher announced in the environment."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import kmp._launcher_env as env

# ------------------------------------------------------------------ world size


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"HOROVOD_SIZE": "4"}, 4),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, 2),
        ({"PMI_SIZE": "3"}, 3),
        ({"MV2_COMM_WORLD_SIZE": "8"}, 8),
        ({"HOROVOD_SIZE": "1"}, 1),
        ({"HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "5"}, 2),  # horovodrun's wins
        ({"HOROVOD_SIZE": "", "PMI_SIZE": "3"}, 3),  # empty means unset
        ({"HOROVOD_RANK": "1"}, None),  # a rank alone does not make a world
    ],
)
def test_launched_world_size(environ, expected):
    assert env.launched_world_size(environ) == expected


@pytest.mark.parametrize("value", ["two", "0", "-1", "2.0"])
def test_garbage_world_size_is_a_value_error(value):
    with pytest.raises(ValueError, match=rf"HOROVOD_SIZE={value!r} is not a world size") as info:
        env.launched_world_size({"HOROVOD_SIZE": value})
    message = str(info.value)
    assert "a positive integer" in message and "unset it" in message and "horovodrun" in message


def test_only_the_first_size_variable_set_is_read():
    with pytest.raises(ValueError, match="PMI_SIZE"):
        env.launched_world_size({"PMI_SIZE": "x", "MV2_COMM_WORLD_SIZE": "2"})


# ------------------------------------------------------------------ local rank


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"HOROVOD_LOCAL_RANK": "1"}, 1),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
        ({"HOROVOD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, 0),
        ({"MPI_LOCALRANKID": "4"}, 4),
        ({"SLURM_LOCALID": "2"}, 2),
        ({"MV2_COMM_WORLD_LOCAL_RANK": "1"}, 1),
        ({"HOROVOD_LOCAL_RANK": ""}, None),
    ],
)
def test_launcher_local_rank(environ, expected):
    assert env.launcher_local_rank(environ) == expected


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_garbage_local_rank_is_a_value_error(value):
    with pytest.raises(ValueError, match=rf"HOROVOD_LOCAL_RANK={value!r} is not a local rank") as i:
        env.launcher_local_rank({"HOROVOD_LOCAL_RANK": value})
    message = str(i.value)
    assert "a non-negative integer" in message and "unset it" in message and "visible=" in message


# ------------------------------------------------------------------ both


@pytest.mark.parametrize(
    ("read", "var"),
    [(env.launched_world_size, "OMPI_COMM_WORLD_SIZE"), (env.launcher_local_rank, "SLURM_LOCALID")],
)
def test_both_read_os_environ_by_default(monkeypatch, read, var):
    for name in (*env.LAUNCH_SIZE_VARS, *env.LOCAL_RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    assert read() is None
    monkeypatch.setenv(var, "3")
    assert read() == 3
    monkeypatch.setenv(var, "garbage")
    with pytest.raises(ValueError, match=var):  # the same error type for both kinds
        read()


def test_any_mapping_is_accepted():
    frozen = types.MappingProxyType({"HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"})
    assert env.launched_world_size(frozen) == 2
    assert env.launcher_local_rank(frozen) == 1


def test_variable_lists():
    assert env.LAUNCH_SIZE_VARS[0] == "HOROVOD_SIZE"
    assert env.LOCAL_RANK_VARS[0] == "HOROVOD_LOCAL_RANK"
    assert not set(env.LAUNCH_SIZE_VARS) & set(env.LOCAL_RANK_VARS)


def test_imports_nothing_from_kmp_but_checks_and_names():
    tree = ast.parse(Path(env.__file__).read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    allowed = {"kmp._checks", "kmp._names"}
    assert [m for m in modules if m.startswith("kmp") and m not in allowed] == []
