"""Plot a ``bench_e2e.py --json`` file: the whole update against one plain copy of its bytes.

    python benchmarks/plot_e2e.py e2e-h200.json --out docs/e2e-cuda.png

Left: the ratio to the plain copy per format and receiver MoE-TP (registered payloads; the
per-update wire format where measured), with the goal of each path as a tick. Right: where the
time of one update goes (export, serialize, and the slowest engine rank's receive, load and
synchronize), next to the plain copy. Needs matplotlib (the ``plot`` extra); without it, says
so and exits 0.
"""

from __future__ import annotations

import sys

from plotting import script_main

STAGES = ("export_s", "serialize_s", "receive_s", "load_s", "synchronize_s")


def draw(plt, data):
    rows = data["results"]
    registered = [r for r in rows if r["path"] == "registered"]
    per_update = {(r["format"], r["moe_tp"]): r for r in rows if r["path"] == "per_update"}
    labels = [f"{r['format']}\nMoE-TP {r['moe_tp']}" for r in registered]
    x = list(range(len(registered)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.38 if per_update else 0.7
    left.bar([i - (width / 2 if per_update else 0) for i in x], [r["ratio"] for r in registered],
             width, color="#1f77b4", label="registered once per model (the reference)")
    if per_update:
        left.bar([i + width / 2 for i in x],
                 [per_update.get((r["format"], r["moe_tp"]), {}).get("ratio", 0) for r in registered],
                 width, color="#ff7f0e", label="serialized every update (update_weights_from_"
                 f"tensor protocol, {next(iter(per_update.values())).get('layers', '?')} layers)")
    for i, r in enumerate(registered):
        left.text(i - (width / 2 if per_update else 0), r["ratio"] + 0.01, f"{r['ratio']:.2f}",
                  ha="center", fontsize=8)
        if r.get("goal"):
            left.hlines(r["goal"], i - 0.45, i + 0.45, colors="black", linestyles="dotted")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set_xticks(x, labels, fontsize=8)
    left.set_ylabel("plain copy time / whole update time")
    left.set_ylim(0, 1.1)
    model = data.get("model", {})
    left.set_title(f"{model.get('layers')} layers x {model.get('experts')} experts "
                   f"({registered[0]['nbytes'] / 2**30:.0f} GiB) on {data.get('machine', {}).get('gpu') or data.get('device')}"
                   if registered else "no rows", fontsize=9)
    left.legend(fontsize=8, loc="lower left")
    bottom = [0.0] * len(registered)
    for stage, color in zip(STAGES, ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")):
        values = [1e3 * (r.get(stage) or 0.0) for r in registered]
        right.bar(x, values, 0.6, bottom=bottom, color=color, label=stage.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    right.scatter(x, [1e3 * r["wall_s"] for r in registered], color="black", marker="x",
                  label="whole update (wall)", zorder=3)
    right.scatter(x, [1e3 * r["plain_copy_s"] for r in registered], color="red", marker="_", s=400,
                  label="plain copy of the same bytes", zorder=3)
    right.set_xticks(x, labels, fontsize=8)
    right.set_ylabel("ms per update (median)")
    right.set_title("stages (engine stages: the slowest rank; load overlaps the copy)", fontsize=9)
    right.legend(fontsize=8)
    return fig


main = script_main(__doc__, "bench_e2e.py", draw,
                   lambda data: f"e2e-{data.get('device', 'cpu').split(':')[0]}.png")


if __name__ == "__main__":
    sys.exit(main())
