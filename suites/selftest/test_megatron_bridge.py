"""Megatron-Bridge's real Megatron -> HF mappings against the reference's gathers, in gloo ranks.

Megatron-Bridge 0.3.1 (the newest release for Python 3.11; it accepts the pinned
megatron-core 0.16.1) is installed without its GPU dependencies; its mapping module is imported
through :mod:`pytest_weightsync.reference_impl.backends.bridge`. Every test initializes
Megatron-Core's ``parallel_state`` in 2 or 4 gloo ranks, puts shards into real Megatron-Core
modules, and calls Bridge's own ``megatron_to_hf`` - the code that runs its TP/ETP all_gather,
its component split and its EP all_gather - next to the reference's gather of the same shards:

* experts: ``GatedMLPMapping`` (fc1 ``[gate_r; up_r]`` over the ETP group, then EP) and
  ``AutoMapping`` (fc2, row-parallel, then EP) on the shards of a real ``MoELayer`` (written from
  :func:`~pytest_weightsync.reference_impl.trainer.trainer.trainer_state`), against
  :func:`~pytest_weightsync.reference_impl.trainer.trainer.gather_full_weights_dist` and the synthetic
  HF tensors;
* attention: ``QKVMapping`` on a real ``ColumnParallelLinear`` holding Megatron's
  per-query-group ``linear_qkv`` shards, against the reference's
  :func:`~pytest_weightsync.reference_impl.trainer.component_gather.split_megatron_qkv`;
* Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): ``GDNLinearMapping`` (``in_proj``)
  and ``GDNConv1dMapping`` (``conv1d``) against the reference's component-major gathers.
  Bridge emits Qwen3-Next's HF format (``in_proj_qkvz`` grouped per key head, ``in_proj_ba``);
  it is decoded with transformers' own ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``
  into ``q, k, v, z, b, a`` - the components of Qwen3.5's ``in_proj_qkv = [q; k; v]``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` - so both sides are held to HF semantics, not to
  each other.

Bridge names TEGroupedMLP experts ``linear_fc1.weight{global}``; its SequentialMLP pattern
(``local_experts.*.linear_fc1.weight``) cannot be exported by 0.3.1 (``gather_from_ep_ranks``
parses the expert id after ``.weight`` and raises ``ValueError``), so the expert tests pass the
real SequentialMLP parameters under the TEGroupedMLP name, as Bridge's Qwen3-MoE export does.
"""

from __future__ import annotations

import pytest

pytestmark = [
    pytest.mark.weightsync_backend("megatron_bridge"),
    pytest.mark.weightsync_property("third_party_export"),
]

HIDDEN, FFN, EXPERTS = 8, 4, 4
#: Attention: 8 query heads in 4 groups (GQA), head dim 2.
HEADS, GROUPS, HEAD_DIM = 8, 4, 2
#: Gated DeltaNet: 4 key heads, 8 value heads (2 per key head), head dims 2, conv kernel 3.
GDN = {"linear_key_head_dim": 2, "linear_num_key_heads": 4, "linear_value_head_dim": 2,
       "linear_num_value_heads": 8, "linear_conv_kernel_dim": 3}


@pytest.fixture(autouse=True)
def _bridge_installed():
    """Skip cheaply in the pytest process when megatron-bridge is absent (ranks probe for real)."""
    from pytest_weightsync.reference_impl.backends import bridge

    try:
        bridge.installed_directory()
    except ImportError as exc:
        pytest.skip(f"megatron_bridge is not importable: {exc}")


def _param_mapping():
    """Bridge's mapping module in a rank; a rank without it skips the test with the reason."""
    from pytest_weightsync.reference_impl.backends import bridge, probe

    status = probe("megatron_bridge")
    if not status.available:
        pytest.skip(status.reason)
    return bridge.param_mapping()


def _bits(t):
    import torch

    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_bits(actual, expected, what):
    """Bit equality naming the first differing (row, col)."""
    import torch

    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    diff = _bits(actual) != _bits(expected)
    if bool(diff.any()):
        first = tuple(int(i) for i in torch.nonzero(diff)[0])
        raise AssertionError(f"{what}: first differing element at {first} (of shape {tuple(actual.shape)})")


