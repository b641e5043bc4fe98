"""Deterministic synthetic expert weights whose every element says where it belongs.

Each BF16 element is a hash of ``(seed, layer, expert, projection, row, col)``: neighbouring
coordinates, other experts, other layers and the other projection all hold unrelated values,
so a swap, a shift by one, a transpose or a wrong slice changes almost every element it
touches. The weight ``version`` is XOR-ed into the sign and mantissa bits with a distinct
8-bit constant per version (mod 256), so two versions differ in *every* element and a stale
value left from an earlier version is always visible. Exponents are kept in ``[2^-14, 2^15]``:
every value is a finite normal number in BF16, FP16 and FP32 alike (no NaN, inf, zero or
subnormal that a copy, a cast or a comparison could treat specially), so casting the BF16
pattern to another floating dtype is exact.

The expected receiver state is computed by evaluating the same function at the coordinates
the layout model assigns to each receiver element (:func:`expected_receiver_params`); it never
slices the full tensors the sender paths slice, so it is an independent oracle for them.
"""

from __future__ import annotations

import torch

from reference_impl.layout import (
    PROJECTIONS,
    ExpertWeights,
    MoESpec,
    ReceiverTopology,
    fused_name,
    receiver_shard,
)

_M32 = 0xFFFFFFFF
_PROJ_ID = {p: i for i, p in enumerate(PROJECTIONS)}


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _scalar_key(seed: int, layer: int, expert: int, projection: str) -> int:
    key = 0x9E3779B9
    for part in (seed, layer, expert, _PROJ_ID[projection]):
        key = ((key ^ (part & _M32)) * 0x01000193) & _M32
        key ^= key >> 13
    return key


def version_mask(version: int) -> int:
    """16-bit XOR mask of a version: touches only sign and mantissa, distinct per version
    modulo 256 (an odd multiplier is a bijection on 8 bits), never zero-equal across two."""
    c = (version * 167 + 89) & 0xFF
    return (c & 0x7F) | ((c & 0x80) << 8)


def bf16_bits(seed: int, version: int, layer: int, expert: int, projection: str,
              rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 tensor ``[len(rows), len(cols)]`` of the 16-bit patterns at those coordinates."""
    key = _scalar_key(seed, layer, expert, projection)
    r = rows.to(torch.int64).reshape(-1, 1)
    c = cols.to(torch.int64).reshape(1, -1)
    x = (key + r * 0x2545F491 + c * 0x9E3779B1) & _M32
    x = _mix32(_mix32(x) ^ (r << 20 & _M32) ^ c)
    bits = x & 0xFFFF
    exponent = 0x71 + ((bits >> 7) & 0xFF) % 30  # biased 113..142: normal in bf16 and fp16
    bits = (bits & 0x807F) | (exponent << 7)
    return bits ^ version_mask(version)


def _bits_to_dtype(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    values = signed.view(torch.bfloat16)
    return values if dtype == torch.bfloat16 else values.to(dtype)


def expert_block(spec: MoESpec, version: int, layer: int, expert: int, projection: str,
                 rows: torch.Tensor, cols: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Values of ``projection`` of ``(layer, expert)`` at HF coordinates ``rows x cols``."""
    return _bits_to_dtype(bf16_bits(seed, version, layer, expert, projection, rows, cols),
                          spec.dtype)


def expert_weights(spec: MoESpec, version: int, layer: int, expert: int,
                   seed: int = 0) -> ExpertWeights:
    """The three full Hugging Face tensors of one expert at ``version``."""
    out = {}
    for projection in PROJECTIONS:
        n_rows, n_cols = spec.hf_shape(projection)
        out[projection] = expert_block(spec, version, layer, expert, projection,
                                       torch.arange(n_rows), torch.arange(n_cols), seed)
    return ExpertWeights(**out)


def full_weights(spec: MoESpec, version: int, seed: int = 0,
                 layers=None) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF expert weights ``{layer: (expert 0, expert 1, ...)}`` at ``version``."""
    layers = range(spec.num_layers) if layers is None else layers
    return {layer: tuple(expert_weights(spec, version, layer, e, seed)
                         for e in range(spec.num_experts))
            for layer in layers}


def expected_receiver_params(spec: MoESpec, topo: ReceiverTopology, rank: int, version: int,
                             seed: int = 0) -> dict[str, torch.Tensor]:
    """What every receiver parameter of ``rank`` must hold after a complete update to
    ``version``: the synthetic value at each element's model coordinates, zero in padding."""
    shard = receiver_shard(spec, topo, rank)
    cols_h = torch.arange(spec.hidden)
    rows_i = torch.arange(shard.row_start, shard.row_start + shard.rows)
    out = {}
    for layer in range(spec.num_layers):
        w13 = torch.zeros(len(shard.experts), 2 * shard.buffer_rows, spec.hidden, dtype=spec.dtype)
        w2 = torch.zeros(len(shard.experts), spec.hidden, shard.buffer_rows, dtype=spec.dtype)
        for slot, expert in enumerate(shard.experts):
            for projection in ("gate", "up"):
                off = shard.half_offset(projection, topo.order)
                w13[slot, off:off + shard.rows] = expert_block(
                    spec, version, layer, expert, projection, rows_i, cols_h, seed)
            # down_proj is [hidden, intermediate]: the rank owns columns rows_i.
            w2[slot, :, :shard.rows] = expert_block(
                spec, version, layer, expert, "down", cols_h, rows_i, seed)
        out[fused_name(layer, "w13")] = w13
        out[fused_name(layer, "w2")] = w2
    return out


def poison_(tensor: torch.Tensor, seed: int = 0xBAD) -> torch.Tensor:
    """Fill ``tensor`` in place with an unrelated non-zero pattern, so an element a loader
    forgot to write (or a padding tail it forgot to zero) does not equal its expected value
    by luck of a zero-initialised buffer."""
    flat = torch.arange(tensor.numel())
    bits = bf16_bits(seed, 0x55, -1, -1, "gate", flat, torch.zeros(1, dtype=torch.int64))
    values = _bits_to_dtype(bits.reshape(-1), tensor.dtype).reshape(tensor.shape)
    with torch.no_grad():
        tensor.copy_(values)
    return tensor
