"""Qwen3-MoE: every layer GQA attention with q/k norms and a sparse MoE block (router
``mlp.gate``, routed experts); no shared expert, no GDN layer, no draft model.

SGLang serves it as ``Qwen3MoeForCausalLM`` (``sglang/srt/models/qwen3_moe.py``), vLLM as
``Qwen3MoeForCausalLM`` (``qwen3_moe.py``), Megatron-Bridge converts it with
``Qwen3MoEBridge``. ``docs/model-families.md`` is the prose.
"""

from __future__ import annotations

from pytest_weightsync.reference_impl.model.families.record import ModelFamily

__all__ = ["MEGATRON_CONFIG", "MEGATRON_MODEL", "RECORD", "VLLM_MLP", "VLLM_QKV"]

#: vLLM's stacked renames of the attention projections and the dense / shared-expert MLPs
#: (``Qwen3MoeModel``'s ``hf_to_vllm_mapper``); Qwen3.5 starts from the same entries.
VLLM_QKV = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v")}
VLLM_MLP = {".mlp.gate_proj": (".mlp.gate_up_proj", 0), ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1)}

#: ``TransformerConfig`` settings of every Qwen3-MoE outside its sizes, as Megatron-Bridge 0.3.1
#: sets them (``megatron/bridge/models/qwen/qwen_provider.py`` ``Qwen3MoEModelProvider``;
#: ``qwen3_moe_bridge.py`` ``Qwen3MoEBridge.provider_bridge``: "Qwen3 MoE does NOT have QKV
#: bias", "Qwen3 MoE uses QK layernorm"); they decide which parameters exist (RMSNorm: no
#: norm bias; no linear or qkv bias; q/k norms). Held to the installed Bridge by
#: ``suites/selftest/test_trainer_model_names.py``.
MEGATRON_CONFIG = {"normalization": "RMSNorm", "qk_layernorm": True, "add_bias_linear": False,
                   "add_qkv_bias": False, "gated_linear_unit": True, "layernorm_epsilon": 1e-6}
#: ``GPTModel`` arguments of the same provider: rotary positions (no
#: ``embedding.position_embeddings`` parameter), untied embeddings.
MEGATRON_MODEL = {"position_embedding_type": "rope", "rotary_base": 1000000,
                  "share_embeddings_and_output_weights": False}

RECORD = ModelFamily(
    name="qwen3_moe",
    id_prefix="q3",
    layer_rule="all_attention",
    fixed_fields={"intermediate_shared": 0, "linear_k_heads": 0, "mtp_layers": 0,
                  "full_attention_interval": 1},
    fixed_message="qwen3_moe has no shared expert, no GDN layers and no MTP draft",
    fixed_shown=("intermediate_shared", "mtp_layers", "full_attention_interval"),
    sglang_module="qwen3_moe",
    sglang_class="Qwen3MoeForCausalLM",
    sglang_loader_class="Qwen3MoeForCausalLM",
    sglang_attention_prefix="self_attn.",
    sglang_config=("transformers", "Qwen3MoeConfig"),
    vllm_model=("qwen3_moe.py", "Qwen3MoeForCausalLM"),
    vllm_stacked={**VLLM_QKV, **VLLM_MLP},
    vllm_served_prefixes={},
    vllm_module_tree={
        "Qwen3MoeForCausalLM": {"model": "Qwen3MoeModel", "lm_head": "ParallelLMHead"},
        "Qwen3MoeModel": {"embed_tokens": "VocabParallelEmbedding",
                          "layers": "Qwen3MoeDecoderLayer", "norm": "RMSNorm"},
        "Qwen3MoeDecoderLayer": {"self_attn": "Qwen3MoeAttention", "mlp": "Qwen3MoeSparseMoeBlock",
                                 "input_layernorm": "RMSNorm",
                                 "post_attention_layernorm": "RMSNorm"},
        "Qwen3MoeAttention": {"qkv_proj": "QKVParallelLinear", "o_proj": "RowParallelLinear",
                              "q_norm": "RMSNorm", "k_norm": "RMSNorm"},
        "Qwen3MoeSparseMoeBlock": {"gate": "GateLinear", "experts": "MoERunner"},
        "MoERunner": {"routed_experts": "RoutedExperts"},
    },
    bridge=("models/qwen/qwen3_moe_bridge.py", "Qwen3MoEBridge"),
    bridge_provider="Qwen3MoEModelProvider",
    megatron_config=MEGATRON_CONFIG,
    megatron_model=MEGATRON_MODEL,
    # 2 layers, 4 experts, 4 query heads on 1 KV head (fewer KV heads than TP ranks from TP 2
    # on), a vocab of 37 (not divisible by any TP size)
    small_spec={"num_layers": 2, "num_experts": 4, "hidden": 8, "intermediate": 4, "vocab": 37,
                "num_heads": 4, "num_kv_heads": 1, "head_dim": 2},
)
