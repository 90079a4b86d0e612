"""kmp.distributed's world: init() and its engine, the accessors before and after it, GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kmp
import kmp.distributed as dist
from kmp import _launcher_env as _env
from kmp.distributed import _horovod, _jax, collectives, engines
from kmp.distributed.world import _configure_local_gpu
from tests._support import ROOT, patch_tf_gpus

# kmp.distributed.world is the function world(); the module is reached through sys.modules.
world_mod = sys.modules["kmp.distributed.world"]


@pytest.fixture
def no_horovod(monkeypatch):
    """Make `import horovod...` fail as if Horovod were not installed."""
    for name in ("horovod", "horovod.tensorflow"):
        monkeypatch.setitem(sys.modules, name, None)


def test_init_without_launcher_is_single_process_and_idempotent(fresh):
    assert not dist.is_initialized()
    hvd_before = sys.modules.get("horovod.tensorflow")
    world = dist.init()
    assert world == dist.World(rank=0, size=1, local_rank=0, local_size=1, horovod=False)
    assert dist.init() is world
    assert dist.is_initialized()
    assert (dist.rank(), dist.size(), dist.local_rank(), dist.local_size()) == (0, 1, 0, 1)
    assert dist.is_chief() and not dist.uses_horovod()
    # init() outside a launcher does not import Horovod (earlier tests in this
    # process may have imported it already).
    assert sys.modules.get("horovod.tensorflow") is hvd_before


def test_accessors_do_not_initialise(fresh):
    # Changed by issue 28: the accessors used to call init() on first use; init() alone starts.
    assert dist.size() == 1 and dist.rank() == 0 and dist.is_chief()
    assert dist.world() == dist.World(0, 1, 0, 1, False)
    assert not dist.is_initialized()
    assert dist.engine() is engines.SINGLE_PROCESS  # a world of one needs none
    assert not dist.is_initialized()


def test_public_names_resolve_from_the_package():
    assert len(dist.__all__) == len(set(dist.__all__))
    for name in dist.__all__:
        assert getattr(dist, name) is not None, name
    # The submodule world.py does not hide the function world().
    assert callable(dist.world) and dist.world.__name__ == "world"
    assert kmp.distributed is dist


def test_garbage_launcher_size_is_a_value_error(fresh, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "two")
    with pytest.raises(ValueError, match=r"HOROVOD_SIZE='two'.*unset it"):
        dist.init()
    assert not dist.is_initialized()


def test_world_above_one_without_horovod_says_how_to_install(fresh, no_horovod, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(ImportError, match=r"launched as 2 processes.*Install Horovod.*setup\.sh"):
        dist.init()
    assert not dist.is_initialized()


def test_world_of_one_without_horovod_is_a_no_op(fresh, no_horovod, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert dist.init().size == 1


# --------------------------------------------------------------- GPU pinning by init()


def test_init_pins_one_gpu_per_local_rank(monkeypatch, recwarn):
    fake = patch_tf_gpus(monkeypatch, 2)
    _configure_local_gpu(1)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_init_shares_a_gpu_with_a_warning_when_ranks_outnumber_gpus(monkeypatch):
    # -np 3 on a 2-GPU host: local rank 2 shares GPU 0 instead of failing init(); the rule is
    # kmp.gpu's (see test_gpu.py), the same one configure_gpus() applies.
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning, match=r"shares GPU 0 .*horovodrun -H host:2.*visible="):
        _configure_local_gpu(2)
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:0"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:0", True),
    ]


def test_init_leaves_a_cpu_only_host_alone(monkeypatch):
    fake = patch_tf_gpus(monkeypatch, 0)
    _configure_local_gpu(1)
    assert fake.calls == []


def test_init_gpu_pinning_ignores_the_launcher_variables(monkeypatch):
    # The engine's local rank is what counts; the launcher's is not read a second time.
    import kmp.gpu

    fake = patch_tf_gpus(monkeypatch, 2)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "garbage")
    monkeypatch.setattr(kmp.gpu, "_current_local_rank", pytest.fail)
    _configure_local_gpu(1)
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:1"], "GPU")


def test_init_warns_when_tensorflow_already_set_up_its_gpus(monkeypatch):
    import tensorflow as tf

    patch_tf_gpus(monkeypatch, 2)

    def too_late(devices, kind):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", too_late)
    with pytest.warns(
        RuntimeWarning, match=r"could not pin a GPU to local rank 1.*before building"
    ):
        _configure_local_gpu(1)


class _FakeHorovod:
    """Just enough of horovod.tensorflow for init(): a rank layout, no collectives."""

    def __init__(self, rank, size, local_rank, local_size):
        self.layout = (rank, size, local_rank, local_size)
        self.initialised = False

    def init(self):
        self.initialised = True

    def rank(self):
        return self.layout[0]

    def size(self):
        return self.layout[1]

    def local_rank(self):
        return self.layout[2]

    def local_size(self):
        return self.layout[3]

    def cross_rank(self):
        return self.layout[0] // self.layout[3]

    def cross_size(self):
        return self.layout[1] // self.layout[3]


@pytest.fixture
def fake_horovod(monkeypatch, no_launcher):
    """init() under a launcher, with a stand-in Horovod and a throw-away state."""
    import types

    import kmp.gpu

    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())
    monkeypatch.setattr(kmp.gpu, "_current_local_rank", pytest.fail)

    def install(rank, size, local_rank, local_size):
        hvd = _FakeHorovod(rank, size, local_rank, local_size)
        monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
        monkeypatch.setitem(sys.modules, "horovod.tensorflow", hvd)
        monkeypatch.setenv("HOROVOD_SIZE", str(size))
        monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")  # must not be what picks the GPU
        return hvd

    return install


def test_init_under_a_launcher_passes_horovods_local_rank_to_configure_gpus(
    monkeypatch, fake_horovod, recwarn
):
    hvd = fake_horovod(rank=3, size=4, local_rank=1, local_size=2)
    fake = patch_tf_gpus(monkeypatch, 2)
    w = dist.init()
    assert hvd.initialised
    assert w == dist.World(
        rank=3,
        size=4,
        local_rank=1,
        local_size=2,
        horovod=True,
        cross_rank=1,
        cross_size=2,
        engine="horovod",
    )
    assert dist.uses_horovod() and not dist.is_chief() and dist.size() == 4
    running = dist.engine()  # the one engine: the World says its name
    assert isinstance(running, _horovod.HorovodEngine) and running.hvd is hvd
    assert running.name == w.engine == "horovod" and running.optimizer_averages
    assert fake.calls == [
        ("set_visible_devices", ["/physical_device:GPU:1"], "GPU"),
        ("set_memory_growth", "/physical_device:GPU:1", True),
    ]
    assert not [x for x in recwarn if issubclass(x.category, RuntimeWarning)]


def test_init_with_more_local_ranks_than_gpus_shares_with_a_warning(monkeypatch, fake_horovod):
    fake_horovod(rank=2, size=3, local_rank=2, local_size=3)
    fake = patch_tf_gpus(monkeypatch, 2)
    with pytest.warns(RuntimeWarning, match=r"Local rank 2 has no GPU of its own.*shares GPU 0"):
        dist.init()
    assert fake.calls[0] == ("set_visible_devices", ["/physical_device:GPU:0"], "GPU")


# ------------------------------------------------- before init(): nothing starts (issue 28)

# Rank 3 of 4, the second of two on its host, as horovodrun announces it.
HOROVOD_ENV = {
    "HOROVOD_SIZE": "4",
    "HOROVOD_RANK": "3",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
}
NOT_STARTED = r"kmp\.distributed\.init\(\) has not run.*Call kmp\.distributed\.init\(\) once"


def _no_start(*args, **kwargs):
    pytest.fail("an engine was started")


@pytest.fixture
def launched(fresh, monkeypatch):
    """A process horovodrun started (:data:`HOROVOD_ENV`); starting an engine fails the test."""
    for var, value in HOROVOD_ENV.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(_horovod, "start", _no_start)
    monkeypatch.setattr(_jax, "start", _no_start)


def test_accessors_before_init_answer_from_the_launchers_environment(launched):
    assert (dist.rank(), dist.size(), dist.local_rank(), dist.local_size()) == (3, 4, 1, 2)
    assert not dist.is_chief() and not dist.uses_horovod()
    assert dist.world() == dist.World(3, 4, 1, 2, False, cross_rank=1, cross_size=2)
    assert dist.world().engine == "none"
    assert not dist.is_initialized()


def test_accessors_before_init_read_kmps_local_launcher(fresh, monkeypatch):
    for var, value in {"KMP_SIZE": "3", "KMP_RANK": "0", "KMP_ENGINE": "jax"}.items():
        monkeypatch.setenv(var, value)
    assert (dist.rank(), dist.size(), dist.is_chief()) == (0, 3, True)
    assert not dist.is_initialized()


def test_a_launched_rank_that_is_not_announced_is_not_guessed(fresh, monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"rank is unknown.*" + NOT_STARTED):
        dist.rank()


@pytest.mark.parametrize(
    "call",
    [
        dist.barrier,
        lambda: dist.allreduce(1.0),
        lambda: dist.grouped_allreduce([1.0, None]),
        lambda: dist.allgather(1.0),
        lambda: dist.broadcast_object(1),
        lambda: dist.broadcast_variables([]),
        dist.alone,
        collectives.gradients_need_allreduce,
        lambda: collectives.check_averaging_runtime(4),
        dist.restart,
        dist.engine,
    ],
)
def test_a_collective_before_init_in_a_launched_job_says_to_call_init(launched, call):
    with pytest.raises(RuntimeError, match=r"launcher started 4 process\(es\), but " + NOT_STARTED):
        call()
    assert not dist.is_initialized()


def test_wrap_optimizer_before_init_in_a_launched_job_says_to_call_init(launched):
    import keras

    with pytest.raises(RuntimeError, match=NOT_STARTED):
        kmp.wrap_optimizer(keras.optimizers.SGD())
    assert not dist.is_initialized()


def test_an_elastic_job_needs_init_even_as_one_process(fresh, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    assert dist.size() == 1
    with pytest.raises(RuntimeError, match=r"\(an elastic job\), but " + NOT_STARTED):
        dist.broadcast_object(1)


def test_nothing_imports_horovod_before_init_in_a_launched_process(no_launcher):
    # A fresh interpreter under horovodrun's variables: the getters, a collective and
    # kmp.wrap_optimizer neither start Horovod nor import it.
    code = (
        "import json, sys\n"
        "import keras, kmp\n"
        "d = kmp.distributed\n"
        "out = {'layout': [d.rank(), d.size(), d.local_rank(), d.local_size(), d.is_chief()]}\n"
        "out['refused'] = []\n"
        "for call in (lambda: d.allreduce(1.0), "
        "lambda: kmp.wrap_optimizer(keras.optimizers.SGD())):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as exc:\n"
        "        out['refused'].append(str(exc))\n"
        "out['initialized'] = d.is_initialized()\n"
        "out['horovod'] = sorted(m for m in sys.modules if m.split('.')[0] == 'horovod')\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, **HOROVOD_ENV}  # no_launcher: only these launcher variables are set
    env.update(PYTHONPATH=str(ROOT), KERAS_BACKEND="tensorflow")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layout"] == [3, 4, 1, 2, False]
    assert len(out["refused"]) == 2 and all("init() has not run" in m for m in out["refused"])
    assert out["initialized"] is False and out["horovod"] == []


# ------------------------------------------------------------- which engine init() starts


def test_init_starts_the_engine_of_the_launch(no_launcher, monkeypatch):
    calls = []
    sentinel = object()

    def hvd_start(n, *, elastic=False):
        calls.append(("horovod", n, elastic))
        return sentinel if n > 1 or elastic else None  # None: one process, no Horovod

    def jax_start(coordinator, n, process_id, *, timeouts, local_device=None, own_step=True):
        calls.append(("jax", coordinator, n, process_id, timeouts, local_device, own_step))

    monkeypatch.setattr(_horovod, "start", hvd_start)
    monkeypatch.setattr(_jax, "start", jax_start)
    start = world_mod._start
    assert start("horovod") is engines.SINGLE_PROCESS and start("jax") is engines.SINGLE_PROCESS
    assert calls == []  # no launcher: nothing to start
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    assert start("horovod") is engines.SINGLE_PROCESS  # one process and no Horovod
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    assert start("horovod") is sentinel
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.delenv("HOROVOD_SIZE")
    assert start("horovod") is sentinel
    assert calls == [("horovod", 1, False), ("horovod", 2, False), ("horovod", 1, True)]
    calls.clear()
    monkeypatch.delenv("HOROVOD_ELASTIC")
    jax_env = {
        "KMP_SIZE": "2",
        "KMP_RANK": "1",
        "KMP_LOCAL_RANK": "1",
        "KMP_LOCAL_SIZE": "2",
        "KMP_COORDINATOR": "h1:29500",
    }
    for var, value in jax_env.items():
        monkeypatch.setenv(var, value)
    assert isinstance(start("jax"), _jax.JaxEngine)
    # Two on the host: one GPU each; the launcher's defaults for join, heartbeat and shutdown.
    assert calls == [("jax", "h1:29500", 2, 1, _env.JaxTimeouts(), 1, True)]
    monkeypatch.setenv("KMP_JAX_HEARTBEAT_TIMEOUT", "45")
    start("jax")
    assert calls[-1][4] == _env.JaxTimeouts(heartbeat=45)
    monkeypatch.setenv("KMP_JAX_STEP", "keras")  # Keras's own train step, for comparison
    start("jax")
    assert calls[-1][-1] is False
    monkeypatch.delenv("KMP_JAX_STEP")
    with pytest.raises(ValueError, match="kmp's local launcher"):
        start("horovod")


def test_every_engine_has_the_whole_interface():
    with pytest.raises(TypeError):
        engines.Engine()  # abstract
    single = engines.SINGLE_PROCESS
    assert (single.name, single.optimizer_averages, single.layout()) == (
        "none",
        False,
        (0, 1, 0, 1, 0, 1),
    )
    assert not _jax.JaxEngine(None, None, None).optimizer_averages
    assert _horovod.HorovodEngine(object()).optimizer_averages
    x = [1.0, 2.0]
    assert single.grouped_allreduce(x, "sum", engines.Transport("fp16", 4, "gather")) == x
    assert single.broadcast_object(x, 0) is x and single.broadcast_variables(x, 0) is None
    with pytest.raises(RuntimeError, match=r"needs a running Horovod job.*this process runs alone"):
        single.restart()
    with pytest.raises(RuntimeError, match="runs on the jax engine"):
        _jax.JaxEngine(None, None, None).restart()
    assert engines.layout(5, 8, None, None, None) == (5, 8, 0, 1, 5, 8)
    assert engines.layout(5, 8, 1, 4, None) == (5, 8, 1, 4, 1, 2)
    assert engines.layout(5, 8, 1, 4, (0, 3)) == (5, 8, 1, 4, 0, 3)
