"""``kmp_pytext``: a byte-level text corpus that every machine with Python already has.

The default corpus is the Python standard library's own source code, read from
``sysconfig.get_paths()["stdlib"]``, so nothing is downloaded and every machine
with the same Python version reads the same bytes:

* **Files.** Every ``*.py`` file directly in the stdlib folder (no sub-folders, so
  no ``test/``, ``idlelib/tests`` or vendored packages), sorted by file name, read as raw
  bytes and concatenated in that order (CPython 3.11: 168 files, about 4.7 MB).
* **Cap.** The concatenation is cut at :data:`STDLIB_MAX_BYTES` bytes (1 MiB; on
  CPython 3.11 that is ``__future__.py`` up to part of ``contextlib.py``).
  :func:`corpus_files` lists the files, :func:`read_corpus` gives the bytes, and
  :attr:`Corpus.sha256` fingerprints them, to compare two machines.

A user's folder (``text_dir=``) is read the same way: every regular file below it
(recursively, hidden files and folders skipped) whose bytes decode as UTF-8, sorted
by relative path, concatenated, and capped at ``max_bytes`` when one is given.

**Byte-level.** The tokens are the bytes themselves (vocabulary 256): no tokenizer to
train, ship or version, every file encodes, and the loss in nats per byte converts to
bits per byte (``nats / ln 2``), the usual compression figure, comparable across models
whatever their tokenizer.

**Split.** The last :data:`VALIDATION_FRACTION` (10 %) of the bytes is ``validation``
(``split="test"`` names the same bytes), the rest ``train``: contiguous, so no
validation window overlaps a training one.

**Sequences.** A split of ``n`` bytes gives ``(n - 1) // seq_len`` windows at stride
``seq_len``: window ``i`` has inputs ``bytes[i*L : i*L + L]`` and targets
``bytes[i*L + 1 : i*L + L + 1]`` (the next byte at every position).

Why not a TFDS builder like ``kmp_digits``: the examples here depend on ``seq_len``
and on the user's folder, so a prepared TFDS copy would be one per setting, on disk, of
data that takes milliseconds to read from the source files. The corpus is read into
memory instead and dealt to the ranks by :mod:`kmp.datasets.memory`, which shards and
reshuffles per epoch exactly as :func:`kmp.data.load` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = [
    "NAME",
    "STDLIB_MAX_BYTES",
    "VALIDATION_FRACTION",
    "VOCAB_SIZE",
    "Corpus",
    "corpus_files",
    "read_corpus",
    "split_bytes",
    "windows",
]

NAME = "kmp_pytext"
VOCAB_SIZE = 256
STDLIB_MAX_BYTES = 1 << 20
VALIDATION_FRACTION = 0.1
_SPLITS = {"train": "train", "validation": "validation", "test": "validation"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The bytes of a corpus and where they came from.

    Attributes:
        data: The bytes, as a uint8 array.
        files: The files read, in order (the last one possibly cut by the cap).
        source: The folder the files come from.
        sha256: Hex SHA-256 of ``data``.
    """

    data: np.ndarray
    files: tuple[Path, ...]
    source: Path
    sha256: str


def stdlib_dir() -> Path:
    """Return the standard library's folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def corpus_files(text_dir: str | os.PathLike | None = None) -> list[Path]:
    """Return the corpus's files in reading order (see the module docstring).

    Args:
        text_dir: A folder of text files; None for the standard library's sources.

    Raises:
        TypeError: ``text_dir`` is not a path.
        ValueError: The folder does not exist or holds no (UTF-8) text files.
    """
    if text_dir is None:
        root = stdlib_dir()
        files = sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)
        if not files:
            raise ValueError(
                f"The standard library folder {root} holds no *.py files (a Python built "
                "without its sources?). Pass text_dir= (--text-dir) with a folder of text files."
            )
        return files
    if not isinstance(text_dir, str | os.PathLike):
        raise TypeError(f"text_dir must be a folder path, got {text_dir!r}.")
    root = Path(text_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"text_dir {str(root)!r} is not a folder: pass a folder of text files.")
    files = sorted(
        (
            p
            for p in root.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and _is_utf8(p)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files or not any(p.stat().st_size for p in files):
        raise ValueError(
            f"text_dir {str(root)!r} holds no non-empty UTF-8 text files (hidden files and "
            "binary files are skipped): pass a folder with text in it."
        )
    return files


def read_corpus(text_dir: str | os.PathLike | None = None, max_bytes: int | None = None) -> Corpus:
    """Read the corpus: the files of :func:`corpus_files`, concatenated and capped.

    Args:
        text_dir: A folder of text files; None for the standard library's sources.
        max_bytes: Keep at most this many bytes; default :data:`STDLIB_MAX_BYTES` for the
            standard library and no cap for a folder.

    Returns:
        The :class:`Corpus`.

    Raises:
        TypeError: ``max_bytes`` is not an int.
        ValueError: ``max_bytes < 2``, or see :func:`corpus_files`.
    """
    if max_bytes is None and text_dir is None:
        max_bytes = STDLIB_MAX_BYTES
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int or None, got {max_bytes!r}.")
        if max_bytes < 2:
            raise ValueError(f"max_bytes must be >= 2 (one input and its target), got {max_bytes}.")
    files = corpus_files(text_dir)
    chunks, total, used = [], 0, []
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        raw = path.read_bytes()
        if max_bytes is not None:
            raw = raw[: max_bytes - total]
        chunks.append(raw)
        used.append(path)
        total += len(raw)
    blob = b"".join(chunks)
    source = stdlib_dir() if text_dir is None else Path(text_dir).expanduser()
    data = np.frombuffer(blob, dtype=np.uint8).copy()
    return Corpus(data, tuple(used), source, hashlib.sha256(blob).hexdigest())


def split_bytes(data: np.ndarray, split: str) -> np.ndarray:
    """Return the bytes of ``split``: ``train`` (first 90 %) or ``validation``/``test`` (last 10 %).

    Raises:
        ValueError: An unknown split name.
    """
    if split not in _SPLITS:
        raise ValueError(f"{NAME} has the splits 'train' and 'validation' ('test'), not {split!r}.")
    cut = len(data) - int(len(data) * VALIDATION_FRACTION)
    return data[:cut] if _SPLITS[split] == "train" else data[cut:]


def windows(data: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``data`` into ``(inputs, targets)`` int32 arrays of shape ``[(n - 1) // L, L]``.

    Window ``i`` is ``data[i*L : i*L + L]``; its targets are the same bytes one further.

    Raises:
        TypeError: ``seq_len`` is not an int.
        ValueError: ``seq_len < 1``, or the data is shorter than one window of ``seq_len + 1``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}.")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ValueError(
            f"seq_len={seq_len} needs at least {seq_len + 1} bytes, but the split has "
            f"{len(data)}: use a shorter sequence length or more text (max_bytes, text_dir)."
        )
    stop = count * seq_len
    inputs = data[:stop].reshape(count, seq_len).astype(np.int32)
    targets = data[1 : stop + 1].reshape(count, seq_len).astype(np.int32)
    return inputs, targets
