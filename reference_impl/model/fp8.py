"""FP8 block-quantized experts as SGLang's ``Fp8MoEMethod`` holds them, and the quantizer.

The weights the FP8 suites send and the state they must leave are the oracle's
(:mod:`pytest_weightsync.reference_impl.oracle.fp8`); the reference's FP8 payloads are a
sender's (:mod:`pytest_weightsync.reference_impl.senders.fp8`).

SGLang 0.5.23 (``sglang/srt/layers/quantization/fp8.py``, ``Fp8MoEMethod.create_fp8_moe_weight_``
with ``weight_block_size = [block_n, block_k]`` and an FP8-serialized checkpoint) allocates per
layer ``w13_weight [E, 2 * I_local, H]`` and ``w2_weight [E, H, I_local]`` in
``float8_e4m3fn`` plus ``w13_weight_scale_inv [E, 2 * ceil(I_local / block_n), ceil(H /
block_k)]`` and ``w2_weight_scale_inv [E, ceil(H / block_n), ceil(I_local / block_k)]`` in
float32; ``FusedMoE`` loads a scale like its weight, one scale per block instead of one value
per element (``quant_method="block"`` -> ``_load_w13`` / ``_load_w2`` on the block grid). The
checkpoint (and the trainer's FP8 refit) names them ``experts.{e}.{gate,up,down}_proj.weight``
(fp8) and ``...weight_scale_inv`` (float32 ``[ceil(rows / block_n), ceil(cols / block_k)]``).
Blocks are square here (``block_n == block_k``, SGLang's default 128 x 128), so a rank's scales
are the checkpoint-layout state of a smaller model whose elements are blocks.

The quantizer is written from the definition, not taken from an engine: for every
``block_n x block_k`` block of a projection (the last ones partial), ``amax`` = the largest
``|x|`` in float32, clamped below at ``AMAX_FLOOR``; ``scale_inv = amax / 448`` (float32,
:data:`FP8_MAX`: the largest finite e4m3fn value); ``q = clamp(x / scale_inv, -448, 448)``
cast to float8_e4m3fn (round to nearest even). Dequantized, ``x ~ q * scale_inv``. The
``ue8m0`` variant rounds ``scale_inv`` up to a power of two; the suites check it against
SGLang's own ``fp8_utils.per_block_cast_to_fp8`` (DeepGEMM's, 128 x 128), which runs on CPU.

The weights the FP8 suites send are the synthetic finite values with every block scaled by a
location-derived power of two (:func:`block_exponent`): neighbouring blocks, the two halves of
``w13`` and two versions never share a scale, so a scale paired with the wrong block, or kept
from the previous version, always shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pytest_weightsync.reference_impl.model.layout import (
    PROJECTIONS,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
)

FP8 = torch.float8_e4m3fn
#: The largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Smallest amax a block's scale is computed from (an all-zero block gets a finite scale);
#: DeepGEMM's and SGLang's ``per_block_cast_to_fp8`` clamp at the same value.
AMAX_FLOOR = 1e-4
#: Suffix of a scale's name (checkpoint and receiver).
SCALE_SUFFIX = "_scale_inv"


class Fp8LayoutError(WeightSyncError):
    """An FP8 topology or tensor the block layout cannot hold."""


def block_of(topo: ReceiverTopology) -> int:
    """The (square) block size of an ``fp8_block`` receiver."""
    block_n, block_k = topo.quant_block
    if block_n != block_k:
        raise Fp8LayoutError(f"only square FP8 blocks are modelled (SGLang's default 128 x 128); "
                             f"got quant_block={topo.quant_block}")
    return block_n


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# The quantizer (from the definition)
# --------------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [N, K]`` zero-padded to whole blocks, viewed ``[N/b, b, K/b, b]`` (float32)."""
    n, k = x.shape
    padded = torch.zeros(ceil_div(n, block) * block, ceil_div(k, block) * block,
                         dtype=torch.float32, device=x.device)
    padded[:n, :k] = x.float()
    return padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)


def quantize(x: torch.Tensor, block: int, scale_format: str = "float"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [N, K], scale_inv float32 [ceil(N/b), ceil(K/b)])`` of ``x`` (see
    the module docstring). ``scale_format="ue8m0"`` rounds each ``scale_inv`` up to a power of
    two (DeepGEMM / SGLang ``per_block_cast_to_fp8``) and multiplies by its reciprocal."""
    if x.dim() != 2:
        raise Fp8LayoutError(f"quantize takes one [rows, cols] projection, got {tuple(x.shape)}")
    n, k = x.shape
    view = _blocks(x, block)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    if scale_format == "float":
        scale = amax / FP8_MAX
        scaled = view / scale
    elif scale_format == "ue8m0":
        bits = (amax / FP8_MAX).view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exponent.clamp(1, 254) << 23).view(torch.float32)
        scaled = view * (1.0 / scale)
    else:
        raise Fp8LayoutError(f"scale_format must be 'float' or 'ue8m0', got {scale_format!r}")
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(view.shape[0] * block, view.shape[2] * block)[:n, :k].contiguous()
    return q, scale.view(view.shape[0], view.shape[2]).contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """``q * scale_inv`` of its block, in float32 (the value an FP8 kernel computes with)."""
    n, k = q.shape[-2:]
    scale = scale_inv.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
    return q.float() * scale


def fp8_ulp(q: torch.Tensor) -> torch.Tensor:
    """float32 size of one e4m3fn unit in the last place at each element of ``q``
    (subnormals: 2^-9; normals: 2^(e - 3))."""
    magnitude = q.float().abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3)


@dataclass(frozen=True)
class Quantized:
    """One quantized projection: ``weight`` (fp8) and ``scale_inv`` (float32 per block)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor


