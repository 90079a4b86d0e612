"""Small helpers shared by the benchmark scripts (timing, results files)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """Facts about where a benchmark ran, stored next to its figures."""
    from kmp import hardware

    hw = hardware.detect()
    return {
        "cpu": hw.cpu.model,
        "cores": hw.cpu.cores,
        "avx512_bf16": hw.cpu.avx512_bf16,
        "amx": hw.cpu.amx,
        "gpus": [g.name for g in hw.gpus],
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name: str, payload: dict, markdown: str | None = None) -> Path:
    """Write ``bench/results/NAME.json`` (and ``NAME.md``) atomically; return the JSON path."""
    out_dir = Path(os.environ.get("KMP_BENCH_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    if markdown is not None:
        md = out_dir / f"{name}.md"
        md.write_text(markdown.rstrip() + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """Render a Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
