"""What every plot script of the benchmarks does around its figure.

A script reads one benchmark's ``--json`` file, draws, and writes a PNG (by default under
``docs/``). matplotlib is optional (the ``plot`` extra): without it a script says so and exits
0, so a benchmark run never fails for want of a plot.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable


def plot_main(argv, description: str, source: str, draw: Callable, default_name: Callable) -> int:
    """Parse ``json_path`` and ``--out``, read the JSON that ``source`` wrote, call
    ``draw(plt, data)`` for the figure and save it to ``--out`` or ``docs/<default_name(data)>``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("json_path", help=f"output of {source} --json")
    p.add_argument("--out", help="PNG to write (default: under docs/, named by the device)")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'pytest-weightsync[plot]'); no plot written")
        return 0
    with open(args.json_path) as f:
        data = json.load(f)
    fig = draw(plt, data)
    fig.tight_layout()
    out = args.out or os.path.join("docs", default_name(data))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def script_main(doc: str, source: str, draw: Callable, default_name: Callable) -> Callable:
    """A plot script's ``main(argv=None)``: :func:`plot_main` described by the first paragraph of
    the script's docstring ``doc``, so each script states only what it draws."""
    return lambda argv=None: plot_main(argv, doc.split("\n\n")[0], source, draw, default_name)
