"""The engine layouts are SGLang 0.5.23's, checked against its own code where it runs on CPU.

- TRT-LLM BF16 (``engine_layout="trtllm_block"``): the reference transform
  (``engine_layout.apply_post_load`` / ``restore_pre_load``) equals SGLang's
  ``UnquantizedFusedMoEMethod._apply_trtllm_bf16_block_layout`` /
  ``_restore_trtllm_bf16_canonical_layout`` (``sglang/srt/layers/quantization/unquant.py``,
  calling flashinfer 0.7.2's ``_maybe_get_cached_w3_w1_permute_indices``,
  ``get_w2_permute_indices_with_cache`` and ``convert_to_block_layout``) byte for byte, on a
  real ``FusedMoE`` built with the flashinfer_trtllm runner; the closed-form coordinates
  (``engine_layout.source_rows``, the oracle) agree with both; the layer's storage is kept.
- FlashInfer CUTLASS: in 0.5.23 the up/gate swap happens while loading
  (``load_up_proj_weight_first``, receiver order ``up_gate``); its
  ``process_weights_after_loading`` leaves ``w13_weight`` / ``w2_weight`` bit-identical, so
  it is no post-load layout.
- EPLB: the physical copies SGLang's ``FusedMoE.weight_loader`` writes
  (``ExpertLocationMetadata.logical_to_all_physical`` of the metadata the SGLang rows build)
  are the slots the reference layout gives each logical expert, on every rank and layer.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer",
                    reason="sglang (FusedMoE layer) is not importable")

from pytest_weightsync.compare import assert_bitwise_equal  # noqa: E402
from pytest_weightsync.reference_impl.model import engine_layout  # noqa: E402
from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, receiver_shard  # noqa: E402

from ..harness import cases  # noqa: E402

pytestmark = [pytest.mark.weightsync_backend("sglang"),
              pytest.mark.weightsync_property("receiver_layout")]


def _layer(runner: str, num_experts: int, hidden: int, intermediate: int):
    from pytest_weightsync.reference_impl.backends.sglang import _activated
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.runtime_context import SpawnRanks, create_context
    from sglang.srt.server_args import ServerArgs

    context = create_context(ServerArgs(model_path="dummy", device="cpu"), role="test",
                             ranks=SpawnRanks(world_rank=0))
    with _activated(context, runner):
        layer = FusedMoE(num_experts=num_experts, hidden_size=hidden,
                         intermediate_size=intermediate, layer_id=0, top_k=2,
                         params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.experts")
    return layer, context


def _fill(layer):
    with torch.no_grad():
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            synth.poison_(param.data, seed=1 if name == "w13_weight" else 2)


@pytest.mark.parametrize("hidden, intermediate", [(64, 128), (128, 256)])
def test_trtllm_block_layout_equals_sglang_and_flashinfer(hidden, intermediate):
    pytest.importorskip("flashinfer.fused_moe.core", reason="flashinfer is not installed")
    from pytest_weightsync.reference_impl.backends.sglang import _activated

    layer, context = _layer("flashinfer_trtllm", 2, hidden, intermediate)
    assert layer.use_flashinfer_trtllm_moe and layer.use_padded_loading
    _fill(layer)
    canonical = {n: getattr(layer, n).data.clone() for n in ("w13_weight", "w2_weight")}
    storage = {n: getattr(layer, n).data.data_ptr() for n in canonical}
    with _activated(context, "flashinfer_trtllm"):
        layer.quant_method.process_weights_after_loading(layer)  # the real post-processing
    for name, before in canonical.items():
        param = "w13" if name == "w13_weight" else "w2"
        real = getattr(layer, name).data
        assert real.data_ptr() == storage[name], f"{name}: SGLang moved the storage"
        assert tuple(real.shape) != tuple(before.shape), f"{name}: no block shape"
        ours = before.clone()
        engine_layout.apply_post_load(ours, param, "trtllm_block")
        assert_bitwise_equal(ours.view(-1), real.reshape(-1), name=f"reference {name}")
        rows, cols = engine_layout.source_rows(param, tuple(before.shape[1:]), 2)
        assert_bitwise_equal(before[:, rows, cols].reshape(-1), real.reshape(-1),
                             name=f"coordinates of {name}")
        engine_layout.restore_pre_load(ours, param)
        assert_bitwise_equal(ours, before, name=f"reference restore of {name}")
    with _activated(context, "flashinfer_trtllm"):
        layer.quant_method.restore_weights_before_loading(layer)  # the real restore
    for name, before in canonical.items():
        assert_bitwise_equal(getattr(layer, name).data, before, name=f"SGLang restore {name}")


def test_trtllm_coordinates_are_a_permutation_and_the_transform_moves_every_row():
    """The oracle can fail: every engine element maps to a distinct checkpoint element, and
    the block layout differs from the checkpoint layout (it is no identity)."""
    for param, shape in (("w13", (256, 64)), ("w2", (64, 128))):
        rows, cols = engine_layout.source_rows(param, shape, 2)
        flat = (rows * shape[1] + cols).view(-1)
        assert torch.equal(flat.sort().values, torch.arange(shape[0] * shape[1]))
        assert not torch.equal(flat, torch.arange(shape[0] * shape[1]))


def test_cutlass_post_processing_leaves_the_loaded_layout():
    """0.5.23's ``UnquantizedFusedMoEMethod.process_weights_after_loading`` with the
    flashinfer_cutlass runner (``materialize_swiglu_params_for_cutlass`` only) keeps every
    bit: the CUTLASS up/gate order is the load order (``load_up_proj_weight_first``)."""
    from pytest_weightsync.reference_impl.backends.sglang import _activated
    from sglang.srt.layers.moe.fused_moe_triton.layer import _weight_layout_method

    layer, context = _layer("flashinfer_cutlass", 2, 16, 8)
    assert _weight_layout_method(layer).load_up_proj_weight_first
    _fill(layer)
    before = {n: getattr(layer, n).data.clone() for n in ("w13_weight", "w2_weight")}
    with _activated(context, "flashinfer_cutlass"):
        layer.quant_method.process_weights_after_loading(layer)
    for name, tensor in before.items():
        assert_bitwise_equal(getattr(layer, name).data, tensor, name=name)


@pytest.mark.parametrize("case", [c for c in cases.ENGINE_CASES if c.receiver.eplb],
                         ids=lambda c: c.id)
def test_sglang_writes_every_physical_copy_the_layout_names(case):
    from pytest_weightsync.reference_impl.backends.sglang_models import Qwen3MoeLoader

    row = Qwen3MoeLoader()
    for step in range(cases.ENGINE_UPDATES):
        topo = cases.rebalanced(case.receiver, case.spec, step)
        for rank in range(topo.world_size):
            shard = receiver_shard(case.spec, topo, rank)
            metadata = row.model_for(case.spec, topo, rank).expert_location
            for layer in range(case.spec.num_layers):
                for expert in range(case.spec.num_experts):
                    physical = metadata.logical_to_all_physical(layer, expert)
                    local = sorted(p - shard.experts.start for p in physical if p in shard.experts)
                    assert local == shard.slots_of(layer, expert), (
                        f"rank {rank} layer {layer} expert {expert}: SGLang writes local slots "
                        f"{local}, the reference layout says {shard.slots_of(layer, expert)}")


def test_engine_topology_constraints_are_sglangs():
    """Impossible engine topologies are refused by name before anything is built."""
    from pytest_weightsync.reference_impl.model.layout import TopologyError

    with pytest.raises(TopologyError, match="multiple of 128"):
        ReceiverTopology(order="up_gate", intermediate_padded=96, pad_mode="blocked",
                         engine_layout="trtllm_block")
    with pytest.raises(TopologyError, match="gate first"):
        ReceiverTopology(order="up_gate", engine_layout="transposed")
    with pytest.raises(TopologyError, match="at least one physical slot"):
        receiver_shard(MoESpec(1, 3, 4, 4), ReceiverTopology(redundant_experts=1,
                                                             placement=((0, 0, 1, 1),)), 0)
    with pytest.raises(TopologyError, match="hidden a multiple of 64"):
        receiver_shard(MoESpec(1, 2, 32, 128),
                       ReceiverTopology(order="up_gate", intermediate_padded=128,
                                        pad_mode="blocked", engine_layout="trtllm_block"), 0)
