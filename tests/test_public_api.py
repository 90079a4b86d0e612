"""kmp's public surface, pinned: each face's ``__all__`` is what users call, and no more.

Growing a face is a decision: add the name here, in the change that makes it public. A name
only kmp's own modules use stays out of ``__all__``, and a package does not re-export it: it
keeps its public name in the module that defines it (tests/test_architecture.py forbids a
``_private`` name across modules) and is imported from there.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

import kmp

# ``kmp.__all__``: what ``from kmp import *`` gives, every name a training script needs.
TOP = {
    "__version__",
    "enable",
    "disable",
    "current_policy",
    "policy_scope",
    "float32_outputs",
    "keep_float32",
    "audit",
    "probe",
    "wrap_optimizer",
    "OptimizerSettings",
    "LossScale",
    "save_model",
    "load_model",
    "export",
    "quantize",
    "configure_gpus",
}
# Namespaces reachable as ``kmp.<name>`` (not star-exported), each with its own face below.
NAMESPACES = {
    "callbacks",
    "compat",
    "data",
    "datasets",
    "distributed",
    "elastic",
    "hardware",
    "layers",
    "loss_scale",
    "versions",
    "xla",
}
FACES: dict[str, set[str]] = {
    "kmp.distributed": {
        "init",
        "restart",
        "rank",
        "size",
        "local_rank",
        "local_size",
        "is_chief",
        "is_initialized",
        "uses_horovod",
        "engine",
        "world",
        "World",
        "alone",
        "barrier",
        "broadcast_variables",
        "broadcast_object",
        "allreduce",
        "grouped_allreduce",
        "allgather",
    },
    "kmp.callbacks": {
        "AtomicCheckpoint",
        "BroadcastInitialState",
        "ChiefOnly",
        "chief_only",
        "LearningRateWarmup",
        "LossScaleMonitor",
        "MetricAverage",
        "Preempted",
        "default_callbacks",
        "latest_checkpoint",
        "verbosity",
    },
    "kmp.loss_scale": {"GradientStats", "LossScale", "ScaleState", "gradient_stats", "update"},
    "kmp.master_weights": {
        "compensated_add",
        "keyed_random_bits",
        "random_bits",
        "rounding_key",
        "state_bytes",
        "stochastic_round",
    },
    "kmp.gpu": {"GPUConfig", "GPUConfigurationError", "configure_gpus"},
    "kmp.policy": {
        "PolicyChoice",
        "choose_policy",
        "current_policy",
        "disable",
        "enable",
        "policy_scope",
    },
    "kmp.layers": {"Float32Output", "float32_outputs", "has_float32_outputs"},
    "kmp.float32_layers": {"KeepsFloat32", "KeptFloat32", "keep_float32"},
    "kmp.load_precision": {
        "computes_in_16_bits",
        "forget_kept",
        "outputs_were_float32",
        "plan_policies",
        "quantized_layers",
        "rewrite_config",
    },
    "kmp.probing": {"ProbeReport", "probe"},
    "kmp.auditing": {"AuditReport", "audit"},
    "kmp.elastic": {
        "CommitCallback",
        "ElasticData",
        "KerasState",
        "ShardPlan",
        "fit",
        "plan_shard",
        "run",
    },
    "kmp.data": {"ShardSpec", "available", "load", "shard_spec"},
    "kmp.datasets": {"is_prepared", "prepare"},
    "kmp.hardware": {"CPU", "GPU", "Hardware", "detect"},
    "kmp.compat": {"keras2", "v1"},
    "kmp.compat.v1": {
        "broadcast_global_variables",
        "distributed_optimizer",
        "session",
        "session_config",
    },
    "kmp.compat.keras2": {
        "broadcast_callback",
        "is_legacy_keras",
        "set_global_policy",
        "wrap_optimizer",
    },
    "kmp.saving": {"load_model", "read_state", "save_model"},
    "kmp.exporting": {
        "ExportPlan",
        "ExportResult",
        "cached_step",
        "export",
        "greedy",
        "greedy_cached",
        "greedy_loop",
        "open_runner",
        "plan_export",
    },
    "kmp.quantizing": {"LayerOutcome", "QuantizeReport", "quantize"},
    "kmp.xla": {"fused", "jit_gradients", "step_jit_compile"},
    "kmp.versions": {
        "SUPPORTED",
        "TENSORFLOW_DISTRIBUTIONS",
        "Supported",
        "UntestedVersionWarning",
        "installed_distribution",
        "installed_tensorflow",
        "supported",
        "installed",
        "parse",
        "untested",
        "warn_if_untested",
    },
}
# Packages whose ``__init__`` only gathers a face: every public name in them that is not a
# submodule is listed in ``__all__`` (``dir()`` shows no internal).
GATHERING_PACKAGES = ("kmp.distributed", "kmp.callbacks", "kmp.elastic", "kmp.compat.v1")
# Names that left a face, and the module each lives in now. The packages above no longer
# have them at all; a module that uses one itself still has it, outside ``__all__``.
MOVED: dict[str, dict[str, str]] = {
    "kmp.distributed": {
        "COMPRESSIONS": "kmp._names",
        "REDUCE_OPS": "kmp._names",
        "SPARSE_GRADIENTS": "kmp._names",
        "normalize_compression": "kmp._names",
        "LAUNCH_SIZE_VARS": "kmp._launcher_env",
        "launched_world_size": "kmp._launcher_env",
        "check_averaging_runtime": "kmp.distributed.collectives",
        "gradients_need_allreduce": "kmp.distributed.collectives",
        "payload_bytes": "kmp.distributed.buckets",
        "Engine": "kmp.distributed.engines",
        "ENGINES": "",  # gone: the names are kmp._names.ENGINE_CHOICES
    },
    "kmp.callbacks": {
        "Checkpoint": "",  # renamed: what latest_checkpoint found is not a callback
        "FoundCheckpoint": "kmp.callbacks.checkpoint",
        "atomic_save": "kmp.callbacks.checkpoint",
        "DEFAULT_CHECKPOINT_NAME": "kmp.callbacks.checkpoint_files",
        "DEFAULT_WEIGHTS_NAME": "kmp.callbacks.checkpoint_files",
    },
    "kmp.elastic": {
        "epoch_order": "kmp.elastic.data",
        "is_horovod_failure": "kmp.elastic.run",
    },
    "kmp.compat.v1": {
        "DistributedOptimizer": "kmp.compat.v1.optimizer",
        "MIXED_PRECISION_REWRITES": "kmp.compat.v1.sessions",
        "build_session_config": "kmp.compat.v1.sessions",
    },
}


def public_members(module: types.ModuleType) -> set[str]:
    """The public names of ``module`` that are not submodules."""
    return {
        name
        for name in dir(module)
        if not name.startswith("_") and not inspect.ismodule(getattr(module, name))
    }


def test_the_top_level_face():
    assert len(kmp.__all__) == len(set(kmp.__all__)), "duplicates in kmp.__all__"
    assert set(kmp.__all__) == TOP
    for name in NAMESPACES:
        module = getattr(kmp, name)
        assert inspect.ismodule(module) and module.__name__ == f"kmp.{name}", name
        assert name in dir(kmp), name
    assert set(dir(kmp)) >= TOP | NAMESPACES


def test_every_namespace_has_a_pinned_face():
    assert {f"kmp.{name}" for name in NAMESPACES} <= set(FACES)


@pytest.mark.parametrize("name", sorted(FACES))
def test_each_face_is_pinned(name):
    module = importlib.import_module(name)
    assert len(module.__all__) == len(set(module.__all__)), f"duplicates in {name}.__all__"
    assert set(module.__all__) == FACES[name]


@pytest.mark.parametrize("name", ["kmp", *sorted(FACES)])
def test_every_listed_name_resolves_and_is_documented(name):
    module = importlib.import_module(name)
    for attr in module.__all__:
        obj = getattr(module, attr)
        if inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip(), f"{name}.{attr} has no docstring"
        elif inspect.isclass(obj):  # its own docstring, not one a base class has
            assert (obj.__dict__.get("__doc__") or "").strip(), f"{name}.{attr} has no docstring"


@pytest.mark.parametrize("name", ["kmp", *sorted(FACES)])
def test_star_import_gives_exactly_the_face(name):
    namespace: dict = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(importlib.import_module(name).__all__)


@pytest.mark.parametrize("name", GATHERING_PACKAGES)
def test_gathering_packages_hold_nothing_else(name):
    module = importlib.import_module(name)
    assert public_members(module) == set(module.__all__)


@pytest.mark.parametrize(
    ("face", "name", "home"),
    [(face, name, home) for face, moved in MOVED.items() for name, home in moved.items()],
)
def test_internals_left_the_faces_for_their_modules(face, name, home):
    module = importlib.import_module(face)
    assert name not in module.__all__
    assert not hasattr(module, name), f"{face} still re-exports {name}"
    if home:
        assert hasattr(importlib.import_module(home), name), f"{name} is not in {home}"


def test_the_distributed_package_offers_no_internal():
    import kmp.distributed as dist

    # The function world() wins over the submodule of the same name.
    assert callable(dist.world) and dist.world.__name__ == "world"
    assert public_members(dist) == FACES["kmp.distributed"]
