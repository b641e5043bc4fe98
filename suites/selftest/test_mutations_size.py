"""A bug that shows only at size is caught by the suites' realistically sized case.

Every tensor of the topology matrix is a few KiB, and a whole update there is well under a
megabyte. A loader that stages each bucket through a fixed 10 MB buffer - and never fills the
part of a bucket beyond it (the staging buffer's zeros are copied instead) - passes every one
of them; ``cases.REALISTIC`` (36 MiB an update, one bucket) kills it, located.
"""

from __future__ import annotations

import pytest
import torch

from pytest_weightsync import compare
from pytest_weightsync.reference_impl.impl import ReferenceImplementation

from ..harness import cases, inputs, judge, loader

pytestmark = pytest.mark.weightsync_property("mutation_detected")

STAGING_BYTES = 10 * 1024 * 1024


class StagesThrough10MB(ReferenceImplementation):
    """The reference loader behind a 10 MB staging buffer that drops the tail of a bucket."""

    name = "stages-through-10mb"

    def load_weights(self, params, payload, **kwargs):
        staged, used = [], 0
        for name, tensor in payload:
            nbytes = tensor.numel() * tensor.element_size()
            if used + nbytes <= STAGING_BYTES:
                staged.append((name, tensor))
            else:  # what did not fit: the staging buffer's zeros
                fits = max(0, (STAGING_BYTES - used) // tensor.element_size())
                flat = torch.zeros_like(tensor).reshape(-1)
                flat[:fits] = tensor.reshape(-1)[:fits]
                staged.append((name, flat.reshape(tensor.shape)))
            used += nbytes
        super().load_weights(params, staged, **kwargs)


@pytest.mark.parametrize("fmt", ["compat", "direct"])
def test_a_fixed_staging_buffer_passes_the_small_matrix_and_fails_the_realistic_case(fmt):
    mutant = StagesThrough10MB()
    for case in cases.ANCHORS[:3]:  # small cases: the whole update fits in 10 MB
        for rank in range(case.receiver.world_size):
            params = inputs.receiver_params(case, rank)
            before = compare.snapshot(params)
            loader.load(mutant, params, fmt, case, rank, 1, bucket="whole")
            judge.check_rank(params, case, rank, 1, before)
    case = cases.REALISTIC
    params = inputs.receiver_params(case, 0)
    before = compare.snapshot(params)
    loader.load(mutant, params, fmt, case, 0, 1, bucket="whole")
    with pytest.raises(judge.ConformanceError) as info:
        judge.check_rank(params, case, 0, 1, before)
    message = str(info.value)
    assert "layer=" in message and "expert=" in message and "row=" in message, message
    assert info.value.location is not None
