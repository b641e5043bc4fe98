"""Expected LoRA values: every A and B of an adapter version, and the merge of an adapter into
the base, computed here and never read from a sender or loader.

A and B are the oracle's keyed value function at their PEFT names (finite bf16 values: a merge
computes with them), so every element of every version is known at its coordinates without
storing anything; a new version changes every element (the value function's version mask).
The merge (:func:`merged`) is ``W + (alpha / r) * (B @ A)``, in this order: ``B @ A`` in float32,
multiplied by the scaling in float32, added to ``W`` in float32, rounded once to the base dtype -
the order ``peft``'s ``merge_and_unload`` and Megatron-Bridge's merge use for a bf16 base.
"""

from __future__ import annotations

import torch

from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params
from pytest_weightsync.reference_impl.oracle import model_synth, synth

__all__ = ["adapter_tensors", "bridge_adapter_tensors", "expected_slots", "lora_tensor", "merged", "merged_model"]


def lora_tensor(name: str, shape: tuple, dtype, version: int, seed: int = 0, *, device=None):
    """The A or B tensor named ``name`` (PEFT name) of ``shape`` at ``version``."""
    key = model_synth.name_key(name, seed)
    rows = torch.arange(shape[0], device=device)
    cols = torch.arange(shape[1], device=device)
    bits = synth.keyed_bf16_bits(key, version, rows, cols, finite=True)
    return synth._bits_to_dtype(bits, torch.bfloat16).to(dtype)


def adapter_tensors(adapter: AdapterSpec, version: int, seed: int = 0, *, device=None) -> dict:
    """PEFT name -> every A and B of ``adapter`` at ``version``."""
    out = {}
    for param in lora_params(adapter).values():
        out[param.a_name] = lora_tensor(param.a_name, param.a_shape, adapter.dtype, version,
                                        seed, device=device)
        out[param.b_name] = lora_tensor(param.b_name, param.b_shape, adapter.dtype, version,
                                        seed, device=device)
    return out


def bridge_adapter_tensors(adapter: AdapterSpec, version: int, trainer_ep: int = 1,
                           seed: int = 0, *, device=None) -> dict:
    """The adapter a Megatron-Bridge trainer holds (``reference_impl/backends/lora_facts.py``):
    one A per fused base - q, k and v share the q projection's A, up shares gate's - and one
    adapter per expert group of the trainer's ``trainer_ep`` (every expert of a group holds
    the group's first expert's A and B). Names and shapes as :func:`adapter_tensors`."""
    own = adapter_tensors(adapter, version, seed, device=device)
    per = adapter.model.num_experts // trainer_ep
    out = {}
    for param in lora_params(adapter).values():
        source = param
        if param.expert is not None and param.expert % per:
            first = param.base.replace(f".experts.{param.expert}.",
                                       f".experts.{param.expert - param.expert % per}.")
            source = lora_params(adapter)[first]
        a_from = source
        for fused, leader in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
            leader_base = a_from.base.replace(f".{fused}.", f".{leader}.")
            if a_from.module == fused and leader_base in lora_params(adapter):
                a_from = lora_params(adapter)[leader_base]
        out[param.a_name] = own[a_from.a_name]
        out[param.b_name] = own[source.b_name]
    return out


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * (b @ a)`` in float32, rounded once to ``base``'s dtype."""
    delta = (b.float() @ a.float()) * torch.tensor(scaling, dtype=torch.float32)
    return (base.float() + delta).to(base.dtype)


def merged_model(adapter: AdapterSpec, base_version: int, version: int, seed: int = 0) -> dict:
    """Base checkpoint name -> the merged weight of every targeted linear (base at
    ``base_version``, adapter at ``version``)."""
    spec = adapter.model
    full = model_synth.full_model(spec, base_version, seed)
    tensors = adapter_tensors(adapter, version, seed)
    out = {}
    for param in lora_params(adapter).values():
        if param.expert is None:
            base = full.dense[param.base]
        else:
            base = full.experts["target"][param.layer][param.expert][param.module[:-len("_proj")]]
        out[param.base] = merged(base, tensors[param.a_name], tensors[param.b_name],
                                 adapter.scaling)
    return out


def expected_slots(adapter: AdapterSpec, topo, rank: int, layout: str, slots: int,
                   versions: dict, seed: int = 0, *, device=None, folds: int = 1,
                   place=None, tensors: dict = None) -> dict:
    """Buffer name -> what engine rank ``rank``'s adapter buffers hold with version
    ``versions[slot]`` of ``adapter`` in each slot listed (the other slots zero): every piece
    of the layout at its place, scaled (``B * alpha / r`` in float32, rounded once) where the
    layout folds the scaling, and SGLang's per-slot ``scalings``. ``folds``: how many times the
    scaling is folded into B (1; the judge asks for 0 and 2 to name a bug); ``place``: a
    function of ``(buffer, piece)`` returning the piece to write instead (the judge's models of
    misplaced pieces), ``None`` to drop it. ``tensors``: ``{version: adapter tensors}`` to place
    instead of :func:`adapter_tensors` (a Megatron-Bridge-shaped adapter)."""
    from pytest_weightsync.reference_impl.model.adapter_layout import SCALINGS, adapter_buffers

    buffers = adapter_buffers(adapter, topo, rank, layout, slots)
    out = {name: torch.zeros(buf.shape, dtype=torch.float32 if name == SCALINGS
                             else adapter.dtype, device=device)
           for name, buf in buffers.items()}
    given = tensors
    for slot, version in versions.items():
        tensors = given[version] if given is not None else \
            adapter_tensors(adapter, version, seed, device=device)
        if SCALINGS in out:
            out[SCALINGS][slot] = adapter.scaling
        for name, buf in buffers.items():
            for piece in buf.pieces:
                if place is not None:
                    piece = place(buf, piece)
                    if piece is None:
                        continue
                value = tensors[piece.tensor].narrow(piece.src_dim, piece.src_start, piece.size)
                for _ in range(folds if piece.scaled else 0):
                    value = (value.float() * adapter.scaling).to(adapter.dtype)
                target = out[name][slot]
                for i in piece.index:
                    target = target[i]
                target.narrow(piece.dst_dim, piece.dst_start, piece.size).copy_(value)
    return out
