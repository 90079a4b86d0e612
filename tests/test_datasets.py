"""kmp.datasets: the offline digits and synthetic-image TFDS builders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kmp import datasets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """One data directory for the module, with both kmp data sets prepared."""
    root = tmp_path_factory.mktemp("tfds")
    datasets.prepare("kmp_digits", root)
    datasets.prepare("kmp_synthetic_images", root)
    return root


def _read_all(builder, split):
    import tensorflow_datasets as tfds

    return list(tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)))


def test_import_is_light():
    code = (
        "import sys, kmp.datasets, kmp.data, kmp.commands.launch\n"
        "print(sorted(m for m in ('tensorflow_datasets', 'horovod', 'sklearn', 'tensorflow')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_default_data_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KMP_DATA_DIR", str(tmp_path / "cache"))
    assert datasets.default_data_dir() == tmp_path / "cache"
    assert datasets.resolve_data_dir() == (tmp_path / "cache").resolve()
    monkeypatch.delenv("KMP_DATA_DIR")
    assert datasets.default_data_dir() == Path.home() / ".cache/kmp/tensorflow_datasets"
    assert datasets.resolve_data_dir(tmp_path) == tmp_path.resolve()


def test_unknown_builder_name():
    with pytest.raises(KeyError, match="kmp_digits"):
        datasets.builder_class("kmp_nope")


def test_split_indices_is_stratified_disjoint_and_deterministic():
    from kmp.datasets.digits import split_indices

    labels = np.repeat(np.arange(4), [10, 20, 30, 41])
    train, test = split_indices(labels, test_fraction=0.2, seed=3)
    assert set(train).isdisjoint(test)
    assert sorted([*train, *test]) == list(range(len(labels)))
    assert [int((labels[test] == c).sum()) for c in range(4)] == [2, 4, 6, 8]
    again = split_indices(labels, test_fraction=0.2, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    other = split_indices(labels, test_fraction=0.2, seed=4)
    assert not np.array_equal(test, other[1])


def test_digits_prepared_offline_hold_all_1797_real_images(data_dir):
    from sklearn.datasets import load_digits

    builder = datasets.prepare("kmp_digits", data_dir)
    splits = builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (1438, 359)
    assert datasets.is_prepared("kmp_digits", data_dir)

    train, test = _read_all(builder, "train"), _read_all(builder, "test")
    rows = [int(ex["index"]) for ex in train + test]
    assert len(rows) == 1797 and sorted(rows) == list(range(1797))

    sk = load_digits()
    for ex in train[:50] + test[:50]:
        row = int(ex["index"])
        assert ex["image"].shape == (8, 8, 1) and ex["image"].dtype == np.uint8
        # Stored 0..255 from scikit-learn's 0..16, one to one.
        assert np.array_equal(np.rint(ex["image"][..., 0].astype(float) * 16 / 255), sk.images[row])
        assert int(ex["label"]) == sk.target[row]
    # Every class is in both splits, about 20 % in test.
    test_labels = np.array([int(ex["label"]) for ex in test])
    counts = np.bincount(test_labels, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 37


def test_prepare_twice_reuses_the_data(data_dir):
    builder = datasets.builder("kmp_digits", data_dir)
    record = next(Path(os.fspath(builder.data_path)).glob("*train.tfrecord*"))
    before = record.stat().st_mtime_ns
    datasets.prepare("kmp_digits", data_dir)
    assert record.stat().st_mtime_ns == before


def test_synthetic_images_are_labelled_synthetic_and_deterministic(data_dir):
    from kmp.datasets.synthetic import make_example

    builder = datasets.prepare("kmp_synthetic_images", data_dir)
    assert "SYNTHETIC" in builder.info.description
    splits = builder.info.splits
    assert (splits["train"].num_examples, splits["test"].num_examples) == (512, 128)
    test = _read_all(builder, "test")
    labels = np.array([int(ex["label"]) for ex in test])
    assert np.bincount(labels, minlength=10).min() >= 12  # balanced classes
    for ex in test[:3]:
        assert ex["image"].shape == (64, 64, 3) and ex["image"].dtype == np.uint8
    image, label = make_example("test", 7)
    again, _ = make_example("test", 7)
    assert label == 7 and np.array_equal(image, again)
    assert not np.array_equal(image, make_example("train", 7)[0])
    # Images of one class differ (random phase and noise), classes differ in colour.
    assert not np.array_equal(make_example("train", 0)[0], make_example("train", 10)[0])


def test_prepared_names_lists_what_is_in_a_data_dir(data_dir, tmp_path):
    assert datasets.prepared_names(data_dir) == ["kmp_digits", "kmp_synthetic_images"]
    assert datasets.prepared_names(tmp_path / "missing") == []


def test_two_processes_preparing_at_once_both_succeed(tmp_path):
    """Two processes start preparing the same data set together: the lock serialises them."""
    code = (
        "import json, sys, kmp.datasets as d\n"
        "b = d.prepare('kmp_digits', sys.argv[1])\n"
        "print(json.dumps({k: v.num_examples for k, v in b.info.splits.items()}))\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"train": 1438, "test": 359}
    assert datasets.prepared_names(tmp_path) == ["kmp_digits"]
    # One finished version folder, no temporary leftovers.
    assert [p.name for p in (tmp_path / "kmp_digits").iterdir()] == ["1.0.0"]
