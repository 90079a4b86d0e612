"""AtomicCheckpoint inside an epoch: step checkpoints, exact mid-epoch resume, signals.

In one process, a model with Dropout and BatchNormalization (tests/test_resume.py's kind,
with a moving statistic): an uninterrupted run writes step checkpoints; a run loaded from
each of them, given the same data, ends bit-identical to the uninterrupted one (weights,
every optimizer variable, the seed generators). A SIGTERM sent in the middle of an epoch
stops fit after that step with one checkpoint and ``Preempted`` (exit status 75), a
handler installed before is chained, and the resumed run ends where the uninterrupted
one did. Positions that mean other examples are refused with what to do.
"""

from __future__ import annotations

import os
import signal

import keras
import numpy as np
import pytest

import kmp
from kmp.callbacks.checkpoint_files import FoundCheckpoint, step_template
from kmp.callbacks.preemption import PREEMPTED_EXIT_CODE, Preempted, normalize_signals
from kmp.callbacks.resume import plan_skip
from kmp.saving import read_state
from kmp.training_state import TrainingState

STEPS, BATCH, EPOCHS = 6, 8, 2


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(STEPS * BATCH, 8)).astype("float32"), rng.integers(0, 3, STEPS * BATCH)


def build(policy: str, master: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(1)
    kmp.enable(policy)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )
    model = kmp.float32_outputs(model)
    kwargs = {} if master is None else {"master_weights": master}
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2), **kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def state_of(model: keras.Model) -> list[np.ndarray]:
    """Every weight, every optimizer variable (loss scale, iterations) and the RNG states."""
    values = [v.numpy() for v in model.weights]
    values += [np.asarray(v) for v in model.optimizer.variables]
    values += [np.asarray(v) for v in kmp.training_state.seed_states(model)]
    return [np.asarray(v, "float64") for v in values]


def largest_difference(a: list, b: list) -> float:
    return max(float(np.max(np.abs(u - v))) if u.size else 0.0 for u, v in zip(a, b, strict=True))


def fit(model, callbacks, initial_epoch=0):
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        initial_epoch=initial_epoch,
        shuffle=False,
        callbacks=callbacks,
        verbose=0,
    )


@pytest.mark.parametrize(
    "policy,master",
    [("float32", None), ("mixed_float16", None), ("bfloat16", "kahan")],
)
def test_a_run_resumed_from_any_step_checkpoint_ends_bit_identical(policy, master, tmp_path):
    straight = build(policy, master)
    ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path, save_every_steps=4, keep=None)
    fit(straight, [ckpt])
    names = sorted(os.listdir(tmp_path))
    # Global steps 4 and 8 fall inside epochs (1, step 4) and (2, step 2); 12 is an end.
    assert names == [
        "ckpt-0000-step-000004.keras",
        "ckpt-0001-step-000002.keras",
        "ckpt-0001.keras",
        "ckpt-0002.keras",
    ]
    state = read_state(tmp_path / "ckpt-0001-step-000002.keras")
    assert (state.epoch, state.step, state.steps_per_epoch, state.iterations) == (1, 2, STEPS, 8)
    assert kmp.callbacks.latest_checkpoint(tmp_path) == FoundCheckpoint(
        str(tmp_path / "ckpt-0002.keras"), 2, 0
    )
    want = state_of(straight)
    for name in names[:2]:
        keras.config.set_dtype_policy("float32")  # the loaded file brings its own
        resumed = kmp.load_model(tmp_path / name)
        found = read_state(tmp_path / name)
        again = kmp.callbacks.AtomicCheckpoint(tmp_path / "again" / name[:-6])
        fit(resumed, [again], initial_epoch=found.epoch)
        assert again.skipped_steps == found.step
        assert int(resumed.optimizer.iterations) == EPOCHS * STEPS, name
        assert largest_difference(state_of(resumed), want) == 0.0, (policy, name)


def test_without_the_skip_the_resumed_epoch_trains_its_first_batches_again(tmp_path):
    straight = build("float32")
    fit(straight, [kmp.callbacks.AtomicCheckpoint(tmp_path, save_every_steps=4)])
    resumed = kmp.load_model(tmp_path / "ckpt-0000-step-000004.keras")
    fit(resumed, [kmp.callbacks.AtomicCheckpoint(tmp_path / "b", resume_inside_epoch=False)])
    assert int(resumed.optimizer.iterations) == 4 + EPOCHS * STEPS
    assert largest_difference(state_of(resumed), state_of(straight)) > 0


class SignalAt(keras.callbacks.Callback):
    """Sends this process a signal at the start of one batch (as a scheduler would)."""

    def __init__(self, epoch, batch, sig=signal.SIGTERM):
        super().__init__()
        self.at, self.sig, self.epoch = (epoch, batch), sig, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), self.sig)


