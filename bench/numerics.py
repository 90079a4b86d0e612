"""The numerics table: does mixed precision lose accuracy on work people recognise?

    .venv/bin/python bench/numerics.py                   # 3 seeds x 3 policies x 3 workloads
    .venv/bin/python bench/numerics.py --seeds 0 --workloads gpt --policies float32,mixed_float16
    .venv/bin/python bench/numerics.py --quick           # a smoke run (2 tiny jobs)

Every run is a real 2-rank job, ``kmp launch -np 2 launch/train.py --model M --policy P
--seed S``, one after the other, on the workloads of issue 24:

* ``digits``: the digits CNN on scikit-learn's 8x8 digits (test accuracy, 359 images);
* ``mnist1d``: the MNIST-1D paper's CNN on its procedural data set (test accuracy, 1,000
  signals; the paper reports 94 %);
* ``gpt``: the byte-level causal transformer on the Python standard library's sources
  (validation loss in nats per byte), evaluated every 25 steps for the curves.

Per workload and policy: mean, sample standard deviation, min and max of the metric over
the seeds, its difference from float32's mean (points of accuracy, or percent of the
validation loss), the skipped steps and final loss scales (float16), and the largest
difference between the ranks' weights. The targets of issue 24 are judged here (the suite
reads them back); the GPT's validation-loss curves are plotted per policy. Results:
``numerics.{json,md,png}`` in ``$KMP_BENCH_RESULTS`` (default ``bench/results``), with the
CPU they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from targets import part_target  # noqa: E402  (beside this file)

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# workload -> (train.py model, metric, the run's extra arguments, the quick run's).
WORKLOADS = {
    "digits": ("digits_cnn", "test_accuracy", (), ("--epochs", "1", "--steps-per-epoch", "2")),
    "mnist1d": ("mnist1d_cnn", "test_accuracy", (), ("--epochs", "1", "--steps-per-epoch", "2")),
    # The default GPT run (200 steps) as 8 epochs of 25, evaluated after each one.
    "gpt": (
        "gpt",
        "val_loss_nats",
        ("--epochs", "8", "--steps-per-epoch", "25", "--eval-every", "1"),
        ("--epochs", "2", "--steps-per-epoch", "2", "--eval-every", "1"),
    ),
}
# The targets of issue 24.
MAX_POINTS = 0.5  # accuracy: a mixed policy's mean within 0.5 points of float32's
MAX_LOSS_PERCENT = 1.0  # the GPT: validation loss within 1 % of float32's
PAPER_MNIST1D = 94.0  # Greydanus (2020), the CNN's test accuracy in percent
# The targets against float32, per workload: (label, what is compared, the difference's
# key in the table, its bound, its unit, how the measured figure reads).
_POINTS = "{d:+.2f} points ({mean:.2f} % vs {base:.2f} %, {n} seeds)"
VS_FLOAT32 = {
    "digits": ("digits CNN", "test accuracy", "delta_points", MAX_POINTS, "points", _POINTS),
    "mnist1d": ("MNIST-1D CNN", "test accuracy", "delta_points", MAX_POINTS, "points", _POINTS),
    "gpt": (
        "GPT on text",
        "validation loss",
        "delta_percent",
        MAX_LOSS_PERCENT,
        "%",
        "{d:+.2f} % ({mean:.4f} vs {base:.4f} nats/byte)",
    ),
}


def run_options(description: str, policies, workloads) -> argparse.ArgumentParser:
    """A parser with the options every bench of 2-rank jobs has: seeds, policies, workloads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--policies", default=",".join(policies))
    p.add_argument("--workloads", default=",".join(workloads))
    p.add_argument("--np", type=int, default=2, help="ranks per job")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = run_options(__doc__.splitlines()[0], POLICIES, WORKLOADS)
    p.add_argument(
        "--report",
        metavar="NUMERICS_JSON",
        type=Path,
        help="measure nothing: derive the table, targets, plot and .md again from the rows of "
        "a results file (after a change of the targets' wording) and rewrite them",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="seed 0, float32 and mixed_float16, the GPT only, 2 steps an epoch: checks that it "
        "runs (the figures mean nothing); writes numerics_quick.*",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.policies, args.workloads = "0", "float32,mixed_float16", "gpt"
    return split_lists(p, args, POLICIES)


def split_lists(
    p: argparse.ArgumentParser, args: argparse.Namespace, policies, workloads=None
) -> argparse.Namespace:
    """Turn the comma-separated options into lists, each checked against its choices.

    ``workloads`` is the calling bench's workload table (default :data:`WORKLOADS`).
    """
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    args.workloads = [s.strip() for s in args.workloads.split(",") if s.strip()]
    for name, chosen, valid in (
        ("--policies", args.policies, tuple(policies)),
        ("--workloads", args.workloads, tuple(workloads or WORKLOADS)),
    ):
        bad = [c for c in chosen if c not in valid]
        if bad or not chosen:
            p.error(f"{name}: {bad or 'nothing'} given; choose from {', '.join(valid)}")
    if not args.seeds or args.np < 1:
        p.error("--seeds needs at least one seed and --np at least 1")
    return args


# ----------------------------------------------------------------------------- runs


# A variant after "+" that names a loss-scale rule, not a master-weights mode.
LOSS_SCALE_RULES = ("keras",)


def train_args(
    workload: str, policy: str, seed: int, quick: bool, workloads: dict | None = None
) -> list[str]:
    """The ``launch/train.py`` arguments of one run.

    ``policy`` is a policy name, or ``POLICY+MODE`` for a ``--master-weights`` mode
    (``bfloat16+kahan``: bench/master_weights.py) or a ``--loss-scale-rule``
    (``mixed_float16+keras``: bench/underflow.py). ``workloads`` is the table the
    workload is looked up in (default :data:`WORKLOADS`).
    """
    model, _, extra, quick_extra = (workloads or WORKLOADS)[workload]
    policy, _, mode = policy.partition("+")
    args = ["--model", model, "--policy", policy, "--seed", str(seed), "--verbose", "2"]
    if mode in LOSS_SCALE_RULES:
        args += ["--loss-scale-rule", mode]
    elif mode:
        args += ["--master-weights", mode]
    return args + list(quick_extra if quick else extra)


def run_one(workload: str, policy: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Run one 2-rank job; return its row (raises SystemExit with the log's tail on failure).

    ``args.workload_table``, when set, is the workload table of the calling bench.
    """
    from _common import run_train_job

    print(f"[numerics] {workload} {policy} seed {seed}", flush=True)
    table = getattr(args, "workload_table", None)
    s, wall = run_train_job(
        train_args(workload, policy, seed, args.quick, table),
        args.np,
        tmp / f"{workload}-{policy}-{seed}.json",
        f"bench/numerics.py: {workload} {policy} seed {seed}",
    )
    metric = (table or WORKLOADS)[workload][1]
    return {
        "workload": workload,
        "policy": policy,
        "seed": seed,
        "metric": metric,
        "value": s[metric] * (100.0 if metric == "test_accuracy" else 1.0),
        "skipped_steps": s["skipped_steps"],
        "loss_scale_end": s["loss_scale_end"],
        "weights_max_diff": s["weights_max_diff"],
        "state_bytes_per_param": s.get("state_bytes_per_param"),
        "steps": s["iterations_end"] - s["iterations_start"],
        "speed": s["tokens_per_sec"] or s["images_per_sec"],
        "speed_unit": "tokens/s" if s["tokens_per_sec"] else "examples/s",
        "curve": [[p["step"], p[metric]] for p in s.get("eval_history", [])],
        "wall_s": round(wall, 1),
    }


# ------------------------------------------------------------------------ figures


def aggregate(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per workload and policy: the metric's mean, spread and difference from float32.

    Accuracy is in percent and its difference in points; a validation loss's difference
    is in percent of float32's mean (``delta_percent``; positive: worse).
    """
    out: dict[str, dict[str, dict]] = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        out[workload] = {}
        for policy in dict.fromkeys(r["policy"] for r in mine):
            runs = [r for r in mine if r["policy"] == policy]
            values = [r["value"] for r in runs]
            out[workload][policy] = {
                "metric": runs[0]["metric"],
                "seeds": [r["seed"] for r in runs],
                "values": values,
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "min": min(values),
                "max": max(values),
                "skipped_steps": [r["skipped_steps"] for r in runs],
                "loss_scale_end": [r["loss_scale_end"] for r in runs],
                "weights_max_diff": max(r["weights_max_diff"] for r in runs),
                "speed": statistics.fmean(r["speed"] for r in runs),
                "speeds": [r["speed"] for r in runs],
                "speed_unit": runs[0]["speed_unit"],
            }
        base = out[workload].get("float32")
        for fig in out[workload].values():
            if base is None:
                continue
            if fig["metric"] == "test_accuracy":
                fig["delta_points"] = fig["mean"] - base["mean"]
            else:
                fig["delta_percent"] = 100.0 * (fig["mean"] - base["mean"]) / base["mean"]
    return out


def targets(table: dict, rows: list[dict]) -> list[dict]:
    """Judge issue 24's targets on this run's figures (a target not measured: met None)."""
    out = []
    for workload, (label, what, key, bound, unit, fmt) in VS_FLOAT32.items():
        for policy in POLICIES[1:]:
            fig = (table.get(workload) or {}).get(policy)
            name = f"{label}, {policy} vs float32 {what} (mean of seeds)"
            goal = f"within {bound} {unit}"
            if fig is None or key not in fig:
                out.append(part_target(name, goal, None, None, "not run"))
                continue
            d = fig[key]
            base = table[workload]["float32"]["mean"]
            measured = fmt.format(d=d, mean=fig["mean"], base=base, n=len(fig["values"]))
            why = "" if abs(d) <= bound else _spread_note(table[workload], policy)
            out.append(part_target(name, goal, round(d, 3), abs(d) <= bound, measured, why))
    m1d = table.get("mnist1d") or {}
    name, goal = "MNIST-1D CNN test accuracy, every policy (mean of seeds)", f">= {PAPER_MNIST1D} %"
    if m1d:
        worst = min(m1d, key=lambda p: m1d[p]["mean"])
        low = m1d[worst]["mean"]
        measured = ", ".join(f"{p} {f['mean']:.2f} %" for p, f in m1d.items())
        why = "" if low >= PAPER_MNIST1D else _mnist1d_note(m1d)
        out.append(part_target(name, goal, round(low, 3), low >= PAPER_MNIST1D, measured, why))
    else:
        out.append(part_target(name, goal, None, None, "not run"))
    out.append(ranks_target(rows, "ranks' weights bit-identical after every run"))
    return out


def ranks_target(rows: list[dict], name: str) -> dict:
    """The ranks ended bit-identical in every one of ``rows``."""
    worst = max((r["weights_max_diff"] for r in rows), default=None)
    return part_target(
        name,
        "max diff 0",
        worst,
        None if worst is None else worst == 0,
        f"largest difference {worst} over {len(rows)} runs",
        "" if not worst else "some rank ended with different weights: a bug; see the rows",
    )


def _spread_note(fig_by_policy: dict, policy: str) -> str:
    base, mine = fig_by_policy["float32"], fig_by_policy[policy]
    return (
        f"seed-to-seed spread: float32 {base['std']:.2f}, {policy} {mine['std']:.2f} "
        f"(ranges {base['min']:.2f}-{base['max']:.2f} and {mine['min']:.2f}-{mine['max']:.2f})."
    )


def _mnist1d_note(m1d: dict) -> str:
    f32 = m1d.get("float32")
    if f32 and f32["mean"] < PAPER_MNIST1D:
        return (
            f"float32 itself reaches {f32['mean']:.2f} % (seeds {f32['min']:.1f}-"
            f"{f32['max']:.1f}): the gap is not mixed precision's. docs/benchmarks.md's MNIST-1D "
            "section lists what differs from the paper's PyTorch run."
        )
    worst = min(m1d, key=lambda p: m1d[p]["mean"])
    return f"{worst} reaches {m1d[worst]['mean']:.2f} % where float32 reaches 94 % or more."


def heading(result: dict, title: str, note: str = "") -> list[str]:
    """The title and the line that says where and how the table was measured."""
    m = result["machine"]
    return [
        f"# {title}",
        "",
        f"{result['ranks']} ranks per job, seeds {result['seeds']}, on {m.get('cpu')} "
        f"({m.get('cores')} cores), {m.get('date')}. Mean +- sample standard deviation over "
        f"the seeds; accuracy in percent, the GPT's validation loss in nats per byte.{note}",
        "",
    ]


def first_cells(workload: str, policy: str, f: dict) -> list[str]:
    """A table row's workload, policy, metric, range and difference from float32."""
    delta = (
        f"{f['delta_points']:+.2f} points"
        if "delta_points" in f
        else (f"{f['delta_percent']:+.2f} %" if "delta_percent" in f else "-")
    )
    return [workload, policy, f"{f['mean']:.4g} +- {f['std']:.2g}",
            f"{f['min']:.4g} - {f['max']:.4g}", delta]  # fmt: skip


def targets_section(result: dict, plot_alt: str) -> list[str]:
    """The targets table and the plot, as Markdown lines."""
    from _common import markdown_table

    lines = ["", "## Targets", ""]
    lines.append(
        markdown_table(
            ["target", "goal", "measured", "result", "why"],
            [
                [t["name"], t["goal"], t["measured"], _result(t["met"]), t["why"] or "-"]
                for t in result["targets"]
            ],
        )
    )
    if result.get("plot"):
        lines += ["", f"![{plot_alt}]({result['plot']})"]
    return lines


def markdown(result: dict) -> str:
    lines = heading(result, "Numerics: mixed precision against float32 on real workloads")
    lines.append(policy_table(result))
    lines += targets_section(result, "GPT validation loss per policy")
    return "\n".join(lines)


def policy_table(result: dict) -> str:
    """The table of every workload and policy: metric, spread, skips, scales, ranks, speed."""
    from _common import markdown_table

    rows = []
    for workload, by_policy in result["table"].items():
        for policy, f in by_policy.items():
            rows.append([
                *first_cells(workload, policy, f),
                ", ".join(str(s) for s in f["skipped_steps"]),
                ", ".join(f"{s:g}" if s is not None else "-" for s in f["loss_scale_end"]),
                f"{f['weights_max_diff']:g}", f"{f['speed']:.0f} {f['speed_unit']}",
            ])  # fmt: skip
    headers = ["workload", "policy", "metric", "range", "vs float32", "skipped steps"]
    headers += ["final loss scale", "ranks' max diff", "speed"]
    return markdown_table(headers, rows)


def _result(met) -> str:
    return "not run" if met is None else ("met" if met else "missed")


def plot(
    rows: list[dict], path: Path, title: str = "Byte-level GPT on the Python standard library"
) -> Path | None:
    """The GPT's validation loss against steps, one colour per policy, one line per seed."""
    curves = [r for r in rows if r["workload"] == "gpt" and r["curve"]]
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = dict.fromkeys([*POLICIES, *(r["policy"] for r in curves)])  # numerics' first
    colours = {p: f"C{i}" for i, p in enumerate(labels)}
    seen = set()
    for r in curves:
        steps, values = zip(*r["curve"], strict=True)
        label = r["policy"] if r["policy"] not in seen else None
        seen.add(r["policy"])
        ax.plot(steps, values, color=colours[r["policy"]], alpha=0.75, label=label, marker=".")
    ax.set_xlabel("training step (2 ranks)")
    ax.set_ylabel("validation loss, nats per byte")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measure(args: argparse.Namespace, name: str, extra_rows=None) -> tuple[dict, Path, str]:
    """Run every job of ``args`` (or read ``--report``'s rows).

    ``extra_rows(rows)`` adds rows measured elsewhere (not with ``--report``). Returns the
    result, its folder and its file name.
    """
    from _common import RESULTS, machine

    out_dir = Path(os.environ.get("KMP_BENCH_RESULTS", RESULTS))
    name = f"{name}_quick" if args.quick else name
    if args.report is not None:  # the measured rows as they were, everything derived anew
        result = json.loads(args.report.read_text())
        return result, args.report.parent, args.report.stem
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"kmp-{name}-") as tmp:
        for workload in args.workloads:
            for seed in args.seeds:
                for policy in args.policies:  # the policies side by side, seed by seed
                    rows.append(run_one(workload, policy, seed, args, Path(tmp)))
    if extra_rows is not None:
        rows += extra_rows(rows)
    result = {"quick": args.quick, "ranks": args.np, "seeds": args.seeds, "machine": machine()}
    return {**result, "rows": rows}, out_dir, name


def finish(result: dict, out_dir: Path, name: str, judge, render, plot_title: str) -> int:
    """Derive the table and targets from the rows, plot, write and print the results."""
    from _common import write_results

    rows = result["rows"]
    table = aggregate(rows)
    result.update(table=table, targets=judge(table, rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot(rows, out_dir / f"{name}.png", plot_title)
    result["plot"] = png.name if png else None
    os.environ["KMP_BENCH_RESULTS"] = str(out_dir)
    write_results(name, result, render(result))
    print(render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, out_dir, name = measure(args, "numerics")
    title = "Byte-level GPT on the Python standard library"
    return finish(result, out_dir, name, targets, markdown, title)


if __name__ == "__main__":
    sys.exit(main())
