"""The documentation: the site builds strictly, the README's links resolve, the code runs.

Conventions for the Markdown of ``README.md`` and every page under ``docs/`` (also written
up for contributors in docs/contributing.md):

* A fenced code block whose info string starts with ``python`` (or ``py``) is executed.
  A page's blocks run in order, in one fresh Python process per page (a block sees what
  the blocks before it defined), on the CPU, in a temporary folder, with
  ``TF_CPP_MIN_LOG_LEVEL=2``, ``KERAS_BACKEND=tensorflow``, ``KMP_DATA_DIR`` set to a
  temporary data folder and no launcher variables (a world of one process).
* ``<!-- docs-test env: NAME=VALUE ... -->`` anywhere in a page sets more variables (or
  other values, e.g. ``KERAS_BACKEND=jax``) for that page's blocks.
* A ``python`` block that is not meant to run (it needs several processes, a GPU, a
  download, an optional package or long training, or it is a sketch) is marked by
  ``<!-- not run: REASON -->`` as the last non-blank line before its opening fence. The
  reason is required; a marker that no ``python`` block follows is an error.
* Blocks in any other language (``bash``, ``diff``, ``markdown``, ...) are never run.

A failing block is reported with its page and line: each block is compiled with the page
as its file name and its own line numbers. Every executed block must stay fast: this
whole module is meant to take about a minute and a half on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests._support import ROOT

DOCS = ROOT / "docs"
PAGE_TIMEOUT_S = 240
BUILD_TIMEOUT_S = 240
# The READMEs whose relative links must resolve (the front door and the ones it links).
READMES = ("README.md", "notebooks/README.md", "launch/README.md", "examples/README.md")

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run\b(?P<rest>.*?)-->\s*$")
_ENV = re.compile(r"<!--\s*docs-test env:(?P<vars>.*?)-->")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first code line (1-based) and code."""

    page: str
    language: str
    line: int
    code: str
    not_run: str | None  # the reason, when marked not to run


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def parse_blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of ``text``, with its not-run marker; markers are checked."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # a not-run marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _NOT_RUN.match(line)
        if marker:
            if pending is not None:
                raise ValueError(f"{page}:{pending[0]}: a not-run marker with no python block")
            reason = marker.group("rest").strip().lstrip(":").strip()
            if not marker.group("rest").strip().startswith(":") or not reason:
                raise ValueError(f"{page}:{i + 1}: write the reason: <!-- not run: REASON -->")
            pending = (i + 1, reason)
            i += 1
            continue
        opening = _FENCE.match(line)
        if not opening:
            if line.strip() and pending is not None:
                raise ValueError(f"{page}:{pending[0]}: a not-run marker with no python block")
            i += 1
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        info = opening.group("info").strip()
        language = info.split()[0].lstrip("{.").rstrip("}").lower() if info else ""
        body, j = [], i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing
                and closing.group("fence")[0] == fence[0]
                and len(closing.group("fence")) >= len(fence)
                and not closing.group("info").strip()
            ):
                break
            text_line = lines[j]
            strip = min(indent, len(text_line) - len(text_line.lstrip(" ")))
            body.append(text_line[strip:])
            j += 1
        is_python = language in ("python", "py")
        if pending is not None and not is_python:
            raise ValueError(f"{page}:{pending[0]}: a not-run marker with no python block")
        blocks.append(
            Block(page, language, i + 2, "\n".join(body) + "\n", pending[1] if pending else None)
        )
        pending = None
        i = j + 1
    if pending is not None:
        raise ValueError(f"{page}:{pending[0]}: a not-run marker with no python block")
    return blocks


def page_env(text: str) -> dict[str, str]:
    """The variables a page sets for its blocks with ``<!-- docs-test env: ... -->``."""
    env = {}
    for match in _ENV.finditer(text):
        for item in shlex.split(match.group("vars")):
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise ValueError(f"docs-test env: {item!r} is not NAME=VALUE")
            env[name] = value
    return env


