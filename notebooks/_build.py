"""Build the tutorial notebooks from their sources and run them, saving the outputs.

Each notebook is written as a plain Python file in ``notebooks/_src/`` in the
"percent" format (``# %%`` starts a code cell, ``# %% [markdown]`` a Markdown
cell whose lines are ``# `` comments), which diffs and reviews like code. This
script turns each source into a ``.ipynb`` next to this file, executes it top to
bottom in a Jupyter kernel of this Python (the project's ``.venv``) and saves it
with its outputs, plots included::

    .venv/bin/python notebooks/_build.py                 # all of them
    .venv/bin/python notebooks/_build.py 02_loss_scaling # one

Edit the sources, not the ``.ipynb`` files: a rebuild overwrites them.
``tests/test_notebooks.py`` executes the committed notebooks (in a temporary
copy) and checks that they carry their outputs.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "_src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (kmp .venv)", "language": "python"}
CELL_TIMEOUT_S = 600

_CELL_MARK = re.compile(r"^# %%(?P<md> \[markdown\])?\s*$")
# TensorFlow's C++ start-up lines (absl), printed before TF_CPP_MIN_LOG_LEVEL applies on
# some CPUs: machine noise, not tutorial output, so they are not saved.
_TF_LOG_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} )")


def drop_tf_startup_logs(cell: nbformat.NotebookNode) -> None:
    """Remove stderr outputs that hold nothing but TensorFlow's C++ log lines."""
    if cell.get("cell_type") != "code":
        return
    kept = []
    for out in cell.get("outputs", []):
        text = out.get("text", "") if out.get("name") == "stderr" else None
        if text is not None:
            lines = [ln for ln in text.splitlines() if not _TF_LOG_LINE.match(ln)]
            if not any(ln.strip() for ln in lines):
                continue
            out["text"] = "\n".join(lines) + "\n"
        kept.append(out)
    cell["outputs"] = kept


def parse_percent(text: str) -> list[nbformat.NotebookNode]:
    """Split percent-format source into notebook cells.

    Args:
        text: The source file's text.

    Returns:
        The cells, in order; empty cells are dropped.
    """
    cells = []
    kind, lines = None, []

    def flush() -> None:
        body = "\n".join(lines).strip("\n")
        if kind is None or not body.strip():
            return
        if kind == "markdown":
            md = "\n".join(
                ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(md))
        else:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        m = _CELL_MARK.match(line)
        if m:
            flush()
            kind, lines = ("markdown" if m.group("md") else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build(name: str) -> Path:
    """Build, execute and save one notebook; return its path."""
    source = SOURCES / f"{name}.py"
    if not source.is_file():
        known = ", ".join(p.stem for p in sorted(SOURCES.glob("[0-9]*.py")))
        raise SystemExit(f"No notebook source {source}; known: {known}")
    nb = nbformat.v4.new_notebook()
    nb.cells = parse_percent(source.read_text())
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    start = time.perf_counter()
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNELSPEC["name"],
        resources={"metadata": {"path": str(HERE)}},
        record_timing=False,
    )
    client.execute()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)  # nbclient writes the kernel's own name
    for i, cell in enumerate(nb.cells):  # stable ids keep rebuild diffs small
        cell["id"] = f"{name.split('_')[0]}-{i:02d}"
        drop_tf_startup_logs(cell)
    out = HERE / f"{name}.ipynb"
    nbformat.validate(nb)
    nbformat.write(nb, out)
    print(f"{out.name}: {len(nb.cells)} cells, ran in {time.perf_counter() - start:.0f} s")
    return out


def main(argv: list[str]) -> int:
    """Build the notebooks named in ``argv`` (all when empty)."""
    names = argv or [p.stem for p in sorted(SOURCES.glob("[0-9]*.py"))]
    for name in names:
        build(name.removesuffix(".py").removesuffix(".ipynb"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
