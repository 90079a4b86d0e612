"""Keras's own ways under kmp (issue 56): a keras.io train_step on 2 ranks, pinned layers served.

    .venv/bin/python bench/keras_conventions.py [--epochs 5]

1. keras.io's "Customizing what happens in fit()" ``train_step`` (TensorFlow: loss from
   ``self.compute_loss``, ``tape.gradient``, ``self.optimizer.apply``), compiled with
   ``kmp.wrap_optimizer(SGD(0.05))``, trained on scikit-learn's digits (each rank its half)
   on 2 Horovod ranks, side by side: ``mixed_float16`` without ``scale_loss`` (what kmp
   says), ``mixed_float16`` with it, and ``float32``; accuracy on all 1,797 digits, the
   ranks' weights compared.
2. The Keras guide's pinned model (``LayerNormalization(dtype="float32")``, ``Activation(
   "softmax", dtype="float32")``) trained under ``mixed_float16`` and saved with
   ``model.save``, loaded with ``kmp.load_model(path, policy=...)``: the pinned layers' and
   the outputs' dtypes and the largest difference from the trained model's predictions,
   beside kmp's own float32 head on the same model (the tolerance kmp already reports).
3. ``kmp.keep_float32`` then ``model.save``: the kept layer after Keras's loader,
   ``kmp.load_model(path)`` and ``kmp.load_model(path, policy="bfloat16")``.

Results go to ``bench/results/keras_conventions.{json,md}`` with the CPU they ran on. Run by
hand: about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIANTS = (("mixed_float16", False), ("mixed_float16", True), ("float32", True))


def worker(policy: str, scale: bool, epochs: int, out: str) -> None:
    """One rank of the keras.io train_step job (under ``kmp launch -np 2``)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import kmp

    world = kmp.distributed.init()

    class CustomModel(keras.Model):  # keras.io, plus the one line kmp asks for
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                if scale:
                    loss = self.optimizer.scale_loss(loss)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on a CPU is slow, and kmp says so
        kmp.enable(policy)
    keras.utils.set_random_seed(0)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    logits = keras.layers.Dense(10)(hidden)
    model = CustomModel(inputs, keras.layers.Activation("softmax", dtype="float32")(logits))
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.05))
    model.compile(opt, "sparse_categorical_crossentropy")
    result: dict = {"policy": policy, "scale_loss": scale, "rank": world.rank}
    try:
        model.fit(
            x[world.rank :: world.size],
            y[world.rank :: world.size],
            batch_size=32,
            epochs=epochs,
            verbose=0,
            callbacks=kmp.callbacks.default_callbacks(),
        )
    except RuntimeError as exc:
        result["error"] = str(exc).splitlines()[0]
    else:
        result["accuracy"] = float((model.predict(x, verbose=0).argmax(-1) == y).mean())
        result["loss_scale"] = opt.loss_scale
        result["skipped_steps"] = opt.skipped_steps
        result["weights_sum"] = float(sum(np.abs(w).sum() for w in model.get_weights()))
    Path(f"{out}.{world.rank}.json").write_text(json.dumps(result))


