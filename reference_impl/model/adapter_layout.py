"""Where an engine rank keeps each piece of a LoRA adapter: its per-slot A and B buffers.

Two layouts (:data:`~pytest_weightsync.vocabulary.LORA_LAYOUTS`; the facts and their sources are
``reference_impl/backends/lora_facts.py``, held to the installed code):

``sglang`` (0.5.23 memory pool)
    one A and one B buffer per engine module, slot first: a fused module stacks its sources'
    A along the rank dim (``qkv_proj`` x3 in q, k, v order, ``gate_up_proj`` x2 in gate, up
    order; an untargeted source's rows stay zero) and concatenates their B rows as the base
    parameter does on this rank; the routed experts' ``gate_up`` and ``down`` buffers carry an
    expert dim (``[slot, E_local, 2r, H]`` ...). The scaling ``alpha / r`` is kept per slot
    (``scalings``) for dense modules and folded into the experts' B as they are copied, out of
    place.
``vllm`` (0.33 ``LoRAModel`` / punica buffers)
    one A and one B buffer per source of an engine module (``lora_a_stacked[i]``), slot first;
    ``lora_alpha / r`` folded into every B when the adapter is built (``LoRALayerWeights.optimize``
    - in place on the staged tensor in vLLM, which is why a rebuild from the same tensors
    scales twice; a loader folds a copy).

Tensor parallel slicing is the base parameter's: a column-parallel base (rows of ``W`` sliced:
``qkv_proj``, ``gate_up_proj``) keeps A whole and takes B's rows of this rank, a row-parallel
one (``o_proj``, ``down_proj``) takes A's columns of this rank and keeps B whole - read off the
engine layout's segments (:func:`~pytest_weightsync.reference_impl.model.model_layout.source_uses`),
so the adapter lands exactly where its base lives. Routed experts follow the expert layout
(:func:`~pytest_weightsync.reference_impl.model.layout.receiver_shard`: this rank's experts,
intermediate rows ``[row_start, row_start + rows)`` of gate, up and down).
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Mapping, NamedTuple

from pytest_weightsync.reference_impl.model.adapter_spec import AdapterSpec, lora_params
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, receiver_shard
from pytest_weightsync.reference_impl.model.model_layout import engine_params, source_uses
from pytest_weightsync.reference_impl.model.moe_spec import _require
from pytest_weightsync.vocabulary import LORA_LAYOUTS

__all__ = ["AdapterBuffer", "Piece", "SCALINGS", "adapter_buffers", "pieces_of"]

#: SGLang's per-slot scaling buffer (float32 ``[slots]``).
SCALINGS = "scalings"


class Piece(NamedTuple):
    """Copy ``tensor.narrow(src_dim, src_start, size)`` (a PEFT-named A or B) into
    ``buffer[slot][index].narrow(dst_dim, dst_start, size)`` (``index``: leading indices after
    the slot, e.g. the local expert), multiplied by the scaling when ``scaled``."""

    tensor: str
    src_dim: int
    src_start: int
    size: int
    index: tuple
    dst_dim: int
    dst_start: int
    scaled: bool


class AdapterBuffer(NamedTuple):
    """One buffer of an engine rank: ``shape`` (slot dim first), its pieces."""

    name: str
    shape: tuple
    pieces: tuple


@functools.lru_cache(maxsize=128)
def adapter_buffers(adapter: AdapterSpec, topo: ReceiverTopology, rank: int, layout: str,
                    slots: int) -> Mapping[str, AdapterBuffer]:
    """Every adapter buffer of engine rank ``rank`` for ``adapter`` in ``layout``, with
    ``slots`` adapter slots, by name."""
    _require(layout in LORA_LAYOUTS, f"LoRA layout must be one of {LORA_LAYOUTS}", layout=layout)
    _require(isinstance(slots, int) and slots >= 1, "slots must be an int >= 1", slots=slots)
    spec, r = adapter.model, adapter.rank
    params = lora_params(adapter)
    uses = source_uses(spec, topo, rank)
    layout_params = engine_params(spec, topo, rank)
    fold = layout == "vllm"
    buffers: dict = {}

    def add(name, shape, piece):
        shape = (slots, *shape)
        held = buffers.get(name)
        _require(held is None or held[0] == shape, "one buffer, one shape", name=name)
        buffers[name] = (shape, (held[1] if held else ()) + (piece,))

    for param in params.values():
        if param.expert is not None:
            continue
        for use in uses.get(param.base, ()):
            engine = layout_params[use.engine]
            module = use.engine[:-len(".weight")] if use.engine.endswith(".weight") else use.engine
            sources = list(dict.fromkeys(s.source for s in engine.segments if s.source))
            stack = sources.index(param.base)
            out_local, in_local = engine.shape[0], engine.shape[1]
            if use.axis == 0:  # column-parallel: A whole, B's rows of this rank
                if layout == "sglang":
                    add(f"{module}.lora_A", (len(sources) * r, in_local),
                        Piece(param.a_name, 0, 0, r, (), 0, stack * r, False))
                    add(f"{module}.lora_B", (out_local, r),
                        Piece(param.b_name, 0, use.src, use.size, (), 0, use.dst, False))
                else:
                    add(f"{module}.lora_A.{stack}", (r, in_local),
                        Piece(param.a_name, 0, 0, r, (), 0, 0, False))
                    add(f"{module}.lora_B.{stack}", (use.size, r),
                        Piece(param.b_name, 0, use.src, use.size, (), 0, 0, fold))
            else:  # row-parallel: A's columns of this rank, B whole
                suffix = "" if layout == "sglang" else ".0"
                add(f"{module}.lora_A{suffix}", (r, in_local),
                    Piece(param.a_name, 1, use.src, use.size, (), 1, use.dst, False))
                add(f"{module}.lora_B{suffix}", (out_local, r),
                    Piece(param.b_name, 0, 0, out_local, (), 0, 0, fold))
    if adapter.experts:
        _expert_buffers(adapter, topo, rank, layout, add)
    out = {name: AdapterBuffer(name, shape, pieces) for name, (shape, pieces) in buffers.items()}
    if layout == "sglang":
        out[SCALINGS] = AdapterBuffer(SCALINGS, (slots,), ())
    return MappingProxyType(out)


def _expert_buffers(adapter, topo, rank, layout, add) -> None:
    spec, r, H = adapter.model, adapter.rank, adapter.model.hidden
    shard = receiver_shard(spec.experts, topo, rank)
    e_local, rows, start = len(shard.experts), shard.rows, shard.row_start
    params = lora_params(adapter)
    for param in params.values():
        if param.expert is None or param.expert not in shard.experts:
            continue
        local = param.expert - shard.experts.start
        prefix = f"model.layers.{param.layer}.mlp.experts"
        if param.module == "down_proj":  # row-parallel: A's columns of this rank, B whole
            a_shape, b_shape = (e_local, r, rows), (e_local, H, r)
            a_piece = Piece(param.a_name, 1, start, rows, (local,), 1, 0, False)
            b_piece = Piece(param.b_name, 0, 0, H, (local,), 0, 0, True)
            name = "down" if layout == "sglang" else "w2"
            add(f"{prefix}.{name}.lora_A", a_shape, a_piece)
            add(f"{prefix}.{name}.lora_B", b_shape, b_piece)
            continue
        half = 0 if param.module == "gate_proj" else 1
        if layout == "sglang":  # [gate; up] stacked: A along the rank dim, B rows per half
            add(f"{prefix}.gate_up.lora_A", (e_local, 2 * r, H),
                Piece(param.a_name, 0, 0, r, (local,), 0, half * r, False))
            add(f"{prefix}.gate_up.lora_B", (e_local, 2 * rows, r),
                Piece(param.b_name, 0, start, rows, (local,), 0, half * rows, True))
        else:  # one buffer per slice (gate, up)
            add(f"{prefix}.w13.lora_A.{half}", (e_local, r, H),
                Piece(param.a_name, 0, 0, r, (local,), 0, 0, False))
            add(f"{prefix}.w13.lora_B.{half}", (e_local, rows, r),
                Piece(param.b_name, 0, start, rows, (local,), 0, 0, True))


def pieces_of(buffers: Mapping[str, AdapterBuffer]) -> dict:
    """PEFT tensor name -> ``[(buffer, piece)]``: everything one tensor of the adapter writes."""
    out: dict = {}
    for buffer in buffers.values():
        for piece in buffer.pieces:
            out.setdefault(piece.tensor, []).append((buffer.name, piece))
    return out
