"""Worker of bench/checkpoints.py: the GPT's step time with and without step checkpoints.

Or, with ``--modes signal``, a run that a signal stops.

Started with ``kmp launch -np N``. ``--modes none,signals_each_step,signals,sync,async``
trains the same model in one process, mode after mode (each ``--steps`` steps in one
epoch): without AtomicCheckpoint; with it catching signals but no step checkpoints, the
ranks agreeing after every step or every 2 s (the default); with a checkpoint every
``--every`` steps, written at once or in the background. Rank 0 writes every step's wall
time. The first ``--every`` steps of each mode are left out (warm-up, and async's first
checkpoint, written at once to make the copy it writes from later). ``--modes signal``
trains until the launcher passes a signal on; rank 0 writes when the checkpoint was on
disk (wall clock).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kmp  # noqa: E402

WORLD = kmp.distributed.init()

import keras  # noqa: E402
import models  # noqa: E402  (bench/models.py)


class StepTimes(keras.callbacks.Callback):
    """Every batch's wall time, and rank 0's progress file (the step count)."""

    def __init__(self, progress: Path | None = None):
        super().__init__()
        self.progress = progress
        self.times: list[float] = []
        self.last = None

    def on_train_batch_begin(self, batch, logs=None):
        """Start the clock at the first batch."""
        if self.last is None:
            self.last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        """Record the batch's wall time (and, on rank 0, the progress)."""
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        if self.progress is not None and WORLD.rank == 0:
            tmp = self.progress.with_suffix(".tmp")
            tmp.write_text(str(len(self.times)))
            tmp.replace(self.progress)


def train(mode: str, args: argparse.Namespace, folder: Path) -> dict:
    keras.utils.set_random_seed(0)
    model = models.build("gpt")
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.AdamW(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(),  # the GPT ends in a softmax
    )
    x, y = models.batch("gpt", args.batch * args.steps, seed=WORLD.rank)
    timer = StepTimes(folder / "progress" if mode == "signal" else None)
    callbacks = [kmp.callbacks.BroadcastInitialState(), timer]
    ckpt = None
    if mode != "none":
        ckpt = kmp.callbacks.AtomicCheckpoint(
            folder / mode,
            save_every_steps=None if mode.startswith("signals") else args.every,
            agree_every_seconds=0 if mode == "signals_each_step" else 2.0,
            async_write=mode in ("async", "signal"),
            keep=2,
            verbose=1 if mode == "signal" else 0,
        )
        callbacks.append(ckpt)
    started = time.time()
    out = {"mode": mode, "started": started}
    try:
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)  # fmt: skip
    except kmp.callbacks.Preempted as stop:
        out.update(written_at=time.time(), step=stop.step, path=stop.path)
        out["signal_seconds"] = ckpt.signal_seconds
        return {**out, "times": timer.times}
    times = timer.times[args.every :]
    out["step_s"] = sum(times) / len(times)
    out["steps_timed"] = len(times)
    if ckpt is not None and ckpt._writer is not None:
        out["waited_s"] = ckpt._writer.waited_s
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--modes", default="none,signals_each_step,signals,sync,async")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    kmp.enable()
    results = {"policy": keras.config.dtype_policy().name, "world": WORLD.size, "runs": []}
    try:
        for mode in args.modes.split(","):
            results["runs"].append(train(mode, args, args.folder))
    finally:
        if WORLD.rank == 0:
            (args.folder / "result.json").write_text(json.dumps(results))
    if results["runs"] and "written_at" in results["runs"][-1]:
        raise SystemExit(kmp._names.PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
