"""A stale trainer shard is said where it lies, whole or in part: the harness's finding for a
parameter that holds the previous version carries the text of where the trainer left that
version (``stale_copies``), also when only some of its elements are stale (a parameter that
spans two DP ranks' shards of the trainer's buffer)."""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync import compare
from pytest_weightsync.suites.harness import coverage, model_inputs
from pytest_weightsync.suites.harness.model_cases import MODEL_CASES

CASE, RANK = MODEL_CASES[0], 0
WHERE = "another DP rank's shard of the trainer's parameter buffer, not gathered yet"


def _stale(part: str):
    params = model_inputs.engine_params(CASE, RANK)
    before = compare.snapshot(params)
    new, old = model_inputs.expected(CASE, RANK, 2), model_inputs.expected(CASE, RANK, 1)
    for name, tensor in new.items():
        params[name].copy_(tensor)
    name = max((n for n, t in new.items() if t.dim() == 2 and not torch.equal(t, old[n])),
               key=lambda n: new[n].numel())
    rows = old[name].shape[0] if part == "whole" else old[name].shape[0] // 2
    params[name][:rows].copy_(old[name][:rows])
    return name, coverage.state_findings(params, CASE, RANK, 2, before, previous_version=1,
                                         stale_copies=WHERE)


@pytest.mark.parametrize("part", ["whole", "half"])
def test_a_stale_trainer_shard_says_where_it_lies(part):
    name, findings = _stale(part)
    assert [(f.param, f.kind) for f in findings] == [(name, "stale trainer shard")]
    detail = findings[0].detail
    assert detail.endswith(": " + WHERE), detail
    assert ("it holds version 1's values" in detail) == (part == "whole"), detail
    assert findings[0].location is not None
