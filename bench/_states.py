"""Memory held by weights and optimizer state, per master-weights configuration (issue 26).

Used by ``bench/memory.py --states``. Each configuration (float32, mixed_bfloat16, and
the bfloat16 policy with each ``master_weights`` mode) builds a deep MLP whose weights
and Adam states dominate its memory (``DEPTH`` dense layers of ``WIDTH``), compiles it
with ``kmp.wrap_optimizer(Adam)`` and trains a few steps on a batch of 8, in a child
process of its own. Figures:

* ``state_bytes_per_param`` (counted): the bytes of every weight and optimizer variable
  over the trainable parameters: 12 for float32 weights with Adam's two float32 moments.
* ``resident_bytes`` (measured): live bytes of TensorFlow's CPU BFC allocator after the
  warm-up steps: the weights, the optimizer state and what else stays allocated.
* ``step_peak_bytes`` (measured): the allocator's peak during one training step (the
  gradients and the update's temporaries on top of the resident state).
* ``rss_peak_bytes`` (measured): the process's peak resident set size
  (``ru_maxrss``) minus its size before the model was built.
* ``step_seconds`` (measured): the median time of a training step (the measured steps).
"""

from __future__ import annotations

import resource
import statistics
import time
import warnings

import numpy as np

CONFIGS = (
    "float32",
    "mixed_bfloat16",
    "bfloat16+kahan",
    "bfloat16+stochastic",
    "bfloat16+none",
)
WIDTH, DEPTH, BATCH = 2048, 16, 8
QUICK_WIDTH, QUICK_DEPTH = 256, 2
# The targets of issue 26, against mixed_bfloat16 (float32 weights and Adam moments).
TARGETS = {"bfloat16+stochastic": 0.55, "bfloat16+kahan": 0.70}
# Issue 44's: the whole step's peak (state, gradients, the update's temporaries).
STEP_PEAK_TARGETS = {"bfloat16+stochastic": 0.55}
# And its step time, against plain bfloat16 (round to nearest).
STEP_TIME_TARGETS = {"bfloat16+kahan": 1.25, "bfloat16+stochastic": 1.25}
STEP_TIME_WHY = (
    "at batch 8 this step is its update, bound by memory traffic: Kahan's buffer adds a "
    "read and a write, 4 of about 18 bytes moved per parameter (docs/bfloat16.md)"
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(config: str, quick: bool, steps: int, tf_memory) -> dict:
    """Build, compile and train the deep MLP under ``config``; return its figures."""
    import keras

    import kmp
    from kmp.master_weights import state_bytes

    policy, _, mode = config.partition("+")
    width, depth = (QUICK_WIDTH, QUICK_DEPTH) if quick else (WIDTH, DEPTH)
    before = _rss_bytes()
    # No keras.backend.clear_session(): each configuration runs in a fresh process, and
    # after it TensorFlow kept 128-273 MiB more live here than a script that never calls it.
    kmp.enable(policy)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
            + [keras.layers.Dense(10)]
        )
        model = kmp.float32_outputs(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-4), master_weights=mode or "auto")
        model.compile(
            optimizer=opt,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCH, width)).astype("float32")
        y = rng.integers(0, 10, size=(BATCH,))
        for _ in range(2):  # trace, build the optimizer
            model.train_on_batch(x, y)
        params = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
        counted = state_bytes(model)
        result = {
            "config": config,
            "params": params,
            "weight_dtype": model.trainable_weights[0].dtype,
            "slot_dtype": model.optimizer.inner_optimizer.variables[-1].dtype,
            "state_bytes": counted,
            "state_bytes_per_param": counted / params,
            "resident_bytes": None,
            "step_peak_bytes": None,
        }
        times = []
        reset, read = tf_memory if tf_memory is not None else (None, None)
        if read is not None:
            result["resident_bytes"] = int(read()["current"])
        for _ in range(steps):
            if reset is not None:
                reset()
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
            if read is not None:
                peak = int(read()["peak"])
                result["step_peak_bytes"] = max(result["step_peak_bytes"] or 0, peak)
        result["step_seconds"] = statistics.median(times)
        result["rss_peak_bytes"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        )
        return result
    finally:
        kmp.disable()