def _distinct(rows, cols, tag):
    """bf16 values whose bits encode (tag, row, col): a moved row is visible (all finite)."""
    import torch

    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    bits = 0x3C00 + ((tag * 37 + r * 11 + c) % 0x2FF)
    return bits.to(torch.int16).view(torch.bfloat16).contiguous()


# --------------------------------------------------------------------------------------------
# Experts: GatedMLPMapping / AutoMapping with ETP and EP gathers
# --------------------------------------------------------------------------------------------


def bridge_expert_export_in_rank(tp, ep, etp):
    """One rank: real MoELayer holding the reference's shards; Bridge's export vs the reference's."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.backends.megatron import MegatronMoEConfig, megatron_moe_layer, write_expert_shards
    from pytest_weightsync.reference_impl.model.layout import MoESpec, TrainerTopology, hf_expert_name
    from pytest_weightsync.reference_impl.trainer.trainer import TrainerGroups, gather_full_weights_dist, trainer_state

    pm = _param_mapping()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = MoESpec(num_layers=1, num_experts=EXPERTS, hidden=HIDDEN, intermediate=FFN, dtype=torch.bfloat16)
    topo = TrainerTopology(tp=tp, ep=ep, etp=etp, dp=world // tp)
    full = synth.full_weights(spec, version=3)
    state = trainer_state(spec, topo, rank, full)
    prefix = "decoder.layers.0.mlp."
    cfg = MegatronMoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=EXPERTS, tp=tp, ep=ep, etp=etp)
    exported = {}
    with megatron_moe_layer(cfg) as (layer, placement):
        write_expert_shards(layer, {name[len(prefix):]: t for name, t in state.items()})
        for local, expert in enumerate(placement.local_expert_indices):
            mlp = layer.experts.local_experts[local]
            fc1 = pm.GatedMLPMapping(
                f"{prefix}experts.linear_fc1.weight{expert}",
                gate=hf_expert_name(0, expert, "gate"),
                up=hf_expert_name(0, expert, "up"),
            )
            fc2 = pm.AutoMapping(f"{prefix}experts.linear_fc2.weight{expert}", hf_expert_name(0, expert, "down"))
            assert fc1.is_expert and fc2.is_expert, "Bridge does not treat the expert names as expert weights"
            for mapping, module in ((fc1, mlp.linear_fc1), (fc2, mlp.linear_fc2)):
                for name, tensor in mapping.megatron_to_hf(module.weight, module).items():
                    assert name not in exported, f"Bridge exported {name} twice on rank {rank}"
                    exported[name] = tensor.detach().clone()
        sequential_error = _sequential_pattern_error(pm, layer)
        groups = TrainerGroups.create(spec, topo)
        try:
            reference = gather_full_weights_dist(spec, topo, state, groups)
        finally:
            groups.destroy()
    expected_names = sorted(hf_expert_name(0, e, p) for e in range(EXPERTS) for p in ("gate", "up", "down"))
    assert sorted(exported) == expected_names, f"rank {rank}: Bridge exported {sorted(exported)}"
    for expert in range(EXPERTS):
        for projection in ("gate", "up", "down"):
            name = hf_expert_name(0, expert, projection)
            _assert_bits(exported[name], full[0][expert][projection], f"rank {rank} Bridge {name} vs synthetic HF")
            _assert_bits(reference[0][expert][projection], exported[name], f"rank {rank} reference gather vs Bridge {name}")
    return {"count": len(exported), "sequential_error": sequential_error}


def _sequential_pattern_error(pm, layer):
    """Bridge 0.3.1's SequentialMLP expert pattern on a real SequentialMLP parameter: the error."""
    fc1 = layer.experts.local_experts[0].linear_fc1
    mapping = pm.GatedMLPMapping("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", gate="g", up="u")
    try:
        mapping.megatron_to_hf(fc1.weight, fc1)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "tp, ep, etp",
    [
        pytest.param(1, 2, 2, id="tp1-ep2-etp2"),
        pytest.param(2, 4, 1, id="tp2-ep4-etp1"),
        pytest.param(4, 1, 2, id="tp4-ep1-etp2"),
    ],
)
def test_bridge_expert_export_equals_reference_gather(rank_pool, tp, ep, etp):
    results = rank_pool.run(bridge_expert_export_in_rank, 4, tp, ep, etp)
    assert [r["count"] for r in results] == [3 * EXPERTS] * 4
    # Why the TEGroupedMLP names: Bridge 0.3.1's SequentialMLP pattern parses the expert id
    # after ".weight" and raises. If an upgrade fixes it, this fails: add that pattern here.
    assert all("invalid literal for int()" in (r["sequential_error"] or "") for r in results), results


