"""The reference adapter exporter: Megatron-Bridge's LoRA shards in, the engine's adapter out.

From every trainer rank's ``ParallelLinearAdapter`` shards (:mod:`pytest_weightsync.reference_impl.trainer.lora_state`)
it gathers what must be gathered - a column-parallel base's A over its rank dim and B over its
rows in the base's own order (``linear_qkv`` per query group, ``linear_fc1`` component-major),
a row-parallel base's A over its in dim and B over its rows, the routed experts over ETP - and
names the result as Megatron-Bridge exports it for SGLang and vLLM: per HF projection (the one
A of a fused base under each projection's name) and per expert (an expert group's adapter under
each of its experts' names), ``<module>.lora_A.weight`` / ``.lora_B.weight``. Engine rank
``rank`` is sent every tensor unsharded (each engine rank slices its own, as
``load_lora_adapter_from_tensors`` / ``from_lora_tensors`` take them), cut into buckets of at
most ``bucket_bytes``. Nothing it reads is modified.
"""

from __future__ import annotations

from typing import Optional

import torch

from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params
from pytest_weightsync.reference_impl.model.layout import TrainerTopology, trainer_shard
from pytest_weightsync.reference_impl.model.model_spec import layer_prefix
from pytest_weightsync.reference_impl.senders.buckets import split_buckets
from pytest_weightsync.reference_impl.trainer import megatron_model
from pytest_weightsync.reference_impl.trainer.lora_state import ADAPTER_IN, ADAPTER_OUT, MODULES

__all__ = ["export_adapter"]


def _first_ranks(adapter: AdapterSpec, trainer: TrainerTopology, key) -> dict:
    """``key(shard) -> the lowest trainer rank with that key`` (one replica of each shard)."""
    out = {}
    for rank in range(trainer.world_size):
        out.setdefault(key(trainer_shard(adapter.model.experts, trainer, rank)), rank)
    return out


def _dense(adapter, trainer, states) -> dict:
    spec, params = adapter.model, lora_params(adapter)
    tp_ranks = _first_ranks(adapter, trainer, lambda s: (s.pp_rank, s.tp_rank))
    out = {}
    for param in megatron_model.trainer_params(spec, trainer):
        module = param.name[:-len(".weight")]
        kind = next((m for m in MODULES if module.endswith(m)), None)
        if kind is None or param.layer is None or param.layer[0] != "target":
            continue
        shards = [states[tp_ranks[(param.stage, t)]] for t in range(trainer.tp)]
        if module + ADAPTER_IN not in shards[0]:
            continue
        a_shards = [s[module + ADAPTER_IN] for s in shards]
        b_shards = [s[module + ADAPTER_OUT] for s in shards]
        if param.kind == "row":
            a, b = torch.cat(a_shards, dim=1), torch.cat(b_shards, dim=0)
            per = {param.blocks[0].source: b}
        else:
            a = torch.cat(a_shards, dim=0)
            per = megatron_model.checkpoint_tensors(spec, param,
                                                    megatron_model.unshard(param, b_shards))
        for base, b_part in per.items():
            out[params[base].a_name] = a
            out[params[base].b_name] = b_part.contiguous()
    return out


def _experts(adapter, trainer, states) -> dict:
    spec, params = adapter.model, lora_params(adapter)
    owners = _first_ranks(adapter, trainer, lambda s: (s.pp_rank, s.ep_rank, s.etp_rank))
    out = {}
    for (pp, ep, etp_rank) in sorted(owners):
        if etp_rank != 0:
            continue
        group = [states[owners[(pp, ep, e)]] for e in range(trainer.etp)]
        shard = trainer_shard(spec.experts, trainer, owners[(pp, ep, 0)])
        for local, layer in enumerate(shard.layers):
            name = f"decoder.layers.{local}.mlp.experts"
            tensors = {}
            if f"{name}.linear_fc1{ADAPTER_IN}" in group[0]:
                a = torch.cat([s[f"{name}.linear_fc1{ADAPTER_IN}"] for s in group], dim=0)
                halves = [s[f"{name}.linear_fc1{ADAPTER_OUT}"].chunk(2) for s in group]
                tensors["gate_proj"] = (a, torch.cat([h[0] for h in halves]))
                tensors["up_proj"] = (a, torch.cat([h[1] for h in halves]))
            if f"{name}.linear_fc2{ADAPTER_IN}" in group[0]:
                tensors["down_proj"] = (
                    torch.cat([s[f"{name}.linear_fc2{ADAPTER_IN}"] for s in group], dim=1),
                    torch.cat([s[f"{name}.linear_fc2{ADAPTER_OUT}"] for s in group], dim=0))
            for expert in shard.experts:
                for proj, (a, b) in tensors.items():
                    param = params[f"{layer_prefix('target', layer)}.mlp.experts.{expert}."
                                   f"{proj}.weight"]
                    out[param.a_name], out[param.b_name] = a, b
    return out


def export_adapter(trainer_states, *, adapter: AdapterSpec, trainer: TrainerTopology, receiver,
                   rank: int, bucket_bytes: Optional[int] = None) -> list:
    """The adapter engine rank ``rank`` loads, as a bucket stream (see the module)."""
    tensors = _dense(adapter, trainer, trainer_states)
    if adapter.experts:
        tensors.update(_experts(adapter, trainer, trainer_states))
    pairs = [pair for p in lora_params(adapter).values()
             for pair in ((p.a_name, tensors[p.a_name]), (p.b_name, tensors[p.b_name]))
             if p.a_name in tensors]
    return split_buckets([(n, t.clone()) for n, t in pairs], bucket_bytes)
