"""The reference receiver agrees with SGLang's real ``FusedMoE.weight_loader``.

For every receiver rank of MoE-TP 1/2/4 x MoE-EP 1/2/4 engines and both gate/up orders
(the default triton runner: ``[gate | up]``; flashinfer_cutlass, whose quant method sets
``load_up_proj_weight_first``: ``[up | gate]``), the real SGLang layer is constructed on CPU
with that rank's placement and the compat (per-expert HF) payload is fed through its real
loader. The reference receiver must produce the same parameters bit for bit; the packed and
direct payloads, loaded by the reference, must produce them too; and SGLang's own direct
loader (``default_weight_loader``) and packed HF names (``experts.gate_up_proj``) must agree.
The synthetic oracle (``synth.expected_receiver_params``) pins all of them.

The last test is the cross-check over the whole topology matrix: on every case (and every
receiver rank) SGLang serves, the reference receiver's state after a compat payload equals what the
stock SGLang row (``sglang-qwen3.5-moe``: the real ``Qwen3_5MoeForCausalLM.load_weights`` over
real ``FusedMoE`` layers) produced from the same payload - an oracle that shares no layout code
with the reference.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip(
    "sglang.srt.layers.moe.fused_moe_triton.layer", reason="sglang (FusedMoE layer) is not importable"
)

import torch  # noqa: E402

from pytest_weightsync.compare import assert_same_storage, assert_state_equal, snapshot  # noqa: E402
from pytest_weightsync.reference_impl.senders import compat, direct, packed  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth  # noqa: E402
from pytest_weightsync.reference_impl.backends.sglang import ReceiverPlacement, build_fused_moe  # noqa: E402
from pytest_weightsync.reference_impl.model.layout import (  # noqa: E402
    MoESpec,
    ReceiverTopology,
    fused_name,
    receiver_shard,
)
from pytest_weightsync.reference_impl.model.locate import locate_receiver_element  # noqa: E402
from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver  # noqa: E402

from pytest_weightsync.reference_impl.backends.sglang_models import (  # noqa: E402
    Qwen35MoeLoader,
    sglang_refusal,
)
from pytest_weightsync.reference_impl.impl import ReferenceImplementation  # noqa: E402

from ..harness import inputs  # noqa: E402

pytestmark = [pytest.mark.weightsync_backend("sglang"), pytest.mark.weightsync_property("receiver_layout")]

SPEC = MoESpec(num_layers=1, num_experts=4, hidden=10, intermediate=12, dtype=torch.bfloat16)
VERSION = 7

#: (moe_tp, moe_ep) engines: MoE-TP 1/2/4, MoE-EP 1/2/4, and both at once.
ENGINES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
#: SGLang MoE runner -> the reference's gate/up order it must correspond to.
RUNNER_ORDER = {"triton": "gate_up", "flashinfer_cutlass": "up_gate"}

CASES = [
    pytest.param(moe_tp, moe_ep, runner, id=f"moetp{moe_tp}-moeep{moe_ep}-{runner}")
    for moe_tp, moe_ep in ENGINES
    for runner in RUNNER_ORDER
]


@functools.lru_cache(maxsize=None)
def _full(version: int):
    return synth.full_weights(SPEC, version)


def _topology(moe_tp: int, moe_ep: int, runner: str) -> ReceiverTopology:
    return ReceiverTopology(tp=moe_tp * moe_ep, moe_ep=moe_ep, order=RUNNER_ORDER[runner])


def _real_receivers(moe_tp: int, moe_ep: int, runner: str):
    """The real SGLang layer of every rank of the engine, in TP-rank order."""
    return [
        build_fused_moe(
            num_experts=SPEC.num_experts,
            hidden_size=SPEC.hidden,
            intermediate_size=SPEC.intermediate,
            placement=placement,
            runner=runner,
            dtype=SPEC.dtype,
        )
        for placement in ReceiverPlacement.all_ranks(moe_tp, moe_ep)
    ]


def _as_reference_names(real) -> dict:
    return {fused_name(0, name[: -len("_weight")]): p.data for name, p in real.params.items()}


def _locate(topo, rank):
    return functools.partial(locate_receiver_element, SPEC, topo, rank)


@pytest.mark.parametrize("moe_tp, moe_ep, runner", CASES)
def test_sglang_placement_and_order_match_reference_layout(moe_tp, moe_ep, runner):
    topo = _topology(moe_tp, moe_ep, runner)
    for rank, real in enumerate(_real_receivers(moe_tp, moe_ep, runner)):
        shard = receiver_shard(SPEC, topo, rank)
        layer = real.layer
        assert (layer.moe_tp_rank, layer.moe_ep_rank) == (shard.moe_tp_rank, shard.moe_ep_rank), (
            f"rank {rank}: SGLang (moe_tp_rank, moe_ep_rank)={(layer.moe_tp_rank, layer.moe_ep_rank)}, "
            f"reference {(shard.moe_tp_rank, shard.moe_ep_rank)}"
        )
        assert real.num_local_experts == len(shard.experts)
        assert real.up_first == (topo.order == "up_gate"), (
            f"runner {runner}: SGLang load_up_proj_weight_first={real.up_first}, reference order {topo.order}"
        )
        shapes = {name: tuple(t.shape) for name, t in _as_reference_names(real).items()}
        assert shapes == {
            fused_name(0, "w13"): (len(shard.experts), 2 * shard.rows, SPEC.hidden),
            fused_name(0, "w2"): (len(shard.experts), SPEC.hidden, shard.rows),
        }


@pytest.mark.parametrize("moe_tp, moe_ep, runner", CASES)
def test_compat_payload_through_real_loader_equals_reference_receiver(moe_tp, moe_ep, runner):
    topo = _topology(moe_tp, moe_ep, runner)
    payload = compat.export(_full(VERSION))
    for rank, real in enumerate(_real_receivers(moe_tp, moe_ep, runner)):
        before = snapshot(_as_reference_names(real))
        real.load_hf(payload)
        got = _as_reference_names(real)
        assert_same_storage(before, got, rank=rank)
        reference = ReferenceReceiver(SPEC, topo, rank)
        reference.load(payload)
        assert_state_equal(got, reference.params, locate=_locate(topo, rank), rank=rank)
        assert_state_equal(got, synth.expected_receiver_params(SPEC, topo, rank, VERSION),
                           locate=_locate(topo, rank), rank=rank)


@pytest.mark.parametrize("moe_tp, moe_ep, runner", CASES)
def test_packed_and_direct_payloads_reproduce_real_loader_result(moe_tp, moe_ep, runner):
    topo = _topology(moe_tp, moe_ep, runner)
    full = _full(VERSION)
    compat_payload = compat.export(full)
    packed_payload = packed.export(SPEC, full, topo.order)
    for rank, real in enumerate(_real_receivers(moe_tp, moe_ep, runner)):
        real.load_hf(compat_payload)
        truth = {name: t.clone() for name, t in _as_reference_names(real).items()}
        locate = _locate(topo, rank)

        via_packed = ReferenceReceiver(SPEC, topo, rank)
        via_packed.load(packed_payload)
        assert_state_equal(via_packed.params, truth, locate=locate, rank=rank)

        direct_payload = direct.export(SPEC, topo, rank, full)
        via_direct = ReferenceReceiver(SPEC, topo, rank)
        via_direct.load(direct_payload, load_format="direct")
        assert_state_equal(via_direct.params, truth, locate=locate, rank=rank)

        # SGLang's own direct loader takes the same rank-local tensors, and the views of a
        # grouped-GEMM trainer's buffers the direct exporter sends instead of staging copies
        # (at MoE-TP > 1 the rank's fc2 columns: strided, which default_weight_loader copies
        # as they are), through the reference receiver too.
        grouped = direct.export(SPEC, topo, rank, synth.grouped_full_weights(SPEC, VERSION))
        if moe_tp > 1:
            assert not dict(grouped)[fused_name(0, "w2")].is_contiguous(), "w2 was staged"
        for sent in (direct_payload, grouped):
            fresh = build_fused_moe(num_experts=SPEC.num_experts, hidden_size=SPEC.hidden,
                                    intermediate_size=SPEC.intermediate, placement=real.placement,
                                    runner=runner, dtype=SPEC.dtype)
            fresh.load_direct(sent)
            assert_state_equal(_as_reference_names(fresh), truth, locate=locate, rank=rank)
        via_views = ReferenceReceiver(SPEC, topo, rank)
        via_views.load(grouped, load_format="direct")
        assert_state_equal(via_views.params, truth, locate=locate, rank=rank)


@pytest.mark.parametrize("moe_tp, moe_ep", [(2, 2), (1, 4)])
def test_sglang_packed_hf_names_match_per_expert_names(moe_tp, moe_ep):
    """SGLang's packed HF names (``experts.gate_up_proj [E, 2I, H]``, gate first) load the
    same parameters as per-expert names: every expert is in the tensor, the EP filter drops
    the ones a rank does not own."""
    full = _full(VERSION)
    experts = full[0]
    gate_up = torch.stack([torch.cat([w.gate, w.up]) for w in experts])
    down = torch.stack([w.down for w in experts])
    hf_packed = [("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                 ("model.layers.0.mlp.experts.down_proj", down)]
    topo = _topology(moe_tp, moe_ep, "triton")
    for rank, real in enumerate(_real_receivers(moe_tp, moe_ep, "triton")):
        real.load_hf(hf_packed)
        assert_state_equal(_as_reference_names(real), synth.expected_receiver_params(SPEC, topo, rank, VERSION),
                           locate=_locate(topo, rank), rank=rank)


def test_triton_kernels_runner_stores_the_gate_up_layout_transposed():
    """A receiver layout the packed/direct paths must not assume away: the triton_kernels
    runner transposes what it loads (``w13 [E, H, 2I]``, ``w2 [E, I, H]``)."""
    topo = _topology(2, 2, "triton")
    payload = compat.export(_full(VERSION))
    for rank, real in enumerate(_real_receivers(2, 2, "triton_kernels")):
        assert real.transposed
        real.load_hf(payload)
        expected = synth.expected_receiver_params(SPEC, topo, rank, VERSION)
        transposed = {name: t.transpose(-2, -1) for name, t in _as_reference_names(real).items()}
        assert_state_equal(transposed, expected, locate=_locate(topo, rank), rank=rank)


def test_real_loader_result_differs_between_gate_up_orders():
    """The order comparison can fail: the two runners' w13 differ on every MoE rank."""
    payload = compat.export(_full(VERSION))
    gate_first = _real_receivers(2, 1, "triton")
    up_first = _real_receivers(2, 1, "flashinfer_cutlass")
    for a, b in zip(gate_first, up_first):
        a.load_hf(payload)
        b.load_hf(payload)
        w13_a, w13_b = a.params["w13_weight"].data, b.params["w13_weight"].data
        assert not torch.equal(w13_a.view(torch.int16), w13_b.view(torch.int16))
        half = w13_a.shape[1] // 2
        assert torch.equal(w13_a[:, :half].view(torch.int16), w13_b[:, half:].view(torch.int16))


