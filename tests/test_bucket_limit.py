"""The bucket limit as real exporters mean it: a bucket may exceed ``bucket_bytes`` by one unit,
the tensors converted from one source parameter; more is a finding in its own report column,
never a value failure and never a verdict.
"""

from __future__ import annotations

import json

import pytest
from toy_sources import TOY_CASES
import torch

from pytest_weightsync.reference_impl.senders.buckets import bucket_limit_findings, bucket_units


def _t(n: int):
    return torch.zeros(n, dtype=torch.bfloat16)  # 2 bytes per element


def _expert(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"


def test_gate_and_up_of_one_expert_are_one_unit_down_its_own():
    bucket = [(_expert(0, 1, "gate"), _t(32)), (_expert(0, 1, "up"), _t(32)),
              (_expert(0, 1, "down"), _t(32)), ("model.layers.0.mlp.experts.w13_weight", _t(8))]
    units = bucket_units(bucket)
    assert list(units.values()) == [128, 64, 16]
    assert ("linear_fc1", 0, 1) in units


@pytest.mark.parametrize("limit, over", [
    (None, False),  # no limit
    (208, False),   # within
    (80, False),    # over by the fused fc1 (gate + up, 128 bytes) only
    (79, True),     # over by more than its largest unit
    (0, True),
])
def test_a_bucket_may_exceed_the_limit_by_its_largest_unit_only(limit, over):
    bucket = [(_expert(0, 1, "gate"), _t(32)), (_expert(0, 1, "up"), _t(32)),
              (_expert(0, 1, "down"), _t(32)), ("model.layers.0.mlp.experts.w13_weight", _t(8))]
    found = bucket_limit_findings([bucket], limit, "exporter")
    assert bool(found) is over, found
    if over:
        assert found[0].startswith("exporter: bucket 0 holds 4 tensors in 3 units, 208 bytes; "
                                   "without its largest unit (128 bytes) it still exceeds "
                                   f"bucket_bytes={limit}")


def test_a_single_tensor_larger_than_the_limit_is_within_and_every_bucket_is_judged():
    big = [("model.layers.0.mlp.experts.w13_weight", _t(1000))]
    two = [(_expert(0, 0, "down"), _t(10)), (_expert(0, 1, "down"), _t(10))]
    assert bucket_limit_findings([big], 8, "x") == []
    found = bucket_limit_findings([big, two, big, two], 8, "x")
    assert [line.split(" holds")[0] for line in found] == ["x: bucket 1", "x: bucket 3"]


def test_the_reference_bucketing_keeps_the_rule():
    from pytest_weightsync.reference_impl.senders.buckets import split_buckets

    named = [(_expert(0, e, p), _t(7 * (e + 1))) for e in range(4) for p in ("gate", "up", "down")]
    for limit in (None, 0, 1, 30, 100, 1000):
        assert bucket_limit_findings(split_buckets(named, limit), limit, "ref") == []


CONFTEST = '''
import pytest
from pytest_weightsync.protocols import Capabilities


class Toy:
    name = "toy"
    capabilities = Capabilities(formats={"compat"})

    def export_weights_distributed(self, model_state, *, config, format, spec, trainer,
                                   receiver, delivery, bucket_bytes):
        return None


''' + TOY_CASES

TESTS = '''
import pytest


@pytest.mark.weightsync_property("distributed_export_bit_exact")
def test_distributed(weightsync_distributed_exporter, case, record_property):
    over = case.id == "topoB" and weightsync_distributed_exporter.name == "toy"
    record_property("weightsync_bucket_limit", "over" if over else "within")
    record_property("weightsync_bucket_limit_detail",
                    "1 buckets over; first: toy: bucket 3 holds 9 tensors" if over else "")
'''


def test_buckets_over_the_limit_are_a_column_of_their_own_not_a_verdict(
        pytester: pytest.Pytester):
    from pytest_weightsync.vocabulary import CONFORMANCE_MODULES

    pytester.makeconftest(CONFTEST)
    pytester.mkpydir("conformance")
    for module in CONFORMANCE_MODULES:
        text = TESTS if module == "test_distributed_exporter" else f"def {module}_x():\n    pass\n"
        (pytester.path / "conformance" / f"{module}.py").write_text(text)
    result = pytester.runpytest("--weightsync-report", "r.json")
    # 2 implementations x 2 topologies + one stand-in per other conformance module
    result.assert_outcomes(passed=4 + len(CONFORMANCE_MODULES) - 1)
    result.stdout.re_match_lines([
        r"implementation\s+distributed_export_bit_exact\s+bucket_limit\s+verdict",
        r"reference\s+2/0/0\s+within 2/2\s+PASS",
        r"toy\s+2/0/0\s+within 1/2\s+PASS",
        r"bucket_limit \(a bucket may exceed bucket_bytes by one unit.*findings, not verdicts\):",
        r"  toy / topoB: 1 buckets over; first: toy: bucket 3 holds 9 tensors",
    ], consecutive=False)
    report = json.loads((pytester.path / "r.json").read_text())
    impl = next(i for i in report["implementations"] if i["name"] == "toy")
    assert impl["verdict"] == "PASS" and impl["bucket_limit"] == "within 1/2"
    assert [(e["topology"], e["finding"]) for e in report["bucket_limit"]["toy"]] == [
        ("topoA", "within"), ("topoB", "over")]