def test_a_signal_mid_epoch_stops_after_that_step_with_one_checkpoint(tmp_path):
    straight = build("mixed_float16")
    fit(straight, [])
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        model = build("mixed_float16")
        ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path, verbose=1)
        with pytest.raises(Preempted) as stopped:
            fit(model, [SignalAt(1, 2), ckpt])
        # The user's handler was chained; kmp's is gone again after fit.
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not ckpt._catcher._handle
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == PREEMPTED_EXIT_CODE == 75
    assert (stopped.value.epoch, stopped.value.step, stopped.value.signal) == (1, 3, "SIGTERM")
    # Work lost: none. The step in flight (batch index 2) finished and is in the checkpoint.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0001-step-000003.keras", "ckpt-0001.keras"]
    assert int(model.optimizer.iterations) == STEPS + 3
    assert ckpt.signal_seconds is not None and ckpt.signal_seconds < 10
    found = kmp.callbacks.latest_checkpoint(tmp_path)
    assert (found.epoch, found.step) == (1, 3)
    resumed = kmp.load_model(found.path)
    fit(resumed, [kmp.callbacks.AtomicCheckpoint(tmp_path)], initial_epoch=found.epoch)
    assert largest_difference(state_of(resumed), state_of(straight)) == 0.0


def test_kmp_data_resumes_inside_the_epoch_without_decoding_the_done_batches(tmp_path):
    """kmp.data.load(skip_batches=ckpt.step) gives the resumed epoch's done batches as empty
    placeholders, which AtomicCheckpoint drops: the run ends as the one that never stopped."""
    from kmp import datasets

    datasets.prepare("kmp_digits", tmp_path / "data")

    def digits(epoch=0, skip=0):
        return kmp.data.load("kmp_digits", "train", batch_size=64, data_dir=tmp_path / "data",
                             rank=0, size=1, seed=3, epoch=epoch, epochs=2 - epoch,
                             steps_per_epoch=STEPS, skip_batches=skip)  # fmt: skip

    def digits_model():
        keras.utils.set_random_seed(1)
        kmp.enable("float32")
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(10)])  # fmt: skip
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2)), loss=loss)
        return model

    straight = digits_model()
    run = {"epochs": 2, "steps_per_epoch": STEPS, "verbose": 0}
    straight.fit(digits(), **run)
    stopped = digits_model()
    with pytest.raises(Preempted):
        stop = [SignalAt(1, 3), kmp.callbacks.AtomicCheckpoint(tmp_path / "c")]
        stopped.fit(digits(), callbacks=stop, **run)
    found = kmp.callbacks.latest_checkpoint(tmp_path / "c")
    assert (found.epoch, found.step) == (1, 4)
    resumed = kmp.load_model(found.path)
    again = kmp.callbacks.AtomicCheckpoint(tmp_path / "c")
    resumed.fit(digits(found.epoch, found.step), initial_epoch=found.epoch, callbacks=[again],
                **run)  # fmt: skip
    assert again.skipped_steps == 4 and int(resumed.optimizer.iterations) == 2 * STEPS
    assert largest_difference(state_of(resumed), state_of(straight)) == 0.0


def test_signals_off_leave_the_handlers_alone(tmp_path):
    model = build("float32")
    before = signal.getsignal(signal.SIGUSR1)
    ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path, signals=())

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.during = signal.getsignal(signal.SIGUSR1)

    look = Look()
    fit(model, [ckpt, look])
    assert look.during is before
    on = kmp.callbacks.AtomicCheckpoint(tmp_path / "on")
    fit(model, [on, look])
    assert look.during == on._catcher._handle and signal.getsignal(signal.SIGUSR1) is before


