"""Readers of the installed Megatron-Bridge and SGLang source and of vLLM's wheel for the LoRA
layout checks (``test_lora_source.py``).

Megatron-Bridge's ``peft/lora.py`` and ``models/conversion/peft_bridge.py`` import Transformer
Engine and do not import on a CPU machine, so their functions are compiled from the installed
text (the way :mod:`suites.selftest.vllm_source` compiles vLLM's) and run over stand-ins;
``peft/utils.py`` imports, and :func:`bridge_adapters_in_rank` builds its real
``ParallelLinearAdapter`` inside gloo ranks. Nothing here is copied from those projects: every
function is read from the installed package or the wheel when the tests run.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pytest_weightsync.reference_impl.backends import lora_facts as lf
from pytest_weightsync.suites.selftest import vllm_source as vsrc

__all__ = [
    "ALPHA", "IN", "OUT", "RANK", "WORLD", "bridge_adapters_in_rank", "bridge_dir",
    "bridge_name", "bridge_suffix", "class_fields", "class_literal", "compile_source",
    "definition", "expected_local", "peft_helper", "scaling_ops", "sglang_pool", "source_path",
    "source_text", "source_tree", "tp_stub", "vllm_2d_expert_names", "vllm_namespace",
    "vllm_rel",
]


def bridge_dir() -> Path:
    """The installed ``megatron/bridge`` directory; skips when Megatron-Bridge is absent."""
    from pytest_weightsync.reference_impl.backends import bridge

    try:
        return Path(bridge.installed_directory())
    except ImportError as exc:
        pytest.skip(f"megatron-bridge {lf.BRIDGE_VERSION} is not installed ({exc})")


def source_path(file: str) -> Path:
    """``file`` (``megatron/bridge/...`` or ``sglang/srt/...``) of the installed package."""
    if file.startswith("megatron/bridge/"):
        return bridge_dir() / file[len("megatron/bridge/"):]
    return Path(importlib.util.find_spec("sglang").origin).parent.parent / file


@functools.lru_cache(maxsize=None)
def source_tree(file: str) -> ast.Module:
    if file.startswith("vllm/"):
        return vsrc.tree(file[len("vllm/"):])
    path = source_path(file)
    return ast.parse(path.read_text(), str(path))


def definition(source: lf.Source):
    """The class or function ``source.name`` (``Class.method`` or ``name``) in ``source.file``."""
    body = source_tree(source.file).body
    *owner, name = source.name.split(".")
    for part in owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == part).body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise LookupError(f"{source.file}: no {source.name}")


def source_text(source: lf.Source) -> str:
    return ast.unparse(definition(source))


def compile_source(source: lf.Source, namespace: dict):
    """The function ``source.name`` compiled from the installed text (annotations and
    decorators other than staticmethod / classmethod dropped) into ``namespace``."""
    node = vsrc._Prepare({}, False).visit(ast.Module(body=[definition(source)], type_ignores=[]))
    ast.fix_missing_locations(node)
    exec(compile(node, f"<{source.file}:{source.name}>", "exec"), namespace)
    fn = namespace[source.name.split(".")[-1]]
    return fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn


def class_fields(source: lf.Source) -> dict:
    """A dataclass's field defaults: literals, or the list a ``default_factory`` lambda returns."""
    out = {}
    for node in definition(source).body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Call):
                factory = next(k.value for k in value.keywords if k.arg == "default_factory")
                out[node.target.id] = tuple(ast.literal_eval(factory.body))
            else:
                try:
                    out[node.target.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return out


WORLD = 4


IN, OUT, RANK, ALPHA = 8, 12, 4, 8


def bridge_adapters_in_rank():
    """One rank: real ``ParallelLinearAdapter`` factors at (tp2) and (tp1, ep2, etp2)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from pytest_weightsync.reference_impl.backends.bridge import register_namespace_packages
    from pytest_weightsync.reference_impl.backends.megatron import model_parallel

    register_namespace_packages()
    from megatron.bridge.peft.utils import ParallelLinearAdapter

    def build(input_is_parallel, is_expert, tp, etp):
        cfg = ModelParallelConfig(use_cpu_initialization=True, tensor_model_parallel_size=tp,
                                  expert_tensor_parallel_size=etp)
        name = "decoder.layers.0.mlp.experts.linear_fc1" if is_expert else "x.linear_fc1"
        adapter = ParallelLinearAdapter(IN, OUT, RANK, name, activation="identity",
                                        input_is_parallel=input_is_parallel,
                                        model_parallel_config=cfg, alpha=ALPHA,
                                        is_expert=is_expert)

        def factor(linear):
            return (tuple(linear.weight.shape), getattr(linear.weight, "partition_dim", None),
                    bool(getattr(linear, "gather_output", False)))
        return adapter, {"in": factor(adapter.linear_in), "out": factor(adapter.linear_out)}

    out = {}
    with model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=True):
        out["tp2"] = {kind: build(kind == "row", False, 2, 1)[1] for kind in ("column", "row")}
    with model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2,
                        expert_tensor_parallel_size=2, create_gloo_process_groups=True):
        out["etp2"] = {kind: build(kind == "row", True, 1, 2)[1] for kind in ("column", "row")}
        adapter, out["dense_tp1"] = build(False, False, 1, 2)
        with torch.no_grad():
            a = torch.arange(RANK * IN, dtype=torch.float32).reshape(RANK, IN) / 7
            b = torch.arange(OUT * RANK, dtype=torch.float32).reshape(OUT, RANK) / 5
            adapter.linear_in.weight.copy_(a)
            adapter.linear_out.weight.copy_(b)
            x = torch.arange(2 * IN, dtype=torch.float32).reshape(2, IN) / 3
            y = adapter(x)
        out["forward"] = torch.equal(y, (x @ a.t() @ b.t()) * (ALPHA / RANK))
    return out


def expected_local(factor: lf.ShardedFactor, size: int) -> tuple:
    dims = {"r": RANK, "in": IN, "out": OUT}
    shape = [dims[s] for s in factor.full]
    if factor.split_dim is not None:
        shape[factor.split_dim] //= size
    return tuple(shape)


def bridge_suffix():
    for node in source_tree(lf.BRIDGE_HF_LORA_SUFFIX[1].file).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "MEGATRON_TO_HF_LORA_SUFFIX":
            return ast.literal_eval(node.value)
    raise LookupError("MEGATRON_TO_HF_LORA_SUFFIX")


def bridge_name(base: str, suffix: str):
    fn = compile_source(lf.BRIDGE_HF_LORA_SUFFIX[1], {"MEGATRON_TO_HF_LORA_SUFFIX": bridge_suffix(),
                                               "Optional": object})
    return fn(None, base, suffix)


def sglang_pool(tp=2, r=4):
    from sglang.srt.lora import mem_pool as sgl_pool

    pool = object.__new__(sgl_pool.LoRAMemoryPool)
    cfg = SimpleNamespace(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                          intermediate_size=32, moe_intermediate_size=8, num_experts=4)
    model = torch.nn.Module()
    model.config = cfg
    vars(pool).update(base_hf_config=cfg, max_loras_per_batch=3, tp_size=tp, attn_tp_size=tp,
                      moe_tp_size=tp, experts_shared_outer_loras=False,
                      moe_use_local_expert_ids=False, moe_ep_size=1)
    return pool, model


def tp_stub(**base):
    return SimpleNamespace(base_layer=SimpleNamespace(
        tp_group=SimpleNamespace(rank_in_group=1, world_size=2), **base))


def scaling_ops(source: lf.Source):
    """(out-of-place ``x * ....scaling`` count, in-place ``x *= ....scaling`` count)."""
    def is_scaling(n):
        return isinstance(n, ast.Attribute) and n.attr == "scaling"
    nodes = list(ast.walk(definition(source)))
    binop = sum(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and is_scaling(n.right)
                for n in nodes)
    aug = sum(isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Mult) and is_scaling(n.value)
              for n in nodes)
    return binop, aug


def vllm_rel(source: lf.Source) -> str:
    return source.file[len("vllm/"):]


def vllm_namespace():
    from dataclasses import dataclass

    ns = {"torch": torch, "PIN_MEMORY": False, "math": math, "dataclass": dataclass}
    vsrc.compile_defs("lora/utils.py", ["parse_fine_tuned_lora_name", "is_base_embedding_weights"], ns)
    vsrc.compile_defs("lora/lora_weights.py", ["LoRALayerWeights", "LoRAFullModuleWeights"], ns)
    vsrc.compile_methods("lora/lora_model.py", "LoRAModel",
                         ["__init__", "from_lora_tensors", "_should_skip_module"], ns)
    vsrc.compile_methods("lora/peft_helper.py", "PEFTHelper", ["_scaling", "get_rank_and_scaling"],
                         ns)
    return ns


def peft_helper(ns, r, alpha, rslora=False):
    h = ns["PEFTHelper"]()
    vars(h).update(r=r, lora_alpha=alpha, use_rslora=rslora, rank_pattern=None, alpha_pattern=None,
                   modules_to_save=None)
    h.vllm_lora_scaling_factor = h._scaling(r, alpha)
    return h


def class_literal(rel: str, cls: str, attr: str):
    for node in vsrc.class_node(rel, cls).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == attr:
            return ast.literal_eval(node.value)
    return None


def vllm_2d_expert_names(num_experts=2):
    src = lf.VLLM_2D_EXPERT_NAMES[1]
    eplb = SimpleNamespace(build_initial_global_physical_to_logical_map=lambda n, r: list(range(n + r)))
    ns = {"EplbState": eplb, "logger": vsrc.Logger()}
    cls = vsrc.compile_methods(vllm_rel(src), "RoutedExperts", ["build_expert_params_mapping"], ns)
    mapping = cls.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    return [weight_name.rstrip(".") for _, weight_name, _, _ in mapping]

