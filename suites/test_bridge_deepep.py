"""Megatron-Bridge's own HF export and DeepEP-style EP-only receivers, against the reference.

Both need packages that only install where CUDA is (Megatron-Bridge needs Python 3.12 and
Transformer Engine; DeepEP needs NVSHMEM and a GPU), so each test asks for its package with
``pytest.importorskip`` and for a GPU with the ``gpu`` marker: on a CPU-only CI machine they
are reported skipped with the missing piece named, never errored.

* Bridge: a tiny Qwen3-MoE / Qwen3-Next model built through ``AutoBridge`` holds the
  reference's synthetic trainer shards; ``AutoBridge.export_hf_weights`` must yield the
  reference's HF expert tensors bit for bit, and for GDN ``in_proj`` the component-major
  gather of the reference (``[q; k; v]``, ``z``, ``b``, ``a``).
* DeepEP: with an all-to-all backend SGLang forces ``ep_size == tp_size`` (MoE-TP 1); the
  real ``FusedMoE`` of every such rank must hold what the reference receiver holds.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.weightsync_property("third_party_export")]

HIDDEN, FFN, EXPERTS, LAYERS = 16, 8, 4, 2


def _tiny_qwen3_moe_config():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * FFN, moe_intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        torch_dtype="bfloat16",
    )


@pytest.mark.gpu
@pytest.mark.weightsync_backend("megatron_bridge")
def test_bridge_hf_export_of_experts_equals_reference():
    bridge_mod = pytest.importorskip("megatron.bridge", reason="megatron-bridge is not installed")
    import torch
    import torch.distributed as dist

    from pytest_weightsync.compare import assert_bitwise_equal
    from reference_impl import synth
    from reference_impl.layout import MoESpec, TrainerTopology, hf_expert_name, parse_megatron_name
    from reference_impl.trainer import trainer_state

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
    spec = MoESpec(num_layers=LAYERS, num_experts=EXPERTS, hidden=HIDDEN, intermediate=FFN, dtype=torch.bfloat16)
    full = synth.full_weights(spec, version=2)
    bridge = bridge_mod.AutoBridge.from_hf_config(_tiny_qwen3_moe_config())
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.params_dtype = torch.bfloat16
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    state = trainer_state(spec, TrainerTopology(), 0, full)
    written = 0
    with torch.no_grad():
        for name, param in model[0].named_parameters():
            key = name[name.index("decoder."):] if "decoder." in name else name
            if parse_megatron_name(key) is not None:
                param.copy_(state[key].to(param.device))
                written += 1
    assert written == len(state), f"the Bridge model holds {written} expert weights, the reference {len(state)}"
    exported = {name: t for name, t in bridge.export_hf_weights(model) if ".experts." in name}
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for projection in ("gate", "up", "down"):
                name = hf_expert_name(layer, expert, projection)
                assert name in exported, f"Bridge export lacks {name}"
                assert_bitwise_equal(exported[name].cpu(), full[layer][expert][projection], name=name)


@pytest.mark.gpu
@pytest.mark.weightsync_backend("megatron_bridge")
def test_bridge_gdn_in_proj_export_is_component_major():
    bridge_mod = pytest.importorskip("megatron.bridge", reason="megatron-bridge is not installed")
    transformers = pytest.importorskip("transformers")
    import torch

    from pytest_weightsync.compare import assert_bitwise_equal
    from reference_impl.component_gather import gdn_in_proj_layout

    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * FFN, moe_intermediate_size=FFN,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=4, linear_value_head_dim=4, num_experts=EXPERTS, num_experts_per_tok=2,
        torch_dtype="bfloat16",
    )
    layout = gdn_in_proj_layout(4, 2, 4, 4)
    bridge = bridge_mod.AutoBridge.from_hf_config(config)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    (name, param), = [(n, p) for n, p in model[0].named_parameters() if n.endswith("in_proj.weight")]
    rows = torch.arange(param.shape[0] * param.shape[1], dtype=torch.float32).reshape(param.shape)
    with torch.no_grad():
        param.copy_(rows.to(param.dtype).to(param.device))
    exported = {n: t.cpu() for n, t in bridge.export_hf_weights(model) if "in_proj" in n}
    parts = dict(zip(layout.components, torch.split(param.detach().cpu(), list(layout.sizes), dim=0)))
    qkv = torch.cat([parts["q"], parts["k"], parts["v"]])
    prefix = "model.layers.0.linear_attn."
    assert_bitwise_equal(exported[prefix + "in_proj_qkv.weight"], qkv, name="in_proj_qkv")
    for component in ("z", "b", "a"):
        assert_bitwise_equal(exported[prefix + f"in_proj_{component}.weight"], parts[component], name=f"in_proj_{component}")


@pytest.mark.gpu
@pytest.mark.weightsync_backend("deep_ep")
@pytest.mark.parametrize("ranks", [2, 4])
def test_deepep_ep_only_receivers_hold_reference_layout(ranks):
    pytest.importorskip("deep_ep", reason="deep_ep (DeepEP) is not installed")
    pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer", reason="sglang is not importable")
    import torch

    from pytest_weightsync.compare import assert_state_equal
    from reference_impl import compat, direct, synth
    from reference_impl.backends.sglang import ReceiverPlacement, build_fused_moe
    from reference_impl.layout import MoESpec, ReceiverTopology, fused_name
    from reference_impl.receiver import ReferenceReceiver
    from sglang.srt.runtime_context import SpawnRanks, create_context
    from sglang.srt.server_args import ServerArgs

    spec = MoESpec(num_layers=1, num_experts=EXPERTS, hidden=HIDDEN, intermediate=FFN, dtype=torch.bfloat16)
    topo = ReceiverTopology(tp=ranks, moe_ep=ranks)
    full = synth.full_weights(spec, version=4)
    for rank in range(ranks):
        ctx = create_context(ServerArgs(model_path="dummy", tp_size=ranks, moe_a2a_backend="deepep"),
                             role="test", ranks=SpawnRanks(world_rank=rank))
        assert (ctx.parallel.moe_tp_size, ctx.parallel.moe_ep_size) == (1, ranks), (
            "SGLang with moe_a2a_backend=deepep must run EP-only (moe_tp_size 1, ep_size == tp_size)"
        )
        real = build_fused_moe(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=FFN,
                               placement=ReceiverPlacement(1, 0, ranks, rank), dtype=spec.dtype)
        real.load_direct(direct.export(spec, topo, rank, full))
        reference = ReferenceReceiver(spec, topo, rank)
        reference.load(compat.export(full))
        got = {fused_name(0, n[:-len("_weight")]): p.data for n, p in real.params.items()}
        assert_state_equal(got, reference.params, rank=rank)
