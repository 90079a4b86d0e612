"""Targets, tables and the plot of ``bench/peers.py``'s result (pure reading, no jobs)."""

from __future__ import annotations

from pathlib import Path

from _common import markdown_table

PEERS = ("hvd_tape", "mwms")
LINK_HEADERS = ["link", "hosts", "job", "images/s", "vs one bucket", "vs limit", "MB sent",
                "wire limit", "non-overlapped limit", "overlapped limit", "vs non-overlapped",
                "vs overlapped", "ranks identical"]  # fmt: skip


def _target(name: str, goal: str, value: float | None, threshold: float, how: str) -> dict:
    met = None if value is None else value >= threshold
    return {"name": name, "goal": goal, "value": value, "met": met, "measured": how}


def targets(result: dict, goals: dict[str, float]) -> list[dict]:
    """Every target of the issue, judged on the figures of this run."""
    local = result["local"]["jobs"]
    cluster = result["cluster"].get("jobs", {})
    out = []
    kmp = local.get("kmp")
    out.append(
        _target(
            "one host, 2 ranks: kmp / two independent processes",
            f">= {goals['vs_limit']}",
            kmp and kmp["vs_limit"],
            goals["vs_limit"],
            "digits CNN, median of the rounds",
        )
    )
    ratios = []
    for peer in PEERS:
        if peer in local and kmp:
            ratios.append((kmp["images_per_s"] / local[peer]["images_per_s"], f"1 host/{peer}"))
    for key, row in cluster.items():
        rate, n, name = key.split("/")
        mine = cluster.get(f"{rate}/{n}/kmp")  # kmp's defaults, float32 like the peers
        if name in PEERS and mine:
            ratios.append((mine["images_per_s"] / row["images_per_s"], f"{rate}/{n} hosts/{name}"))
    worst = min(ratios, default=None)
    out.append(
        _target(
            "kmp / each peer that runs (images/s)",
            f">= {goals['vs_peer']}",
            worst and round(worst[0], 3),
            goals["vs_peer"],
            f"worst: {worst[1]}" if worst else "no peer ran",
        )
    )
    for key, suffix, goal in (
        ("fp16_1gbit", "kmp_fp16_one_bucket", "fp16 compression"),
        ("overlap_1gbit", "kmp_bucket_4096k", "overlap (4 MiB buckets)"),
    ):
        found = [
            (row["vs_one_bucket"], k)
            for k, row in cluster.items()
            if k.startswith("1gbit/") and k.endswith(f"/{suffix}") and "vs_one_bucket" in row
        ]
        low = min(found, default=None)
        out.append(
            _target(
                f"1 Gbit/s, wide_mlp: {goal} / plain grouped allreduce",
                f">= {goals[key]}",
                low and low[0],
                goals[key],
                f"worst host count: {low[1]}"
                if low
                else result["cluster"].get("skipped", "not run"),
            )
        )
    return out


