"""Helpers for worker scripts started under horovodrun by the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_result(rank: int, payload: dict) -> None:
    """Write this rank's result where the test (tests/conftest.py:run_workers) reads it."""
    out = Path(os.environ["KMP_TEST_OUT"])
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(out / f"rank{rank}.json")
