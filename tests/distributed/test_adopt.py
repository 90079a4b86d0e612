"""kmp adopts the engine a script started: ``hvd.init()`` or ``jax.distributed.initialize()``.

Unit tests with stand-ins for Horovod and JAX's runtime (the pattern of test_world.py), and one
real 2-process JAX job whose script joins the process group itself. The real 2-rank Horovod job
that calls ``hvd.init()`` first is examples/horovod_tf1_session.py, run by tests/test_examples.py.
"""

from __future__ import annotations

import sys
import types

import pytest

import kmp.distributed as dist
from kmp.distributed import _horovod, _jax, engines
from tests._support import patch_tf_gpus, run_workers

world_mod = sys.modules["kmp.distributed.world"]

# Rank 1 of 2, one per host, as horovodrun announces it.
HOROVOD_ENV = {"HOROVOD_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "0"}
NOT_STARTED = r"kmp\.distributed\.init\(\) has not run"


class _ScriptHorovod(types.ModuleType):
    """``horovod.tensorflow`` as a script leaves it: imported, and ``init()`` called or not."""

    def __init__(self, initialised: bool):
        super().__init__("horovod.tensorflow")
        self.initialised = initialised
        self.init_calls = 0

    def init(self):
        self.init_calls += 1
        self.initialised = True

    def is_initialized(self):
        return self.initialised

    def rank(self):
        return 1

    def size(self):
        return 2

    def local_rank(self):
        return 0

    def local_size(self):
        return 1

    def cross_rank(self):
        return 1

    def cross_size(self):
        return 2


def _no_start(*args, **kwargs):
    pytest.fail("kmp started an engine the script had started")


@pytest.fixture
def launched(no_launcher, monkeypatch):
    """A process horovodrun started, kmp.distributed untouched; starting an engine fails."""
    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())  # a throw-away state
    for var, value in HOROVOD_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(_horovod, "start", _no_start)
    monkeypatch.setattr(_jax, "start", _no_start)


@pytest.fixture
def script_horovod(monkeypatch):
    """Put a script's ``horovod.tensorflow`` in sys.modules (``initialised``: it called init)."""

    def install(initialised: bool = True) -> _ScriptHorovod:
        hvd = _ScriptHorovod(initialised)
        monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
        monkeypatch.setitem(sys.modules, "horovod.tensorflow", hvd)
        return hvd

    return install


# ------------------------------------------------------------ hvd.init() before kmp


def test_the_getters_adopt_the_horovod_the_script_started(launched, script_horovod):
    hvd = script_horovod()
    running = dist.engine()  # raised "init() has not run" before issue 41
    assert isinstance(running, _horovod.HorovodEngine) and running.hvd is hvd
    assert hvd.init_calls == 0  # registered, not started again
    assert dist.is_initialized() and dist.uses_horovod()
    assert dist.world() == dist.World(
        1, 2, 0, 1, True, cross_rank=1, cross_size=2, engine="horovod"
    )
    assert (dist.rank(), dist.size(), dist.is_chief()) == (1, 2, False)
    assert dist.engine() is running  # held once, like init()'s


@pytest.mark.parametrize("first", [dist.rank, dist.world, dist.is_initialized, dist.uses_horovod])
def test_any_accessor_adopts_first(launched, script_horovod, first):
    hvd = script_horovod()
    first()
    assert world_mod._STATE.engine.hvd is hvd and dist.world().horovod


def test_init_adopts_instead_of_initialising_again(launched, script_horovod, monkeypatch):
    hvd = script_horovod()
    fake = patch_tf_gpus(monkeypatch, 2)
    world = dist.init()
    assert hvd.init_calls == 0
    assert (world.rank, world.size, world.engine) == (1, 2, "horovod")
    assert dist.engine().hvd is hvd
    # init() still does its own part: the local rank's GPU.
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:0"], "GPU")


def test_a_collective_runs_on_the_adopted_horovod(launched, script_horovod, monkeypatch):
    script_horovod()
    calls = []
    monkeypatch.setattr(
        _horovod.HorovodEngine, "broadcast_object", lambda self, obj, root: calls.append(obj) or obj
    )
    assert dist.broadcast_object({"a": 1}) == {"a": 1} and calls == [{"a": 1}]


