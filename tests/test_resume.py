"""Checkpoints hold the whole training state and resume exactly (kmp.saving, kmp.training_state).

In one process: a model with Dropout trained 2 epochs against 1 epoch, ``kmp.save_model``,
``kmp.load_model`` in place of the model and 1 more epoch, bit for bit, under every policy;
a class that overrides ``compile`` gets its saved optimizer back; what cannot be restored
raises. On 2 real ranks (tests/distributed/worker_resume.py): a run preempted inside an
epoch (SIGTERM to one rank: both stop after the same step with one checkpoint) resumes at
the next batch to the uninterrupted weights, on both engines, on KerasHub's GPT2CausalLM
and a subclassed model too; and a job SIGKILLed in the middle of an epoch resumes from its
last checkpoint to the uninterrupted weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import zipfile

import keras
import numpy as np
import pytest

import kmp
from kmp import training_state as ts
from kmp.saving import read_state
from tests._support import run_workers

HAS_HUB = importlib.util.find_spec("keras_hub") is not None


def dropout_model(policy: str, master: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(1)
    kmp.enable(policy)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )
    kwargs = {} if master is None else {"master_weights": master}
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2), **kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 8)).astype("float32"), rng.integers(0, 3, 48)


def largest_difference(a: list, b: list) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u, "float64") - np.asarray(v, "float64"))))
        for u, v in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "policy,master",
    [
        ("float32", None),
        ("mixed_float16", None),
        ("mixed_bfloat16", None),
        ("bfloat16", "none"),
        ("bfloat16", "kahan"),
        ("bfloat16", "stochastic"),
    ],
)
def test_stop_save_load_resume_is_bit_identical_with_dropout(policy, master, tmp_path):
    x, y = data()
    straight = dropout_model(policy, master)
    straight.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    stopped = dropout_model(policy, master)
    stopped.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = kmp.save_model(stopped, tmp_path / "m.keras", epoch=1)
    keras.utils.set_random_seed(99)  # the file, not the process's seed, decides the masks
    resumed = kmp.load_model(path)
    resumed.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)

    assert largest_difference(straight.get_weights(), resumed.get_weights()) == 0.0
    opt_a, opt_b = straight.optimizer, resumed.optimizer
    assert largest_difference(opt_a.variables, opt_b.variables) == 0.0
    assert type(opt_b) is type(opt_a) and int(opt_b.iterations.numpy()) == 6


def test_without_the_random_state_dropout_resumes_elsewhere(tmp_path):
    """What the state entry is for: Keras's own file resumes with other dropout masks."""
    x, y = data()
    straight = dropout_model("float32")
    straight.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    stopped = dropout_model("float32")
    stopped.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    stopped.save(tmp_path / "plain.keras")  # Keras alone: no kmp state entry
    assert read_state(tmp_path / "plain.keras") is None
    keras.utils.set_random_seed(99)
    with pytest.warns(UserWarning, match=r"no kmp training state.*1 random generator"):
        resumed = kmp.load_model(tmp_path / "plain.keras")
    resumed.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    assert largest_difference(straight.get_weights(), resumed.get_weights()) > 1e-4


def test_the_state_entry_records_position_rng_and_manifest(tmp_path):
    x, y = data()
    model = dropout_model("bfloat16", "stochastic")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = kmp.save_model(model, tmp_path / "m.keras", epoch=1, data_seed=7)
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        raw = json.loads(archive.read(ts.ENTRY))
    assert {"config.json", "model.weights.h5", ts.ENTRY} <= set(names)
    state = read_state(path)
    assert state.epoch == 1 and state.step == 0 and state.data_seed == 7
    assert state.iterations == 3 and state.optimizer == "kmp>DistributedLossScaleOptimizer"
    assert state.policy == "bfloat16" and state.master_weights == "stochastic"
    assert state.world_size == 1 and state.engine == "none"
    assert state.versions == {
        "kmp": kmp.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
    }
    # one rank, one Dropout: one [seed, counter] pair, which moved with every training batch
    assert len(state.seed_states) == 1 and len(state.seed_states[0]) == 1
    assert state.seed_states[0][0][1] == 3
    assert raw["format"] == ts.FORMAT


