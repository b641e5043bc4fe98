"""A failing conformance test costs what the test cost: its report is the located message, not
pages of harness frames, and no frame holding a snapshot of large tensors prints their bytes.

The runs use a harness-like module of the test's own: a ``ConformanceError`` (named like the
suites' judge's) raised two frames below the test, with a snapshot of megabytes of tensors
among the arguments of every frame on the way.
"""

from __future__ import annotations

import re
import time

import pytest
from toy_sources import LOADER_BASE

#: Imported here, before any in-process run, so no run imports it again after pytester
#: restores sys.modules.
torch = pytest.importorskip("torch")

#: Most lines one located failure may take in the terminal.
MAX_LINES = 20
#: Elements of the tensor the snapshots hold (16 MB of float32: its storage printed byte by
#: byte is 16 million lines, minutes of work).
BIG = 4096 * 1024

CONFTEST = LOADER_BASE + '''

class Toy(_Loader):
    name = "toy"


@pytest.fixture
def weightsync_implementations():
    return [Toy]
'''

HARNESS = f'''
import torch

from pytest_weightsync import compare


class ConformanceError(AssertionError):
    """Named like suites.harness.judge.ConformanceError."""


def locate(name, index):
    return f"layer=0 expert=1 projection=gate row={{index[0]}} col={{index[1]}}"


def receiver_params():
    return {{"w13": torch.zeros({BIG // 1024}, 1024), "w2": torch.zeros(8, 8)}}


def check_rank(params, expected, before, rank):
    try:
        compare.assert_state_equal(params, expected, locate=locate, rank=rank)
    except compare.BitMismatchError as error:
        raise ConformanceError(
            f"gate/up halves swapped: the gate rows hold up values\\n{{error}}") from None


def load_and_judge(params, before):
    expected = {{name: t.clone() for name, t in params.items()}}
    expected["w13"][2, 3] = 1.0
    check_rank(params, expected, before, rank=1)


def plain_failure(params, before):
    raise AssertionError("a plain assertion, two frames down")
'''

TESTS = '''
import pytest

from pytest_weightsync import compare

import harness


@pytest.mark.weightsync_property("bit_exact")
def test_conformance(weightsync_loader):
    params = harness.receiver_params()
    before = compare.snapshot(params)
    harness.load_and_judge(params, before)


def test_bit_mismatch():
    params = harness.receiver_params()
    before = compare.snapshot(params)
    params["w13"][5, 7] = -1.0
    compare.assert_unchanged(before, params, locate=harness.locate)


def test_plain_failure_with_a_snapshot():
    params = harness.receiver_params()
    before = compare.snapshot(params)
    harness.plain_failure(params, before)
'''


