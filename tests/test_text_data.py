"""kmp_pytext (kmp.datasets.text, kmp.datasets.memory) and the language models of launch/."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import keras
import numpy as np
import pytest

from kmp.datasets import memory, text
from tests._support import ROOT


def _workloads():
    spec = importlib.util.spec_from_file_location(
        "kmp_launch_workloads_test", ROOT / "launch" / "workloads.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def folder(tmp_path) -> Path:
    (tmp_path / "b.txt").write_text("second file\n" * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.md").write_text("first, in a sub-folder\n" * 10)
    (tmp_path / ".hidden.txt").write_text("never read")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 50)
    return tmp_path


# ----------------------------------------------------------------------- corpus


def test_stdlib_corpus_is_the_sorted_top_level_sources_capped():
    corpus = text.read_corpus()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.name for p in stdlib.glob("*.py"))
    assert [p.name for p in corpus.files] == names[: len(corpus.files)]
    assert all(p.parent == stdlib for p in corpus.files)  # no sub-folders: no test/
    assert len(corpus.data) == text.STDLIB_MAX_BYTES
    expected = b"".join(p.read_bytes() for p in corpus.files)[: text.STDLIB_MAX_BYTES]
    assert corpus.data.tobytes() == expected
    # The same file list reads the same bytes again.
    assert text.read_corpus().sha256 == corpus.sha256


def test_folder_corpus_reads_utf8_files_by_relative_path(folder):
    corpus = text.read_corpus(folder)
    assert [p.relative_to(folder).as_posix() for p in corpus.files] == ["b.txt", "sub/a.md"]
    assert (
        corpus.data.tobytes()
        == (folder / "b.txt").read_bytes() + (folder / "sub" / "a.md").read_bytes()
    )
    assert len(text.read_corpus(folder, max_bytes=100).data) == 100


def test_split_and_windows_shift_targets_by_one():
    data = np.arange(200, dtype=np.uint8)
    train, val = text.split_bytes(data, "train"), text.split_bytes(data, "validation")
    assert (len(train), len(val)) == (180, 20)
    assert np.array_equal(np.concatenate([train, val]), data)
    assert np.array_equal(text.split_bytes(data, "test"), val)
    inputs, targets = text.windows(train, 16)
    assert inputs.shape == targets.shape == ((180 - 1) // 16, 16)
    assert inputs.dtype == np.int32
    assert np.array_equal(inputs[3], train[48:64]) and np.array_equal(targets[3], train[49:65])


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda d: text.read_corpus(d / "nothing"), ValueError, "is not a folder"),
        (lambda d: text.read_corpus(42), TypeError, "folder path"),
        (lambda d: text.read_corpus(d, max_bytes="10"), TypeError, "max_bytes"),
        (lambda d: text.windows(np.zeros(10, np.uint8), 10), ValueError, "shorter sequence"),
        (lambda d: text.windows(np.zeros(10, np.uint8), 2.5), TypeError, "seq_len"),
        (lambda d: text.split_bytes(np.zeros(10, np.uint8), "dev"), ValueError, "'train'"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, call, error, message):
    with pytest.raises(error, match=message):
        call(tmp_path)


def test_folder_without_text_files_is_a_clear_error(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match="no non-empty UTF-8 text files"):
        text.read_corpus(tmp_path)


def test_sequence_longer_than_the_data_is_a_clear_error(folder):
    with pytest.raises(ValueError, match="needs at least"):
        memory.shard_spec("kmp_pytext", "validation", batch_size=1, seq_len=500, text_dir=folder)


# ------------------------------------------------------------------ rank shards


def test_rank_shards_are_disjoint_cover_and_reshuffle_per_epoch(tmp_path):
    # 8-byte lines, all different: every window of 8 at stride 8 is one line.
    (tmp_path / "lines.txt").write_text("".join(f"{i:07d}\n" for i in range(60)))
    opts = {"seq_len": 8, "text_dir": tmp_path}
    inputs, _, _ = memory.arrays("kmp_pytext", "train", **opts)
    spec = memory.shard_spec("kmp_pytext", "train", batch_size=4, size=2, **opts)
    assert spec.num_classes == 256 and spec.image_shape == (8,)
    rows = {tuple(r): i for i, r in enumerate(inputs)}
    assert len(rows) == len(inputs)  # every window is unique in this corpus

    def seen(rank, epoch, batch_size=4):
        ds = memory.load("kmp_pytext", "train", batch_size=batch_size, rank=rank, size=2,
                         epoch=epoch, **opts)  # fmt: skip
        out = []
        for x, y in ds:
            assert x.shape == y.shape == (batch_size, 8)
            assert np.array_equal(x.numpy()[:, 1:], y.numpy()[:, :-1])
            out += [rows[tuple(r)] for r in x.numpy()]
        return out

    a, b = seen(0, 0), seen(1, 0)
    assert len(a) == len(b) == spec.steps_per_epoch * 4
    assert not set(a) & set(b)
    assert len(set(a)) + len(set(b)) == len(inputs) - spec.dropped_per_epoch
    epoch1 = seen(0, 1)
    assert epoch1 != a and seen(0, 0) == a  # each epoch its own order, repeatable
    # Unbatched: each rank's whole part; the two cover every window once.
    whole = [
        [rows[tuple(x.numpy())] for x, _ in memory.load(
            "kmp_pytext", "train", batch_size=None, rank=r, size=2, **opts)]
        for r in (0, 1)
    ]  # fmt: skip
    assert sorted(whole[0] + whole[1]) == list(range(len(inputs)))
    assert set(a) | set(epoch1) <= set(whole[0])  # rank 0 stays in its part


# ------------------------------------------------------------------------ models


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_gpt_computes_in_16_bits_with_float32_logits(policy):
    import kmp

    workloads = _workloads()
    keras.config.set_dtype_policy(policy)
    model = kmp.float32_outputs(workloads.build("gpt", (16,), 256, policy))
    attention = model.get_layer("block0_attention")
    assert attention.compute_dtype == policy.removeprefix("mixed_")
    assert attention.variable_dtype == "float32"
    logits = model(np.zeros((2, 16), np.int32))
    assert logits.dtype == "float32" and logits.shape == (2, 16, 256)


def test_gpt_is_causal_a_future_byte_changes_no_earlier_logits():
    workloads = _workloads()
    model = workloads.build_gpt(seq_len=12, width=32, depth=2, heads=2)
    tokens = np.random.default_rng(0).integers(0, 256, (1, 12)).astype(np.int32)
    changed = tokens.copy()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    before, after = np.asarray(model(tokens)), np.asarray(model(changed))
    np.testing.assert_array_equal(before[0, :7], after[0, :7])
    assert not np.allclose(before[0, 7:], after[0, 7:])


def test_gpt2_hub_is_a_tiny_byte_level_causal_lm():
    pytest.importorskip("keras_hub")
    import kmp

    keras.config.set_dtype_policy("mixed_bfloat16")
    model = kmp.float32_outputs(_workloads().build("gpt2-hub", (8,), 256, "bfloat16"))
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    logits = model({"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)})
    assert logits.shape == (2, 8, 256) and logits.dtype == "float32"
