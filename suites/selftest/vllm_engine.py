"""One vLLM 0.33.0 engine rank built on CPU from vLLM's own layer code, compiled from the wheel.

What is vLLM's (compiled from the wheel's text by :mod:`vllm_source`, run as written):
``ModelWeightParameter`` and its bases (``model_executor/parameter.py``), ``LinearBase``,
``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear`` and ``UnquantizedLinearMethod``
(``layers/linear.py``), ``GateLinear``, ``VocabParallelEmbedding`` / ``ParallelLMHead`` and
their shard indices, ``default_weight_loader`` / ``sharded_weight_loader``,
``mamba_v2_sharded_weight_loader``, the GDN layer's own construction statements (``conv1d``
through ``out_proj`` of ``QwenGatedDeltaNetAttention.__init__``, with its ``create_qkvz_proj``
/ ``create_ba_proj``), ``RoutedExperts``' weight loading (``weight_loader``, ``_load_w13``,
``_load_w2``, ``load_weights``, ``build_expert_params_mapping``),
``UnquantizedFusedMoEMethod.create_weights``, ``determine_expert_map``,
``FusedMoEParallelConfig.make``, ``WeightsMapper`` and the models' ``load_weights`` bodies.

What is arranged around it (the harness, not vLLM): the TP rank and size the layers read
(``get_tensor_model_parallel_rank`` / ``_world_size``), a CPU platform that is no GPU, a
recording logger, norms as plain ``weight`` parameters, the ``AutoWeightsLoader`` walk (a
checkpoint name reaches the module that holds its engine name: a module with ``load_weights``
gets it, else the parameter's ``weight_loader``, as ``AutoWeightsLoader._load_module`` does),
and the constructor arguments of each layer, written from the model files (their classes are
held to those files by ``test_vllm_layouts.py``'s module-tree check).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import typing
from types import SimpleNamespace

import torch
from torch import nn

from pytest_weightsync.suites.selftest import vllm_source as src

LAYERS = "model_executor/layers/"


class Stub:
    """Anything a compiled vLLM body may reference but never needs here."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return None


def base_namespace(tp: int, rank: int) -> dict:
    """Globals of compiled vLLM layer code, now answering TP rank ``rank`` of ``tp``. One
    namespace is compiled per session and re-pointed: layers read the rank when they are
    built and (``sharded_weight_loader``) when they load, so build and load one rank at a time."""
    ns = _compiled()
    ns["get_tensor_model_parallel_rank"] = lambda: rank
    ns["get_tensor_model_parallel_world_size"] = lambda: tp
    return ns