def _python_blocks() -> dict[str, list[Block]]:
    """Each page that has python blocks: its blocks (run or not), in order."""
    found = {}
    for page in _pages():
        blocks = [
            b for b in parse_blocks(page.read_text(), _name(page)) if b.language in ("python", "py")
        ]
        if blocks:
            found[_name(page)] = blocks
    return found


PYTHON_BLOCKS = _python_blocks()


RUNNER = ROOT / "tests" / "_docs_runner.py"
PRELOAD = ("numpy", "tensorflow", "keras", "kmp")


def _base_env() -> dict[str, str]:
    """The variables every page runs with: the CPU, TensorFlow quiet, no launcher's world."""
    launcher = ("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "KMP_", "JAX_COORDINATOR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        KERAS_BACKEND="tensorflow",
        CUDA_VISIBLE_DEVICES="",
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    )
    return env


def _run_pages(pages: list[str], env: dict[str, str], preload, tmp: Path) -> dict:
    """Run ``pages`` (each in a process forked from one runner); page -> (rc, seconds, log)."""
    jobs = []
    for page in pages:
        workdir = Path(tempfile.mkdtemp(prefix="page-", dir=tmp))
        blocks = [dataclasses.asdict(b) for b in PYTHON_BLOCKS[page] if b.not_run is None]
        page_vars = {"KMP_DATA_DIR": str(workdir / "data")}
        jobs.append(
            {
                "page": page,
                "cwd": str(workdir),
                "env": page_vars,
                "blocks": blocks,
                "log": str(workdir / "output.log"),
            }
        )
    spec = Path(tempfile.mkstemp(suffix=".json", dir=tmp)[1])
    results = spec.with_suffix(".results.json")
    spec.write_text(
        json.dumps(
            {
                "preload": list(preload),
                "parallel": 2,
                "timeout": PAGE_TIMEOUT_S,
                "jobs": jobs,
                "results": str(results),
            }
        )
    )
    done = subprocess.run(
        [sys.executable, str(RUNNER), str(spec)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S * len(pages) + 60,
        stdin=subprocess.DEVNULL,
    )
    found = json.loads(results.read_text()) if results.exists() else {}
    out = {}
    for job in jobs:
        log = Path(job["log"])
        text = log.read_text() if log.exists() else ""
        result = found.get(job["page"], {"rc": done.returncode or 1, "seconds": 0.0})
        if job["page"] not in found:
            text += f"\n--- the runner failed (rc {done.returncode}):\n{done.stdout}{done.stderr}"
        out[job["page"]] = (result["rc"], result["seconds"], text)
    return out


def _build_site(site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def runs():
    """Start the site build and every page's blocks at once; their futures, by name.

    The pages that need no variables of their own run from one runner that imports
    TensorFlow and Keras once; a page that sets variables with ``docs-test env`` gets a runner
    of its own (its variables must be set before those imports).
    """
    with tempfile.TemporaryDirectory(prefix="kmp-docs-") as name:
        tmp = Path(name)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
        futures = {}
        if importlib.util.find_spec("mkdocs") is not None:
            futures["site"] = pool.submit(_build_site, tmp / "site")
        runnable = [p for p, bs in PYTHON_BLOCKS.items() if any(b.not_run is None for b in bs)]
        plain = [p for p in runnable if not page_env((ROOT / p).read_text())]
        if plain:
            shared = pool.submit(_run_pages, plain, _base_env(), PRELOAD, tmp)
            futures.update({p: shared for p in plain})
        for page in sorted(set(runnable) - set(plain)):
            env = {**_base_env(), **page_env((ROOT / page).read_text())}
            futures[page] = pool.submit(_run_pages, [page], env, (), tmp)
        try:
            yield futures
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def test_the_site_builds_strictly(runs):
    if "site" not in runs:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed: launch/setup.sh installs requirements-docs.txt")
        pytest.skip("mkdocs is not installed: pip install -r requirements-docs.txt")
    done = runs["site"].result()
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("page", sorted(PYTHON_BLOCKS))
def test_code_blocks_run(runs, page):
    blocks = PYTHON_BLOCKS[page]
    skipped = [f"line {b.line}: {b.not_run}" for b in blocks if b.not_run is not None]
    if page not in runs:
        pytest.skip(f"{page}: every python block is marked not run ({'; '.join(skipped)})")
    rc, seconds, output = runs[page].result()[page]
    ran = output.count("[docs-test] ")
    assert rc == 0, (
        f"{page}: a code block failed (rc {rc}{', timed out' * (rc == 124)}) after {ran} "
        f"block(s) ran; the traceback names the page and line.\n{output[-8000:]}"
    )
    assert ran == sum(b.not_run is None for b in blocks), output
    print(f"{page}: {ran} block(s) ran in {seconds:.1f} s; not run: {skipped or 'none'}")


def test_code_blocks_are_found_and_some_run(capsys):
    ran = {p: sum(b.not_run is None for b in bs) for p, bs in PYTHON_BLOCKS.items()}
    not_run = [
        f"{b.page}:{b.line} ({b.not_run})"
        for bs in PYTHON_BLOCKS.values()
        for b in bs
        if b.not_run is not None
    ]
    report = (
        f"docs code blocks: {sum(ran.values())} executed on {sum(map(bool, ran.values()))} "
        f"pages, {len(not_run)} marked not run: " + "; ".join(not_run)
    )
    with capsys.disabled():  # shown in a plain run; pytest-xdist keeps workers' output
        print(f"\n{report}")
    assert sum(ran.values()) > 0, report
    assert ran.get("README.md", 0) > 0, "README.md's first example must run"


def test_the_readmes_relative_links_resolve():
    broken = []
    for name in READMES:
        readme = ROOT / name
        outside = True
        for number, line in enumerate(readme.read_text().splitlines(), 1):
            if _FENCE.match(line):
                outside = not outside
                continue
            for target in _LINK.findall(line) if outside else []:
                parts = urlsplit(target)
                if parts.scheme or parts.netloc or not parts.path:
                    continue
                if not (readme.parent / parts.path).exists():
                    broken.append(f"{name}:{number}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_a_marker_needs_a_reason_and_a_block():
    good = "<!-- not run: needs a GPU -->\n\n```python\nx = 1\n```\n```bash\nls\n```\n"
    blocks = parse_blocks(good, "good.md")
    assert [(b.language, b.line, b.not_run) for b in blocks] == [
        ("python", 4, "needs a GPU"),
        ("bash", 7, None),
    ]
    for bad in (
        "<!-- not run -->\n```python\nx = 1\n```\n",
        "<!-- not run: why -->\ntext\n```python\nx = 1\n```\n",
        "<!-- not run: why -->\n```bash\nls\n```\n",
        "<!-- not run: why -->\n",
    ):
        with pytest.raises(ValueError, match=r"not-run marker|write the reason"):
            parse_blocks(bad, "bad.md")
    nested = "````markdown\n<!-- not run: x -->\n```python\ny = 1\n```\n````\n"
    assert [b.language for b in parse_blocks(nested, "nested.md")] == ["markdown"]
    assert page_env("<!-- docs-test env: KERAS_BACKEND=jax A=1 -->") == {
        "KERAS_BACKEND": "jax",
        "A": "1",
    }


def test_mkdocs_is_pinned_with_the_project():
    pins = (ROOT / "requirements-docs.txt").read_text().splitlines()
    names = {p.split("==")[0].lower() for p in pins if "==" in p and not p.startswith("#")}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"} <= names
    setup = (ROOT / "launch" / "setup.sh").read_text()
    assert "requirements-docs.txt" in setup