# --------------------------------------------------------------------------------------------
# Attention QKV and Gated DeltaNet: QKVMapping, GDNLinearMapping, GDNConv1dMapping
# --------------------------------------------------------------------------------------------


def _dense_config(tp):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        params_dtype=torch.bfloat16, bf16=True, add_bias_linear=False, **GDN,
    )


def _column_parallel(config, rows):
    """A real Megatron-Core ColumnParallelLinear (what AutoMapping detects as column-parallel)."""
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear(HIDDEN, rows, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                gather_output=False)


def _qwen3_next_decode(qkvz, ba):
    """HF q, k, v, z, b, a weight rows from Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, by
    transformers' own ``fix_query_key_value_ordering`` (fed the weights' columns as activations)."""
    import types

    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    dims = types.SimpleNamespace(
        num_k_heads=GDN["linear_num_key_heads"], num_v_heads=GDN["linear_num_value_heads"],
        head_k_dim=GDN["linear_key_head_dim"], head_v_dim=GDN["linear_value_head_dim"],
    )
    # A linear layer's output for the identity input is its weight transposed: [1, H, rows].
    parts = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
        dims, qkvz.t().contiguous().unsqueeze(0), ba.t().contiguous().unsqueeze(0)
    )
    return [p[0].reshape(HIDDEN, -1).t().contiguous() for p in parts]