@pytest.mark.weightsync_property("sglang_cross_check")
@pytest.mark.parametrize("payload_format", ["compat"])
def test_reference_receiver_equals_real_sglang_on_every_matrix_topology(moe_case, payload_format):
    """compat exercises the whole placement (expert filter, MoE-TP rows, gate/up order,
    padding); that hf_fused and direct land the same follows from both rows' bit_exact cells
    (each equals the synthetic expected state), so they are not repeated here (CI time)."""
    reason = sglang_refusal(moe_case.spec, moe_case.receiver)
    if reason is not None:
        pytest.skip(reason)
    real_loader, reference = _SGLANG_ROW, ReferenceImplementation()
    for rank in range(moe_case.receiver.world_size):
        kwargs = dict(format=payload_format, spec=moe_case.spec, topology=moe_case.receiver,
                      rank=rank)
        payload = inputs.payload(payload_format, moe_case, rank, version=VERSION)
        real = inputs.receiver_params(moe_case, rank)
        before = snapshot(real)
        real_loader.load_weights(real, payload, **kwargs)
        assert_same_storage(before, real, rank=rank)
        ours = inputs.receiver_params(moe_case, rank)
        reference.load_weights(ours, payload, **kwargs)
        assert_state_equal(ours, real, locate=inputs.locator(moe_case, rank), rank=rank)


#: One row for the whole module: its models are cached per (spec, topology, rank).
_SGLANG_ROW = Qwen35MoeLoader()