def targets(figures: dict[str, dict]) -> list[dict]:
    """Judge the memory and step-time targets (counted and measured)."""
    from targets import part_target

    base = figures.get("mixed_bfloat16")
    out = []
    for config, bound in TARGETS.items():
        fig = figures.get(config)
        name = f"weights + Adam state, {config} vs mixed_bfloat16"
        if base is None or fig is None:
            out.append(part_target(name, f"<= {bound}", None, None, "not run"))
            continue
        ratio = fig["state_bytes"] / base["state_bytes"]
        measured = f"{ratio:.3f} counted ({fig['state_bytes_per_param']:.2f} vs "
        measured += f"{base['state_bytes_per_param']:.2f} bytes/param)"
        if fig["resident_bytes"] and base["resident_bytes"]:
            live = fig["resident_bytes"] / base["resident_bytes"]
            measured += f"; {live:.3f} of the allocator's resident bytes"
        out.append(part_target(name, f"<= {bound}", round(ratio, 4), ratio <= bound, measured))
    for config, bound in STEP_PEAK_TARGETS.items():
        peak = (figures.get(config) or {}).get("step_peak_bytes")
        ref = (base or {}).get("step_peak_bytes")
        name = f"step peak, {config} vs mixed_bfloat16"
        if not peak or not ref:
            measured = "not measured (TensorFlow's allocator only)"
            out.append(part_target(name, f"<= {bound}", None, None, measured))
            continue
        ratio = peak / ref
        measured = f"{ratio:.3f} ({peak / 2**20:,.0f} vs {ref / 2**20:,.0f} MiB)"
        out.append(part_target(name, f"<= {bound}", round(ratio, 4), ratio <= bound, measured))
    plain = (figures.get("bfloat16+none") or {}).get("step_seconds")
    for config, bound in STEP_TIME_TARGETS.items():
        mine = (figures.get(config) or {}).get("step_seconds")
        name = f"step time, {config} vs bfloat16+none"
        if not mine or not plain:
            out.append(part_target(name, f"<= {bound}x", None, None, "not run"))
            continue
        ratio = mine / plain
        measured = f"{ratio:.2f}x ({1000 * mine:.0f} vs {1000 * plain:.0f} ms, medians)"
        why = "" if ratio <= bound else STEP_TIME_WHY
        out.append(
            part_target(name, f"<= {bound}x", round(ratio, 3), ratio <= bound, measured, why)
        )
    return out


def markdown(figures: dict[str, dict], checks: list[dict], quick: bool) -> str:
    from _common import markdown_table

    def mib(n):
        return "n/a" if n is None else f"{n / 2**20:,.0f}"

    base = figures.get("mixed_bfloat16") or {}
    rows = []
    for config, f in figures.items():
        ratio = f["state_bytes"] / base["state_bytes"] if base else None
        rows.append([
            config, f["weight_dtype"], f["slot_dtype"], f"{f['state_bytes_per_param']:.2f}",
            "n/a" if ratio is None else f"{ratio:.2f}", mib(f["resident_bytes"]),
            mib(f["step_peak_bytes"]), mib(f["rss_peak_bytes"]),
            f"{1000 * f['step_seconds']:.0f}" if f.get("step_seconds") else "n/a",
        ])  # fmt: skip
    width, depth = (QUICK_WIDTH, QUICK_DEPTH) if quick else (WIDTH, DEPTH)
    params = next(iter(figures.values()))["params"]
    md = "# Weights and optimizer state per master-weights configuration\n\n"
    md += markdown_table(
        ["config", "weights", "Adam slots", "state bytes/param", "vs mixed_bfloat16",
         "resident MiB", "step peak MiB", "peak RSS MiB", "step ms"],
        rows,
    )  # fmt: skip
    md += (
        f"\n\nAn MLP of {depth} dense layers of {width} ({params:,} parameters), Adam, batch "
        f"{BATCH}, TensorFlow on the CPU. State bytes: weights plus optimizer variables "
        "(counted). Resident: the BFC allocator's live bytes after two warm-up steps. Step "
        "peak: its peak during a step. Peak RSS: the process's peak resident memory above its "
        "size before the model was built. Step ms: the median step time.\n\n"
    )
    md += markdown_table(
        ["target", "goal", "measured", "result"],
        [[t["name"], t["goal"], t["measured"],
          "not run" if t["met"] is None else ("met" if t["met"] else "missed")] for t in checks],
    )  # fmt: skip
    return md
