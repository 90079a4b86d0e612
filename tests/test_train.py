"""launch/train.py and launch/demo.py: resume, ResNet-50, GPT and MNIST-1D on 2 ranks, the demo."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support import ROOT, requires_horovod

TRAIN = ROOT / "launch" / "train.py"
DEMO = ROOT / "launch" / "demo.py"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Both kmp data sets prepared once, so the ranks only read them."""
    from kmp import datasets

    root = tmp_path_factory.mktemp("tfds")
    datasets.prepare("kmp_digits", root)
    datasets.prepare("kmp_synthetic_images", root)
    return root


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMP_")}
    env.update(
        KMP_DATA_DIR=str(data_dir),
        PYTHONPATH=str(ROOT),
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    return env


def _run(argv: list[str], data_dir: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv, env=_env(data_dir), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(argv)} failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _train(data_dir: Path, *args: str, np: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "kmp.cli", "launch", "-np", str(np)]
    if np > 1:
        launch.append("--gloo")
    return _run([*launch, str(TRAIN), *args], data_dir)


def test_bad_flags_are_clear_errors(data_dir):
    for args, message in [
        (["--model", "vgg"], "invalid choice: 'vgg'"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--steps-per-epoch", "0"], "--steps-per-epoch must be >= 1"),
        (["--bucket-bytes", "0"], "--bucket-bytes must be >= 1"),
        (["--model", "gpt", "--dataset", "kmp_digits"], "do not fit"),
        (["--model", "digits_cnn", "--dataset", "kmp_pytext"], "do not fit"),
        (["--model", "mnist1d_cnn", "--text-dir", "."], "--text-dir is for"),
        (["--model", "mnist1d_cnn", "--elastic"], "mnist1d lives in memory"),
        (["--model", "gpt", "--seq-len", "0"], "--seq-len must be >= 1"),
        (["--eval-every", "-1"], "--eval-every must be >= 0"),
        (["--eval-every", "2", "--elastic"], "--eval-every evaluates on every rank"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(TRAIN), *args],
            env=_env(data_dir), cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_resume_after_stopping_part_way(data_dir, tmp_path):
    """A run stopped after epoch 2 of 3 resumes at epoch 2 with its loss scale, not afresh."""
    # The first and third runs are single processes, the second runs on 2 ranks.
    ckpt = tmp_path / "ckpt"
    common = [
        "--model", "digits_cnn", "--policy", "mixed_float16", "--epochs", "3",
        "--steps-per-epoch", "4", "--batch-size", "16", "--checkpoint-dir", str(ckpt),
        # Let the dynamic loss scale move within a few steps, so it is worth checking.
        "--loss-scale-growth-interval", "2",
    ]  # fmt: skip
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    _train(data_dir, *common, "--stop-after-epochs", "2", "--summary", str(first))
    a = json.loads(first.read_text())
    assert (a["initial_epoch"], a["epochs_run"], a["final_epoch"]) == (0, 2, 2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0001.keras", "ckpt-0002.keras"]
    assert a["loss_scale_start"] == 2.0**15
    assert a["loss_scale_end"] != a["loss_scale_start"]  # 8 steps moved it

    # Resume on 2 ranks: rank 0 picks the checkpoint and tells rank 1; both continue from it.
    # ... with XLA for the forward and backward pass, the allreduce outside it.
    proc = _train(data_dir, *common, "--jit-gradients", "--summary", str(second), np=2)
    b = json.loads(second.read_text())
    assert b["resumed_from"].endswith("ckpt-0002.keras") and b["ranks"] == 2
    assert "resumed from" in proc.stdout
    assert b["weights_max_diff"] == 0.0
    assert b["xla_traces"] >= 1 and a["xla_traces"] is None
    # Same epoch counter: epoch 3 is the only one trained, and the step counter goes on.
    assert (b["initial_epoch"], b["epochs_run"], b["final_epoch"]) == (2, 1, 3)
    # (the optimizer counts applied updates: 4 steps per epoch minus skipped ones)
    assert b["iterations_start"] == a["iterations_end"] == 8 - a["skipped_steps"]
    assert b["iterations_end"] == 12 - b["skipped_steps"]
    # Same loss scale and skipped-step count as where the first run stopped.
    assert b["loss_scale_start"] == a["loss_scale_end"]
    assert b["skipped_steps"] >= a["skipped_steps"]
    assert (ckpt / "ckpt-0003.keras").exists()

    # A third start finds all 3 epochs done and trains nothing.
    third = tmp_path / "third.json"
    _train(data_dir, *common, "--summary", str(third))
    c = json.loads(third.read_text())
    assert (c["initial_epoch"], c["epochs_run"]) == (3, 0)
    assert c["loss_scale_start"] == b["loss_scale_end"]


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_resnet50_two_ranks_few_steps_finite_loss(data_dir, tmp_path):
    summary = tmp_path / "resnet.json"
    _train(
        data_dir,
        "--model", "resnet50", "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "4",
        "--image-size", "64", "--compression", "fp16", "--scale-lr", "--warmup-epochs", "1",
        "--bucket-bytes", str(4 << 20), "--summary", str(summary),
        np=2,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    assert s["model"] == "resnet50" and s["dataset"] == "kmp_synthetic_images"
    assert s["ranks"] == 2 and s["iterations_end"] == 3
    assert s["bucket_bytes"] == 4 << 20
    assert math.isfinite(s["final_loss"])
    # Checksums of all 23.5M trainable weights agree across ranks (BatchNormalization moving
    # statistics follow each rank's own batches and are reported apart).
    assert s["weights_max_diff"] == 0.0
    assert "non_trainable_max_diff" in s
    assert 0.0 <= s["test_accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_demo_reaches_its_accuracy_target_on_two_ranks(data_dir, tmp_path):
    out = tmp_path / "demo.json"
    proc = _run(
        [sys.executable, str(DEMO), "--compare", "none", "--out", str(tmp_path / "logs"),
         "--json", str(out)],
        data_dir,
    )  # fmt: skip
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert result["ok"] and "kmp demo passed" in proc.stdout
    assert run["ranks"] == 2 and run["policy_reason"].startswith("auto")
    assert run["test_accuracy"] >= 0.95
    assert run["weights_max_diff"] == 0.0  # full weights allgathered: bit-identical ranks
    assert run["engine"] == "horovod"
    assert run["jit_compile"] is False  # Horovod's ops have no XLA kernels


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_demo_reaches_its_accuracy_target_on_the_jax_engine(data_dir, tmp_path):
    out = tmp_path / "demo.json"
    proc = _run(
        [sys.executable, str(DEMO), "--engine", "jax", "--compare", "none",
         "--out", str(tmp_path / "logs"), "--json", str(out)],
        data_dir,
    )  # fmt: skip
    run = json.loads(out.read_text())["runs"][0]
    assert "kmp demo passed" in proc.stdout
    assert run["engine"] == "jax" and run["ranks"] == 2
    # The whole step compiled (kmp.xla.step_jit_compile): op by op it ran 8-60x slower.
    assert run["jit_compile"] is True
    assert run["test_accuracy"] >= 0.95
    assert run["weights_max_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_gpt_two_ranks_reports_nats_bits_per_byte_and_tokens_per_sec(tmp_path):
    from kmp.datasets import text

    summary = tmp_path / "gpt.json"
    proc = _train(
        tmp_path,
        "--model", "gpt", "--policy", "mixed_bfloat16", "--seq-len", "32", "--batch-size", "8",
        "--epochs", "2", "--steps-per-epoch", "5", "--summary", str(summary),
        np=2,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    assert s["dataset"] == "kmp_pytext" and s["ranks"] == 2 and s["iterations_end"] == 10
    assert s["test_accuracy"] is None
    # The whole validation split (the corpus's last 10 %, in windows of 32), all ranks.
    val = text.split_bytes(text.read_corpus().data, "validation")
    assert s["val_bytes"] == (len(val) - 1) // 32 * 32
    assert 0 < s["val_loss_nats"] < math.log(256)  # better than a uniform guess over bytes
    assert s["val_bits_per_byte"] == pytest.approx(s["val_loss_nats"] / math.log(2))
    assert s["tokens_per_sec"] == pytest.approx(s["images_per_sec"] * 32) and s["tokens_per_sec"]
    assert s["weights_max_diff"] == 0.0
    assert "nats/byte" in proc.stdout and "tokens/s" in proc.stdout


@pytest.mark.slow
def test_gpt_on_the_jax_backend_is_evaluated(tmp_path):
    # The validation pass feeds the JAX backend's predict_on_batch arrays, not tf.Tensors.
    summary = tmp_path / "gpt.json"
    launch = [sys.executable, "-m", "kmp.cli", "launch", "--engine", "jax", "-np", "1"]
    _run(
        [*launch, str(TRAIN), "--model", "gpt", "--policy", "mixed_bfloat16", "--seq-len", "16",
         "--batch-size", "4", "--epochs", "1", "--steps-per-epoch", "2", "--summary", str(summary)],
        tmp_path,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    assert s["jit_compile"] is True and s["iterations_end"] == 2  # True: the JAX backend
    assert 0 < s["val_loss_nats"] < math.log(256) and s["val_bytes"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_mnist1d_cnn_two_ranks_learns(tmp_path):
    pytest.importorskip("mnist1d")
    summary = tmp_path / "mnist1d.json"
    _train(
        tmp_path, "--model", "mnist1d_cnn", "--policy", "float32", "--epochs", "2",
        "--eval-every", "1", "--summary", str(summary), np=2,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    assert s["dataset"] == "mnist1d" and s["batch_size_per_rank"] == 50
    assert s["iterations_end"] == 2 * 40  # 4,000 signals / 2 ranks / 50
    assert s["test_accuracy"] > 0.3  # chance is 0.1
    assert s["weights_max_diff"] == 0.0
    # --eval-every 1: the test accuracy after each epoch, the last one the final figure.
    curve = s["eval_history"]
    assert [(p["epoch"], p["step"]) for p in curve] == [(1, 40), (2, 80)]
    assert curve[-1]["test_accuracy"] == s["test_accuracy"]


@pytest.mark.slow
@pytest.mark.distributed
@requires_horovod
def test_gpt2_hub_two_ranks_through_train_py(tmp_path):
    """KerasHub's GPT2CausalLM, the user's path: train.py on 2 ranks, evaluated per epoch."""
    pytest.importorskip("keras_hub")
    summary = tmp_path / "hub.json"
    _train(
        tmp_path,
        "--model", "gpt2-hub", "--policy", "mixed_bfloat16", "--seq-len", "32",
        "--batch-size", "4", "--epochs", "2", "--steps-per-epoch", "2", "--eval-every", "1",
        "--summary", str(summary),
        np=2,
    )  # fmt: skip
    s = json.loads(summary.read_text())
    assert s["model"] == "gpt2-hub" and s["iterations_end"] == 4
    assert s["weights_max_diff"] == 0.0
    curve = s["eval_history"]
    assert [p["step"] for p in curve] == [2, 4]
    assert curve[-1]["val_loss_nats"] == s["val_loss_nats"] < math.log(256)
