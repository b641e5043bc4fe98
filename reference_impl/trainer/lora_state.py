"""A LoRA adapter as Megatron-Bridge holds it in each trainer rank: ``ParallelLinearAdapter``
shards.

Megatron-Bridge 0.3.1 (``reference_impl/backends/lora_facts.py``, held to its code) wraps each
targeted Megatron linear in an adapter ``linear_in`` (A ``[r, in]``) / ``linear_out`` (B
``[out, r]``), sharded over TP - ETP for routed experts:

* a column-parallel base (``linear_qkv``, ``linear_fc1``): A split on its RANK dim, B on its out
  dim in the base's own row order (``linear_qkv`` interleaved per query group, ``linear_fc1``
  component-major ``[gate_t; up_t]``);
* a row-parallel base (``linear_proj``, ``linear_fc2``): A split on its in dim, B on its out dim;
* a fused base has ONE adapter: q, k and v share A (as gate and up do), each projection's B
  rows sit where its base rows sit;
* grouped routed experts (``TEGroupedMLP``) have one adapter per EP rank, shared by that rank's
  experts (Bridge exports it under every one of their names).

So the adapter a trainer can hold is :func:`pytest_weightsync.reference_impl.oracle.adapter_synth.bridge_adapter_tensors`'s
(shared A, one adapter per expert group), and :func:`adapter_state` cuts it into each rank's
shards, named as Megatron names them (``decoder.layers.<local>.self_attention.linear_qkv.adapter.linear_in.weight``).
"""

from __future__ import annotations

from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params
from pytest_weightsync.reference_impl.model.layout import TrainerTopology, trainer_shard
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.reference_impl.model.model_spec import layer_prefix
from pytest_weightsync.reference_impl.trainer import megatron_model

__all__ = ["ADAPTER_IN", "ADAPTER_OUT", "MODULES", "adapter_state", "adapter_states"]

#: The suffixes of an adapter's A and B under its base module.
ADAPTER_IN, ADAPTER_OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
#: Megatron module -> the HF projections its one adapter covers (dense and shared-expert).
MODULES = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
            "self_attention.linear_proj": ("o_proj",),
            "mlp.shared_experts.linear_fc1": ("gate_proj", "up_proj"),
            "mlp.shared_experts.linear_fc2": ("down_proj",)}


def _split(tensor, dim: int, parts: int, index: int):
    size = tensor.shape[dim]
    _require(size % parts == 0, "a LoRA factor must split evenly over its TP group",
             size=size, parts=parts)
    step = size // parts
    return tensor.narrow(dim, index * step, step).contiguous()


def adapter_state(adapter: AdapterSpec, trainer: TrainerTopology, rank: int, tensors) -> dict:
    """Trainer rank ``rank``'s adapter shards, from the adapter's checkpoint-named tensors
    ``tensors`` (which must have Bridge's sharing: one A per fused module, one adapter per
    expert group)."""
    spec = adapter.model
    shard = trainer_shard(spec.experts, trainer, rank)
    stage = megatron_model.trainer_params(spec, trainer)
    params = lora_params(adapter)
    out = {}
    for param in stage:
        if param.stage != shard.pp_rank or param.layer is None or param.layer[0] != "target":
            continue
        module = param.name[:-len(".weight")]
        kind = next((m for m in MODULES if module.endswith(m)), None)
        if kind is None or not param.name.endswith(".weight"):
            continue
        group = "self_attn" if "attention" in kind else "mlp.shared_expert"
        hf = [f"{layer_prefix('target', param.layer[1])}.{group}.{p}.weight"
              for p in MODULES[kind]]
        present = [h for h in hf if h in params]
        if not present:
            continue
        _require(len(present) == len(hf), "one adapter covers a fused base: target every "
                 "projection of it or none (Megatron-Bridge's LoRA)", base=param.name)
        a = tensors[params[present[0]].a_name]
        b_parts = {h: tensors[params[h].b_name] for h in hf}
        if param.kind == "row":
            out[module + ADAPTER_IN] = _split(a, 1, trainer.tp, shard.tp_rank)
            out[module + ADAPTER_OUT] = _split(b_parts[hf[0]], 0, trainer.tp, shard.tp_rank)
        else:
            full_b = megatron_model.full_tensor(spec, param, b_parts, trainer.tp)
            out[module + ADAPTER_IN] = _split(a, 0, trainer.tp, shard.tp_rank)
            out[module + ADAPTER_OUT] = megatron_model.shard(param, full_b, trainer.tp,
                                                             shard.tp_rank)
    if adapter.experts:
        out.update(_expert_state(adapter, trainer, shard, tensors))
    return out


def _expert_state(adapter, trainer, shard, tensors) -> dict:
    """One adapter per EP rank's experts (its first expert's values): fc1 A on the rank dim
    and B component-major ``[gate_t; up_t]`` over ETP, fc2 A on its in dim and B on out."""
    import torch

    out, first = {}, shard.experts.start
    modules = adapter.modules
    _require(("gate_proj" in modules) == ("up_proj" in modules), "one adapter covers "
             "linear_fc1: target gate_proj and up_proj together or neither", targets=modules)
    for local, layer in enumerate(shard.layers):
        p = f"{layer_prefix('target', layer)}.mlp.experts.{first}"
        name = f"decoder.layers.{local}.mlp.experts"
        rows = slice(shard.row_start, shard.row_start + shard.rows)
        if "gate_proj" in modules:
            gate_a = tensors[f"{p}.gate_proj.lora_A.weight"]
            gate_b, up_b = (tensors[f"{p}.{x}_proj.lora_B.weight"] for x in ("gate", "up"))
            out[f"{name}.linear_fc1{ADAPTER_IN}"] = _split(gate_a, 0, trainer.etp,
                                                           shard.etp_rank)
            out[f"{name}.linear_fc1{ADAPTER_OUT}"] = torch.cat([gate_b[rows], up_b[rows]])
        if "down_proj" in modules:
            out[f"{name}.linear_fc2{ADAPTER_IN}"] = tensors[
                f"{p}.down_proj.lora_A.weight"][:, rows].clone()
            out[f"{name}.linear_fc2{ADAPTER_OUT}"] = _split(
                tensors[f"{p}.down_proj.lora_B.weight"], 0, trainer.etp, shard.etp_rank)
    return out


def adapter_states(adapter: AdapterSpec, trainer: TrainerTopology, tensors) -> list:
    """Every trainer rank's :func:`adapter_state`."""
    return [adapter_state(adapter, trainer, rank, tensors) for rank in range(trainer.world_size)]
