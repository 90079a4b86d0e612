"""bfloat16 weights and optimizer states: each master-weights mode against float32 on real work.

    .venv/bin/python bench/master_weights.py              # 3 seeds x 3 modes x 3 workloads
    .venv/bin/python bench/master_weights.py --quick      # a smoke run (the GPT, 2 tiny jobs)
    .venv/bin/python bench/master_weights.py --report bench/results/master_weights.json

Every run is a real 2-rank job, ``kmp launch -np 2 launch/train.py --policy bfloat16
--master-weights MODE``, on the workloads and seeds of ``bench/numerics.py`` (digits CNN,
MNIST-1D CNN, the byte-level GPT), for the modes ``kahan``, ``stochastic`` and ``none``
of ``kmp.wrap_optimizer(master_weights=...)``. float32 and mixed_bfloat16 are the
references: their rows are read from ``numerics.json`` (the same train.py arguments and
seeds; a float32 weight takes no master-weights hook, so their path is unchanged), or
measured here side by side with ``--policies float32,mixed_bfloat16,...``.

Judged here (issue 26): ``kahan`` and ``stochastic`` within 0.5 points of float32's
accuracy (the GPT: within 1 % of its validation loss); ``none`` shown losing on the same
runs; the ranks bit-identical after every run. Each row also carries the bytes of weights
plus optimizer state per parameter of its run (``bench/memory.py`` judges the memory
targets). Results: ``master_weights.{json,md,png}`` in ``$KMP_BENCH_RESULTS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numerics  # noqa: E402  (beside this file)
from targets import part_target  # noqa: E402

MODES = ("kahan", "stochastic", "none")
CONFIGS = tuple(f"bfloat16+{m}" for m in MODES)
REFERENCES = ("float32", "mixed_bfloat16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument(
        "--policies",
        default=",".join(CONFIGS),
        help=f"what to run: {', '.join(CONFIGS + REFERENCES)}",
    )
    p.add_argument("--workloads", default=",".join(numerics.WORKLOADS))
    p.add_argument("--np", type=int, default=2, help="ranks per job")
    p.add_argument(
        "--reference",
        type=Path,
        default=HERE / "results" / "numerics.json",
        help="rows of the reference policies not run here (numerics.json)",
    )
    p.add_argument("--report", type=Path, help="measure nothing: derive everything again")
    p.add_argument("--quick", action="store_true", help="seed 0, the GPT, 2 steps an epoch")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.workloads = "0", "gpt"
        args.policies = "float32,bfloat16+kahan"
    return numerics.split_lists(p, args, CONFIGS + REFERENCES)


def reference_rows(path: Path, have: list[dict], seeds: list[int], workloads: list[str]) -> list:
    """The reference policies' rows not measured here, from ``path`` (same seeds and workloads)."""
    ran = {(r["workload"], r["policy"], r["seed"]) for r in have}
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["rows"]
    return [
        {**r, "source": path.name}
        for r in rows
        if r["policy"] in REFERENCES
        and r["seed"] in seeds
        and r["workload"] in workloads
        and (r["workload"], r["policy"], r["seed"]) not in ran
    ]


def targets(table: dict, rows: list[dict]) -> list[dict]:
    """Judge issue 26's accuracy targets on the figures (not measured: met None)."""
    out = []
    for workload, (label, what, key, bound, unit, fmt) in numerics.VS_FLOAT32.items():
        figs = table.get(workload) or {}
        for mode in ("kahan", "stochastic"):
            fig = figs.get(f"bfloat16+{mode}")
            name = f"{label}, bfloat16 + {mode} vs float32 {what} (mean of seeds)"
            goal = f"within {bound} {unit}"
            if fig is None or key not in fig:
                out.append(part_target(name, goal, None, None, "not run"))
                continue
            d = fig[key]
            measured = fmt.format(
                d=d, mean=fig["mean"], base=figs["float32"]["mean"], n=len(fig["values"])
            )
            why = "" if abs(d) <= bound else numerics._spread_note(figs, f"bfloat16+{mode}")
            out.append(part_target(name, goal, round(d, 3), abs(d) <= bound, measured, why))
        none = figs.get("bfloat16+none")
        name = f"{label}, bfloat16 + none loses against kahan and stochastic"
        goal = "worse mean than both"
        better = [figs.get(f"bfloat16+{m}") for m in ("kahan", "stochastic")]
        if none is None or key not in none or None in better:
            out.append(part_target(name, goal, None, None, "not run"))
            continue
        higher_is_better = key == "delta_points"
        loses = all((none["mean"] < b["mean"]) == higher_is_better for b in better)
        measured = fmt.format(
            d=none[key], mean=none["mean"], base=figs["float32"]["mean"], n=len(none["values"])
        )
        out.append(part_target(name, goal, round(none[key], 3), loses, measured))
    mine = [r for r in rows if r["policy"].startswith("bfloat16+")]
    out.append(numerics.ranks_target(mine, "ranks' weights bit-identical after every bfloat16 run"))
    return out


def markdown(result: dict) -> str:
    from _common import markdown_table

    title = "bfloat16 weights: master-weights modes against float32 on real workloads"
    lines = numerics.heading(
        result, title, " Rows marked * are numerics.json's (same arguments and seeds)."
    )
    rows = []
    for workload, by_policy in result["table"].items():
        for policy, f in by_policy.items():
            mine = [r for r in result["rows"] if (r["workload"], r["policy"]) == (workload, policy)]
            state = [r["state_bytes_per_param"] for r in mine if r.get("state_bytes_per_param")]
            label = policy + (" *" if any(r.get("source") for r in mine) else "")
            rows.append([
                *numerics.first_cells(workload, label, f),
                f"{state[0]:.2f}" if state else "-",
                f"{f['weights_max_diff']:g}", f"{f['speed']:.0f} {f['speed_unit']}",
            ])  # fmt: skip
    headers = ["workload", "policy", "metric", "range", "vs float32", "state bytes/param"]
    lines.append(markdown_table([*headers, "ranks' max diff", "speed"], rows))
    lines += numerics.targets_section(result, "GPT validation loss per mode")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def references(rows: list[dict]) -> list[dict]:
        return (
            [] if args.quick else reference_rows(args.reference, rows, args.seeds, args.workloads)
        )

    result, out_dir, name = numerics.measure(args, "master_weights", references)
    title = "bfloat16 weights: GPT validation loss"
    return numerics.finish(result, out_dir, name, targets, markdown, title)


if __name__ == "__main__":
    sys.exit(main())
