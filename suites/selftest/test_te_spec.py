"""The Transformer Engine layer spec the whole-model trainer is built from, checked against
megatron-core's installed source (``reference_impl/trainer/te_spec.py`` compiles it over a
modelled TE, absent on CPU).

Real Megatron RL jobs build ``GPTModel`` from ``get_gpt_layer_with_transformer_engine_spec``:
the input norm fused into ``linear_qkv`` (``self_attention.linear_qkv.layer_norm_weight``), no
``input_layernorm`` parameter; slime's and verl's converters read exactly those names. The
local spec is kept for the trainers that still build it: the two specs must hold the same
tensors under their own names.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pytest_weightsync.reference_impl.model.layout import TrainerTopology
from pytest_weightsync.reference_impl.model.model_spec import qwen3_5_moe, qwen3_moe

from ..harness import distributed as dh

pytestmark = pytest.mark.weightsync_property("mutation_detected")

SPEC = qwen3_moe(num_layers=2, num_kv_heads=2)
#: Qwen3.5: a Gated DeltaNet layer, then attention.
SPEC_GDN = qwen3_5_moe(linear_k_heads=4, linear_v_heads=8, num_kv_heads=2, mtp_layers=0)
TOPO = TrainerTopology(tp=2, ep=2, etp=2, expert_impl="te_grouped")


def _describe(model) -> dict:
    """``{parameter name (wrappers' prefix removed): (shape, dtype, owning module's class,
    tensor_model_parallel, partition_dim)}``."""
    from pytest_weightsync.reference_impl.trainer.megatron_state import unwrapped

    chunk = unwrapped(model[0])
    out = {}
    for module_name, module in chunk.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            out[full] = (tuple(param.shape), param.dtype, type(module).__qualname__,
                         type(module).__module__,
                         bool(getattr(param, "tensor_model_parallel", False)),
                         getattr(param, "partition_dim", None))
    return out


def both_specs_in_rank(spec, topo):
    from pytest_weightsync.reference_impl.trainer import megatron_whole
    from pytest_weightsync.reference_impl.trainer.megatron_state import megatron_parallel_state

    from megatron.core.models.gpt import gpt_layer_specs

    with megatron_parallel_state(spec.experts, topo):
        config = megatron_whole.transformer_config(spec, topo)
        built = {layer_spec: _describe(megatron_whole.build_model(spec, topo, config, layer_spec))
                 for layer_spec in ("te", "local")}
    built["source"] = inspect.getsource(gpt_layer_specs)
    return built


@pytest.mark.parametrize("spec", [SPEC, SPEC_GDN], ids=["qwen3-moe", "qwen3.5-moe-gdn"])
def test_the_te_spec_fuses_the_input_norm_as_megatron_core_builds_it(rank_pool, spec):
    dh.require_megatron()
    from pytest_weightsync.reference_impl.trainer import megatron_whole

    per_rank = rank_pool.run(both_specs_in_rank, TOPO.world_size, spec, TOPO)
    first = next(l for l in range(spec.num_layers) if spec.layer_kind(l) == "attention")
    for rank, built in enumerate(per_rank):
        te, local = built["te"], built["local"]
        qkv = f"decoder.layers.{first}.self_attention.linear_qkv"
        # megatron-core's own classes, compiled from its installed source
        assert te[f"{qkv}.weight"][2:4] == ("TELayerNormColumnParallelLinear",
                                             "megatron.core.extensions.transformer_engine")
        assert te[f"decoder.layers.{first}.self_attention.linear_proj.weight"][2] == \
            "TERowParallelLinear"
        # the input norm lives in linear_qkv: replicated, beside the column-sharded weight
        shape, dtype, _, _, tp_sharded, dim = te[f"{qkv}.layer_norm_weight"]
        assert shape == (spec.hidden,) and not tp_sharded, (rank, te[f"{qkv}.layer_norm_weight"])
        assert te[f"{qkv}.weight"][4:] == (True, 0)
        assert te[f"decoder.layers.{first}.self_attention.linear_proj.weight"][4:] == (True, 1)
        assert not [n for n in te if "input_layernorm" in n], rank
        # the local spec: separate norms, the same tensors under their own names
        assert f"{qkv}.layer_norm_weight" not in local
        assert f"decoder.layers.{first}.input_layernorm.weight" in local
        # the local spec's GDN is the modelled one (Megatron-Bridge's names); the TE spec's is
        # megatron-core's own GatedDeltaNet: the same names, shapes and dtypes
        renamed = {megatron_whole.modelled_name(n): v[:2] for n, v in local.items()}
        assert renamed == {n: v[:2] for n, v in te.items()}, (
            sorted(set(renamed) ^ set(te)))
        for layer in range(spec.num_layers):
            if spec.layer_kind(layer) != "attention":
                mixer = f"decoder.layers.{layer}.self_attention"
                assert te[f"{mixer}.A_log"][2:4] == ("GatedDeltaNet",
                                                     "megatron.core.ssm.gated_delta_net")
                assert local[f"{mixer}.A_log"][2].endswith("ModelledGatedDeltaNet")
                assert te[f"{mixer}.in_proj.layer_norm_weight"][0] == (spec.hidden,)
    # what was built is what the installed source says the TE spec is: linear_qkv from the
    # backend's fused norm + linear, no separate input norm
    source = per_rank[0]["source"]
    body = source[source.index("def get_gpt_layer_with_transformer_engine_spec"):]
    assert "get_transformer_layer_spec_for_backend" in body or \
        "column_parallel_layer_norm_linear" in body, body[:400]
    assert "linear_qkv=backend.column_parallel_layer_norm_linear()" in source, \
        "megatron-core's TE spec no longer fuses the input norm into linear_qkv"


def test_the_modelled_te_linear_sets_the_attributes_te_sets():
    """``te_linear_attributes`` is what TE's ``Linear`` / ``LayerNormLinear.reset_parameters``
    give a weight (``te_spec.TE_LINEAR_SOURCE``); megatron-core's wrappers read them."""
    from pytest_weightsync.reference_impl.trainer import te_spec

    classes = te_spec.te_base_classes()
    layer = classes["LayerNormLinear"](8, 6, tp_size=2, parallel_mode="column",
                                       normalization="RMSNorm", device="cpu",
                                       params_dtype=torch.bfloat16)
    assert tuple(layer.weight.shape) == (3, 8) and layer.layer_norm_bias is None
    assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim,
            layer.weight.partition_stride) == (True, 0, 1)
    assert not getattr(layer.layer_norm_weight, "tensor_model_parallel", False)
    row = classes["Linear"](8, 6, tp_size=2, parallel_mode="row", device="cpu", bias=False)
    assert tuple(row.weight.shape) == (6, 4) and row.weight.partition_dim == 1