def test_positions_that_mean_other_examples_are_refused():
    saved = TrainingState(epoch=1, step=3, steps_per_epoch=6, world_size=2, data_seed=7)
    ok = {"first_epoch": 1, "steps_per_epoch": 6, "world_size": 2, "data_seed": 7}
    assert plan_skip(saved, **ok) == 3
    assert plan_skip(TrainingState(epoch=1, step=0), **ok) == 0
    cases = [
        ({"first_epoch": 0}, r"initial_epoch=1"),
        ({"steps_per_epoch": 12}, r"another batch size"),
        ({"world_size": 1}, r"Resume with 2 process"),
        ({"data_seed": 8}, r"Resume with seed 7"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            plan_skip(saved, **{**ok, **change})
        assert "resume_inside_epoch=False" in str(info.value)


def test_a_resume_into_another_epoch_length_fails_before_training(tmp_path):
    model = build("float32")
    fit(model, [kmp.callbacks.AtomicCheckpoint(tmp_path, save_every_steps=4)])
    resumed = kmp.load_model(tmp_path / "ckpt-0000-step-000004.keras")
    before = state_of(resumed)
    x, y = data()
    with pytest.raises(ValueError, match="another batch size"):
        resumed.fit(
            x,
            y,
            batch_size=BATCH * 2,
            epochs=1,
            shuffle=False,
            callbacks=[kmp.callbacks.AtomicCheckpoint(tmp_path / "b")],
            verbose=0,
        )
    assert largest_difference(state_of(resumed), before) == 0.0


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"save_every_steps": 0}, ValueError, "save_every_steps"),
        ({"save_every_steps": "5"}, TypeError, "save_every_steps"),
        ({"save_every_seconds": -1}, ValueError, "save_every_seconds"),
        ({"save_every_steps": 5, "save_every_seconds": 60}, ValueError, "not both"),
        ({"signals": ("SIGNOPE",)}, ValueError, "not a signal"),
        ({"signals": ("SIGKILL",)}, ValueError, "cannot be caught"),
        ({"signals": [1.5]}, TypeError, "not a signal name"),
        ({"save_every_steps": 5, "save_best_only": True}, ValueError, "save_best_only"),
        ({"async_write": True, "save_weights_only": True}, ValueError, "async_write"),
        ({"async_write": 1}, TypeError, "async_write"),
        ({"agree_every_seconds": -1}, ValueError, "agree_every_seconds"),
        ({"agree_every_seconds": "2"}, TypeError, "agree_every_seconds"),
    ],
)
def test_bad_arguments_are_refused_clearly(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        kmp.callbacks.AtomicCheckpoint(tmp_path, **kwargs)


def test_the_ranks_meet_about_every_interval_at_a_step_they_all_agree_on():
    """Two ranks of different speeds propose different intervals; the agreement's maximum
    (what every rank receives) puts their next meeting at the same step."""
    from kmp.callbacks.checkpoint_schedule import AgreementCadence

    fast, slow = AgreementCadence(2.0), AgreementCadence(2.0)
    assert fast.due(1) and fast.proposal(1, 10.0) == 1.0  # no step time yet: meet next step
    for c in (fast, slow):
        c.agreed(1, 1.0, 10.0)
    assert not fast.due(1) and fast.due(2)
    # After step 2: one rank took 0.125 s a step (16 steps to 2 s), the other 0.25 s (8).
    agreed = max(fast.proposal(2, 10.125), slow.proposal(2, 10.25))
    assert (fast.proposal(2, 10.125), slow.proposal(2, 10.25), agreed) == (16.0, 8.0, 16.0)
    for c in (fast, slow):
        c.agreed(2, agreed, 10.25)
    assert (
        [s for s in range(3, 30) if fast.due(s)][:1]
        == [18]
        == [s for s in range(3, 30) if slow.due(s)][:1]
    )
    every_step = AgreementCadence(0.0)
    every_step.agreed(5, every_step.proposal(5, 99.0), 99.0)
    assert every_step.due(6)


def test_step_names_follow_the_epoch_name():
    assert step_template("ckpt-{epoch:04d}.keras") == "ckpt-{epoch:04d}-step-{step:06d}.keras"
    assert step_template("w/{epoch}.weights.h5") == "w/{epoch}-step-{step:06d}.weights.h5"
    assert step_template("e{epoch}-s{step}.keras") == "e{epoch}-s{step}.keras"
    with pytest.raises(ValueError, match="epoch logs"):
        step_template("{epoch}-{val_loss:.2f}.keras")
    with pytest.warns(UserWarning, match="signals are not caught"):
        ckpt = kmp.callbacks.AtomicCheckpoint("r/{epoch}-{val_loss:.2f}.keras", signals=["TERM"])
    assert ckpt.signals == ()
    assert kmp.callbacks.AtomicCheckpoint("r/best.keras").signals == ()  # the default: quiet
    assert normalize_signals(["usr1", signal.SIGTERM, "SIGUSR1"]) == ("SIGUSR1", "SIGTERM")


def test_the_same_signal_twice_does_what_it_did_without_kmp():
    from kmp.callbacks.preemption import SignalCatcher

    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        catcher = SignalCatcher(("SIGUSR1",))
        catcher.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert catcher.caught == "SIGUSR1" and catcher.installed and len(seen) == 1
        os.kill(os.getpid(), signal.SIGUSR1)  # again: kmp steps aside
        assert not catcher.installed and len(seen) == 2
        assert signal.getsignal(signal.SIGUSR1) is not catcher._handle
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("checkpointed, status", [(True, PREEMPTED_EXIT_CODE), (False, None)])
def test_a_stop_signal_after_the_checkpoint_still_exits_preempted(checkpointed, status):
    """srun --kill-on-bad-exit (and Horovod's launcher) stop every rank once the first one
    leaves with 75: a rank still leaving must not turn into "killed by SIGTERM" (143),
    which a launcher would not requeue. Without a checkpoint, SIGTERM does what it did."""
    from kmp.callbacks.preemption import SignalCatcher

    pid = os.fork()
    if pid == 0:  # the child: catch, "checkpoint", put the handlers back, get SIGTERM
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not what earlier tests left
            catcher = SignalCatcher(("SIGTERM",))
            catcher.install()
            os.kill(os.getpid(), signal.SIGTERM)
            catcher.remove(checkpointed=checkpointed)
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            os._exit(3)  # only if the second SIGTERM did nothing
    _, wait_status = os.waitpid(pid, 0)
    if status is None:
        assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGTERM
    else:
        assert os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == status


def test_after_a_caught_preemption_the_next_catcher_does_not_exit():
    """A script (a notebook, a worker running several cases) that caught Preempted and
    trains again: the next fit catches the next signal instead of exiting with 75."""
    from kmp.callbacks.preemption import SignalCatcher

    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        first = SignalCatcher(("SIGUSR1",))
        first.install()
        first.remove(checkpointed=True)  # as after Preempted: a stop signal now exits 75
        second = SignalCatcher(("SIGUSR1",))
        second.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert second.caught == "SIGUSR1"  # caught, and this process still runs
        second.remove()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_fit_that_raised_leaves_no_catcher_that_swallows_the_next_signal(tmp_path):
    """Keras calls no on_train_end when fit raises: kmp's handler stays, but a signal after
    that fit goes where it went before kmp, the first time."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:

        class Boom(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                raise RuntimeError("boom")

        ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path)
        with pytest.raises(RuntimeError, match="boom"):
            fit(build("float32"), [ckpt, Boom()])
        assert signal.getsignal(signal.SIGUSR1) == ckpt._catcher._handle  # left behind
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and ckpt._catcher.caught is None
        assert signal.getsignal(signal.SIGUSR1) is not ckpt._catcher._handle
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_fit_without_atomic_checkpoint_is_told_its_position_is_not_resumed(tmp_path):
    model = build("float32")
    fit(model, [kmp.callbacks.AtomicCheckpoint(tmp_path, save_every_steps=4)])
    resumed = kmp.load_model(tmp_path / "ckpt-0000-step-000004.keras")
    with pytest.warns(UserWarning, match=r"written 4 batch\(es\) into epoch 1.*trained again"):
        fit(resumed, [kmp.callbacks.BroadcastInitialState()])
    assert kmp.training_state.loaded_state(resumed) is None  # warned once, then dropped


def test_background_writes_hold_the_same_state_and_resume_exactly(tmp_path):
    sync_run = build("mixed_float16")
    fit(sync_run, [kmp.callbacks.AtomicCheckpoint(tmp_path / "sync", save_every_steps=4)])
    model = build("mixed_float16")
    ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path / "bg", save_every_steps=4, async_write=True)
    fit(model, [ckpt])
    names = sorted(os.listdir(tmp_path / "bg"))
    assert names == sorted(os.listdir(tmp_path / "sync"))
    # The first checkpoint made the twin; the three after it were written from a thread.
    assert len(ckpt._writer.written) == 3 and not ckpt._writer.busy()
    for name in names:
        a = kmp.load_model(tmp_path / "bg" / name)
        b = kmp.load_model(tmp_path / "sync" / name)
        assert largest_difference(state_of(a), state_of(b)) == 0.0, name
        assert read_state(tmp_path / "bg" / name) == read_state(tmp_path / "sync" / name)
    resumed = kmp.load_model(tmp_path / "bg" / "ckpt-0001-step-000002.keras")
    fit(resumed, [kmp.callbacks.AtomicCheckpoint(tmp_path / "again")], initial_epoch=1)
    assert largest_difference(state_of(resumed), state_of(model)) == 0.0


def test_a_background_write_that_fails_is_raised_on_the_training_thread(tmp_path, monkeypatch):
    import kmp.callbacks.checkpoint as module

    model = build("float32")
    ckpt = kmp.callbacks.AtomicCheckpoint(tmp_path, save_every_steps=4, async_write=True)
    real = module.save_model
    calls = []

    def failing(m, path, **kwargs):
        calls.append(path)
        if len(calls) > 1:  # the first (synchronous) one succeeds
            raise OSError(28, "No space left on device")
        return real(m, path, **kwargs)

    monkeypatch.setattr(module, "save_model", failing)
    with pytest.raises(RuntimeError, match="No space left on device"):
        fit(model, [ckpt])
    # Nothing half-written: only the first checkpoint is there, and no temporary file.
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000-step-000004.keras"]