def markdown(result: dict) -> str:
    """The run as Markdown: targets, the one-host table, the links table, errors."""
    m = result["machine"]
    parts = [
        "# kmp against its peers and the limit",
        f"CPU: {m['cpu']}, {m['cores']} cores, avx512_bf16={m['avx512_bf16']}; "
        f"load average at the end {', '.join(f'{x:.2f}' for x in result['load_average'])}.",
        markdown_table(
            ["target", "goal", "measured", "met", "how"],
            [
                [t["name"], t["goal"], t["value"], t["met"], t["measured"]]
                for t in result["targets"]
            ],
        ),
    ]
    local = result["local"]["jobs"]
    rows = [
        [
            f"{name} (= {row['job']})" if "job" in row else name,
            row["images_per_s"],
            row.get("vs_limit", ""),
            row.get("efficiency", ""),
            row.get("accuracy", ""),
            row["ranks_identical"],
            row.get("rounds", ""),
        ]
        for name, row in local.items()
        if "/" not in name and "images_per_s" in row
    ]
    parts += [
        "## One host, 2 ranks, digits CNN (batch 64 per rank, 1 thread per rank)",
        "vs limit = images/s / two independent processes at once; efficiency = images/s / "
        "(2 x one process alone).",
        markdown_table(
            [
                "job",
                "images/s",
                "vs limit",
                "efficiency",
                "test accuracy",
                "ranks identical",
                "rounds",
            ],
            rows,
        ),
        "XLA (`jit_compile=True`) / default, one process: "
        + ", ".join(
            f"{k.split('/')[1]} {v}x" for k, v in local.items() if k.startswith("xla_gain")
        ),
    ]
    cluster = result["cluster"]
    if "skipped" in cluster:
        parts.append(f"Multi-host part not run: {cluster['skipped']}.")
    else:
        rows = [
            [
                *k.split("/")[:2],
                f"kmp (= {r['job']})" if "job" in r else k.split("/")[2],
                r["images_per_s"],
                r.get("vs_one_bucket", ""),
                r.get("vs_limit", ""),
                *_limit_cells(r),
                r["ranks_identical"],
            ]
            for k, r in cluster["jobs"].items()
        ]
        mb = cluster.get("float32_gradient_bytes", 0) / 1e6
        parts += [
            f"## Hosts and links: wide_mlp ({mb:.1f} MB of float32 gradients), kmp cluster, tc tbf",
            "vs limit = images/s / the independent processes (the compute limit). MB sent = "
            "bytes each rank sends per step (ring allreduce: 2(N-1)/N of the payload; bf16: an "
            "allgather, N-1 payloads). Wire, non-overlapped (compute + wire) and overlapped "
            "(max of the two) limits in images/s, and the job's ratio to the last two "
            "(docs/performance.md, bench/limits.py).",
            markdown_table(LINK_HEADERS, rows),
        ]
    errors = {**result["local"]["errors"], **cluster.get("errors", {})}
    if errors:
        parts.append(
            "## Jobs that failed\n\n"
            + "\n".join(f"- `{k}`: " + v.strip().splitlines()[-1][:300] for k, v in errors.items())
        )
    return "\n\n".join(parts)


def _limit_cells(row: dict) -> list:
    lim, traffic = row.get("limits"), row.get("traffic")
    if not lim or not traffic:
        return ["", "", "", "", "", ""]
    return [
        f"{traffic['sent_bytes_per_rank'] / 1e6:.1f}",
        f"{lim['wire']:.0f}",
        f"{lim['non_overlapped']:.0f}",
        f"{lim['overlapped']:.0f}",
        row["vs_non_overlapped"],
        row["vs_overlapped"],
    ]


def plot(result: dict, path: Path) -> None:
    """Throughput against hosts and link speed (kmp and peers), and the one-host bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    local = result["local"]["jobs"]
    names = [n for n in ("independent_pair", "kmp", "kmp_one_bucket", *PEERS) if n in local]
    a.bar(names, [local[n]["images_per_s"] for n in names], color="tab:blue")
    a.set_title("one host, 2 ranks, digits CNN")
    a.set_ylabel("images/s")
    a.tick_params(axis="x", rotation=30)
    jobs = result["cluster"].get("jobs", {})
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, row in jobs.items():
        rate, n, name = key.split("/")
        series.setdefault((rate, name), []).append((int(n), row["images_per_s"]))
    shown = ("independent", "kmp", "kmp_one_bucket", "kmp_fp16_one_bucket", *PEERS)
    series = {k: v for k, v in series.items() if k[1] in shown}
    for (rate, name), pts in sorted(series.items()):
        pts.sort()
        style = "-" if rate.startswith("1gbit") else "--"
        b.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{name} {rate}")
    b.set_title("wide_mlp on kmp cluster: hosts x link speed")
    b.set_xlabel("hosts (1 rank each)")
    b.set_ylabel("images/s (log)")
    b.set_yscale("log")
    b.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    if series:
        b.legend(fontsize=7, ncol=2)
    else:
        b.text(0.5, 0.5, "not run", ha="center", va="center", transform=b.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
