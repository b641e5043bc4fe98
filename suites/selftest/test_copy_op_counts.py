"""What each copy path does per MoE layer, counted exactly: the CPU guard CI can trust.

Throughput ratios on a shared two-core CI machine move 30-40% run to run; these counts do not
move at all. Each test runs one path once under the op counter (``throughput.count_ops``:
aten operations dispatched, bytes written, temporaries allocated) and CI compares the result
with ``ci/baselines/cpu.json`` exactly, so a regression to a per-expert loop (one copy per
expert instead of one batched copy) or an extra full copy of the payload fails every time.

Each test also checks the counts against figures derived here from the shapes alone (bytes
written = payload bytes, nothing allocated by a reused plan), so the baseline cannot quietly
absorb a wasteful path. The ``cuda-plan/*`` entries are what a plan would launch on a GPU
(``CopyPlan.counts()`` of the same pairs planned for the Triton backend), checked on CPU.

Shapes: Qwen3.5-35B-A3B's per-expert proportions, scaled down (16 experts, hidden 512,
moe_ffn 256: 12 MiB of bf16 per layer).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pytest_weightsync.opcount import count_ops  # noqa: E402
from pytest_weightsync.reference_impl.senders import direct, hf_fused, packed  # noqa: E402
from pytest_weightsync.reference_impl.kernels.fastcopy import copy_pairs, plan_copies  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology  # noqa: E402
from pytest_weightsync.reference_impl.oracle.synth import full_weights  # noqa: E402

from .expert_layers import (  # noqa: E402
    assert_bits_equal,
    layer_bytes,
    layer_pairs,
    per_expert_load,
    receiver_buffers,
    trainer_experts,
)

EXPERTS, HIDDEN, INTER = 16, 512, 256
LAYER = (EXPERTS, HIDDEN, INTER)
SPEC = MoESpec(num_layers=1, num_experts=EXPERTS, hidden=HIDDEN, intermediate=INTER)


PATHS = ("packed", "direct_tp1", "direct_tp2")


@pytest.mark.parametrize("path", PATHS)
def test_reused_plan_writes_the_payload_once_and_allocates_nothing(throughput, path):
    pairs = layer_pairs(path, *LAYER)
    payload = layer_bytes(path, *LAYER)
    plan = plan_copies(pairs)
    plan.run()  # what a sender does every update after the first
    c = throughput.count_ops(f"ops/{path}/plan", plan.run)
    assert_bits_equal(pairs, EXPERTS)
    assert c.bytes_written == payload, c
    assert c.allocations == 0, c


@pytest.mark.parametrize("path", PATHS)
def test_copy_pairs_writes_the_payload_once_and_allocates_nothing(throughput, path):
    pairs = layer_pairs(path, *LAYER)
    payload = layer_bytes(path, *LAYER)
    c = throughput.count_ops(f"ops/{path}/copy_pairs", lambda: copy_pairs(pairs))
    assert_bits_equal(pairs, EXPERTS)
    assert c.bytes_written == payload, c
    assert c.allocations == 0, c


@pytest.mark.parametrize("path", ("packed", "direct_tp1"))
def test_whole_expert_tensors_are_one_batched_copy_per_fused_buffer(path):
    """The independent part of the expectation: whole per-expert tensors into w13 and w2 are
    two operations per layer however many experts there are - never a loop over them."""
    pairs = layer_pairs(path, *LAYER)
    c = count_ops(path, plan_copies(pairs).run)
    assert sum(c.ops.values()) == 2, c


@pytest.mark.parametrize("path", PATHS)
def test_cuda_plan_launches_a_fixed_number_of_kernels_per_layer(throughput, path):
    """What the same pairs would launch on a GPU: torch.cat runs plus Triton launches."""
    pytest.importorskip("triton")
    pairs = layer_pairs(path, *LAYER)
    payload = layer_bytes(path, *LAYER)
    plan = plan_copies(pairs, backend="triton", runs=True, graph=False)
    counts = plan.counts()
    throughput.record_counts(
        f"cuda-plan/{path}", {f"step:{k}": v for k, v in counts.items()},
        bytes_written=sum(s.nbytes for s in plan.steps),
    )
    assert sum(s.nbytes for s in plan.steps) == payload
    assert sum(counts.values()) <= 3, counts  # a launch per expert would be 16 or more


@pytest.mark.parametrize("moe_tp", [1, 2])
def test_per_expert_compat_loop_is_seen_as_a_loop(throughput, moe_tp):
    """SGLang ``weight_loader``-style narrow + copy per (expert, shard): the counter must see
    one copy per shard, or it could not catch a fast path regressing to this."""
    fc1, fc2 = trainer_experts(*LAYER)
    w13, w2 = receiver_buffers(*LAYER, moe_tp)
    payload = layer_bytes(f"direct_tp{moe_tp}", *LAYER)
    c = throughput.count_ops(f"ops/per_expert_tp{moe_tp}", lambda: per_expert_load(fc1, fc2, w13, w2, moe_tp))
    assert c.ops == {"aten.copy_.default": 3 * EXPERTS}, c
    assert c.bytes_written == payload


def _export(sender: str, weights):
    if sender == "packed":
        return packed.export_layer(SPEC, 0, weights, "gate_up")
    if sender == "hf_fused":
        return hf_fused.export_layer(0, weights)
    tp = int(sender.removeprefix("direct_tp"))
    return direct.export_layer(SPEC, ReceiverTopology(tp=tp), 0, 0, weights)


@pytest.mark.parametrize("sender", ("packed", "hf_fused", "direct_tp1", "direct_tp2"))
def test_reference_sender_builds_each_fused_buffer_once(throughput, sender):
    """The reference exporters per layer: two buffers allocated (w13, w2), the payload written
    once into them, one batched copy per buffer - except the strided fc2 column slices of
    MoE-TP > 1, which a CPU copies one expert at a time (a GPU: one Triton launch)."""
    weights = full_weights(SPEC, version=1)[0]
    out = []
    c = throughput.count_ops(f"ops/sender/{sender}", lambda: out.extend(_export(sender, weights)))
    payload = sum(t.numel() * t.element_size() for _, t in out)
    assert len(out) == 2
    assert c.allocations == 2 and c.allocated_bytes == payload, c
    assert c.bytes_written == payload, c
    strided = EXPERTS if sender == "direct_tp2" else 0
    assert sum(c.ops.values()) == 2 + 2 - (strided > 0) + strided, c
