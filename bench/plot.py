"""One PNG of a ``kmp bench`` run: throughput, memory, allreduce and scaling, with targets.

    .venv/bin/python bench/plot.py [bench/results]    # re-plot from the JSON files

Five panels, each showing the goal as a dashed line: training throughput of
each policy relative to float32 (target 1.9x for "auto", 1.8x for the best 16-bit policy
on the MLP and the GPT); memory relative to
float32 (target 0.6x); the JAX engine's throughput relative to the Horovod
engine's, with kmp's step and Keras's (target 0.9x); milliseconds per allreduce
of one step's gradients, grouped vs one tensor at a time, with and without
compression; weak-scaling efficiency and the wrapper's speed relative to Keras
(targets 0.90 and 0.98).
A panel whose benchmark did not run says so. Uses matplotlib's Agg backend (no
display needed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

POLICY_ORDER = ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "auto")


def _empty(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """Grouped bars: one group per label of ``groups``, one bar per series."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)


def panel_policies(ax, res: dict | None) -> None:
    title = "Training throughput vs float32"
    models = (res or {}).get("models") or {}
    if not models:
        return _empty(ax, title)
    names = list(models)
    series = {
        p: [models[m][p]["vs_float32"] for m in names]
        for p in POLICY_ORDER
        if all("vs_float32" in models[m].get(p, {}) for m in names)  # not a failed policy
    }
    _bars(ax, names, series)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.9, color="red", ls="--", lw=1, label="target for auto (1.9x)")
    ax.axhline(1.8, color="purple", ls=":", lw=1, label="best 16-bit, MLP and GPT (1.8x)")
    ax.set_title(title)
    ax.set_ylabel("x float32")
    ax.legend(fontsize=7)


def panel_memory(ax, res: dict | None) -> None:
    title = "Memory vs float32"
    pols = (res or {}).get("policies") or {}
    if not pols:
        return _empty(ax, title)
    names = [p for p in pols if p != "float32"] or list(pols)
    labels = {
        "activation_vs_float32": "layer outputs (counted)",
        "retained_vs_float32": "kept for backward (measured)",
        "step_vs_float32": "step peak (measured)",
    }
    series = {
        label: [pols[p].get(key) or 0.0 for p in names]
        for key, label in labels.items()
        if any(pols[p].get(key) is not None for p in names)
    }
    _bars(ax, names, series)
    ax.axhline(0.6, color="red", ls="--", lw=1, label="target (0.6x)")
    ax.set_title(f"{title} ({res.get('model')}, batch {res.get('batch')})")
    ax.set_ylabel("x float32")
    ax.legend(fontsize=7)


def panel_allreduce(ax, figures: dict[str, dict]) -> None:
    """``figures``: per-model allreduce figures (``targets.allreduce_figures``)."""
    title = "Allreduce of one step's gradients (2 ranks)"
    if not figures:
        return _empty(ax, title)
    groups, grouped, single = [], [], []
    for label, fig in figures.items():
        for comp in ("None", "fp16", "bf16"):
            if f"grouped/{comp}" in fig:
                # "setting: model" over two lines, then the dtype sent: labels stay narrow
                groups.append(
                    label.replace(": ", ":\n") + f"\n{'float32' if comp == 'None' else comp}"
                )
                grouped.append(fig[f"grouped/{comp}"])
                single.append(fig.get(f"one_at_a_time/{comp}", 0.0))
    _bars(ax, groups, {"grouped": grouped, "one tensor at a time": single})
    ax.set_title(title)
    ax.set_ylabel("ms (median)")
    ax.legend(fontsize=7)


def panel_scaling(ax, efficiencies: dict[str, float], overhead: dict | None) -> None:
    """``efficiencies``: weak-scaling efficiency per model/policy (``targets.efficiencies``)."""
    from targets import overhead_ratio

    title = "Weak scaling and wrapper speed"
    labels = [f"2-proc eff.\n{key}" for key in efficiencies]
    values = list(efficiencies.values())
    goals = [0.90] * len(values)
    ratio = overhead_ratio(overhead)
    if ratio is not None:
        labels.append(f"kmp / Keras LSO\n{overhead.get('model', '')}")
        values.append(ratio)
        goals.append(0.98)
    if not labels:
        return _empty(ax, title)
    colors = ["tab:green" if v >= g else "tab:orange" for v, g in zip(values, goals, strict=True)]
    ax.bar(range(len(labels)), values, color=colors)
    for i, goal in enumerate(goals):
        ax.plot([i - 0.4, i + 0.4], [goal, goal], color="red", ls="--", lw=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylim(0, max([1.05, *values]) * 1.05)
    ax.set_title(title + " (dashed: target)")


def panel_engines(ax, res: dict | None) -> None:
    title = "JAX engine vs the Horovod engine (2 processes)"
    rows = (res or {}).get("runs") or []
    hvd = {(r["model"], r["policy"]): r["rate"] for r in rows if r["engine"] == "horovod"}
    groups = [k for k in hvd if hvd[k]]
    if not groups:
        return _empty(ax, title)
    rate = {(r["model"], r["policy"], r["engine"]): r["rate"] for r in rows}
    labels = {"jax": "kmp's step", "jax-keras": "Keras's step"}
    series = {
        labels[e]: [rate.get((*g, e), 0.0) / hvd[g] for g in groups]
        for e in labels
        if any((*g, e) in rate for g in groups)
    }
    _bars(ax, [f"{m}\n{p}" for m, p in groups], series)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.9, color="red", ls="--", lw=1, label="target (0.9x)")
    ax.set_title(title)
    ax.set_ylabel("x Horovod engine")
    ax.legend(fontsize=7)


def plot_summary(results: dict[str, Any], targets: list | None, path: Path) -> Path:
    """Draw the five panels from the parts' results and save them as a PNG at ``path``.

    Args:
        results: The parts' JSON payloads by part name (``policies``, ``memory``,
            ``allreduce``, ``overhead``, ``engines``); missing parts give an empty panel.
        targets: The judged targets (their count of met / missed goes in the title).
        path: Where to write the PNG.

    Returns:
        ``path``.
    """
    import matplotlib
    from targets import allreduce_figures, efficiencies

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    panel_policies(axes[0][0], results.get("policies"))
    panel_memory(axes[0][1], results.get("memory"))
    panel_engines(axes[0][2], results.get("engines"))
    panel_allreduce(axes[1][0], allreduce_figures(results.get("allreduce")))
    panel_scaling(axes[1][1], efficiencies(results.get("allreduce")), results.get("overhead"))
    axes[1][2].axis("off")
    title = "kmp benchmarks"
    if targets:
        met = sum(1 for t in targets if t.passed)
        judged = sum(1 for t in targets if t.passed is not None)
        title += f": {met} of {judged} measured targets met"
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results"
    results = {}
    for name in ("policies", "memory", "allreduce", "overhead", "engines"):
        for stem in (name, f"{name}_quick"):
            if (folder / f"{stem}.json").is_file():
                results[name] = json.loads((folder / f"{stem}.json").read_text())
                break
    path = plot_summary(results, None, folder / "summary.png")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
