"""The expected receiver state, rebuilt from plain slicing arithmetic, independent of layout.py.

Every other suite takes its expected receiver parameters from
``synth.expected_receiver_params``, which asks ``pytest_weightsync.reference_impl.model.layout.receiver_shard`` which
experts and rows a rank owns - the same function the reference receiver and the direct path
use. A bug there (expert range, row start, gate/up half) would cancel out. This module states
SGLang's ownership rules again in a few lines of arithmetic (DOMAIN.md section 3), slices the
full Hugging Face tensors with them, and requires both the expected state and the reference
receiver's result after a compat update to equal that, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ..harness.inputs import fresh_receivers, stream
from pytest_weightsync.compare import assert_bitwise_equal
from pytest_weightsync.reference_impl.oracle import synth

pytestmark = pytest.mark.weightsync_property("receiver_layout_oracle")

VERSION = 3


def _owned(spec, topo, rank):
    """(experts, row start, rows, buffer rows, gate offset, up offset) by SGLang's rules, or
    by vLLM's expert map where the engine places experts as vLLM does (``linear_uneven``:
    ``determine_expert_map`` hands the first ``E % ep`` EP ranks one expert more)."""
    moe_tp = topo.tp // topo.moe_ep // topo.moe_dp
    tp_rank, ep_rank = rank % moe_tp, (rank // moe_tp) % topo.moe_ep
    if getattr(topo, "expert_placement", "even") == "linear_uneven":
        # every EP rank in turn takes E // ep, and one more while E % ep are left over
        counts = [spec.num_experts // topo.moe_ep + (1 if e < spec.num_experts % topo.moe_ep
                                                     else 0) for e in range(topo.moe_ep)]
        first = sum(counts[:ep_rank])
        experts = list(range(first, first + counts[ep_rank]))
    else:
        per_ep = spec.num_experts // topo.moe_ep
        experts = list(range(ep_rank * per_ep, (ep_rank + 1) * per_ep))
    if topo.intermediate_padded is not None and topo.pad_mode == "blocked":
        block = topo.intermediate_padded
        start = tp_rank * block
        rows = max(0, min(block, spec.intermediate - start))
        buffer_rows = block
    else:
        rows = spec.intermediate // moe_tp
        start = tp_rank * rows
        buffer_rows = topo.intermediate_padded or rows
    gate_first = topo.order == "gate_up"
    return experts, start, rows, buffer_rows, (0 if gate_first else buffer_rows), (buffer_rows if gate_first else 0)


def _oracle(spec, topo, rank, full):
    experts, start, rows, buffer_rows, gate_off, up_off = _owned(spec, topo, rank)
    out = {}
    for layer, weights in full.items():
        w13 = torch.zeros(len(experts), 2 * buffer_rows, spec.hidden, dtype=spec.dtype)
        w2 = torch.zeros(len(experts), spec.hidden, buffer_rows, dtype=spec.dtype)
        for slot, e in enumerate(experts):
            w13[slot, gate_off:gate_off + rows] = weights[e]["gate"][start:start + rows]
            w13[slot, up_off:up_off + rows] = weights[e]["up"][start:start + rows]
            w2[slot, :, :rows] = weights[e]["down"][:, start:start + rows]
        out[f"model.layers.{layer}.mlp.experts.w13_weight"] = w13
        out[f"model.layers.{layer}.mlp.experts.w2_weight"] = w2
    return out


def test_expected_state_and_reference_receiver_match_plain_slicing(moe_case):
    spec, topo = moe_case.spec, moe_case.receiver
    full = synth.full_weights(spec, VERSION)
    for receiver in fresh_receivers(moe_case):  # poisoned buffers: padding must be zeroed
        rank = receiver.rank
        receiver.begin_update()  # a layer's experts straddle buckets, as in real streams
        for bucket in stream("compat", moe_case, rank, bucket="split_layer", full=full):
            receiver.load(bucket)
        receiver.end_update()
        oracle = _oracle(spec, topo, rank, full)
        expected = synth.expected_receiver_params(spec, topo, rank, VERSION)
        assert sorted(expected) == sorted(oracle) == sorted(receiver.params)
        for name, want in oracle.items():
            assert_bitwise_equal(expected[name], want, name=f"expected {name}", rank=rank)
            assert_bitwise_equal(receiver.params[name], want, name=name, rank=rank)
