"""The CPU op-count guard fails planted regressions every time, against the committed baseline.

Runs ``suites/selftest/test_copy_op_counts.py`` in a subprocess with ``ci/baselines/cpu.json`` (what
CI runs) with each planted regression loaded as a plugin module (the committed paths against
the committed counts are what CI's own run of that file checks, with the same baseline):
fastcopy no longer batching runs (every layer back to one copy per expert and shard), and a
sender staging its payload through a temporary copy. The counts are exact,
so these fail deterministically - unlike a throughput ratio on a busy two-core machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from zygote import run_pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "suites" / "selftest" / "test_copy_op_counts.py"
BASELINE = ROOT / "ci" / "baselines" / "cpu.json"

PER_EXPERT_LOOP = """
from pytest_weightsync.reference_impl.kernels import fastcopy

# planted: runs are never found, so whole per-expert tensors are copied one pair at a time
fastcopy.find_runs = lambda pairs: ([], [i for i, (d, _) in enumerate(pairs) if d.numel()])
"""

STAGING_COPY = """
from pytest_weightsync.reference_impl.kernels import fastcopy

_plan = fastcopy.plan_copies

# planted: every source is staged through a temporary before it is copied
def staged(pairs, *args, **kwargs):
    return _plan([(d, s.clone()) for d, s in pairs], *args, **kwargs)

fastcopy.plan_copies = staged
"""


def run_guard(tmp_path, plant: str | None, zygote=None):
    """Run the suite in place (it imports its package's shared helpers) with the committed
    baseline; ``plant`` is loaded first as a plugin module (``-p planted``). Forked from the
    warm ``zygote`` when there is one (``tests/zygote.py``)."""
    args = ["-p", "weightsync", "-p", "no:cacheprovider", "-q",
            f"--weightsync-baseline={BASELINE}", "-o", "addopts=", str(SUITE)]
    env = dict(os.environ)
    if plant:
        (tmp_path / "planted.py").write_text(plant)
        args[0:0] = ["-p", "planted"]
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    proc = run_pytest(zygote, args, cwd=ROOT, env=env, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def baseline_exists():
    if not BASELINE.exists():
        pytest.fail(f"{BASELINE.relative_to(ROOT)} is missing: CI compares op counts against it")


def test_a_per_expert_loop_fails_the_guard(tmp_path, baseline_exists, zygote):
    rc, out = run_guard(tmp_path, PER_EXPERT_LOOP, zygote)
    assert rc == 1, out
    assert "weightsync throughput REGRESSION" in out, out
    # reused plans of a layer: 2 batched copies became one per pair - 32 whole per-expert
    # tensors (packed), 48 gate/up/down slices (direct, MoE-TP 1)
    lines = [line.split() for line in out.splitlines()]
    assert ["ops/packed/plan", "op:aten.copy_.default", "0", "32", "MORE"] in lines, out
    assert ["ops/direct_tp1/plan", "op:aten.copy_.default", "0", "48", "MORE"] in lines, out
    assert ["ops/packed/plan", "op:aten.cat.out", "2", "0", "fewer", "(update", "the", "baseline)"] in lines, out
    assert ["cuda-plan/packed", "op:step:triton", "0", "1", "MORE"] in lines, out
    assert ["ops/direct_tp2/plan", "op:aten.copy_.default", "16", "48", "MORE"] in lines, out


def test_an_extra_staging_copy_fails_the_guard(tmp_path, baseline_exists, zygote):
    """An extra copy is caught twice: the suite's own shape-derived expectation (payload
    written once) fails the test, and the guard then reports its stored entry unmeasured."""
    rc, out = run_guard(tmp_path, STAGING_COPY, zygote)
    assert rc == 1, out
    assert "weightsync throughput REGRESSION" in out, out
    assert (
        "baseline entry ops/sender/packed was not measured: test_copy_op_counts.py::"
        "test_reference_sender_builds_each_fused_buffer_once[packed] failed in call"
    ) in out, out
    assert "allocations=50" in out, out  # the failing assertion shows the staged temporaries
