"""The reference adapter loader: a LoRA adapter into one engine rank's slot, strict.

The engine keeps adapters in per-slot buffers laid out as SGLang or vLLM keep them
(:mod:`pytest_weightsync.reference_impl.model.adapter_layout`). A load of one adapter into one
slot:

* is checked whole before anything is written: every name is an A or B the adapter has (a name
  of the 3-D expert layout, ``mlp.experts.gate_up_proj``, is refused naming it: the flat
  per-expert layout is what these engines read for Qwen3-MoE), every A and B present (a missing
  B is named), shapes and dtypes as the adapter says (an A/B swap shows as a shape), the
  adapter's rank equal to the engine's, the buffers the engine's;
* copies each piece into the slot - the previous adapter of the slot is overwritten whole
  (zeros where this one has no module), so no mix of two versions is ever left;
* applies ``alpha / r`` exactly once: to a COPY of B where the layout folds it (the staged
  tensors are never modified, so a rebuild after eviction from the same tensors scales once),
  else kept in SGLang's per-slot ``scalings``;
* never touches the base weights.
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch

from pytest_weightsync.reference_impl.errors import PayloadError
from pytest_weightsync.reference_impl.model.adapter_layout import SCALINGS, adapter_buffers
from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params

__all__ = ["AdapterPayloadError", "allocate_slots", "evict_adapter", "load_adapter"]


class AdapterPayloadError(PayloadError):
    """An adapter an engine cannot load as it is configured: refused before anything is
    written, the message naming the tensor and the reason."""


def allocate_slots(adapter: AdapterSpec, topo, rank: int, layout: str, slots: int,
                   device="cpu") -> dict:
    """Zeroed adapter buffers of engine rank ``rank`` (what an engine allocates at start)."""
    return {name: torch.zeros(buf.shape, dtype=torch.float32 if name == SCALINGS
                              else adapter.dtype, device=device)
            for name, buf in adapter_buffers(adapter, topo, rank, layout, slots).items()}


def _check(adapter: AdapterSpec, slots: Mapping, buffers, payload, slot: int) -> dict:
    params = lora_params(adapter)
    shapes = {p.a_name: p.a_shape for p in params.values()}
    shapes.update({p.b_name: p.b_shape for p in params.values()})
    if set(slots) != set(buffers):
        raise AdapterPayloadError(f"the engine's adapter buffers {sorted(slots)[:3]}... are not "
                                  f"the layout's ({len(buffers)} buffers)")
    for name, buf in buffers.items():
        if tuple(slots[name].shape) != buf.shape:
            raise AdapterPayloadError(f"buffer {name!r} is {tuple(slots[name].shape)}, the "
                                      f"layout needs {buf.shape} (an adapter of rank "
                                      f"{adapter.rank})")
    if not 0 <= slot < next(iter(buffers.values())).shape[0]:
        raise AdapterPayloadError(f"slot {slot} outside the engine's "
                                  f"{next(iter(buffers.values())).shape[0]} slots")
    tensors = {}
    for index, item in enumerate(payload):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise AdapterPayloadError(f"payload entry {index} is not a (name, tensor) pair")
        name, tensor = item
        if name not in shapes:
            hint = (" (the 3-D expert layout; this engine reads the flat per-expert layout "
                    "'...mlp.experts.{e}.gate_proj.lora_A.weight')"
                    if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name
                    else "")
            raise AdapterPayloadError(f"{name!r} is no lora_A / lora_B of this adapter{hint}")
        if name in tensors:
            raise AdapterPayloadError(f"{name!r} appears twice in the adapter")
        if not isinstance(tensor, torch.Tensor):
            raise AdapterPayloadError(f"{name!r} carries a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != tuple(shapes[name]) or tensor.dtype != adapter.dtype:
            raise AdapterPayloadError(f"{name!r} is {tuple(tensor.shape)} {tensor.dtype}, the "
                                      f"engine's adapter of rank {adapter.rank} needs "
                                      f"{tuple(shapes[name])} {adapter.dtype}")
        tensors[name] = tensor
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise AdapterPayloadError(f"the adapter lacks {len(missing)} tensors, first "
                                  f"{missing[0]!r}: every targeted module needs its A and B")
    return tensors


def load_adapter(params, slots: Mapping, payload, *, adapter: AdapterSpec, topology, rank: int,
                 slot: int, layout: str) -> None:
    """Write ``payload`` (the adapter's named A and B) into ``slot`` of ``slots``."""
    buffers = adapter_buffers(adapter, topology, rank, layout, next(
        iter(slots.values())).shape[0] if slots else 1)
    tensors = _check(adapter, slots, buffers, list(payload), slot)
    for name, buf in buffers.items():
        if name == SCALINGS:
            slots[name][slot] = adapter.scaling
            continue
        target_slot = slots[name][slot]
        target_slot.zero_()
        for (src_dim, src_start, size, dst_dim, dst_start, scaled, depth), group in _groups(buf):
            values = [tensors[p.tensor].narrow(src_dim, src_start, size) for p in group]
            if depth:  # one piece per expert, consecutive slots: stacked, one copy
                value = torch.stack(values) if len(values) > 1 else values[0].unsqueeze(0)
                target = target_slot.narrow(dst_dim + depth, dst_start, size).narrow(
                    0, group[0].index[0], len(group))
            else:
                (value,), target = values, target_slot.narrow(dst_dim, dst_start, size)
            if scaled:  # into the slot, never into the staged tensors: a bf16 product rounds
                torch.mul(value, adapter.scaling, out=target)  # once, as (B * s) in float32
            else:
                target.copy_(value)


@functools.lru_cache(maxsize=512)
def _groups(buf) -> tuple:
    """The pieces of ``buf`` grouped by everything but their tensor and leading index: the
    pieces of one module's experts form one group (written with one indexed copy)."""
    groups: dict = {}
    for piece in buf.pieces:
        key = (piece.src_dim, piece.src_start, piece.size, piece.dst_dim, piece.dst_start,
               piece.scaled, len(piece.index))
        groups.setdefault(key if piece.index else key + (piece.tensor,), []).append(piece)
    out = []
    for key, group in groups.items():
        group.sort(key=lambda p: p.index)
        runs = [[group[0]]]  # experts in runs of consecutive local slots: one copy per run
        for piece in group[1:]:
            if piece.index[0] == runs[-1][-1].index[0] + 1 if piece.index else False:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        out += [(key[:7], tuple(run)) for run in runs]
    return tuple(out)


def evict_adapter(slots: Mapping, *, slot: int, **_) -> None:
    """Free ``slot``: its buffers zeroed (what serves no adapter)."""
    for tensor in slots.values():
        tensor[slot].zero_()
