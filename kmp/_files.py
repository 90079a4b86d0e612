"""Atomic file writes, once: a reader sees the old file or the whole new one, never a part.

:func:`atomic_write` is kmp's one way to replace a file (checkpoints, ``kmp
cluster``'s state and keys, the cached Horovod wheel). Its guarantee:

1. the new content is written to a temporary file in the target's own folder
   (so the final rename never crosses file systems), under a fresh random name;
2. that file is flushed and ``fsync``-ed, and given its mode if one is asked for;
3. ``os.replace`` moves it over the target in one step (atomic on POSIX);
4. the folder is ``fsync``-ed where the system allows it, so the rename itself
   survives a power cut (Linux; skipped silently where a folder cannot be opened).

If anything fails before the rename, the temporary file is removed and the error
raised again; the target is untouched. Standard library only.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """``fsync`` a folder, so that a rename in it is durable; a no-op where that is impossible."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows, or a folder that cannot be opened for reading
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[str], Any],
    *,
    mode: int | None = None,
    temp_prefix: str = ".tmp-",
) -> str:
    """Replace ``path`` by what ``write(tmp)`` writes, atomically and durably (see the module).

    Args:
        path: The final file; its folder is created if missing. The temporary
            name ends with the final name, so extension checks (``.keras``,
            ``.weights.h5``) still pass.
        write: Writes a complete file at the path it is given (and closes it).
        mode: Permission bits for the new file (e.g. ``0o600``), set before the
            rename; None keeps what ``write`` created.
        temp_prefix: Starts the temporary name, so that a reader listing the
            folder can skip temporary files.

    Returns:
        ``path`` as a string.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{temp_prefix}{uuid.uuid4().hex[:12]}-{os.path.basename(path)}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int | None = None) -> str:
    """Replace ``path`` by ``text`` with :func:`atomic_write`.

    The temporary file is created new (never through an existing file or a
    symlink) and, with ``mode``, with those permission bits from the start, so
    a private file (a key, an sshd configuration) is never readable by others.
    """

    def write(tmp: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(tmp, flags, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    return atomic_write(path, write, mode=mode)