@pytest.fixture
def located(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(harness=HARNESS, test_located=TESTS)
    pytester.syspathinsert()
    return pytester


def _failures(output: str) -> dict:
    """``{test name: the lines of its failure report}`` from pytest's FAILURES section."""
    section = output.split(" FAILURES ", 1)[1]
    out, name = {}, None
    for line in section.splitlines():
        header = re.match(r"^_{3,} (\S+) _{3,}$", line)
        if header:
            name = header.group(1)
            out[name] = []
        elif line.startswith("====="):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def test_a_located_failure_prints_its_message_and_the_test_line(located: pytest.Pytester):
    started = time.monotonic()
    result = located.runpytest("-p", "no:cacheprovider", "test_located.py")
    elapsed = time.monotonic() - started
    result.assert_outcomes(failed=4)
    out = result.stdout.str()
    failures = _failures(out)
    assert set(failures) == {"test_conformance[reference]", "test_conformance[toy]",
                             "test_bit_mismatch", "test_plain_failure_with_a_snapshot"}
    for name in ("test_conformance[reference]", "test_conformance[toy]"):
        lines = failures[name]
        assert len(lines) < MAX_LINES, "\n".join(lines)
        text = "\n".join(lines)
        assert lines[0] == "gate/up halves swapped: the gate rows hold up values"
        assert ("first at layer=0 expert=1 projection=gate row=2 col=3 (w13[2, 3]): got 0.0"
                in text), text
        assert "test_located.py:12: ConformanceError" in text, text  # the test's own line
        assert "raised in check_rank at harness.py:" in text and "--tb=long" in text, text
        assert "def load_and_judge" not in text and "before = " not in text, text
    mismatch = "\n".join(failures["test_bit_mismatch"])
    assert len(failures["test_bit_mismatch"]) < MAX_LINES, mismatch
    assert "w13: 1 of 4194304 elements differ bitwise" in mismatch
    assert "first at layer=0 expert=1 projection=gate row=5 col=7" in mismatch
    assert "test_located.py:19: BitMismatchError" in mismatch
    # the summary line and the matrix still carry the exception's own message
    result.stdout.fnmatch_lines(["*toy / bit_exact / -: harness.ConformanceError: gate/up halves "
                                 "swapped: the gate rows hold up values",
                                 "FAILED test_located.py::test_conformance[[]toy[]] - "
                                 "harness.ConformanceError: *"])
    # any other failure keeps pytest's report, and a snapshot in its frames stays one line
    plain = "\n".join(failures["test_plain_failure_with_a_snapshot"])
    assert "before = Snapshot(2 tensors: 'w13', 'w2')" in plain, plain
    assert "E       AssertionError: a plain assertion, two frames down" in plain
    assert len(failures["test_plain_failure_with_a_snapshot"]) < 2 * MAX_LINES, plain
    assert "UntypedStorage" not in out and "TensorRecord(data_ptr" not in out
    assert elapsed < 120, f"four failures over 16 MB snapshots took {elapsed:.0f} s"


def test_a_snapshot_in_the_locals_prints_one_line(located: pytest.Pytester):
    """``--showlocals`` prints every frame's locals: a snapshot is its names, never its bytes
    (and the located failures keep pytest's full report, since it was asked for)."""
    result = located.runpytest("-p", "no:cacheprovider", "--showlocals", "test_located.py",
                               "-k", "plain or bit_mismatch")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "UntypedStorage" not in out
    result.stdout.fnmatch_lines(["before * = Snapshot(2 tensors: 'w13', 'w2')"])
    assert len(out.splitlines()) < 200, out[-5000:]


def test_tb_long_shows_the_harness_frames(located: pytest.Pytester):
    result = located.runpytest("-p", "no:cacheprovider", "--tb=long", "test_located.py",
                               "-k", "conformance and toy")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "def load_and_judge(params, before):" in out and "def check_rank(" in out
    assert "before = Snapshot(2 tensors: 'w13', 'w2')" in out
    assert "UntypedStorage" not in out


def test_reprs_of_tensor_holders_never_show_data():
    from pytest_weightsync import compare, distributed, wire

    params = {f"p{i}": torch.zeros(64, 64) for i in range(5)}
    snap = compare.snapshot(params)
    assert repr(snap) == "Snapshot(5 tensors: 'p0', 'p1', 'p2', ... (+2))"
    record = repr(snap.records["p0"])
    assert record.startswith("TensorRecord(shape=(64, 64), dtype=torch.float32, device=cpu, "
                             "data_ptr=0x"), record
    export = distributed.RankExport(0, {0: [[("p0", params["p0"])]] * 3, 1: []},
                                    frozenset({"tensors"}))
    assert repr(export) == ("RankExport(trainer_rank=0, buckets per engine rank {0: 3, 1: 0}, "
                            "transports=['tensors'])")
    update = wire.TensorUpdate([b"x" * 10_000, "y" * 20], "flattened_bucket")
    assert repr(update) == ("TensorUpdate(2 entries, lengths [10000, 20], "
                            "load_format='flattened_bucket')")


def test_located_failures_are_told_apart_without_importing_the_harness():
    from pytest_weightsync import compare
    from pytest_weightsync.failures import LocatedFailure, is_located

    class ConformanceError(AssertionError):
        pass

    class Narrower(ConformanceError):
        pass

    assert issubclass(compare.BitMismatchError, LocatedFailure)
    assert is_located(compare.StorageChangedError("moved"))
    assert is_located(ConformanceError("x")) and is_located(Narrower("x"))
    assert not is_located(AssertionError("x")) and not is_located(ValueError("x"))
