"""kmp._files: the one atomic write (temporary file, fsync, os.replace, folder fsync)."""

from __future__ import annotations

import os
import stat

import pytest

from kmp import _files


def test_the_target_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    target = tmp_path / "sub" / "state.json"  # the folder is created
    seen = []

    def write(tmp):
        assert os.path.dirname(tmp) == str(target.parent)  # same folder: the rename is atomic
        assert tmp.endswith("state.json") and os.path.basename(tmp).startswith(".tmp-")
        seen.append(target.exists())
        with open(tmp, "w") as f:
            f.write("new")

    assert _files.atomic_write(target, write) == str(target)
    _files.atomic_write(target, write)
    assert seen == [False, True]
    assert target.read_text() == "new"
    assert os.listdir(target.parent) == ["state.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "w.keras"
    target.write_text("old")

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _files.atomic_write(target, broken)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["w.keras"]


def test_the_file_and_its_folder_are_synced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _files.atomic_write_text(tmp_path / "a.txt", "x")
    assert synced == [False, True]  # the file before the rename, the folder after it


def test_text_is_written_with_its_mode_from_the_start(tmp_path):
    target = tmp_path / "key"
    _files.atomic_write_text(target, "secret\n", mode=0o600)
    assert target.read_text() == "secret\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    _files.atomic_write_text(target, "public\n", mode=0o644)  # replaces, and re-modes
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.read_text() == "public\n"


def test_a_symlink_target_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    link = tmp_path / "config"
    link.symlink_to(elsewhere)
    _files.atomic_write_text(link, "new")
    assert not link.is_symlink() and link.read_text() == "new"
    assert elsewhere.read_text() == "keep"