def bridge_attention_in_rank(tp):
    """One rank of a TP group (4 ranks = 4/tp TP groups): Bridge's QKV / GDN exports vs the
    reference's gathers vs HF."""
    import torch
    import torch.distributed as dist

    from pytest_weightsync.reference_impl.trainer import component_gather as cg
    from pytest_weightsync.reference_impl.backends.megatron import model_parallel

    pm = _param_mapping()
    with model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=True) as ps:
        config = _dense_config(tp)
        rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        assert rank == dist.get_rank() % tp, "Megatron's TP rank is not global rank mod tp"
        results = {}

        # --- attention linear_qkv: per query group [q heads; k; v], TP = whole groups ---------
        q, k, v = (_distinct(n * HEAD_DIM, HIDDEN, tag) for n, tag in ((HEADS, 1), (GROUPS, 2), (GROUPS, 3)))
        full_qkv = cg.interleave_qkv(q, k, v, HEADS, GROUPS, HEAD_DIM)
        merged = pm.merge_qkv_weights(config, q, k, v)  # Bridge's own HF -> Megatron merge
        _assert_bits(full_qkv, merged, "reference interleave_qkv vs Bridge merge_qkv_weights")
        layout = cg.megatron_qkv_layout(HEADS, GROUPS, HEAD_DIM, tp)
        shard = cg.shard_of(full_qkv, layout, tp, rank)
        linear_qkv = _column_parallel(config, layout.rows)
        assert tuple(linear_qkv.weight.shape) == tuple(shard.shape), "Megatron's linear_qkv shard shape differs"
        with torch.no_grad():
            linear_qkv.weight.copy_(shard)
        names = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight"}
        mapping = pm.QKVMapping("decoder.layers.0.self_attention.linear_qkv.weight", **names)
        bridge_qkv = mapping.megatron_to_hf(linear_qkv.weight, linear_qkv)
        reference_qkv = cg.split_megatron_qkv(cg.gather_components_async(shard, layout, group=group), HEADS, GROUPS, HEAD_DIM)
        for component, hf, ours in zip("qkv", (q, k, v), reference_qkv):
            _assert_bits(bridge_qkv[names[component]], hf, f"rank {rank} Bridge QKVMapping {component} vs HF")
            _assert_bits(ours, hf, f"rank {rank} reference split_megatron_qkv {component} vs HF")
        # Control: the HF-style [q; k; v] component gather is wrong for Megatron's layout.
        wrong = cg.gather_components_async(
            shard, cg.qkv_layout(HEADS * HEAD_DIM, GROUPS * HEAD_DIM) if tp > 1 else layout, group=group
        )
        results["qkv_control_differs"] = tp == 1 or not torch.equal(wrong.view(torch.int16), full_qkv.view(torch.int16))

        # --- Gated DeltaNet in_proj: TP rank holds [q_r; k_r; v_r; z_r; b_r; a_r] ------------
        dk, nk, dv, nv = (GDN[k] for k in ("linear_key_head_dim", "linear_num_key_heads", "linear_value_head_dim", "linear_num_value_heads"))
        in_layout = cg.gdn_in_proj_layout(dk, nk, dv, nv)
        components = [_distinct(size, HIDDEN, 10 + i) for i, size in enumerate(in_layout.sizes)]
        full_in = torch.cat(components)
        in_shard = cg.shard_of(full_in, in_layout, tp, rank)
        in_proj = _column_parallel(config, in_layout.rows)
        with torch.no_grad():
            in_proj.weight.copy_(in_shard)
        gdn = pm.GDNLinearMapping("decoder.layers.0.self_attention.in_proj.weight",
                                  qkvz="linear_attn.in_proj_qkvz.weight", ba="linear_attn.in_proj_ba.weight")
        out = gdn.megatron_to_hf(in_proj.weight, in_proj)
        reference_in = cg.gather_components_async(in_shard, in_layout, group=group)
        _assert_bits(reference_in, full_in, f"rank {rank} reference gdn_in_proj gather vs unsharded")
        # Decoded with transformers' Qwen3-Next code in the pytest process (one import, not four).
        results["in_proj"] = {
            "qkvz": out["linear_attn.in_proj_qkvz.weight"], "ba": out["linear_attn.in_proj_ba.weight"],
            "reference": torch.split(reference_in, list(in_layout.sizes)), "components": components,
        }

        # --- Gated DeltaNet conv1d: [q; k; v] channels, weight [C, 1, kernel] ----------------
        conv_layout = cg.gdn_conv1d_layout(dk, nk, dv, nv)
        kernel = GDN["linear_conv_kernel_dim"]
        full_conv = _distinct(conv_layout.rows, kernel, 20).reshape(conv_layout.rows, 1, kernel)
        conv_shard = cg.shard_of(full_conv, conv_layout, tp, rank)
        holder = torch.nn.Module()
        holder.config = config  # the mapping reads only the GDN sizes from its module's config
        conv = pm.GDNConv1dMapping("decoder.layers.0.self_attention.conv1d.weight", "linear_attn.conv1d.weight")
        bridge_conv = conv.megatron_to_hf(conv_shard, holder)["linear_attn.conv1d.weight"]
        _assert_bits(bridge_conv, full_conv, f"rank {rank} Bridge GDNConv1dMapping vs HF conv1d")
        _assert_bits(cg.gather_components_async(conv_shard, conv_layout, group=group), bridge_conv,
                     f"rank {rank} reference gdn_conv1d gather vs Bridge")
        return results


@pytest.mark.parametrize("tp", [2, 4])
def test_bridge_qkv_and_gdn_exports_equal_reference_gathers(rank_pool, tp):
    results = rank_pool.run(bridge_attention_in_rank, 4, tp)
    assert all(r["qkv_control_differs"] for r in results), "the [q; k; v] control gather matched Megatron's layout"
    from pytest_weightsync.reference_impl.trainer.component_gather import gdn_in_proj_layout

    names = gdn_in_proj_layout(*(GDN[k] for k in ("linear_key_head_dim", "linear_num_key_heads", "linear_value_head_dim", "linear_num_value_heads"))).components
    for rank, result in enumerate(results):
        gdn = result["in_proj"]
        decoded = _qwen3_next_decode(gdn["qkvz"], gdn["ba"])
        for name, hf, ours, original in zip(names, decoded, gdn["reference"], gdn["components"]):
            _assert_bits(hf, original, f"rank {rank} Bridge in_proj -> HF (transformers' Qwen3-Next split) {name}")
            _assert_bits(ours, hf, f"rank {rank} reference in_proj {name} vs Bridge/HF")
