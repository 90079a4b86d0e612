"""Data sets that kmp prepares on this machine, with no download.

Two TensorFlow Datasets builders ship with kmp:

* ``kmp_digits``: scikit-learn's bundled handwritten digits, 1,797 real 8x8
  grayscale images in 10 classes, with a fixed stratified 80/20 train/test
  split (1,438 / 359 examples). The pixels come from the scikit-learn package
  itself, so preparing needs no internet.
* ``kmp_synthetic_images``: **synthetic** 64x64 RGB images in 10 classes
  (512 train / 128 test), generated from a fixed seed, for small-scale runs
  of image models such as ResNet-50. They are not real photographs.

Both are prepared on first use into the cache directory (``$KMP_DATA_DIR``, or
``~/.cache/kmp/tensorflow_datasets``) and read back with TensorFlow Datasets
from then on. Preparing is safe when several processes start at once: it runs
under an exclusive file lock and TFDS moves the finished files into place in
one rename, so a second process either waits and finds the data ready, or
finds it complete. (File locks need a local or lock-capable file system;
on a shared file system without locking, prepare once before launching.)

Example::

    from kmp import datasets
    builder = datasets.prepare("kmp_digits")        # seconds, first time only
    print(builder.info.splits["train"].num_examples)  # 1437

TensorFlow Datasets and scikit-learn are imported only when a builder is
needed.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kmp._imports import optional_import

__all__ = [
    "BUILDERS",
    "DATA_DIR_ENV_VAR",
    "builder",
    "builder_class",
    "default_data_dir",
    "is_prepared",
    "prepare",
    "prepared_names",
    "resolve_data_dir",
]

DATA_DIR_ENV_VAR = "KMP_DATA_DIR"

# TFDS name -> "module:class" of the builders that ship with kmp.
BUILDERS: dict[str, str] = {
    "kmp_digits": "kmp.datasets.digits:KmpDigits",
    "kmp_synthetic_images": "kmp.datasets.synthetic:KmpSyntheticImages",
}


def default_data_dir() -> Path:
    """Return the cache directory: ``$KMP_DATA_DIR`` or ``~/.cache/kmp/tensorflow_datasets``."""
    env = os.environ.get(DATA_DIR_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kmp" / "tensorflow_datasets"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Return ``data_dir`` as an absolute path, or the default cache directory when None."""
    path = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return path.resolve()


def builder_class(name: str) -> type:
    """Return (and register with TFDS) the builder class of a kmp data set.

    Args:
        name: One of :data:`BUILDERS`.

    Returns:
        The ``tfds.core.GeneratorBasedBuilder`` subclass.

    Raises:
        KeyError: ``name`` is not a kmp data set.
        ImportError: TensorFlow Datasets is not installed.
    """
    if name not in BUILDERS:
        raise KeyError(f"{name!r} is not a kmp data set; kmp ships {', '.join(BUILDERS)}")
    optional_import("tensorflow_datasets", feature=f"the {name} data set")
    module_name, class_name = BUILDERS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def builder(name: str, data_dir: str | os.PathLike | None = None) -> Any:
    """Return the TFDS builder of a kmp data set (prepared or not) in ``data_dir``."""
    return builder_class(name)(data_dir=str(resolve_data_dir(data_dir)))


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _ready(tfds_builder: Any) -> bool:
    # TFDS writes dataset_info.json into a temporary folder and renames the folder into
    # place when everything is written, so the file in the final folder means "complete".
    return (Path(os.fspath(tfds_builder.data_path)) / "dataset_info.json").is_file()


def is_prepared(name: str, data_dir: str | os.PathLike | None = None) -> bool:
    """Return True if the kmp data set ``name`` is ready to read in ``data_dir``."""
    return _ready(builder(name, data_dir))


@contextlib.contextmanager
def _no_progress_bars(tfds: Any) -> Iterator[None]:
    was_on = getattr(tfds.core.utils.tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(was_on)


def prepare(name: str, data_dir: str | os.PathLike | None = None) -> Any:
    """Prepare a kmp data set in ``data_dir`` if it is not there yet; return its builder.

    Generating the examples needs no network. Concurrent callers (for example
    two ranks starting together) serialise on a file lock next to the data;
    the one that comes second finds the data prepared and returns at once.

    Args:
        name: One of :data:`BUILDERS`.
        data_dir: TFDS data directory; the default cache directory when None.

    Returns:
        The prepared ``tfds`` builder.
    """
    root = resolve_data_dir(data_dir)
    ready = builder(name, root)
    if _ready(ready):
        return ready
    tfds = optional_import("tensorflow_datasets", feature=f"preparing {name}")
    with _exclusive_lock(root / f".{name}.lock"):
        ready = builder(name, root)  # re-read: another process may have finished meanwhile
        if not _ready(ready):
            print(
                f"kmp.datasets: preparing {name!r} in {root} (first use; generated on this "
                "machine, nothing is downloaded)",
                flush=True,
            )
            # TFDS's own messages speak of downloading; keep them out of the way.
            with _no_progress_bars(tfds), contextlib.redirect_stdout(io.StringIO()):
                ready.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(try_download_gcs=False)
                )
    return builder(name, root)


def prepared_names(data_dir: str | os.PathLike | None = None) -> list[str]:
    """Names of the TFDS data sets prepared in ``data_dir`` (any builder, not only kmp's).

    A data set counts as prepared when ``<data_dir>/<name>/<version>/`` (or
    ``<data_dir>/<name>/<config>/<version>/``, listed as ``name/config``) holds
    a ``dataset_info.json``.
    """
    root = resolve_data_dir(data_dir)
    if not root.is_dir():
        return []
    names = {info.parent.parent.name for info in root.glob("*/*/dataset_info.json")}
    names |= {
        f"{info.parent.parent.parent.name}/{info.parent.parent.name}"
        for info in root.glob("*/*/*/dataset_info.json")
    }
    return sorted(n for n in names if not n.startswith(".") and "incomplete" not in n)
