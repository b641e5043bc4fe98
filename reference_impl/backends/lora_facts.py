"""How Megatron-Bridge 0.3.1, SGLang 0.5.23 and vLLM 0.33.0 lay out a LoRA adapter, as plain data.

An adapter sync moves A and B, not the weights: a few MB per step, but every framework names,
shards, stacks and scales them its own way, and the bugs live in the seams (an expert LoRA sent
3-D where the loader wants it per expert, ``alpha / r`` applied twice after a rebuild, A sliced
on the wrong dimension for a row-parallel base). The reference adapter exporter and loaders read
these layouts from here instead of restating them, and ``suites/selftest/test_lora_source.py``
holds every value to the pinned source - Megatron-Bridge and SGLang as installed (run on CPU
where cheap, read where not), vLLM from its wheel - so a layout cannot drift from the code it
models. Each fact names where it is read (:class:`Source`: a file under ``megatron/bridge/``,
``sglang/srt/`` or ``vllm/``, and the function or class).

Where the pinned source differs from the public reports the project issue cites, the source
wins and the comment says so: Megatron-Bridge 0.3.1 exports grouped-expert LoRA *per expert*
(``...mlp.experts.<e>.gate_proj.lora_A.weight``), not as 3-D ``gate_up_proj``; it emits no
``base_model.model.`` prefix; and vLLM 0.33.0 wants the flat per-expert layout only for models
that are not ``is_3d_moe_weight`` (Qwen3-MoE) - Qwen3.5-MoE wants the 3-D PEFT layout.

Conventions: a base linear maps ``in -> out`` (its weight is ``[out, in]``); ``r`` is the LoRA
rank (Bridge calls it ``dim``); A is ``[r, in]`` and B is ``[out, r]`` in every framework
(Bridge: ``linear_in`` / ``linear_out``). Nothing here imports torch or a framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_weightsync.reference_impl.backends.control_plane import (
    SGLANG_VERSION,
    VLLM_VERSION,
    Source,
)

__all__ = [
    "BRIDGE_VERSION", "SGLANG_VERSION", "VLLM_VERSION", "Source", "ShardedFactor",
    "BridgeAdapterLayout", "BRIDGE_BASE_KIND",
    # Megatron-Bridge
    "BRIDGE_LORA_TARGETS", "BRIDGE_CANONICAL_LORA_TARGETS", "BRIDGE_LORA_DEFAULTS",
    "BRIDGE_EXPERT_LINEAR_CASES", "BRIDGE_EXPERT_USES_ETP", "BRIDGE_ADAPTER_LAYOUTS",
    "BRIDGE_SCALING", "BRIDGE_SCALING_APPLIED_IN_FORWARD", "BRIDGE_MERGE",
    "BRIDGE_HF_LORA_SUFFIX", "BRIDGE_HF_NAME_PREFIX", "BRIDGE_3D_EXPERT_NAME_IS_NONE",
    "BRIDGE_QWEN3_MOE_EXPERT_HF_NAMES", "BRIDGE_GROUPED_EXPERT_ADAPTER",
    "BRIDGE_FUSED_A_SHARED", "BRIDGE_FC1_SPLIT",
    # SGLang
    "SGLANG_LOAD_FROM_TENSORS_ARGS", "SGLANG_CONFIG_FIELDS", "SGLANG_SCALING",
    "SGLANG_NORMALIZED_TARGETS", "SGLANG_STACKED_MULTIPLY", "SGLANG_STACK_ORDER",
    "SGLANG_ROW_PARALLEL_MODULES", "SGLANG_BUFFER_SHAPES", "SGLANG_TP_SLICING",
    "SGLANG_MOE_TP_SLICING", "SGLANG_SCALE_KEPT_FOR_DENSE", "SGLANG_SCALE_FOLDED_FOR_MOE",
    "SGLANG_MOE_NAMES", "SGLANG_SLOTS",
    # vLLM
    "VLLM_FROM_LORA_TENSORS_ARGS", "VLLM_SCALING", "VLLM_FOLD", "VLLM_FOLD_CALLERS",
    "VLLM_FROM_LORA_TENSORS_ALIASES", "VLLM_PEFT_PREFIX_STRIPPED", "VLLM_PACKED_MODULES",
    "VLLM_QWEN35_PACKED_MODULES", "VLLM_2D_EXPERT_NAMES", "VLLM_3D_EXPERT_NAMES",
    "VLLM_3D_MOE_MODELS", "VLLM_3D_INTO_2D_ERROR", "VLLM_TP_SLICING", "VLLM_MOE_TP_SLICING",
    "VLLM_MOE_BUFFER_SHAPES", "VLLM_SLOTS",
]

BRIDGE_VERSION = "0.3.1"

_B_LORA = "megatron/bridge/peft/lora.py"
_B_CANON = "megatron/bridge/peft/canonical_lora.py"
_B_UTILS = "megatron/bridge/peft/utils.py"
_B_PEFT = "megatron/bridge/models/conversion/peft_bridge.py"
_B_QWEN = "megatron/bridge/models/qwen/qwen3_moe_bridge.py"
_S_LORA = "sglang/srt/lora/lora.py"
_S_MGR = "sglang/srt/lora/lora_manager.py"
_S_CFG = "sglang/srt/lora/lora_config.py"
_S_UTILS = "sglang/srt/lora/utils.py"
_S_POOL = "sglang/srt/lora/mem_pool.py"
_S_LAYERS = "sglang/srt/lora/layers.py"
_V_MODEL = "vllm/lora/lora_model.py"
_V_WEIGHTS = "vllm/lora/lora_weights.py"
_V_MGR = "vllm/lora/model_manager.py"
_V_PEFT = "vllm/lora/peft_helper.py"
_V_UTILS = "vllm/lora/utils.py"
_V_COL = "vllm/lora/layers/column_parallel_linear.py"
_V_ROW = "vllm/lora/layers/row_parallel_linear.py"
_V_MOE = "vllm/lora/layers/fused_moe.py"
_V_EXPERTS = "vllm/model_executor/layers/fused_moe/routed_experts.py"


@dataclass(frozen=True)
class ShardedFactor:
    """One LoRA factor on one TP rank: its full shape in symbols (``"r"``, ``"in"``, ``"out"``),
    the dimension split across the TP group (``None``: every rank holds all of it), and
    whether the layer all-gathers its output in the forward."""

    full: tuple
    split_dim: int | None
    gathers_output: bool


@dataclass(frozen=True)
class BridgeAdapterLayout:
    """``ParallelLinearAdapter`` over one kind of base linear: A (``linear_in``) and B
    (``linear_out``) and how TP (ETP for routed experts) shards them."""

    base: str  # "column" (linear_qkv, linear_fc1) or "row" (linear_proj, linear_fc2)
    linear_in: ShardedFactor
    linear_out: ShardedFactor
    source: Source


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge 0.3.1
# ---------------------------------------------------------------------------------------------

#: ``LoRA.target_modules`` default (Megatron module names; wildcards allowed).
BRIDGE_LORA_TARGETS = (("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
                       Source(_B_LORA, "LoRA"))
#: ``CanonicalLoRA`` splits the fused bases into one adapter per HF projection
#: (``adapter_q`` / ``adapter_k`` / ``adapter_v``, ``adapter_up`` / ``adapter_gate``).
BRIDGE_CANONICAL_LORA_TARGETS = (("linear_q", "linear_k", "linear_v", "linear_proj",
                                  "linear_fc1_up", "linear_fc1_gate", "linear_fc2"),
                                 Source(_B_CANON, "CanonicalLoRA"))
BRIDGE_LORA_DEFAULTS = ({"dim": 32, "alpha": 32, "dropout": 0.0, "dropout_position": "pre",
                         "lora_A_init_method": "xavier", "lora_B_init_method": "zero"},
                        Source(_B_LORA, "LoRA"))

#: ``is_expert_linear(fqn)``: a routed-expert fc1/fc2 (grouped or sequential), never a shared
#: expert or a dense MLP. Routed-expert adapters are built with ``is_expert=True``.
BRIDGE_EXPERT_LINEAR_CASES = ({
    "decoder.layers.0.mlp.experts.linear_fc1": True,  # TEGroupedMLP
    "decoder.layers.0.mlp.experts.linear_fc2": True,
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1": True,  # SequentialMLP
    "decoder.layers.0.mlp.shared_experts.linear_fc1": False,
    "decoder.layers.0.mlp.linear_fc1": False,
    "decoder.layers.0.self_attention.linear_qkv": False,
}, Source(_B_UTILS, "is_expert_linear"))
#: Expert adapters take the expert-TP size (ETP) for ``in_features`` / ``out_features`` and
#: their parallel linears are built with ``is_expert=True`` (the ETP group); all others take TP.
BRIDGE_EXPERT_USES_ETP = (True, Source(_B_UTILS, "get_adapter_attributes_from_linear"))

_PLA = Source(_B_UTILS, "ParallelLinearAdapter.__init__")
#: Column-parallel base: A is a ``ColumnParallelLinear(in, r, gather_output=True)`` - split on
#: the *rank* dim; B a ``ColumnParallelLinear(r, out, gather_output=False)`` - split on out.
#: Row-parallel base: A a ``RowParallelLinear(in, r, input_is_parallel=True)`` - split on in;
#: B a ``ColumnParallelLinear(r, out, gather_output=True)`` - split on out, gathered. (A base
#: that is not TP-parallel - a duplicated TE linear, the router - gathers B in every case.)
BRIDGE_ADAPTER_LAYOUTS = {
    "column": BridgeAdapterLayout(
        "column", ShardedFactor(("r", "in"), 0, True), ShardedFactor(("out", "r"), 0, False), _PLA),
    "row": BridgeAdapterLayout(
        "row", ShardedFactor(("r", "in"), 1, False), ShardedFactor(("out", "r"), 0, True), _PLA),
}
#: Which base kind each target is (TE column / row parallel linears).
BRIDGE_BASE_KIND = {"linear_qkv": "column", "linear_fc1": "column",
                    "linear_proj": "row", "linear_fc2": "row"}

#: ``alpha / dim`` multiplies the adapter output in ``ParallelLinearAdapter.forward`` (after
#: ``linear_out``, after a ``"post"`` dropout); A and B are stored unscaled. ``alpha=None``
#: means ``alpha = dim``. Dropout ``"pre"`` (default) applies to the adapter input only.
BRIDGE_SCALING = ("alpha / dim", Source(_B_UTILS, "ParallelLinearAdapter.forward"))
BRIDGE_SCALING_APPLIED_IN_FORWARD = (True, Source(_B_UTILS, "ParallelLinearAdapter.forward"))
#: The merged path: ``base + alpha / dim * (linear_out @ linear_in)`` in the base's dtype,
#: for TE grouped linears the same adapter product added to every ``weight{i}``.
BRIDGE_MERGE = ("base + alpha / dim * (B @ A)", Source(_B_LORA, "LoRAMerge.merge"))

#: Megatron adapter suffix -> HF/PEFT suffix; the HF name is the base's HF name with
#: ``.weight`` replaced.
BRIDGE_HF_LORA_SUFFIX = ({".linear_in.weight": ".lora_A.weight",
                          ".linear_out.weight": ".lora_B.weight"},
                         Source(_B_PEFT, "MegatronPeftBridge._make_lora_param_name"))
#: Bridge itself emits HF names (``model.layers.0...``) with no ``base_model.model.`` prefix;
#: consumers that want PEFT's file names add it (vLLM strips it either way).
BRIDGE_HF_NAME_PREFIX = ("", Source(_B_PEFT, "MegatronPeftBridge._make_lora_param_name"))
#: A base HF name without ``.weight`` (the 3-D ``mlp.experts.gate_up_proj`` of the Qwen3-VL
#: bridge) gets no LoRA name: ``_make_lora_param_name`` returns ``None``.
BRIDGE_3D_EXPERT_NAME_IS_NONE = (True,
                                 Source(_B_PEFT, "MegatronPeftBridge._make_lora_param_name"))
#: Qwen3-MoE routed experts map to per-expert HF names, so their LoRA is exported per expert:
#: ``model.layers.<l>.mlp.experts.<e>.{gate,up,down}_proj.lora_{A,B}.weight``.
BRIDGE_QWEN3_MOE_EXPERT_HF_NAMES = (("model.layers.*.mlp.experts.*.gate_proj.weight",
                                     "model.layers.*.mlp.experts.*.up_proj.weight",
                                     "model.layers.*.mlp.experts.*.down_proj.weight"),
                                    Source(_B_QWEN, "Qwen3MoEBridge.mapping_registry"))
#: A grouped expert linear (``mlp.experts.linear_fc1``, not ``local_experts``) holds ONE 2-D
#: adapter per EP rank, shared by its local experts; the export walks every global expert
#: ``e`` and emits the adapter gathered from EP rank ``e // (num_experts // ep)``.
BRIDGE_GROUPED_EXPERT_ADAPTER = ("one per EP rank, shared by its local experts",
                                 Source(_B_PEFT, "MegatronPeftBridge._select_expert_adapter_weight"))
#: Fused bases (qkv, fc1) have one A: the export emits the same A under each projection's
#: name (q/k/v, gate/up) and splits only B.
BRIDGE_FUSED_A_SHARED = (True,
                         Source(_B_PEFT, "MegatronPeftBridge.stream_adapter_weights_megatron_to_hf"))
#: fc1's B (gathered over TP) is TP-shard-major ``[gate_0; up_0; gate_1; up_1; ...]``: split
#: into ``tp`` shards, each halved, gates concatenated and ups concatenated. At TP=1 it is
#: ``[gate; up]`` halves.
BRIDGE_FC1_SPLIT = ("per TP shard [gate_i; up_i]",
                    Source(_B_PEFT, "MegatronPeftBridge._split_fused_fc1_linear_out_weight"))

# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23
# ---------------------------------------------------------------------------------------------

#: ``LoRAManager.load_lora_adapter_from_tensors(lora_ref, tensors, config_dict,
#: added_tokens_config=None)``; ``tensors`` are PEFT names -> tensors, ``config_dict`` a PEFT
#: ``adapter_config.json`` as a dict.
SGLANG_LOAD_FROM_TENSORS_ARGS = (("self", "lora_ref", "tensors", "config_dict",
                                  "added_tokens_config"),
                                 Source(_S_MGR, "LoRAManager.load_lora_adapter_from_tensors"))
#: The PEFT config fields LoRAConfig reads; ``peft_type`` must be "lora" (case-insensitive).
SGLANG_CONFIG_FIELDS = (("target_modules", "r", "lora_alpha"), Source(_S_CFG, "LoRAConfig.__init__"))
#: ``LoRAAdapter.scaling = lora_alpha / r`` (no rsLoRA in 0.5.23).
SGLANG_SCALING = ("lora_alpha / r", Source(_S_LORA, "LoRAAdapter.__init__"))
#: PEFT projection -> the module SGLang holds LoRA for (``all`` / ``all-linear`` -> {"all"}).
SGLANG_NORMALIZED_TARGETS = ({"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                              "o_proj": "o_proj", "down_proj": "down_proj"},
                             Source(_S_UTILS, "get_normalized_target_modules"))
#: How many LoRA ranks a module stacks along A's row dim (without a model override).
SGLANG_STACKED_MULTIPLY = ({"qkv_proj": 3, "gate_up_proj": 2, "gate_up_proj_moe": 2,
                            "in_proj_qkvz": 4, "o_proj": 1, "down_proj": 1, "down_proj_moe": 1},
                           Source(_S_UTILS, "get_stacked_multiply"))
#: Stacking at load: A and B concatenated in this order along dim ``ndim - 2`` (dim 0 for 2-D,
#: dim 1 for a 3-D expert tensor); a missing k_proj / up_proj is zeros; an already stacked
#: ``qkv_proj`` / ``gate_up_proj`` lora_A is repeated 3x / 2x, its lora_B kept.
SGLANG_STACK_ORDER = ({"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                       "gate_up_proj": ("gate_proj", "up_proj")},
                      Source(_S_LORA, "LoRAAdapter.normalize_gate_up_proj"))
#: Row-parallel LoRA modules: A's input dim is the TP-local one; every other (non-replicated)
#: module's B output dim is TP-local.
SGLANG_ROW_PARALLEL_MODULES = (("o_proj", "out_proj", "down_proj", "down_proj_moe",
                                "down_proj_shared_moe", "wo_ud"),
                               Source(_S_UTILS, "ROW_PARALLELISM_LINEAR_LORA_NAMES"))
#: Memory-pool buffers per module, one slot per ``max_loras_per_batch``; ``c`` the stacked
#: multiply, ``E`` the (local) experts, ``_tp`` a TP-local size.
SGLANG_BUFFER_SHAPES = ({
    "A": ("max_loras", "r*c", "in"), "A_row": ("max_loras", "r*c", "in_tp"),
    "B": ("max_loras", "out_tp", "r"), "B_row": ("max_loras", "out", "r"),
    "A_moe": ("max_loras", "E", "r*c", "in"), "B_moe": ("max_loras", "E", "out", "r"),
}, Source(_S_POOL, "LoRAMemoryPool.get_lora_A_shape"))
#: Per-rank slicing of the full A / B (``None``: unsliced). Column: B rows of this rank's
#: output shard (qkv: q shard + this rank's kv-head shard; gate_up: each half's shard); row:
#: A columns of this rank's input shard.
SGLANG_TP_SLICING = ({
    "column": {"A": None, "B": 0}, "qkv": {"A": None, "B": 0},
    "gate_up": {"A": None, "B": 0}, "row": {"A": 1, "B": None},
}, Source(_S_LAYERS, "RowParallelLinearWithLoRA.slice_lora_a_weights"))
#: Fused MoE: gate_up A unsliced, its B sliced per half (gate rows ``[s:e]`` and up rows
#: ``[I + s: I + e]`` concatenated); down A sliced on its last dim, down B unsliced.
SGLANG_MOE_TP_SLICING = ({"gate_up_proj_moe": {"A": None, "B": "per half"},
                          "down_proj_moe": {"A": -1, "B": None}},
                         Source(_S_LAYERS, "FusedMoEWithLoRA.slice_moe_lora_b_weights"))
#: Dense modules: ``scaling`` is passed per slot to the backend at batch time; the B buffer
#: holds B unscaled.
SGLANG_SCALE_KEPT_FOR_DENSE = (True, Source(_S_MGR, "LoRAManager.prepare_lora_batch"))
#: MoE modules: B is multiplied by ``scaling`` while copied into the buffer - out of place
#: (``w = w * scaling``), so the adapter's own tensors stay unscaled and a reload scales once.
SGLANG_SCALE_FOLDED_FOR_MOE = (True, Source(_S_POOL, "LoRAMemoryPool.load_lora_weight_to_buffer"))
#: Expert LoRA names: per expert ``...experts.<e>.<proj>.lora_X.weight`` (2-D each, keyed by
#: expert id into ``<target>_moe``), or one 3-D tensor under ``...experts...`` (``[E_or_1, ...]``);
#: ``shared_experts`` go to ``<target>_shared_moe``.
SGLANG_MOE_NAMES = (("per-expert 2-D", "3-D under experts"),
                    Source(_S_POOL, "LoRAMemoryPool.load_lora_weight_to_buffer"))
#: Slots: ``uid_to_buffer_id`` maps an adapter uid to its buffer row; uid ``None`` (the base
#: model) gets a zeroed slot.
SGLANG_SLOTS = ("uid_to_buffer_id", Source(_S_POOL, "LoRAMemoryPool.prepare_lora_batch"))

# ---------------------------------------------------------------------------------------------
# vLLM 0.33.0
# ---------------------------------------------------------------------------------------------

VLLM_FROM_LORA_TENSORS_ARGS = (("cls", "lora_model_id", "tensors", "peft_helper", "device", "dtype",
                                "model_vocab_size", "weights_mapper", "skip_prefixes"),
                               Source(_V_MODEL, "LoRAModel.from_lora_tensors"))
#: ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
VLLM_SCALING = ("lora_alpha / r", Source(_V_PEFT, "PEFTHelper._scaling"))
#: ``optimize()`` folds the scaling into B in place: ``self.lora_b *= self.scaling`` and
#: ``self.scaling = 1``.
VLLM_FOLD = ("lora_b *= scaling (in place)", Source(_V_WEIGHTS, "LoRALayerWeights.optimize"))
#: Who folds: the manager when an adapter is added (every LoRA of the model), and ``pack``
#: for the sub-LoRAs of a packed module.
VLLM_FOLD_CALLERS = ((Source(_V_MGR, "LoRAModelManager._create_merged_loras_inplace"),
                      Source(_V_WEIGHTS, "PackedLoRALayerWeights.pack")),
                     Source(_V_MGR, "LoRAModelManager._add_adapter"))
#: ``from_lora_tensors`` stores ``tensor.to(device=..., dtype=...)``: the caller's own tensor when
#: device and dtype already match, so the in-place fold scales the staged tensor - a second build
#: from the same staged tensors (after LRU eviction) starts from scaled B and scales it again.
VLLM_FROM_LORA_TENSORS_ALIASES = (True, Source(_V_MODEL, "LoRAModel.from_lora_tensors"))
#: A leading ``base_model.model.`` is stripped from PEFT names (optional).
VLLM_PEFT_PREFIX_STRIPPED = ("base_model.model.", Source(_V_UTILS, "parse_fine_tuned_lora_name"))
#: Packed modules of Qwen3-MoE (gate_up only where the model has a dense MLP).
VLLM_PACKED_MODULES = ({"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                        "gate_up_proj": ["gate_proj", "up_proj"]},
                       Source("vllm/model_executor/models/qwen3_moe.py",
                              "Qwen3MoeForCausalLM.packed_modules_mapping"))
VLLM_QWEN35_PACKED_MODULES = ({"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
                               "in_proj_ba": ["in_proj_b", "in_proj_a"],
                               "gate_up_proj": ["gate_proj", "up_proj"]},
                              Source("vllm/model_executor/models/qwen3_5.py",
                                     "Qwen3_5ForCausalLMBase.packed_modules_mapping"))
#: 2-D (flat) expert LoRA: ``experts`` packs, expert-major, the triplets
#: ``experts.<e>.gate_proj`` (w1), ``experts.<e>.down_proj`` (w2), ``experts.<e>.up_proj`` (w3).
VLLM_2D_EXPERT_NAMES = (("experts.{e}.gate_proj", "experts.{e}.down_proj", "experts.{e}.up_proj"),
                        Source(_V_EXPERTS, "RoutedExperts.build_expert_params_mapping"))
#: 3-D (PEFT ``target_parameters``) expert LoRA: ``experts.base_layer`` is gate_up and
#: ``experts`` is down; A is ``[E*r, in]`` (read as ``(E, r, in)``), B ``[out, r*E]`` (read as
#: ``(out, r, E)`` then permuted to ``(E, out, r)``).
VLLM_3D_EXPERT_NAMES = ({"gate_up": "experts.base_layer", "down": "experts",
                         "A": ("E*r", "in"), "B": ("out", "r*E")},
                        Source(_V_MGR, "LoRAModelManager._stack_moe_lora_weights"))
#: Which layout a model wants: ``is_3d_moe_weight`` (default False).
VLLM_3D_MOE_MODELS = ({"Qwen3MoeForCausalLM": False, "Qwen3_5MoeForConditionalGeneration": True},
                      Source("vllm/model_executor/models/interfaces.py", "SupportsLoRA"))
#: A 3-D adapter offered to a 2-D fused-MoE wrapper is refused before packing (SkyRL#1852).
VLLM_3D_INTO_2D_ERROR = ("contains fused 3D MoE weights",
                         Source(_V_MGR, "LoRAModelManager._validate_moe_lora_format"))
#: Per-rank slicing (not fully sharded): column / merged / qkv slice B rows, keep A; row
#: slices A columns, keeps B.
VLLM_TP_SLICING = ({"column": {"A": None, "B": 0}, "row": {"A": 1, "B": None}},
                   Source(_V_ROW, "RowParallelLinearWithLoRA.slice_lora_a"))
#: Fused MoE (not fully sharded): w13 A kept, w13 B sliced on out; w2 A sliced on in, w2 B
#: kept (dims of the per-expert ``(E, ., .)`` tensors).
VLLM_MOE_TP_SLICING = ({"w13": {"A": None, "B": 1}, "w2": {"A": 2, "B": None}},
                       Source(_V_MOE, "FusedMoEWithLoRA._slice_w2_a"))
#: Fused-MoE buffers: one tuple entry per w13 slice (gate, up: not stacked), one for w2.
VLLM_MOE_BUFFER_SHAPES = ({
    "w13_lora_a": ("max_loras", "E_local", "max_rank", "hidden"),
    "w13_lora_b": ("max_loras", "E_local", "inter_tp", "max_rank"),
    "w2_lora_a": ("max_loras", "E_local", "max_rank", "inter_tp"),
    "w2_lora_b": ("max_loras", "E_local", "hidden", "max_rank"),
}, Source(_V_MOE, "FusedMoEWithLoRA._create_lora_a_weights"))
#: Slots: ``lora_index_to_id`` (``max_loras`` entries); adapter ids are ints > 0.
VLLM_SLOTS = ("lora_index_to_id", Source(_V_MGR, "LoRAModelManager.__init__"))
