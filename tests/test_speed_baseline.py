"""A team guards its own loader's speed: the speed column's counts, saved as a baseline, fail
a later run in which the same loader copies expert by expert instead of in batches.

Runs the shipped speed suite (``suites/conformance/test_speed.py``) in subprocesses against a
third-party loader named ``mine``: a batched one (the reference's receiver) to save the
baseline, then the same name with a planted per-row copy loop, compared with that baseline.
"""

from __future__ import annotations

import json

MINE = '''
import os

import torch

from pytest_weightsync.protocols import Capabilities
from pytest_weightsync.reference_impl.impl import ReferenceImplementation


class Mine(ReferenceImplementation):
    name = "mine"
    capabilities = Capabilities(formats={"compat", "direct"})

    def load_weights(self, params, payload, **kw):
        if os.environ.get("MINE_LOOP") != "1":
            return super().load_weights(params, payload, **kw)
        # planted: every row copied on its own (a per-expert / per-row loop)
        staged = []
        for name, tensor in payload:
            rows = [row.clone() for row in tensor.reshape(-1, tensor.shape[-1])]
            staged.append((name, torch.stack(rows).reshape(tensor.shape)))
        return super().load_weights(params, staged, **kw)
'''


def test_a_planted_copy_loop_fails_the_loaders_saved_baseline(shipped):
    (shipped.path / "mine.py").write_text(MINE)
    args = ("suites/conformance/test_speed.py", "--weightsync-loader", "mine:Mine",
            "--weightsync-only", "mine", "--weightsync-allow-partial", "-p", "no:cacheprovider")
    saved = shipped.run(*args, "--weightsync-save-baseline", "mine.json")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    baseline = json.loads((shipped.path / "mine.json").read_text())
    assert {"speed/mine/compat", "speed/mine/direct"} <= set(baseline["counts"]), baseline
    # (the same counts compared again pass: tests/test_baseline_guard.py)
    speed = shipped.report()["speed"]["mine"]
    assert speed["compat"]["ops"] > 0 and speed["compat"]["host_us_per_entry"] > 0
    # timed after a warm-up, over rounds, with the spread and the ratio to a plain copy
    compat = speed["compat"]
    assert compat["rounds"] == 5 and compat["loops"] >= 1
    assert (compat["host_us_per_entry_min"] <= compat["host_us_per_entry"]
            <= compat["host_us_per_entry_max"])
    assert 0 < compat["cpu_ratio_min"] <= compat["cpu_ratio"] <= compat["cpu_ratio_max"]
    assert shipped.report()["speed_plot"].endswith("report.speed.svg")
    assert (shipped.path / "report.speed.svg").read_text().startswith("<svg")
    # the planted loop: still bit-exact, but the counts rose and the guard says where
    slow = shipped.run(*args, "--weightsync-baseline", "mine.json", MINE_LOOP="1")
    out = slow.stdout + slow.stderr
    assert slow.returncode == 1, out
    assert "speed/mine/compat" in out and "MORE" in out, out
    assert shipped.verdicts()["mine"]["verdict_word"] == "PARTIAL"  # no property failed
