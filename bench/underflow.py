"""float16's loss scale: kmp's underflow-aware rule against Keras's, beside float32, on real work.

    .venv/bin/python bench/underflow.py              # 3 seeds x 4 policies x 4 workloads
    .venv/bin/python bench/underflow.py --quick      # a smoke run (2 tiny jobs)
    .venv/bin/python bench/underflow.py --report bench/results/underflow.json

Every run is a real 2-rank job, ``kmp launch -np 2 launch/train.py --model M --policy P
--seed S`` (issue 46), side by side seed by seed:

* policies: ``float32``, ``mixed_bfloat16``, ``mixed_float16+keras`` (float16 with Keras's
  and PyTorch's ``GradScaler`` rule: overflow alone moves the scale, ``--loss-scale-rule
  keras``) and ``mixed_float16`` (kmp's default: the scale also grows while the gradients
  underflow, :mod:`kmp.loss_scale`);
* workloads: the MNIST-1D paper's CNN and GRU (Adam 1e-2, batch 100 over the 2 ranks,
  3,000 steps), the digits CNN (train.py's defaults) and the byte-level GPT (numerics'
  run: 200 steps, the validation loss after every 25).

Judged (issue 46): mixed_float16 with kmp's rule within 0.5 points of float32's accuracy
(the GPT: 1 % of its validation loss), mean of the seeds; at most 1 % of its steps skipped
for overflow; its step time within 2 % of Keras's rule (the runs' mean speed); the ranks
bit-identical after every run. Keras's rule is shown beside it, not judged. Results:
``underflow.{json,md,png}`` in ``$KMP_BENCH_RESULTS``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numerics  # noqa: E402  (beside this file)
from targets import part_target  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16+keras", "mixed_float16")
RULE, KERAS_RULE = "mixed_float16", "mixed_float16+keras"
_M1D = ("--epochs", "75")  # 75 epochs of 40 batches of 100: the 3,000 steps
_QUICK = ("--epochs", "1", "--steps-per-epoch", "2")
WORKLOADS = {
    "mnist1d": ("mnist1d_cnn", "test_accuracy", _M1D, _QUICK),
    "mnist1d_gru": ("mnist1d_gru", "test_accuracy", _M1D, _QUICK),
    "digits": numerics.WORKLOADS["digits"],
    "gpt": numerics.WORKLOADS["gpt"],
}
LABELS = {"mnist1d": "MNIST-1D CNN", "mnist1d_gru": "MNIST-1D GRU"}
MAX_SKIPPED = 0.01  # overflow-skipped steps, of all steps of a run
MIN_SPEED = 0.98  # step time within 2 % of Keras's rule: speed ratio >= 0.98


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = numerics.run_options(__doc__.splitlines()[0], POLICIES, WORKLOADS)
    p.add_argument("--report", type=Path, help="measure nothing: derive everything again")
    p.add_argument("--quick", action="store_true", help="seed 0, the GRU, 2 steps an epoch")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.workloads, args.policies = "0", "mnist1d_gru", f"float32,{RULE}"
    args = numerics.split_lists(p, args, POLICIES, WORKLOADS)
    args.workload_table = WORKLOADS
    return args


def _vs_float32(workload: str) -> tuple:
    """The comparison of a workload with float32 (numerics'), under this bench's label."""
    if workload in numerics.VS_FLOAT32:
        label, *rest = numerics.VS_FLOAT32[workload]
        return (LABELS.get(workload, label), *rest)
    return (LABELS[workload], *numerics.VS_FLOAT32["mnist1d"][1:])


def targets(table: dict, rows: list[dict]) -> list[dict]:
    """Judge issue 46's targets on this run's figures (not measured: met None)."""
    out = []
    for workload in WORKLOADS:
        label, what, key, bound, unit, fmt = _vs_float32(workload)
        figs = table.get(workload) or {}
        fig, base = figs.get(RULE), figs.get("float32")
        name = f"{label}, mixed_float16 (kmp's rule) vs float32 {what} (mean of seeds)"
        goal = f"within {bound} {unit}"
        if fig is None or base is None or key not in fig:
            out.append(part_target(name, goal, None, None, "not run"))
        else:
            d = fig[key]
            measured = fmt.format(d=d, mean=fig["mean"], base=base["mean"], n=len(fig["values"]))
            keras = figs.get(KERAS_RULE)
            if keras is not None and key in keras:
                measured += f"; Keras's rule {keras[key]:+.2f}"
            why = "" if abs(d) <= bound else numerics._spread_note(figs, RULE)
            out.append(part_target(name, goal, round(d, 3), abs(d) <= bound, measured, why))
    out.append(skipped_target(rows))
    out.append(speed_target(table))
    mine = [r for r in rows if r["policy"].startswith("mixed_float16")]
    out.append(numerics.ranks_target(mine, "ranks' weights bit-identical after every float16 run"))
    return out


def skipped_target(rows: list[dict]) -> dict:
    """The largest share of a kmp-rule run's steps skipped for overflow."""
    mine = [r for r in rows if r["policy"] == RULE and r["steps"]]
    name, goal = "overflow-skipped steps under kmp's rule, of each run's steps", "<= 1 %"
    if not mine:
        return part_target(name, goal, None, None, "not run")
    worst = max(mine, key=lambda r: r["skipped_steps"] / r["steps"])
    share = worst["skipped_steps"] / worst["steps"]
    measured = (
        f"{100 * share:.2f} % at most ({worst['skipped_steps']} of {worst['steps']}, "
        f"{worst['workload']} seed {worst['seed']})"
    )
    why = "" if share <= MAX_SKIPPED else "the rule grew into overflow: see the rows' scales."
    return part_target(name, goal, round(100 * share, 3), share <= MAX_SKIPPED, measured, why)


def speed_target(table: dict) -> dict:
    """The speed of kmp's rule over Keras's rule's, worst workload (means over the seeds)."""
    name, goal = "mixed_float16 speed, kmp's rule vs Keras's rule", f">= {MIN_SPEED} (2 %)"
    ratios = {}
    for workload, figs in table.items():
        if RULE in figs and KERAS_RULE in figs:
            ratios[workload] = figs[RULE]["speed"] / figs[KERAS_RULE]["speed"]
    if not ratios:
        return part_target(name, goal, None, None, "not run")
    worst = min(ratios, key=ratios.get)
    measured = ", ".join(f"{w} {r:.3f}" for w, r in ratios.items())
    why = ""
    if ratios[worst] < MIN_SPEED:
        spread = _speed_spread(table[worst][KERAS_RULE])
        why = (
            f"{worst}: {ratios[worst]:.3f}; the same policy's runs differ by up to {spread:.1%} "
            "between seeds here (whole 2-rank jobs, start-up included): bench/overhead.py "
            "times the step itself."
        )
    return part_target(name, goal, round(ratios[worst], 4), ratios[worst] >= MIN_SPEED,
                       measured, why)  # fmt: skip


def _speed_spread(fig: dict) -> float:
    speeds = fig.get("speeds") or [fig["speed"]]
    return (max(speeds) - min(speeds)) / statistics.fmean(speeds)


def markdown(result: dict) -> str:
    title = "float16's loss scale: kmp's underflow-aware rule against Keras's, on real work"
    note = " mixed_float16+keras: Keras's and GradScaler's rule (overflow only)."
    lines = numerics.heading(result, title, note)
    lines.append(numerics.policy_table(result))
    lines += numerics.targets_section(result, "GPT validation loss per policy and rule")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, out_dir, name = numerics.measure(args, "underflow")
    title = "float16 loss-scale rules: GPT validation loss"
    return numerics.finish(result, out_dir, name, targets, markdown, title)


if __name__ == "__main__":
    sys.exit(main())
