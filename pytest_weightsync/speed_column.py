"""The matrix's speed column: its cells, the figures under the matrix, and its plot.

The speed tests (``suites/conformance/test_speed.py``) record one profile per implementation
and format: on CPU the exact op counts of one update, then host time per entry and the ratio
to a plain copy of the written bytes over timed rounds (median, min, max); on a GPU the ratio
of one real layer's update to a plain device copy. A cell alone cannot say whether 0.03 is
the loader or the protocol, so under the matrix every implementation's figures are printed
beside the reference's for the same format, and with ``--weightsync-report out.json`` the
column is drawn next to it (``out.speed.svg``: one bar per implementation and format, the
ratio to a plain copy with its min-max whisker). The SVG is written by hand: the plugin
depends on no plotting library. No torch here.
"""

from __future__ import annotations

import textwrap
from html import escape
from pathlib import Path
from typing import Optional

#: The implementation every other one is set beside.
REFERENCE = "reference"


def cell(impl: str, speed: dict) -> str:
    """The CPU profile next to the reference's (ops, bytes written, host time; same formats),
    or the reference's own (ops and the median ratio to a plain copy); the GPU ratio range."""
    mine = speed.get(impl, {})
    if not mine:
        return "not run"
    gpu = [p["gpu_ratio"] for p in mine.values() if "gpu_ratio" in p]
    export = [p["export_gpu_ratio"] for p in mine.values() if "export_gpu_ratio" in p]
    cpu = {f: p for f, p in mine.items() if "ops" in p}
    parts = []
    if cpu:
        ref = speed.get(REFERENCE, {})
        shared = [f for f in cpu if "ops" in ref.get(f, {})]
        if impl != REFERENCE and shared:
            def rel(key):
                return (sum(cpu[f].get(key, 0) for f in shared)
                        / max(1e-12, sum(ref[f].get(key, 0) for f in shared)))
            parts.append(f"{rel('ops'):.2g}x ops, {rel('bytes_written'):.2g}x bytes"
                         + (f", {rel('host_us_per_entry'):.2g}x time"
                            if all("host_us_per_entry" in ref[f] for f in shared) else "")
                         + " of ref")
        else:
            parts.append(f"{sum(p['ops'] for p in cpu.values())} ops / {len(cpu)} fmt")
    if gpu:
        parts.append(f"gpu {min(gpu):.2f}-{max(gpu):.2f}")
    if export:
        parts.append(f"export gpu {min(export):.2f}-{max(export):.2f}")
    return ", ".join(parts) if parts else "not run"


def _spread(profile: dict, key: str, digits: int) -> str:
    value = profile.get(key)
    if value is None:
        return "-"
    low, high = profile.get(f"{key}_min"), profile.get(f"{key}_max")
    text = f"{value:.{digits}f}"
    return text + (f" [{low:.{digits}f}, {high:.{digits}f}]" if low is not None
                   and high is not None else "")


def lines(speed: dict, width: int = 120) -> list[str]:
    """Per implementation and format, what one update cost, the reference's figure beside,
    in lines of at most ``width`` characters."""
    if not speed:
        return []
    out = ["speed (report only; CPU: one profiled update, then median [min, max] of timed "
           "rounds; ratio = a plain copy of the same bytes / the update, 1.0 = the limit):"]
    ref = speed.get(REFERENCE, {})
    for impl in sorted(speed):
        for fmt in sorted(speed[impl]):
            p = speed[impl][fmt]
            beside = ref.get(fmt, {}) if impl != REFERENCE else {}
            if "ops" in p:
                text = (f"  {impl} / {fmt}: {p['ops']} ops, {p.get('bytes_written', 0)} B "
                        f"written; {_spread(p, 'host_us_per_entry', 1)} us/entry; ratio "
                        f"{_spread(p, 'cpu_ratio', 3)}")
                if "cpu_ratio" in beside:
                    text += (f"; reference {beside['ops']} ops, "
                             f"{beside['host_us_per_entry']:.1f} us/entry, ratio "
                             f"{beside['cpu_ratio']:.3f}")
                out.append(text)
            for key, what in (("gpu_ratio", "on GPU"), ("export_gpu_ratio",
                                                         "exported on GPU, end to end")):
                if key in p:
                    text = f"  {impl} / {fmt} {what}: ratio {_spread(p, key, 3)}"
                    if key in beside:
                        text += f"; reference {beside[key]:.3f}"
                    out.append(text)
    return [part for line in out
            for part in textwrap.wrap(line, width, subsequent_indent="      ")]


def bars(speed: dict) -> list[tuple]:
    """``(label, ratio, low, high, device)`` per implementation and format, in plot order."""
    out = []
    for impl in sorted(speed, key=lambda i: (i != REFERENCE, i)):
        for fmt in sorted(speed[impl]):
            p = speed[impl][fmt]
            for device, key in (("cpu", "cpu_ratio"), ("gpu", "gpu_ratio"),
                                ("gpu", "export_gpu_ratio")):
                if key in p:
                    label = "export, " + device if key.startswith("export") else device
                    out.append((f"{impl} / {fmt} ({label})", float(p[key]),
                                float(p.get(f"{key}_min", p[key])),
                                float(p.get(f"{key}_max", p[key])), device))
    return out


def svg(speed: dict, title: str = "weightsync speed column") -> Optional[str]:
    """A horizontal bar chart of :func:`bars` (``None`` when nothing was timed)."""
    rows = bars(speed)
    if not rows:
        return None
    label_w, bar_w, row_h, top = 300, 420, 18, 40
    top_value = max(1.0, max(high for _, _, _, high, _ in rows))
    width, height = label_w + bar_w + 80, top + row_h * len(rows) + 30

    def x(value: float) -> float:
        return label_w + bar_w * value / top_value

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="monospace" font-size="11">',
             f'<text x="8" y="16" font-size="13">{escape(title)}: ratio to a plain copy of the '
             f'same bytes (1.0 = the limit), median with min-max</text>',
             f'<line x1="{x(1.0):.1f}" y1="{top - 6}" x2="{x(1.0):.1f}" '
             f'y2="{height - 24}" stroke="#888" stroke-dasharray="4 3"/>',
             f'<text x="{x(1.0) - 8:.1f}" y="{top - 10}">1.0</text>']
    for i, (label, ratio, low, high, device) in enumerate(rows):
        y = top + i * row_h
        colour = "#4477aa" if device == "cpu" else "#228833"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">'
                     f'{escape(label)}</text>')
        parts.append(f'<rect x="{label_w}" y="{y + 3}" width="{max(0.5, x(ratio) - label_w):.1f}" '
                     f'height="{row_h - 6}" fill="{colour}"/>')
        parts.append(f'<line x1="{x(low):.1f}" y1="{y + row_h / 2:.1f}" x2="{x(high):.1f}" '
                     f'y2="{y + row_h / 2:.1f}" stroke="#000"/>')
        parts.append(f'<text x="{x(high) + 4:.1f}" y="{y + 12}">{ratio:.3g}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def plot_path(report_path: str) -> Path:
    """Where the plot goes beside the JSON report: ``out.json`` -> ``out.speed.svg``."""
    path = Path(report_path)
    return path.with_name(path.stem + ".speed.svg")


def write_plot(speed: dict, report_path: str) -> Optional[Path]:
    text = svg(speed)
    if text is None:
        return None
    target = plot_path(report_path)
    target.write_text(text)
    return target
