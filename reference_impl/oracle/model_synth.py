"""Synthetic values of every tensor of a whole model, and what each engine rank must hold.

The routed experts keep the expert value function of :mod:`~pytest_weightsync.reference_impl.oracle.synth`
(keyed by ``(layer, expert, projection)``; draft layer ``i`` is keyed as layer
``num_layers + i``). Every other checkpoint tensor is keyed by its name: the same bit spread
(every BF16 binade, signed zeros, infinities, subnormals, NaN payloads; two versions differ in
every element), position-encoded by ``(row, col)`` with ``col`` the flat index over the
trailing dimensions. A float32 tensor (``A_log``, a float32 router, the expert bias) takes a
BF16 pattern as its high half and a location-derived non-zero low half (zero only under a
zero or an infinity), so nearly every element is a value BF16 cannot hold: a path that
stages it through BF16 loses its low 16 bits and shows.

The expected engine state (:func:`expected_engine_params`) evaluates the value function at the
checkpoint coordinates the layout assigns to each engine element
(:mod:`~pytest_weightsync.reference_impl.model.model_layout` segments); it never slices the full
tensors the senders slice.
"""

from __future__ import annotations

import math
import zlib

import torch

from pytest_weightsync.reference_impl.oracle import synth
from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, fused_name
from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX, engine_params
from pytest_weightsync.reference_impl.model.model_spec import ModelSpec, ModelWeights, hf_params, value_layer

_M32 = 0xFFFFFFFF


def name_key(name: str, seed: int = 0) -> int:
    """32-bit key of a checkpoint tensor: a CRC of its name, mixed with the seed."""
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & _M32


def _fp32_from_bits(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    exponent = (high >> 7) & 0xFF
    mantissa = high & 0x7F
    keep_low = ~((exponent == 0) & (mantissa == 0)) & ~((exponent == 0xFF) & (mantissa == 0))
    bits = (high << 16) | torch.where(keep_low, low | 1, torch.zeros_like(low))
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return signed.view(torch.float32)


def values_at(name: str, dtype: torch.dtype, version: int, rows: torch.Tensor,
              cols: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Values of checkpoint tensor ``name`` at ``rows x cols`` (``[len(rows), len(cols)]``)."""
    key = name_key(name, seed)
    high = synth.keyed_bf16_bits(key, version, rows, cols)
    if dtype == torch.bfloat16:
        return synth._bits_to_dtype(high, dtype)
    if dtype == torch.float32:
        low = synth.keyed_bf16_bits(key ^ 0x5BD1E995, version, rows, cols, finite=True) & 0xFFFF
        return _fp32_from_bits(high, low)
    raise ValueError(f"no synthetic values for dtype {dtype}")


def hf_tensor(spec: ModelSpec, name: str, version: int, seed: int = 0, *, device=None):
    """The full checkpoint tensor ``name`` of ``spec`` at ``version``."""
    param = hf_params(spec)[name]
    shape = param.shape
    cols = math.prod(shape[1:])
    block = values_at(name, param.dtype, version, torch.arange(shape[0], device=device),
                      torch.arange(cols, device=device), seed)
    return block.reshape(shape)


def draft_value_spec(spec: ModelSpec) -> MoESpec:
    """The expert spec whose layers ``num_layers ..`` key the draft's experts."""
    return MoESpec(spec.num_layers + spec.mtp_layers, spec.num_experts, spec.hidden,
                   spec.intermediate, spec.dtype)


def full_model(spec: ModelSpec, version: int, seed: int = 0, *, device=None) -> ModelWeights:
    """Every tensor of ``spec`` at ``version`` (experts through the expert value function)."""
    dense = {name: hf_tensor(spec, name, version, seed, device=device) for name in hf_params(spec)}
    experts = {"target": synth.full_weights(spec.experts, version, seed, device=device)}
    if spec.mtp_layers:
        keyed = synth.full_weights(draft_value_spec(spec), version, seed, device=device,
                                   layers=[value_layer(spec, "draft", i)
                                           for i in range(spec.mtp_layers)])
        experts["draft"] = {i: keyed[value_layer(spec, "draft", i)] for i in range(spec.mtp_layers)}
    return ModelWeights(dense, experts)


def segment_values(spec: ModelSpec, param, version: int, seed: int = 0, *, device=None):
    """What engine parameter ``param`` (an ``EngineParam`` with segments) holds at
    ``version``: the value function at its checkpoint coordinates, zeros in padding."""
    catalogue = hf_params(spec)
    out = torch.zeros(param.shape, dtype=param.dtype, device=device)
    offset = 0
    for seg in param.segments:
        if seg.source is not None and seg.size:
            src = catalogue[seg.source]
            idx = torch.arange(seg.start, seg.start + seg.size, device=device)
            if param.axis == 0:
                block = values_at(seg.source, src.dtype, version, idx,
                                  torch.arange(math.prod(src.shape[1:]), device=device), seed)
                out.narrow(0, offset, seg.size).copy_(block.reshape(seg.size, *param.shape[1:]))
            else:
                block = values_at(seg.source, src.dtype, version,
                                  torch.arange(src.shape[0], device=device), idx, seed)
                out.narrow(1, offset, seg.size).copy_(block)
        offset += seg.size
    return out


def expected_engine_params(spec: ModelSpec, topo: ReceiverTopology, rank: int, version: int,
                           seed: int = 0, *, device=None) -> dict:
    """What every parameter of engine rank ``rank`` holds after a complete update of every
    target to ``version``."""
    out = {}
    for name, param in engine_params(spec, topo, rank).items():
        if param.part != "experts":
            out[name] = segment_values(spec, param, version, seed, device=device)
    out.update(synth.expected_receiver_params(spec.experts, topo, rank, version, seed,
                                              device=device))
    if spec.mtp_layers:
        keyed = synth.expected_receiver_params(draft_value_spec(spec), topo, rank, version, seed,
                                               device=device)
        for i in range(spec.mtp_layers):
            layer = value_layer(spec, "draft", i)
            for param in ("w13", "w2"):
                out[DRAFT_PREFIX + fused_name(i, param)] = keyed[fused_name(layer, param)]
    return out
