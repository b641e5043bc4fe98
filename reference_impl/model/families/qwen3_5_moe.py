"""Qwen3.5-MoE (language model): layer ``l`` is full attention with an output gate when
``(l + 1) % full_attention_interval == 0``, else a Gated DeltaNet layer; every MoE block has a
shared expert and its gate; ``mtp_layers=1`` adds the multi-token prediction draft.

SGLang serves it as ``Qwen3_5MoeForConditionalGeneration`` with ``language_model_only``
(``sglang/srt/models/qwen3_5.py``; draft ``Qwen3_5ForCausalLMMTP``), vLLM as
``Qwen3_5MoeForCausalLM`` (``qwen3_5.py``; draft ``Qwen3_5MoeMTP``), Megatron-Bridge converts
it with ``Qwen3NextBridge``. ``docs/model-families.md`` is the prose.
"""

from __future__ import annotations

from pytest_weightsync.reference_impl.model.families.record import ModelFamily
from pytest_weightsync.reference_impl.model.families.qwen3_moe import (
    MEGATRON_CONFIG,
    MEGATRON_MODEL,
)
from pytest_weightsync.reference_impl.model.families.qwen3_moe import RECORD as QWEN3_MOE

__all__ = ["RECORD", "VLLM_GDN"]

#: vLLM's stacked renames of the GDN projections (``Qwen3_5Model`` = ``Qwen3NextModel``'s
#: mapper ``|`` these), after Qwen3-MoE's.
VLLM_GDN = {".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)), ".in_proj_z": (".in_proj_qkvz", 3),
            ".in_proj_b": (".in_proj_ba", 0), ".in_proj_a": (".in_proj_ba", 1)}

RECORD = ModelFamily(
    name="qwen3_5_moe",
    id_prefix="q35",
    layer_rule="attention_every_interval",
    extra_parts=frozenset({"gdn", "shared_expert"}),
    attn_output_gate=True,
    required_fields=("intermediate_shared", "linear_k_heads", "linear_v_heads", "linear_k_dim",
                     "linear_v_dim", "conv_kernel"),
    vl_prefix="model.language_model.",
    sglang_module="qwen3_5",
    sglang_class="Qwen3_5MoeForConditionalGeneration",
    sglang_loader_class="Qwen3_5MoeForCausalLM",
    sglang_draft=("qwen3_5_mtp", "Qwen3_5ForCausalLMMTP"),
    sglang_attention_prefix="",
    sglang_config=("sglang.srt.configs.qwen3_5", "Qwen3_5MoeConfig"),
    sglang_text_config=True,
    sglang_tied_head_buffer=True,
    vllm_model=("qwen3_5.py", "Qwen3_5MoeForCausalLM"),
    vllm_draft=("qwen3_5_mtp.py", "Qwen3_5MoeMTP"),
    vllm_stacked={**QWEN3_MOE.vllm_stacked, **VLLM_GDN},
    # Qwen3_5ForCausalLMBase.hf_to_vllm_mapper: the VL prefix away, the draft's tensors dropped
    vllm_served_prefixes={"model.language_model.": "model.", "mtp.": None},
    vllm_module_tree={
        "Qwen3_5MoeForCausalLM": {"model": "Qwen3_5Model", "lm_head": "ParallelLMHead"},
        "Qwen3_5Model": {"embed_tokens": "VocabParallelEmbedding", "layers": "Qwen3_5DecoderLayer",
                         "norm": "GemmaRMSNorm"},
        "Qwen3_5DecoderLayer": {"self_attn": "Qwen3NextAttention",
                                "linear_attn": "QwenGatedDeltaNetAttention",
                                "mlp": "Qwen3NextSparseMoeBlock",
                                "input_layernorm": "GemmaRMSNorm",
                                "post_attention_layernorm": "GemmaRMSNorm"},
        "Qwen3NextAttention": {"qkv_proj": "QKVParallelLinear", "o_proj": "RowParallelLinear",
                               "q_norm": "GemmaRMSNorm", "k_norm": "GemmaRMSNorm"},
        "QwenGatedDeltaNetAttention": {"in_proj_qkvz": "MergedColumnParallelLinear",
                                       "in_proj_ba": "MergedColumnParallelLinear",
                                       "conv1d": "ColumnParallelLinear",
                                       "norm": "RMSNormGated", "out_proj": "RowParallelLinear"},
        "Qwen3NextSparseMoeBlock": {"gate": "GateLinear", "shared_expert_gate": "ReplicatedLinear",
                                    "shared_expert": "Qwen2MoeMLP", "experts": "MoERunner"},
        "Qwen2MoeMLP": {"gate_up_proj": "MergedColumnParallelLinear",
                        "down_proj": "RowParallelLinear"},
        "MoERunner": {"routed_experts": "RoutedExperts"},
        # the draft
        "Qwen3_5MoeMTP": {"model": "Qwen3_5MultiTokenPredictor"},
        "Qwen3_5MultiTokenPredictor": {"fc": "ColumnParallelLinear",
                                       "pre_fc_norm_embedding": "GemmaRMSNorm",
                                       "pre_fc_norm_hidden": "GemmaRMSNorm",
                                       "layers": "Qwen3_5DecoderLayer", "norm": "GemmaRMSNorm"},
    },
    bridge=("models/qwen/qwen3_next_bridge.py", "Qwen3NextBridge"),
    bridge_provider="Qwen3NextModelProvider",
    # Qwen3NextModelProvider inherits Qwen3MoEModelProvider's settings and changes the rotary
    # base; its gated attention and shared-expert gate follow the spec (attn_output_gate,
    # intermediate_shared). layernorm_zero_centered_gamma is left off: it changes what the
    # norm weights mean (Bridge maps GDN out_norm as hf - 1), not which parameters exist.
    megatron_config=MEGATRON_CONFIG,
    megatron_model={**MEGATRON_MODEL, "rotary_base": 10000000},
    # 2 layers (a GDN layer, then full attention), 4 experts with a shared expert of the same
    # FFN size (as Qwen3.5-35B-A3B), 2 key / 4 value GDN heads, 4 query heads on 2 KV heads,
    # a vocab of 37 and one MTP layer
    small_spec={"num_layers": 2, "num_experts": 4, "hidden": 8, "intermediate": 4, "vocab": 37,
                "num_heads": 4, "num_kv_heads": 2, "head_dim": 2, "intermediate_shared": 4,
                "full_attention_interval": 2, "linear_k_heads": 2, "linear_v_heads": 4,
                "linear_k_dim": 2, "linear_v_dim": 2, "conv_kernel": 3, "mtp_layers": 1},
)