def quantize_full(full: dict, block: int) -> dict:
    """``{(layer, expert, projection): Quantized}`` of full HF weights."""
    return {(layer, e, p): Quantized(*quantize(w[p], block))
            for layer, experts in full.items() for e, w in enumerate(experts) for p in PROJECTIONS}


# --------------------------------------------------------------------------------------------
# Receiver layout: parameters, expected state, payloads, locations
# --------------------------------------------------------------------------------------------


def scale_name(layer: int, param: str) -> str:
    """``model.layers.{L}.mlp.experts.{w13,w2}_weight_scale_inv``."""
    return fused_name(layer, param) + SCALE_SUFFIX


def scale_spec(spec: MoESpec, topo: ReceiverTopology) -> MoESpec:
    """The model whose checkpoint-layout receiver state is the scales: one float32 element per
    block (``hidden`` and ``intermediate`` counted in blocks)."""
    block = block_of(topo)
    return MoESpec(spec.num_layers, spec.num_experts, ceil_div(spec.hidden, block),
                   ceil_div(spec.intermediate, block), dtype=torch.float32)


def weight_spec(spec: MoESpec) -> MoESpec:
    """``spec`` with float8_e4m3fn elements (what the receiver's weights hold)."""
    return MoESpec(spec.num_layers, spec.num_experts, spec.hidden, spec.intermediate, dtype=FP8)


def plain_topology(topo: ReceiverTopology) -> ReceiverTopology:
    """``topo`` without its quantization (the placement both weights and scales follow)."""
    from dataclasses import replace

    return replace(topo, weight_quant="none")


def param_specs(spec: MoESpec, topo: ReceiverTopology, rank: int) -> dict[str, tuple]:
    """``{name: (shape, dtype)}`` of every FP8 parameter of receiver ``rank``."""
    from pytest_weightsync.reference_impl.model.layout import receiver_param_shapes

    plain = plain_topology(topo)
    out = {name: (shape, FP8) for name, shape in receiver_param_shapes(spec, plain, rank).items()}
    for name, shape in receiver_param_shapes(scale_spec(spec, topo), plain, rank).items():
        out[name + SCALE_SUFFIX] = (shape, torch.float32)
    return out


@dataclass(frozen=True)
class BlockLocation:
    """Model coordinates of one element of an FP8 weight or scale: for a scale, the block
    (block row, block col) and the HF rows/cols it covers."""

    layer: int
    expert: int
    projection: str
    row: Optional[int]
    col: Optional[int]
    rank: Optional[int]
    block: Optional[tuple] = None
    block_size: int = 0

    def __str__(self) -> str:
        where = f"layer={self.layer} expert={self.expert} projection={self.projection} "
        if self.block is not None:
            bi, bj = self.block
            b = self.block_size
            where += (f"block=({bi}, {bj}) rows {bi * b}..{(bi + 1) * b - 1} cols "
                      f"{bj * b}..{(bj + 1) * b - 1} row={self.row} col={self.col}")
        else:
            where += f"row={self.row} col={self.col}"
        return where + ("" if self.rank is None else f" receiver_rank={self.rank}")


def locate(spec: MoESpec, topo: ReceiverTopology, rank: int, name: str, index: tuple
           ) -> Optional[BlockLocation]:
    """Where ``name[index]`` (an FP8 weight or scale of receiver ``rank``) belongs."""
    from pytest_weightsync.reference_impl.model.locate import locate_receiver_element

    block = block_of(topo)
    plain = plain_topology(topo)
    if name.endswith(SCALE_SUFFIX):
        where = locate_receiver_element(scale_spec(spec, topo), plain, rank,
                                        name[:-len(SCALE_SUFFIX)], index)
        if where is None:
            return None
        bi, bj = where.row, where.col
        return BlockLocation(where.layer, where.expert, where.projection,
                             None if bi is None else bi * block,
                             None if bj is None else bj * block, rank, (bi, bj), block)
    where = locate_receiver_element(spec, plain, rank, name, index)
    if where is None:
        return None
    return BlockLocation(where.layer, where.expert, where.projection, where.row, where.col, rank)