@keras.saving.register_keras_serializable(package="kmp_tests")
class OwnCompile(keras.Model):
    """A subclassed model that overrides compile, as every KerasHub task does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.hidden(x))

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)


@keras.saving.register_keras_serializable(package="kmp_tests")
class IgnoresOptimizer(OwnCompile):
    """A class whose compile never takes the optimizer it is given."""

    def compile(self, optimizer=None, loss=None, **kwargs):
        super().compile(optimizer="sgd", loss=loss, **kwargs)


def test_a_class_overriding_compile_gets_its_saved_optimizer_back(tmp_path):
    kmp.enable("mixed_float16")
    x, y = data()
    model = OwnCompile()
    model(x[:1])
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")  # Keras's own file: the fix is in loading
    with pytest.warns() as caught:
        loaded = kmp.load_model(tmp_path / "m.keras")
        keras.saving.load_model(tmp_path / "m.keras")  # Keras alone: its warning, as before
    texts = [str(w.message) for w in caught]
    assert sum("was not called as part of model loading" in t for t in texts) == 1
    assert type(loaded.optimizer) is type(model.optimizer)
    assert int(loaded.optimizer.iterations.numpy()) == 3
    assert float(loaded.optimizer.loss_scale) == float(model.optimizer.loss_scale)
    assert largest_difference(model.optimizer.variables, loaded.optimizer.variables) == 0.0


def test_an_optimizer_that_cannot_come_back_is_an_error_not_a_swap(tmp_path):
    kmp.enable("float32")
    x, y = data()
    model = IgnoresOptimizer()
    model(x[:1])
    keras.Model.compile(
        model,
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    with pytest.raises(ValueError, match=r"DistributedLossScaleOptimizer.*compile=False"):
        kmp.load_model(tmp_path / "m.keras")
    weights_only = kmp.load_model(tmp_path / "m.keras", compile=False)
    assert largest_difference(model.get_weights(), weights_only.get_weights()) == 0.0


def test_world_change_is_a_decision_with_a_note():
    assert ts.world_change(2, 2, scale_lr=True) is None
    change = ts.world_change(2, 3, scale_lr=True)
    assert change.lr_factor == 3.0
    assert "2 process(es) on 3" in change.note and "1/3 of the data" in change.note
    assert "scaled by 3 instead of 2" in change.note
    assert ts.world_change(1, 2, scale_lr=False).lr_factor is None


def test_a_checkpoint_of_another_world_size_loads_with_the_note_and_rescaled_lr(tmp_path):
    x, y = data()
    model = dropout_model("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = kmp.save_model(model, tmp_path / "m.keras", epoch=1)
    # As a 2-rank job with scale_lr=True would have written it:
    state = read_state(path)
    two = dataclasses.replace(state, world_size=2, seed_states=state.seed_states * 2)
    rewrite_entry(path, two.to_json())
    lr = float(model.optimizer.learning_rate.numpy())
    with pytest.warns(UserWarning, match="written by 2 process.*on 1.*rate is unchanged"):
        loaded = kmp.load_model(path)  # scale_lr=False: the rate stays, the note is given
    assert float(loaded.optimizer.learning_rate.numpy()) == lr


def rewrite_entry(path, text: str) -> None:
    with zipfile.ZipFile(path) as src:
        items = [(i, src.read(i.filename)) for i in src.infolist() if i.filename != ts.ENTRY]
    with zipfile.ZipFile(path, "w") as dst:
        for info, blob in items:
            dst.writestr(info, blob)
        dst.writestr(ts.ENTRY, text)


def test_bad_input_is_refused_clearly(tmp_path):
    model = dropout_model("float32")
    with pytest.raises(ValueError, match=r"must end with '\.keras'"):
        kmp.save_model(model, tmp_path / "m.h5")
    with pytest.raises(TypeError, match=r"needs a keras\.Model"):
        kmp.save_model("model", tmp_path / "m.keras")
    (tmp_path / "junk.keras").write_text("not a zip")
    with pytest.raises(ValueError, match=r"not a \.keras archive"):
        kmp.load_model(tmp_path / "junk.keras")
    path = kmp.save_model(model, tmp_path / "m.keras")
    future = json.loads(read_state(path).to_json())
    rewrite_entry(path, json.dumps({**future, "format": ts.FORMAT + 1}))
    with pytest.raises(ValueError, match="newer than this kmp reads"):
        kmp.load_model(path)


def test_a_model_with_other_random_layers_is_refused(tmp_path):
    model = dropout_model("float32")
    path = kmp.save_model(model, tmp_path / "m.keras")
    other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"1 random-number generator.*has 0"):
        ts.restore_rng(other, read_state(path))


# ---- 2 real ranks --------------------------------------------------------------------

HOROVOD_CASES = [
    "batchnorm:mixed_float16",  # per-rank moving statistics, saved and restored per rank
    "sequential:bfloat16:kahan",
    "own_compile:mixed_bfloat16",
    *(["gpt2:mixed_float16"] if HAS_HUB else []),
]
JAX_CASES = ["sequential:bfloat16:stochastic", "own_compile:mixed_float16"]


@pytest.mark.parametrize("engine,cases", [("horovod", HOROVOD_CASES), ("jax", JAX_CASES)])
def test_two_ranks_resume_bit_identical_on_both_engines(engine, cases, tmp_path):
    res = run_workers("worker_resume.py", str(tmp_path), *cases, np=2, engine=engine, timeout=600)
    for r in res:
        assert r["engine"] == engine and r["size"] == 2
        for spec in cases:
            got = r["cases"][spec]
            assert got["optimizer"] == "DistributedLossScaleOptimizer", spec
            # Rank 1 alone was signalled as epoch 2 began: both stopped after its first step.
            assert got["preempted"] == [1, 1, 75, "SIGTERM"], (spec, got)  # on both ranks
            assert (got["epoch"], got["step"], got["iterations"]) == (1, 1, 4), spec
            assert got["skipped_batches"] == 1, spec
            name = spec.replace(":", "-")
            files = ["ckpt-0000-step-000002.keras", "ckpt-0001-step-000001.keras"]
            assert got["files"] == [*files, "ckpt-0001.keras"], name
            assert got["from_async_vs_straight"] == 0.0, (spec, got)
            assert got["resumed_vs_straight"] == 0.0, (spec, got)
            assert got["ranks"] == 0.0, (spec, got)


def test_a_job_killed_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path):
    spec = "sequential:mixed_float16"
    with pytest.raises(AssertionError, match="job failed"):
        run_workers("worker_resume.py", str(tmp_path), "--killed", spec, np=2, timeout=300)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ckpt-0001.keras"]
    res = run_workers("worker_resume.py", str(tmp_path), "--resume", spec, np=2, timeout=300)
    for r in res:
        got = r["cases"][spec]
        assert got["epoch"] == 1
        assert got["resumed_vs_straight"] == 0.0 and got["ranks"] == 0.0
    # The same 2-rank checkpoint in this single process: loaded, with the note.
    path = tmp_path / "ckpt" / "ckpt-0001.keras"
    state = read_state(path)
    assert state.world_size == 2 and state.engine == "horovod" and len(state.seed_states) == 2
    assert state.seed_states[0] != state.seed_states[1]  # each rank its own dropout masks
    with pytest.warns(UserWarning, match=r"written by 2 process\(es\) on 1"):
        alone = kmp.load_model(path)
    assert int(alone.optimizer.iterations.numpy()) == 3


def test_rank_weights_round_trip_and_are_kept_out_of_the_initial_broadcast():
    from kmp import rank_weights

    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    mean, var = model.non_trainable_weights
    saved = rank_weights.RankWeights(
        (0, 1),
        (mean.path, var.path),
        np.asarray([[0, 1, 2, 3, 1, 1, 1, 1], [5, 6, 7, 8, 2, 2, 2, 2]], "float32"),
    )
    saved = rank_weights.RankWeights.from_bytes(saved.to_bytes())
    rank_weights.restore(model, saved, rank=1)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(mean.value), [5, 6, 7, 8])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(var.value), [2, 2, 2, 2])
    assert rank_weights.rank_local(model) == {mean.path, var.path}
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD()), loss="mse")
    callback = kmp.callbacks.BroadcastInitialState()
    callback.set_model(model)
    sent = {v.path for v in callback.state_variables()}
    assert mean.path not in sent and var.path not in sent
    assert {w.path for w in model.trainable_weights} <= sent
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="only 0 non-trainable"):
        rank_weights.restore(other, saved, rank=0)


@pytest.mark.parametrize("engine", ["horovod", "jax"])
def test_a_launcher_told_to_stop_mid_epoch_exits_75_and_the_rerun_finishes_exactly(
    engine, tmp_path
):
    """As a scheduler does it: SIGUSR1 to `kmp launch` (SLURM's --signal; through Horovod's
    launcher, which would die of it, or kmp's own for the JAX engine), then the same
    command again."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests._support import ROOT, WORKERS

    env = {
        **{k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"},  # the engine's
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMP_NUM_THREADS": "1",
        "KMP_TEST_OUT": str(tmp_path),
    }
    argv = [sys.executable, "-m", "kmp.cli", "launch", "-np", "2", "--no-preflight"]
    argv += ["--engine", engine, str(WORKERS / "worker_preempt.py"), str(tmp_path)]
    job = subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        progress = tmp_path / "progress"
        deadline = time.monotonic() + 240
        while not (progress.exists() and int(progress.read_text() or 0) >= 10):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # 10 steps done: inside epoch 2 of 3 (8 a epoch)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 75, out
    found = kmp.callbacks.latest_checkpoint(tmp_path / "ckpt")
    assert found.epoch == 1 and 2 <= found.step < 8, (found, out)  # inside the epoch
    # Horovod's launcher would die of SIGUSR1: kmp's wrapper passes it on as SIGTERM.
    passed_on = "SIGTERM" if engine == "horovod" else "SIGUSR1"
    assert f"{passed_on} during epoch 2" in out and "exit status 75" in out, out
    res = run_workers("worker_preempt.py", str(tmp_path), "0", np=2, engine=engine, timeout=300)
    for r in res:
        assert r["resumed_from"] == [found.epoch, found.step] and r["skipped"] == found.step
        # Every weight and optimizer variable (step count, loss scale) as without the stop.
        assert r["resumed_vs_straight"] == 0.0 and r["ranks"] == 0.0, r