@functools.lru_cache(maxsize=1)
def _compiled() -> dict:
    ns = {
        "torch": torch, "nn": nn, "Parameter": nn.Parameter, "Module": nn.Module,
        "Any": typing.Any, "Callable": typing.Callable, "dataclass": dataclasses.dataclass,
        "field": dataclasses.field, "replace": dataclasses.replace, "Enum": enum.Enum,
        "logger": src.Logger(),
        "current_platform": src.Platform(current_device=lambda: "cpu"),
        "get_tensor_model_parallel_rank": lambda: 0,
        "get_tensor_model_parallel_world_size": lambda: 1,
        "get_current_vllm_config_or_none": lambda: None,
        "dispatch_unquantized_gemm": lambda *a, **k: None,
        "resolve_quant_method": lambda *a, **k: None,
        "method_has_implemented_embedding": lambda cls: True,
        "envs": SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "OnlineLinearBase": type("OnlineLinearBase", (), {}),
        "QuantizeMethodBase": object,
    }
    src.compile_defs("distributed/utils.py", ["ensure_divisibility", "divide"], ns)
    src.compile_defs("model_executor/utils.py", ["set_weight_attrs"], ns)
    src.compile_defs("model_executor/parameter.py",
                     ["BasevLLMParameter", "_ColumnvLLMParameter", "RowvLLMParameter",
                      "ModelWeightParameter", "PerTensorScaleParameter", "PackedColumnParameter",
                      "PackedvLLMParameter", "BlockQuantScaleParameter"], ns)
    src.compile_defs(LAYERS + "linear.py",
                     ["WEIGHT_LOADER_V2_SUPPORTED", "adjust_marlin_shard",
                      "adjust_block_scale_shard", "adjust_scalar_to_fused_array",
                      "UnquantizedLinearMethod", "LinearBase", "ReplicatedLinear",
                      "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                      "RowParallelLinear"],
                     ns, bases={"PluggableLayer": "Module", "LinearMethodBase": "object"})
    src.compile_defs(LAYERS + "fused_moe/router/gate_linear.py", ["GateLinear"], ns)
    src.compile_defs(LAYERS + "vocab_parallel_embedding.py",
                     ["DEFAULT_VOCAB_PADDING_SIZE", "UnquantizedEmbeddingMethod",
                      "pad_vocab_size", "vocab_range_from_per_partition_vocab_size",
                      "vocab_range_from_global_vocab_size"], ns)
    src.compile_defs(LAYERS + "vocab_parallel_embedding.py",
                     ["VocabParallelEmbeddingShardIndices"], ns, keep_annotations=True)
    src.compile_defs(LAYERS + "vocab_parallel_embedding.py",
                     ["VocabParallelEmbedding", "ParallelLMHead"], ns,
                     bases={"PluggableLayer": "Module"})
    src.compile_defs("model_executor/model_loader/weight_utils.py",
                     ["default_weight_loader", "sharded_weight_loader"], ns)
    src.compile_defs(LAYERS + "mamba/mamba_mixer2.py", ["mamba_v2_sharded_weight_loader"], ns)
    ns["BasevLLMParameter"].__torch_function__ = classmethod(
        lambda cls, func, types, args=(), kwargs=None: super(
            ns["BasevLLMParameter"], cls).__torch_function__(func, types, args, kwargs or {}))
    return ns


class Norm(nn.Module):
    """A norm as the engine holds it: one replicated ``weight`` (no loader of its own)."""

    def __init__(self, size: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)


# --------------------------------------------------------------------------------------------
# Routed experts
# --------------------------------------------------------------------------------------------


_RANKS: dict = {}


@functools.lru_cache(maxsize=1)
def _moe_parallel_cls():
    ns = {"get_tensor_model_parallel_rank": lambda: _RANKS["tp_rank"],
          "get_dp_group": lambda: SimpleNamespace(rank_in_group=_RANKS["dp_rank"],
                                                  world_size=_RANKS["dp"]),
          "get_pcp_group": lambda: SimpleNamespace(rank_in_group=0, world_size=1)}
    cls = src.compile_methods(LAYERS + "fused_moe/config.py", "FusedMoEParallelConfig",
                              ["flatten_tp_across_dp_and_pcp", "make"], ns,
                              name="FusedMoEParallelConfigSource")
    ns["FusedMoEParallelConfig"] = type("FusedMoEParallelConfig", (cls,), {
        "__init__": lambda self, **kw: self.__dict__.update(kw)})
    return ns["FusedMoEParallelConfig"]


def moe_parallel(tp: int, dp: int, rank: int, expert_parallel: bool) -> SimpleNamespace:
    """vLLM's ``FusedMoEParallelConfig.make`` for engine rank ``rank`` (``dp_rank * tp +
    tp_rank``), compiled from ``fused_moe/config.py``."""
    dp_rank, tp_rank = divmod(rank, tp)
    _RANKS.update(tp_rank=tp_rank, dp_rank=dp_rank, dp=dp)
    return _moe_parallel_cls().make(
        tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=1,
        vllm_parallel_config=SimpleNamespace(enable_expert_parallel=expert_parallel,
                                             all2all_backend="allgather_reducescatter",
                                             enable_eplb=False))


@functools.lru_cache(maxsize=1)
def _determine_expert_map():
    ns = {"torch": torch}
    src.compile_defs(LAYERS + "fused_moe/expert_map_manager.py", ["determine_expert_map"], ns)
    return ns["determine_expert_map"]


def expert_map(ep_size: int, ep_rank: int, num_experts: int):
    """``determine_expert_map(ep_size, ep_rank, num_experts, "linear")`` as vLLM computes it:
    ``(local_num_experts, expert_map or None)``."""
    local, mapping, _ = _determine_expert_map()(ep_size, ep_rank, num_experts, "linear")
    return local, mapping


LOGGER = src.Logger()


@functools.lru_cache(maxsize=1)
def _routed_namespace() -> dict:
    ns = {"torch": torch, "Enum": enum.Enum, "logger": LOGGER, "Module": nn.Module,
          "cdiv": lambda a, b: -(-a // b), "current_platform": src.Platform(),
          "OnlineMoEMethodBase": type("OnlineMoEMethodBase", (), {})}
    src.compile_defs(LAYERS + "fused_moe/routed_experts.py",
                     ["_index_expert_mapping", "FusedMoeWeightScaleSupported"], ns)
    ns["EplbState"] = src.compile_methods("distributed/eplb/eplb_state.py", "EplbState",
                                          ["build_initial_global_physical_to_logical_map"], ns)
    src.compile_defs("model_executor/utils.py", ["set_weight_attrs"], ns)
    ns["RoutedExperts"] = src.compile_methods(LAYERS + "fused_moe/routed_experts.py",
                                              "RoutedExperts", RoutedExpertsRank.METHODS, ns,
                                              base="Module")
    ns["Method"] = src.compile_methods(LAYERS + "fused_moe/unquantized_fused_moe_method.py",
                                       "UnquantizedFusedMoEMethod", ["create_weights"], ns,
                                       name="Method")
    return ns


def expert_params_mapping(num_experts: int) -> list:
    """``RoutedExperts.build_expert_params_mapping`` for Qwen's names, no redundant experts,
    as ``RoutedExperts.get_expert_mapping(include_fused=True)`` calls it."""
    return _routed_namespace()["RoutedExperts"].build_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", num_experts=num_experts, num_redundant_experts=0,
        routed_experts_prefix="", include_fused=True, is_gated=True)


class RoutedExpertsRank:
    """One MoE layer's ``RoutedExperts`` of one engine rank: vLLM's weight-loading methods over
    parameters its ``UnquantizedFusedMoEMethod.create_weights`` allocates; ``__init__`` (quant
    method selection, kernels) is replaced by the attributes those methods read."""

    METHODS = ["_get_hidden_dim", "_narrow_expert_data_for_padding", "_orient_fused_weight",
               "_load_w13", "_load_w2", "_load_model_weight_or_group_weight_scale",
               "_map_global_expert_id_to_local_expert_id", "weight_loader", "load_weights",
               "get_expert_mapping", "build_expert_params_mapping"]

    def __init__(self, layer_name: str, num_experts: int, hidden: int, intermediate: int,
                 tp: int, dp: int, rank: int, expert_parallel: bool, dtype=torch.bfloat16):
        parallel = moe_parallel(tp, dp, rank, expert_parallel)
        self.parallel = parallel
        local, mapping = expert_map(parallel.ep_size, parallel.ep_rank, num_experts)
        self.local_num_experts, self.expert_map = local, mapping
        ns = _routed_namespace()
        per_partition = intermediate // parallel.tp_size  # FusedMoEConfig.__post_init__
        moe = SimpleNamespace(is_act_and_mul=True, tp_rank=parallel.tp_rank,
                              moe_parallel_config=parallel, num_logical_experts=num_experts,
                              num_experts=num_experts, tp_size=parallel.tp_size,
                              intermediate_size_per_partition_unpadded=per_partition,
                              hidden_dim_unpadded=hidden, has_bias=False,
                              intermediate_size=intermediate,
                              intermediate_size_per_partition=per_partition,
                              # FusedMoEConfig's default; only FP8 MoE (oracle/fp8.py) sets it
                              tp_shard_with_padding=False)
        layer = ns["RoutedExperts"]()
        layer.layer_name = layer_name
        layer.moe_config = moe
        layer.quant_config = None
        layer.quant_method = SimpleNamespace()
        layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name = "gate_proj", "down_proj"
        layer.ckpt_up_proj_name = "up_proj"
        layer.is_fused_checkpoint_transposed = False
        layer.lora_base_layer_prefix = ""
        layer._loaded_expert_biases = set()
        layer._fused_shared_expert_quantizer = None
        layer.expert_map_manager = SimpleNamespace(
            num_fused_shared_experts=0,
            map_global_to_local=lambda e: e if mapping is None else int(mapping[e]))
        method = ns["Method"]()
        method.moe = moe
        method.create_weights(layer, num_experts=local, hidden_size=hidden,
                              intermediate_size_per_partition=per_partition, params_dtype=dtype,
                              weight_loader=layer.weight_loader)
        self.layer = layer

    def load(self, weights) -> list:
        """``RoutedExperts.load_weights`` over ``(name relative to the MoE block, tensor)``
        pairs (what ``MoERunner.load_weights`` passes on); the names it reports loaded."""
        return list(self.layer.load_weights(weights))


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------


def weights_mapper_namespace() -> dict:
    """``WeightsMapper`` compiled from ``models/utils.py`` (a dataclass: annotations kept)."""
    ns = {"logger": src.Logger(), "re": __import__("re"), "torch": torch,
          "Mapping": typing.Mapping, "Iterable": typing.Iterable, "Any": typing.Any,
          "TypeAlias": typing.TypeAlias, "dataclass": dataclasses.dataclass,
          "field": dataclasses.field, "replace": dataclasses.replace,
          "TYPE_CHECKING": False}
    src.compile_defs("model_executor/models/utils.py", ["ShardId", "ShardIds", "WeightsMapper"],
                     ns, keep_annotations=True)
    return ns


def mapper(family_file: str, cls: str, ns: dict, extra: dict | None = None):
    """The value of ``cls.hf_to_vllm_mapper`` in ``models/<family_file>``, evaluated with the
    compiled ``WeightsMapper`` (``extra`` names other classes it refers to)."""
    expr = src.class_attribute_expr("model_executor/models/" + family_file, cls,
                                    "hf_to_vllm_mapper")
    return eval(compile(ast.Expression(expr), family_file, "eval"), dict(ns, **(extra or {})))


def served_mappers(family: str, ns: dict):
    """``(outer mapper or None, inner model's mapper)`` the served model applies."""
    if family == "qwen3_moe":
        return None, mapper("qwen3_moe.py", "Qwen3MoeModel", ns)
    nxt = SimpleNamespace(hf_to_vllm_mapper=mapper("qwen3_next.py", "Qwen3NextModel", ns))
    inner = mapper("qwen3_5.py", "Qwen3_5Model", ns, {"Qwen3NextModel": nxt})
    outer = mapper("qwen3_5.py", "Qwen3_5ForCausalLMBase", ns)
    return outer, inner


class Recorder:
    """Stands in for ``AutoWeightsLoader`` around a model's own ``load_weights`` body: applies
    the mapper it is handed (as ``AutoWeightsLoader.load_weights`` does) and keeps the stream."""

    def __init__(self, module, **kwargs):
        self.module = module

    def load_weights(self, weights, *, mapper=None):
        return list(mapper.apply(weights) if mapper is not None else weights)


def draft_stream(weights):
    """``Qwen3_5MTP.load_weights``'s renaming of a checkpoint stream (its nested
    ``remap_weight_names``: only ``mtp.*`` and the embedding / head, ``mtp.`` -> ``model.``),
    compiled from ``qwen3_5_mtp.py``, then the predictor's own mapper."""
    ns = dict(weights_mapper_namespace(), AutoWeightsLoader=Recorder)
    cls = src.compile_methods("model_executor/models/qwen3_5_mtp.py", "Qwen3_5MTP",
                              ["is_unused_checkpoint_weight", "load_weights"], ns)
    remapped = cls().load_weights(weights)
    nxt = SimpleNamespace(hf_to_vllm_mapper=mapper("qwen3_next.py", "Qwen3NextModel", ns))
    inner_cls = SimpleNamespace(hf_to_vllm_mapper=mapper("qwen3_5.py", "Qwen3_5Model", ns,
                                                         {"Qwen3NextModel": nxt}))
    inner = mapper("qwen3_5_mtp.py", "Qwen3_5MultiTokenPredictor", ns,
                   {"Qwen3_5Model": inner_cls})
    out = []
    for name, tensor in remapped:
        if name.startswith("model."):
            out += [("model." + n, t) for n, t in inner.apply([(name[len("model."):], tensor)])]
        else:
            out.append((name, tensor))
    return out


def served_stream(family: str, weights):
    """The served model's ``load_weights`` renaming of a checkpoint stream: the model class's
    body (outer mapper) and its inner model's (``Qwen3MoeModel`` / ``Qwen3_5Model``), compiled
    from the model files; names relative to the root, with ``shard_id`` set on the tensors."""
    ns = dict(weights_mapper_namespace(), AutoWeightsLoader=Recorder,
              maybe_fuse_shared_experts=lambda weights, **kw: weights)
    if family == "qwen3_moe":
        outer_cls = src.compile_methods("model_executor/models/qwen3_moe.py",
                                        "Qwen3MoeForCausalLM", ["load_weights"], ns)
        inner_cls = src.compile_methods("model_executor/models/qwen3_moe.py", "Qwen3MoeModel",
                                        ["load_weights"], ns)
        inner = inner_cls()
        inner.hf_to_vllm_mapper = served_mappers(family, ns)[1]
    else:
        outer_cls = src.compile_methods("model_executor/models/qwen3_5.py",
                                        "Qwen3_5ForCausalLMBase", ["load_weights"], ns)
        outer_cls.hf_to_vllm_mapper = served_mappers(family, ns)[0]
        inner_cls = src.compile_methods("model_executor/models/qwen3_5.py", "Qwen3_5Model",
                                        ["load_weights"], ns)
        inner = inner_cls()
        inner.hf_to_vllm_mapper = served_mappers(family, ns)[1]
        inner.config = SimpleNamespace(model_type="qwen3_5_moe_text", num_experts=0)
        inner.is_fused_shared_expert_enabled = False
    top = outer_cls().load_weights(weights)
    out = []
    for name, tensor in top:
        if name.startswith("model."):
            shard = getattr(tensor, "shard_id", None)
            rest = inner.load_weights([(name[len("model."):], tensor)])
            for n, t in rest:
                if shard is not None and getattr(t, "shard_id", None) is None:
                    t.shard_id = shard
                out.append(("model." + n, t))
        else:
            out.append((name, tensor))
    return out


class _DefaultDtype:
    """vLLM builds a model under its dtype as torch's default (``set_default_torch_dtype``)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


def _gdn(spec, ns: dict, tp: int, rank: int) -> nn.Module:
    """A GDN mixer: the statements of ``QwenGatedDeltaNetAttention.__init__`` that set its
    sizes and build its weights (``self.num_k_heads = ...`` through ``self.out_proj = ...``,
    platform branches left out), run on an object holding what the base class's ``__init__``
    sets (``tp_size``, ``tp_rank``, ``hidden_size``, ``quant_config``, ``layer_norm_epsilon``)."""
    rel = LAYERS + "mamba/gdn/qwen_gdn_linear_attn.py"
    init = src.method_node(rel, "QwenGatedDeltaNetAttention", "__init__")
    body, on = [], False
    for stmt in init.body:
        target = None
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            t = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
            target = t.attr if isinstance(t, ast.Attribute) else None
        on = on or target == "num_k_heads"
        if on and not isinstance(stmt, ast.If):
            body.append(stmt)
        if target == "out_proj":
            break
    fn = ast.FunctionDef(name="_gdn_init", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(a) for a in ("self", "config", "prefix", "reduce_results",
                                                   "gqa_interleaved_layout")],
        kwonlyargs=[], kw_defaults=[], defaults=[]), body=body, decorator_list=[])
    namespace = dict(ns, RMSNormGated=lambda size, **kw: Norm(size),
                     AutoAWQConfig=type("A", (), {}), AutoGPTQConfig=type("B", (), {}),
                     INCConfig=type("C", (), {}))
    module = src._Prepare({}, False).visit(ast.Module(body=[fn], type_ignores=[]))
    ast.fix_missing_locations(module)
    exec(compile(module, f"<vllm {src.VERSION} {rel}:__init__>", "exec"), namespace)
    cls = src.compile_methods(rel, "QwenGatedDeltaNetAttention",
                              ["create_qkvz_proj", "create_ba_proj", "maybe_disable_tp"],
                              dict(namespace, Module=nn.Module), name="GDN", base="Module")
    layer = cls()
    layer.tp_size, layer.tp_rank, layer.hidden_size = tp, rank, spec.hidden
    layer.quant_config, layer.layer_norm_epsilon = None, 1e-6
    config = SimpleNamespace(linear_num_key_heads=spec.linear_k_heads,
                             linear_num_value_heads=spec.linear_v_heads,
                             linear_key_head_dim=spec.linear_k_dim,
                             linear_value_head_dim=spec.linear_v_dim,
                             linear_conv_kernel_dim=spec.conv_kernel)
    namespace["_gdn_init"](layer, config, "gdn", True, False)
    return layer


def build_rank(spec, topo, rank: int, ns: dict | None = None) -> dict:
    """Module path -> module of vLLM engine rank ``rank`` of a whole model (``ModelSpec``),
    built from the compiled layers with the constructor arguments of the model files; the
    draft's paths carry ``draft.``, the MoE blocks' ``experts`` are :class:`RoutedExpertsRank`."""
    tp = topo.tp
    ns = ns or base_namespace(tp, rank)
    gated = spec.family == "qwen3_5_moe"
    mods: dict = {}
    H, d = spec.hidden, spec.head_dim
    with _DefaultDtype(spec.dtype):
        def norm(path, size=H):
            mods[path] = Norm(size)

        def layer(prefix, kind, index):
            norm(f"{prefix}.input_layernorm")
            norm(f"{prefix}.post_attention_layernorm")
            if kind == "attention":
                attn = f"{prefix}.self_attn"
                heads = spec.num_heads * (2 if gated else 1)
                mods[f"{attn}.qkv_proj"] = ns["QKVParallelLinear"](H, d, heads, spec.num_kv_heads,
                                                                   bias=False)
                mods[f"{attn}.o_proj"] = ns["RowParallelLinear"](spec.num_heads * d, H, bias=False)
                norm(f"{attn}.q_norm", d)
                norm(f"{attn}.k_norm", d)
            else:
                gdn = _gdn(spec, ns, tp, rank)
                for child in ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"):
                    mods[f"{prefix}.linear_attn.{child}"] = getattr(gdn, child)
                mods[f"{prefix}.linear_attn"] = gdn  # A_log, dt_bias
            mlp = f"{prefix}.mlp"
            mods[f"{mlp}.gate"] = ns["GateLinear"](H, spec.num_experts)
            if gated:
                mods[f"{mlp}.shared_expert_gate"] = ns["ReplicatedLinear"](H, 1, bias=False)
                Is = spec.intermediate_shared
                mods[f"{mlp}.shared_expert.gate_up_proj"] = ns["MergedColumnParallelLinear"](
                    H, [Is] * 2, bias=False)
                mods[f"{mlp}.shared_expert.down_proj"] = ns["RowParallelLinear"](
                    Is, H, bias=False, reduce_results=False)
            mods[f"{mlp}.experts"] = RoutedExpertsRank(
                f"{mlp}.experts", spec.num_experts, H, spec.intermediate, tp, topo.dp, rank,
                topo.expert_parallel, spec.dtype)

        mods["model.embed_tokens"] = ns["VocabParallelEmbedding"](spec.vocab, H)
        for i in range(spec.num_layers):
            layer(f"model.layers.{i}", spec.layer_kind(i), i)
        norm("model.norm")
        head = ns["ParallelLMHead"](spec.vocab, H)
        if spec.tied:
            head = head.tie_weights(mods["model.embed_tokens"])
        mods["lm_head"] = head
        if spec.mtp_layers:
            mods["draft.model.fc"] = ns["ColumnParallelLinear"](2 * H, H, gather_output=True,
                                                               bias=False, return_bias=False)
            norm("draft.model.pre_fc_norm_embedding")
            norm("draft.model.pre_fc_norm_hidden")
            for i in range(spec.mtp_layers):
                layer(f"draft.model.layers.{i}", "attention", i)
            norm("draft.model.norm")
    return mods


def parameters(mods: dict) -> dict:
    """Engine name -> parameter of every module in ``mods`` (each parameter once, under its
    first name, as ``named_parameters`` reports it)."""
    out, seen = {}, set()
    for path, mod in mods.items():
        if isinstance(mod, RoutedExpertsRank):
            named = [("w13_weight", mod.layer.w13_weight), ("w2_weight", mod.layer.w2_weight)]
            path = path + ".routed_experts"
        elif path.endswith("linear_attn"):
            named = [("A_log", mod.A_log), ("dt_bias", mod.dt_bias)]
        else:
            named = [(n, p) for n, p in mod.named_parameters(recurse=False) if p is not None]
        for name, param in named:
            if id(param) not in seen:
                seen.add(id(param))
                out[f"{path}.{name}"] = param
    return out


def load(mods: dict, stream, ns: dict) -> list:
    """Send a mapped checkpoint stream to the modules that hold each name, as
    ``AutoWeightsLoader._load_module`` walks to them: the MoE runner gets expert names relative
    to it (``RoutedExperts.load_weights``), a module with ``load_weights`` (QKV / merged
    column layers) its own names, any other parameter its ``weight_loader`` (else
    ``default_weight_loader``). Returns the names nothing held."""
    unheld = []
    for name, tensor in stream:
        path, _, rest = name.rpartition(".")
        while path and path not in mods:
            path, _, head = path.rpartition(".")
            rest = f"{head}.{rest}"
        if not path:
            unheld.append(name)
            continue
        mod = mods[path]
        if isinstance(mod, RoutedExpertsRank):
            mod.load([(rest, tensor)])
        elif callable(getattr(mod, "load_weights", None)) and not isinstance(mod, Norm):
            list(mod.load_weights([(rest, tensor)]))
        else:
            param = getattr(mod, rest)
            loader = getattr(param, "weight_loader", ns["default_weight_loader"])
            loader(param, tensor)
    return unheld
