"""A model family is one record: a test-only family is picked up everywhere from it.

``reference_impl/model/families`` holds one :class:`ModelFamily` per family; the checkpoint
spec, SGLang's and vLLM's engine layouts, the Megatron trainer model and SGLang's real model
tree read it and hold no branch of their own. Here a third family is registered for a test
and every one of those layouts must derive its names and shapes from that record:

* ``toy_moe``: Qwen3-MoE's record under another name, with SGLang's attention parameters on
  the layer (no ``self_attn.``), vLLM's under ``attn.``, one more vLLM rename
  (``o_proj`` -> ``out_proj``) and other Megatron settings (norm epsilon, rotary base);
* ``toy35_moe``: Qwen3.5-MoE's record under another name, which SGLang's real classes (named
  by the record) build on CPU, parameter for parameter the layout's.

And no module of the reference branches on a family's name any more.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.model import families
from pytest_weightsync.reference_impl.model import vllm_layout as v
from pytest_weightsync.reference_impl.model.families import qwen3_5_moe as q35_family
from pytest_weightsync.reference_impl.model.families import qwen3_moe as q3_family
from pytest_weightsync.reference_impl.model.layout import (
    ReceiverTopology,
    TopologyError,
    TrainerTopology,
)
from pytest_weightsync.reference_impl.model.model_layout import engine_params
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, hf_params, qwen3_moe
from pytest_weightsync.vocabulary import MODEL_FAMILIES

pytestmark = pytest.mark.weightsync_property("receiver_layout")

TOY = dataclasses.replace(
    q3_family.RECORD, name="toy_moe", id_prefix="toy", sglang_attention_prefix="",
    vllm_attention_prefix="attn.",
    vllm_stacked={**q3_family.RECORD.vllm_stacked, ".o_proj": (".out_proj", None)},
    megatron_config={**q3_family.MEGATRON_CONFIG, "layernorm_epsilon": 1e-5},
    megatron_model={**q3_family.MEGATRON_MODEL, "rotary_base": 500000})
TOY35 = dataclasses.replace(q35_family.RECORD, name="toy35_moe", id_prefix="t35")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def toy():
    with families.registered(TOY):
        yield ModelSpec(family="toy_moe", **TOY.small_spec)


def _without_self_attn(name: str) -> str:
    return re.sub(r"^(model\.layers\.[0-9]+\.)self_attn\.", r"\1", name)


def test_builtin_records_are_the_vocabulary_words():
    assert families.names() == MODEL_FAMILIES
    for name in MODEL_FAMILIES:
        assert families.get(name).name == name


def test_an_unknown_family_is_refused_and_a_registered_one_accepted():
    with pytest.raises(families.UnknownModelFamily, match="unknown model family 'toy_moe'"):
        families.get("toy_moe")
    assert issubclass(families.UnknownModelFamily, WeightSyncError)
    with pytest.raises(TopologyError, match="ModelSpec.family must be one of"):
        ModelSpec(family="toy_moe", **TOY.small_spec)
    with families.registered(TOY):
        assert families.names() == MODEL_FAMILIES + ("toy_moe",)
        assert ModelSpec(family="toy_moe", **TOY.small_spec).family_record is TOY
        with pytest.raises(families.UnknownModelFamily, match="already registered"):
            families.register(TOY)
        # the record's fixed fields hold for it too (a Qwen3-MoE-like family has no draft)
        with pytest.raises(TopologyError, match="qwen3_moe has no shared expert"):
            ModelSpec(family="toy_moe", **{**TOY.small_spec, "mtp_layers": 1})
    assert families.names() == MODEL_FAMILIES
    with pytest.raises(families.UnknownModelFamily, match="builtin"):
        families.unregister("qwen3_moe")


def test_the_checkpoint_spec_reads_the_record(toy):
    assert toy.id.startswith("toyL2E4")
    assert toy.parts == qwen3_moe().parts
    assert [toy.layer_kind(layer) for layer in range(toy.num_layers)] == ["attention"] * 2
    assert not toy.attn_output_gate and toy.q_rows == 4 * 2
    assert {n: (p.shape, p.dtype) for n, p in hf_params(toy).items()} == \
        {n: (p.shape, p.dtype) for n, p in hf_params(qwen3_moe()).items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_sglang_layout_takes_the_attention_prefix_from_the_record(toy, tp):
    topo = ReceiverTopology(tp=tp)
    mine = engine_params(toy, topo, 0)
    stock = engine_params(qwen3_moe(), topo, 0)
    assert "model.layers.0.qkv_proj.weight" in mine
    assert not any(".self_attn." in name for name in mine)
    # [q_r; k_r; v_r]: 4 query rows of 2 heads over TP, the one KV head (replicated) twice
    assert mine["model.layers.0.qkv_proj.weight"].shape == (8 // tp + 2 + 2, 8)
    assert mine["model.layers.1.o_proj.weight"].shape == (8, 8 // tp)
    renamed = {_without_self_attn(n): (p.shape, p.segments) for n, p in stock.items()}
    assert {n: (p.shape, p.segments) for n, p in mine.items()} == renamed


def test_the_vllm_layout_takes_names_and_renames_from_the_record(toy):
    params = v.engine_params(toy, v.VllmTopology(tp=2), 0)
    assert params["model.layers.0.attn.qkv_proj.weight"].shape == (4 + 2 + 2, 8)
    assert params["model.layers.1.attn.k_norm.weight"].shape == (2,)
    assert not any("self_attn" in name for name in params)
    assert v.vllm_name(toy, "model.layers.0.qkv_proj.weight") == "model.layers.0.attn.qkv_proj.weight"
    assert v.checkpoint_route(toy, "model.layers.0.self_attn.k_proj.weight") == \
        ("model.layers.0.self_attn.qkv_proj.weight", "k")
    assert v.checkpoint_route(toy, "model.layers.0.self_attn.o_proj.weight") == \
        ("model.layers.0.self_attn.out_proj.weight", None)
    assert v.checkpoint_route(qwen3_moe(), "model.layers.0.self_attn.o_proj.weight") == \
        ("model.layers.0.self_attn.o_proj.weight", None)


def test_the_trainer_model_reads_the_record(toy):
    from pytest_weightsync.reference_impl.trainer.megatron_model import trainer_params

    topo = TrainerTopology(tp=2)
    mine = [(p.name, p.kind, p.blocks) for p in trainer_params(toy, topo)]
    assert mine == [(p.name, p.kind, p.blocks) for p in trainer_params(qwen3_moe(), topo)]
    assert ("decoder.layers.0.self_attention.linear_qkv.weight", "query_groups") in \
        [(name, kind) for name, kind, _ in mine]
    pytest.importorskip("megatron.core", reason="megatron-core is not importable")
    from pytest_weightsync.reference_impl.trainer import megatron_whole

    config = megatron_whole.transformer_config(toy, topo)
    assert config.layernorm_epsilon == 1e-5 and config.qk_layernorm is True
    assert config.normalization == "RMSNorm" and not config.attention_output_gate
    stock = megatron_whole.transformer_config(qwen3_moe(), topo)
    assert stock.layernorm_epsilon == 1e-6


def test_the_sglang_model_tree_builds_the_record_s_classes():
    pytest.importorskip("sglang.srt.models.qwen3_5", reason="sglang (Qwen3.5 model) is not importable")
    import torch

    from pytest_weightsync.reference_impl.backends.sglang_model_tree import (
        SGLangPlacementError,
        build_engine_rank,
    )

    topo = ReceiverTopology(tp=2)
    with families.registered(TOY35):
        spec = ModelSpec(family="toy35_moe", **TOY35.small_spec)
        real = build_engine_rank(spec, topo, 0)
        assert type(real.target).__name__ == TOY35.sglang_class
        assert type(real.draft).__name__ == TOY35.sglang_draft[1]
        params = {n: torch.empty(p.shape, dtype=p.dtype)
                  for n, p in engine_params(spec, topo, 0).items()}
        assert "model.layers.1.qkv_proj.weight" in params
        real.bind(params)  # the record's layout is the real classes' tree, name for name
    # toy_moe names Qwen3MoeForCausalLM (attention under self_attn.) but lays the attention
    # out on the layer: the real tree refuses the record's layout
    with families.registered(TOY):
        spec = ModelSpec(family="toy_moe", **TOY.small_spec)
        real = build_engine_rank(spec, topo, 0)
        assert type(real.target).__name__ == "Qwen3MoeForCausalLM"
        params = {n: torch.empty(p.shape, dtype=p.dtype)
                  for n, p in engine_params(spec, topo, 0).items()}
        with pytest.raises(SGLangPlacementError, match="qkv_proj"):
            real.bind(params)


def test_no_module_of_the_reference_branches_on_a_family_name():
    branch = re.compile(r"""family\s*(==|!=)\s*["']|family\s+(not\s+)?in\s+\(["']""")
    found = []
    for path in sorted((ROOT / "reference_impl").rglob("*.py")):
        if "families" in path.relative_to(ROOT).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
