"""Run the code blocks of documentation pages, each page in a fresh process (tests/test_docs.py).

``python tests/_docs_runner.py SPEC.json``. The spec names modules to import first
(``preload``), how many pages run at once, a timeout per page, the jobs and where the
results go. Each job is one page: this process forks a child for it, which changes to the
page's folder, sets the page's variables, sends its output to the page's log and runs the
page's blocks in order in one fresh namespace. Each block is compiled with the page as its
file name and its own line numbers, so a traceback points into the page.

Importing TensorFlow and Keras costs about 6 CPU-seconds a process; the children of one
runner share one import (the parent runs no TensorFlow op, so no runtime is started before a
fork). A page that needs other variables before those imports (``KERAS_BACKEND=jax``) gets a
runner of its own, with no preload.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback


def _run_blocks(job: dict) -> None:
    namespace = {"__name__": "__main__"}
    for block in job["blocks"]:
        start = time.perf_counter()
        code = "\n" * (block["line"] - 1) + block["code"]
        exec(compile(code, block["page"], "exec"), namespace)
        print(
            f"[docs-test] {block['page']}:{block['line']} ran in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )


def _child(job: dict) -> None:
    """In the forked child: run one page, then leave without returning to the parent's code."""
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.argv = [job["page"]]
        _run_blocks(job)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for name in spec["preload"]:
        importlib.import_module(name)
    pending, running, results = list(spec["jobs"]), {}, {}
    while pending or running:
        while pending and len(running) < spec["parallel"]:
            job = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(job)
            running[pid] = (job, time.monotonic(), False)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, (job, start, killed) in list(running.items()):
                if not killed and time.monotonic() - start > spec["timeout"]:
                    os.kill(child, signal.SIGKILL)
                    running[child] = (job, start, True)
            time.sleep(0.05)
            continue
        job, start, killed = running.pop(pid)
        results[job["page"]] = {
            "rc": 124 if killed else os.waitstatus_to_exitcode(status),
            "seconds": round(time.monotonic() - start, 1),
        }
    with open(spec["results"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