def train_step_jobs(epochs: int, folder: str) -> list[dict]:
    """The three 2-rank jobs; one row each (accuracy or the error, ranks identical)."""
    rows = []
    for policy, scale in VARIANTS:
        out = os.path.join(folder, f"{policy}-{scale}")
        kmp_cli = str(Path(sys.executable).with_name("kmp"))
        argv = [kmp_cli, "launch", "-np", "2", __file__]
        argv += ["--worker", policy, str(int(scale)), str(epochs), out]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if not all(Path(f"{out}.{r}.json").exists() for r in (0, 1)):
            raise RuntimeError(
                f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
        row = {**ranks[0], "exit_code": done.returncode}
        row.pop("rank")
        if "weights_sum" in ranks[0]:
            row["ranks_identical"] = ranks[0]["weights_sum"] == ranks[1]["weights_sum"]
            row.pop("weights_sum")
        rows.append(row)
    return rows


def served(folder: str) -> dict:
    """Targets 2 and 3: the pinned model and the kept layer, saved with model.save."""
    import keras
    import numpy as np

    import kmp
    from kmp.hardware import GPU, Hardware

    gpu = Hardware(gpus=(GPU("a100", (8, 0)),))  # the policy without the CPU warning
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 16)).astype("float32"), rng.integers(0, 4, 256)

    def build(pinned: bool) -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
        h = keras.layers.LayerNormalization(dtype="float32" if pinned else None, name="ln")(h)
        logits = keras.layers.Dense(4, name="logits")(h)
        if pinned:
            return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32")(logits))
        model = keras.Model(inputs, keras.layers.Activation("softmax", name="softmax")(logits))
        model = kmp.float32_outputs(model)  # kmp's own head
        kmp.keep_float32(model, "ln")
        return model

    out: dict = {"pinned": {}, "kmp_head": {}, "kept": {}}
    for kind, pinned in (("pinned", True), ("kmp_head", False)):
        with kmp.policy_scope("mixed_float16", hardware=gpu):
            model = build(pinned)
            opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-2))
            model.compile(opt, "sparse_categorical_crossentropy")
            model.fit(x, y, epochs=8, batch_size=32, verbose=0)
            reference = keras.ops.convert_to_numpy(model(x))
            path = os.path.join(folder, f"{kind}.keras")
            model.save(path)
        for policy in ("bfloat16", "mixed_bfloat16"):
            loaded = kmp.load_model(path, policy=policy)
            outputs = loaded(x)
            layers = {layer.name: layer.compute_dtype for layer in loaded.layers[1:]}
            gap = np.abs(keras.ops.convert_to_numpy(outputs) - reference).max()
            out[kind][policy] = {
                "layers": layers,
                "outputs": keras.backend.standardize_dtype(outputs.dtype),
                "max_difference": float(gap),
            }
        if not pinned:  # the kept layer after each loader
            import kmp.saving  # registers kmp's classes for Keras's loader

            for how, load, kwargs in (
                ("keras.saving.load_model", keras.saving.load_model, {}),
                ("kmp.load_model", kmp.load_model, {}),
                ("kmp.load_model bfloat16", kmp.load_model, {"policy": "bfloat16"}),
            ):
                loaded = load(path, **kwargs)
                rows = [r for r in kmp.audit(loaded).rows if r.name == "ln"]
                out["kept"][how] = {
                    "compute": loaded.get_layer("ln").compute_dtype,
                    "audit_shows_kept": bool(rows and rows[0].kept_float32),
                }
    return out


def markdown(payload: dict) -> str:
    from _common import markdown_table

    lines = ["# Keras's own ways under kmp (issue 56)", "", f"Machine: {payload['machine']}", ""]
    lines.append("## keras.io's custom train_step, 2 Horovod ranks, digits")
    rows = [
        [
            r["policy"],
            "yes" if r["scale_loss"] else "no",
            f"{r['accuracy']:.4f}" if "accuracy" in r else "-",
            r.get("loss_scale", "-"),
            r.get("ranks_identical", "-"),
            r.get("error", "")[:90],
        ]
        for r in payload["train_step"]
    ]
    headers = ["policy", "scale_loss", "accuracy", "loss scale", "ranks identical", "error"]
    lines += [markdown_table(headers, rows), ""]
    lines.append("## Served from model.save in another precision")
    rows = [
        [kind, policy, json.dumps(v["layers"]), v["outputs"], f"{v['max_difference']:.2e}"]
        for kind in ("pinned", "kmp_head")
        for policy, v in payload["served"][kind].items()
    ]
    headers = ["model", "policy", "layers compute", "outputs", "largest difference"]
    lines += [markdown_table(headers, rows), ""]
    lines.append("## keep_float32, then model.save")
    rows = [[k, v["compute"], v["audit_shows_kept"]] for k, v in payload["served"]["kept"].items()]
    lines += [markdown_table(["loaded by", "kept layer computes", "audit shows kept"], rows)]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run every part and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--worker", nargs=4, metavar=("POLICY", "SCALE", "EPOCHS", "OUT"))
    args = parser.parse_args()
    if args.worker:
        policy, scale, epochs, out = args.worker
        worker(policy, bool(int(scale)), int(epochs), out)
        return 0
    from _common import machine, write_results

    with tempfile.TemporaryDirectory(prefix="kmp-conventions-") as folder:
        payload = {
            "machine": machine(),
            "train_step": train_step_jobs(args.epochs, folder),
            "served": served(folder),
        }
    path = write_results("keras_conventions", payload, markdown(payload))
    print(markdown(payload))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
