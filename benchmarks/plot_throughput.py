"""Plot GB/s per path from a ``bench_expert_sync.py --json`` file against the plain-copy limit.

    python benchmarks/plot_throughput.py bench-cpu.json --out docs/throughput-cpu.png

One group of bars per benchmark group (packed, direct at each receiver MoE-TP); the plain
copy of the same bytes is drawn as a dashed line over its group, so the gap to it reads
directly. Needs matplotlib (the ``plot`` extra); without it, says so and exits 0.
"""

from __future__ import annotations

import sys

from plotting import script_main


def draw(plt, data):
    rows = data["results"]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    x, ticks, labels = 0.0, [], []
    for g in groups:
        paths = [r for r in rows if r["group"] == g and r["path"] != "limit"]
        limit = next(r for r in rows if r["group"] == g and r["path"] == "limit")
        start = x
        for r in paths:
            bar = ax.bar(x, r["gbps"], width=0.8, color="tab:blue" if "per_expert" not in r["path"] else "tab:gray")
            ax.annotate(f"{r['ratio_to_limit']:.2f}", (x, r["gbps"]), ha="center", va="bottom", fontsize=8)
            ticks.append(x)
            labels.append(r["path"] if len(paths) == 1 else r["path"].split("/", 1)[-1])
            x += 1
        ax.hlines(limit["gbps"], start - 0.45, x - 0.55, colors="tab:red", linestyles="dashed")
        ax.annotate(
            f"{g}: copy {limit['gbps']:.0f}" if len(paths) > 1 else f"{limit['gbps']:.0f}",
            ((start + x - 1) / 2, limit["gbps"] * 1.05),
            ha="center",
            va="bottom",
            fontsize=8,
            color="tab:red",
        )
        x += 0.8
        del bar
    shape = data["shape"]
    ax.set_ylim(0, max(r["gbps"] for r in rows) * 1.15)
    ax.set_xticks(ticks, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s of payload")
    gpu = data["machine"].get("gpu") or data["machine"].get("cpu")
    ax.set_title(
        f"Expert sync, {shape['experts']} experts, H {shape['hidden']}, I {shape['moe_ffn']} "
        f"({data['device']}: {gpu}); bar labels: ratio to a plain copy of the same bytes (dashed)",
        fontsize=9,
    )
    return fig


main = script_main(__doc__, "bench_expert_sync.py", draw,
                   lambda data: f"throughput-{data['device']}.png")


if __name__ == "__main__":
    sys.exit(main())
