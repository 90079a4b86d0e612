"""The tutorial notebooks under notebooks/: committed with outputs, linked, and still running.

The fast checks read the committed ``.ipynb`` files. The ``notebook``-marked tests execute
each notebook top to bottom with nbclient in a Jupyter kernel of this interpreter (the
project's ``.venv``), in a temporary copy, and fail on any error in any cell.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests._support import requires_horovod

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = (
    "01_quickstart",
    "02_loss_scaling",
    "03_distributed_horovod",
    "04_migrating",
    "05_transformers",
    "06_serving",
)
WITH_PLOTS = (
    "01_quickstart",
    "02_loss_scaling",
    "03_distributed_horovod",
    "05_transformers",
    "06_serving",
)
CELL_TIMEOUT_S = 600

_KERNEL_CHECK = "import sys; print('KMP-KERNEL-PREFIX=' + sys.prefix)"


def _read(name: str):
    return nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb) -> list:
    return [o for c in _code_cells(nb) for o in c.get("outputs", [])]


def _images(nb) -> list:
    return [o for o in _outputs(nb) if "image/png" in o.get("data", {})]


# ------------------------------------------------------------------ committed files


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_executed_with_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    cells = _code_cells(nb)
    assert cells, f"{name} has no code cells"
    unexecuted = [i for i, c in enumerate(cells) if c.get("execution_count") is None]
    assert not unexecuted, f"{name}: code cells {unexecuted} were not executed before committing"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{name} was not run top to bottom in one kernel (execution counts {counts}); "
        "rebuild it with .venv/bin/python notebooks/_build.py"
    )
    errors = [o for o in _outputs(nb) if o.output_type == "error"]
    assert not errors, f"{name} was committed with an error output: {errors[0].get('ename')}"
    assert len(_outputs(nb)) >= len(cells) // 2, f"{name} carries almost no outputs"


@pytest.mark.parametrize("name", WITH_PLOTS)
def test_committed_notebook_has_a_plot(name):
    images = _images(_read(name))
    assert images, f"{name} has no image/png output (its plots are missing)"
    assert all(len(o.data["image/png"]) > 1000 for o in images)


def test_every_source_has_its_notebook_and_back():
    sources = {p.stem for p in (NOTEBOOKS_DIR / "_src").glob("[0-9]*.py")}
    notebooks = {p.stem for p in NOTEBOOKS_DIR.glob("[0-9]*.ipynb")}
    assert sources == notebooks == set(NOTEBOOKS)


def test_committed_notebooks_match_their_sources():
    """The .ipynb cells are exactly what notebooks/_build.py makes of notebooks/_src/."""
    sys.path.insert(0, str(NOTEBOOKS_DIR))
    try:
        import _build
    finally:
        sys.path.remove(str(NOTEBOOKS_DIR))
    for name in NOTEBOOKS:
        expected = _build.parse_percent((NOTEBOOKS_DIR / "_src" / f"{name}.py").read_text())
        actual = _read(name).cells
        assert [(c.cell_type, c.source) for c in actual] == [
            (c.cell_type, c.source) for c in expected
        ], f"{name}.ipynb is out of date with _src/{name}.py: run notebooks/_build.py {name}"


def test_notebook_index_links_every_notebook():
    index = (NOTEBOOKS_DIR / "README.md").read_text()
    for name in NOTEBOOKS:
        assert f"]({name}.ipynb)" in index, f"notebooks/README.md does not link {name}.ipynb"


def test_readme_links_every_notebook():
    readme = (ROOT / "README.md").read_text()
    for name in NOTEBOOKS:
        assert f"](notebooks/{name}.ipynb)" in readme, f"README.md does not link {name}.ipynb"


def test_every_notebook_installs_kmp_first_where_it_is_missing():
    """Colab: the first code cell installs kmp (./kmp or KMP_SOURCE) only when it is missing."""
    for name in NOTEBOOKS:
        first = next(c for c in _read(name).cells if c.cell_type == "code").source
        assert 'importlib.util.find_spec("kmp") is None' in first, name
        assert '"pip", "install"' in first and 'os.environ.get("KMP_SOURCE", "./kmp")' in first
        assert "import kmp" not in first, name  # kmp is imported only after it is there


def test_notebooks_download_nothing():
    """No notebook asks TFDS (or anything else) to download: they must run offline."""
    pattern = re.compile(r"download\s*=\s*True|urlretrieve|requests\.get|wget |curl ")
    for name in NOTEBOOKS:
        source = (NOTEBOOKS_DIR / "_src" / f"{name}.py").read_text()
        assert not pattern.search(source), f"{name} downloads something"


# ------------------------------------------------------------------ execution


def _execute(name: str, tmp_path: Path):
    """Run a temporary copy of the notebook; return it executed (raises on a cell error)."""
    copy = tmp_path / f"{name}.ipynb"
    shutil.copy(NOTEBOOKS_DIR / f"{name}.ipynb", copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_KERNEL_CHECK))
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        record_timing=False,
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - start
    print(f"{name}: executed in {seconds:.0f} s")
    check = nb.cells[-1].outputs
    text = "".join(o.get("text", "") for o in check)
    assert f"KMP-KERNEL-PREFIX={sys.prefix}" in text, (
        f"the notebook ran in another Python ({text.strip()}), not this environment's {sys.prefix}"
    )
    return nb


def _check_executed(name: str, nb) -> None:
    assert not [o for o in _outputs(nb) if o.output_type == "error"]
    if name in WITH_PLOTS:
        assert _images(nb), f"{name} ran but drew no plot"


@pytest.mark.notebook
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("01_quickstart", marks=pytest.mark.slow),
        "02_loss_scaling",
        "04_migrating",
        pytest.param("05_transformers", marks=pytest.mark.slow),
        "06_serving",
    ],
)
def test_notebook_runs(name, tmp_path):
    nb = _execute(name, tmp_path)
    _check_executed(name, nb)
    if name == "06_serving":  # the fine-tuned GPT's exported loop generates Keras's tokens
        text = "".join(o.get("text", "") for o in _outputs(nb))
        assert "identical to Keras's generate: True" in text


@pytest.mark.notebook
@pytest.mark.distributed
@pytest.mark.slow
@requires_horovod
def test_distributed_notebook_runs(tmp_path):
    nb = _execute("03_distributed_horovod", tmp_path)
    _check_executed("03_distributed_horovod", nb)
    text = "".join(o.get("text", "") for o in _outputs(nb))
    assert "all ranks identical after training: True" in text