def test_horovod_imported_but_not_initialised_is_not_adopted(launched, script_horovod):
    hvd = script_horovod(initialised=False)
    with pytest.raises(RuntimeError, match=NOT_STARTED):
        dist.engine()
    assert not dist.is_initialized() and hvd.init_calls == 0
    assert dist.world().engine == "none"  # the launcher's world, nothing started


def test_horovod_without_is_initialized_is_not_adopted(launched, monkeypatch):
    # A stand-in (or a Horovod too old to say) is never guessed to be running.
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", types.ModuleType("horovod.tensorflow"))
    with pytest.raises(RuntimeError, match=NOT_STARTED):
        dist.engine()


def test_the_getters_never_import_horovod(launched, monkeypatch):
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)
    assert _horovod.adopt() is None
    with pytest.raises(RuntimeError, match=NOT_STARTED):
        dist.engine()
    assert "horovod.tensorflow" not in sys.modules


def test_horovod_is_adopted_on_the_tensorflow_backend_only(launched, script_horovod, monkeypatch):
    import keras

    script_horovod()
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match=NOT_STARTED):
        dist.engine()  # the Horovod engine runs on TensorFlow: not taken on JAX
    assert not dist.is_initialized()


# -------------------------------------------------- jax.distributed.initialize() before kmp


@pytest.fixture
def script_jax(no_launcher, monkeypatch):
    """JAX's runtime as a script leaves it after jax.distributed.initialize(): process 1 of 2."""
    import jax
    import keras

    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_jax, "start", _no_start)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    adopted = []
    monkeypatch.setattr(_jax, "adopt", lambda own_step=True: adopted.append(own_step))
    return adopted


def test_the_getters_read_a_joined_jax_runtime_but_set_nothing(script_jax):
    import keras

    assert dist.world() == dist.World(1, 2, 0, 1, False, cross_rank=1, cross_size=2)
    assert (dist.rank(), dist.size(), dist.world().engine) == (1, 2, "none")
    with pytest.raises(
        RuntimeError,
        match=r"joined JAX's process group itself.*2 processes.*"
        r"Call kmp\.distributed\.init\(\).*adopts the running JAX runtime",
    ):
        dist.engine()
    with pytest.raises(RuntimeError, match="joined JAX's process group itself"):
        dist.allreduce(1.0)
    assert script_jax == [] and not dist.is_initialized()
    assert keras.distribution.distribution() is None  # no side effect


def test_init_adopts_a_joined_jax_runtime(script_jax):
    world = dist.init(engine="jax")  # no launcher variables: the script joined by itself
    assert script_jax == [True]  # the rest of start(): seed, distribution, initial values
    assert isinstance(dist.engine(), _jax.JaxEngine)
    assert (world.rank, world.size, world.engine, world.horovod) == (1, 2, "jax", False)
    assert dist.init() is world


def test_a_jax_runtime_of_one_process_needs_no_engine(script_jax, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert dist.engine() is engines.SINGLE_PROCESS and dist.size() == 1


def test_script_joined_never_imports_jax(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    assert _jax.script_joined() is False


# ------------------------------------------------------------------ a real JAX job


def test_two_processes_that_joined_jax_themselves_are_adopted_by_init():
    results = run_workers("worker_jax_adopt.py", np=2, engine="jax", timeout=240)
    for rank, r in enumerate(results):
        assert r["before"] == {"world": [rank, 2], "initialized": False, "distribution": False}
        assert "joined JAX's process group itself" in r["refused"]
        assert r["distribution_after_refusal"] is False
        assert r["initialize_calls"] == 0  # kmp did not join a second time
        assert r["world"] == [rank, 2, "jax"] and r["distribution"] == "FromProcess0DataParallel"
    # Seeded 1000 + rank after init(), both built process 0's kernel (the initial-values hook).
    assert results[0]["kernel"] == results[1]["kernel"]
    assert results[0]["own_kernel"] != results[1]["own_kernel"]
    for r in results:
        assert "clear_session()" in r["after_clear_session"]
        assert r["distribution_after_init"] == "FromProcess0DataParallel"
