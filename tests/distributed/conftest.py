"""Fixtures of the distributed tests: a process no launcher started, kmp.distributed not started."""

from __future__ import annotations

import pytest

from kmp import _launcher_env as launcher_env
from kmp.distributed.world import _reset_for_tests

# Every variable through which a launcher describes the job to kmp.
LAUNCH_VARS = (
    *launcher_env.LAUNCH_SIZE_VARS,
    *launcher_env.LAUNCH_RANK_VARS,
    *launcher_env.LOCAL_RANK_VARS,
    *launcher_env.LOCAL_SIZE_VARS,
    *launcher_env.LOCAL_RUN_VARS,
    *launcher_env.CROSS_RANK_VARS,
    *launcher_env.CROSS_SIZE_VARS,
    launcher_env.ENGINE_VAR,
    launcher_env.COORDINATOR_VAR,
    "HOROVOD_ELASTIC",
)


@pytest.fixture
def no_launcher(monkeypatch):
    """A process that no launcher started: none of the launcher's variables is set."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fresh(no_launcher):
    """A process that was not started by a launcher, with kmp.distributed not yet initialised."""
    _reset_for_tests()
    yield
    _reset_for_tests()
