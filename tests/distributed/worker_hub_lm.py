"""Worker: a KerasHub causal LM (GPT2CausalLM, tiny config) trained on 2 real Horovod ranks.

Started by tests/test_zoo.py. For each policy given on the command line, every rank
seeds itself differently, builds the model, gives it float32 outputs, compiles it with
``kmp.wrap_optimizer`` and ``kmp.callbacks.BroadcastInitialState`` (so every rank starts
from rank 0's weights), and fits a few steps on token ids of its own. It writes, per
policy, the largest difference between the ranks' weights (through a real allgather),
the losses, the logits' dtype, the skipped steps and the loss scale.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from _common import rank_spread, write_result

import kmp.distributed as dist

WORLD = dist.init()
RANK = WORLD.rank

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for _zoo

import keras  # noqa: E402
from _zoo import gpt2_causal_lm, lm_batch  # noqa: E402

import kmp  # noqa: E402


def train(policy: str) -> dict:
    kmp.enable(policy)
    keras.utils.set_random_seed(1000 + RANK)  # different initial weights on every rank
    lm = kmp.float32_outputs(gpt2_causal_lm())
    x, y = lm_batch(np.random.default_rng(RANK), batch=16)  # different tokens on every rank
    lm.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    hist = lm.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[kmp.callbacks.BroadcastInitialState()],
    )
    opt = lm.optimizer
    return {
        "spread": rank_spread(lm.get_weights()),
        "losses": [float(v) for v in hist.history["loss"]],
        "logits_dtype": keras.backend.standardize_dtype(lm(x).dtype),
        "skipped": opt.skipped_steps,
        "applied": int(opt.iterations.numpy()),
        "scale": float(opt.loss_scale),
        "class": type(lm).__name__,
    }


def main(policies: list[str]) -> None:
    result = {}
    for policy in policies:
        result[policy] = train(policy)
        keras.backend.clear_session()
    write_result(RANK, result)


if __name__ == "__main__":
    main(sys.argv[1:])
