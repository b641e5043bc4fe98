"""What the FP8 suites send and what an FP8 engine must hold after an update.

The source weights are the synthetic finite values (:mod:`.synth`) with every block scaled by a
location-derived power of two (:func:`block_exponent`): neighbouring blocks, the two halves of
``w13`` and two versions never share a scale, so a scale paired with the wrong block, or kept
from the previous version, always shows. The expected engine state quantizes each projection
whole with the model's quantizer and slices the rank's rows at the layout's coordinates; it
shares nothing with the reference's FP8 sender or receiver.
"""

from __future__ import annotations

import torch

from pytest_weightsync.reference_impl.model.fp8 import (
    FP8,
    block_of,
    ceil_div,
    plain_topology,
    quantize,
    scale_name,
)
from pytest_weightsync.reference_impl.model.layout import (PROJECTION_INDEX, PROJECTIONS,
                                                         ExpertWeights, MoESpec,
                                                         ReceiverTopology, fused_name,
                                                         receiver_shard)

#: Range of the per-block power-of-two exponents of the FP8 suites' weights.
_EXP_SPAN = 9


def block_exponent(layer: int, expert: int, projection: str, version: int,
                   rows: torch.Tensor, cols: torch.Tensor, block: int) -> torch.Tensor:
    """The power of two block ``(rows // b, cols // b)`` is scaled by, in ``[-4, 4]``:
    ``(3 * bi + 5 * bj + 7 * layer + 11 * expert + 13 * projection + version) mod 9 - 4``.
    Neighbours along a row differ by 5 and along a column by 3 (mod 9): never equal; the next
    version adds 1 everywhere."""
    bi = (rows.reshape(-1, 1) // block)
    bj = (cols.reshape(1, -1) // block)
    base = 7 * layer + 11 * expert + 13 * PROJECTION_INDEX[projection] + version
    return (3 * bi + 5 * bj + base) % _EXP_SPAN - _EXP_SPAN // 2


def source_block(spec: MoESpec, block: int, version: int, layer: int, expert: int,
                 projection: str, rows: torch.Tensor, cols: torch.Tensor,
                 seed: int = 0) -> torch.Tensor:
    """The model-dtype weights of ``projection`` at HF coordinates ``rows x cols``: synthetic
    finite values times ``2 ** block_exponent`` (exact: a power of two, inside BF16's
    range)."""
    from pytest_weightsync.reference_impl.oracle import synth

    values = synth.expert_block(spec, version, layer, expert, projection, rows, cols, seed,
                                finite=True)
    exponent = block_exponent(layer, expert, projection, version, rows.to(values.device),
                              cols.to(values.device), block)
    return (values.float() * torch.exp2(exponent.float())).to(spec.dtype)


def source_weights(spec: MoESpec, topo: ReceiverTopology, version: int, seed: int = 0,
                   device=None) -> dict[int, tuple[ExpertWeights, ...]]:
    """Full HF weights ``{layer: (expert 0, ...)}`` the FP8 suites quantize."""
    block = block_of(topo)
    out = {}
    for layer in range(spec.num_layers):
        experts = []
        for e in range(spec.num_experts):
            tensors = {}
            for p in PROJECTIONS:
                n_rows, n_cols = spec.hf_shape(p)
                tensors[p] = source_block(spec, block, version, layer, e, p,
                                          torch.arange(n_rows, device=device),
                                          torch.arange(n_cols, device=device), seed)
            experts.append(ExpertWeights(**tensors))
        out[layer] = tuple(experts)
    return out


def expected_params(spec: MoESpec, topo: ReceiverTopology, rank: int, version: int,
                    seed: int = 0, *, device=None) -> dict[str, torch.Tensor]:
    """What every FP8 parameter of ``rank`` holds after a complete update to ``version``: each
    projection quantized whole (blocks at HF coordinates) by :func:`quantize`, then the rank's
    rows and block rows at the layout's coordinates (``receiver_shard``)."""
    block = block_of(topo)
    shard = receiver_shard(spec, plain_topology(topo), rank)
    b_start, b_rows = shard.row_start // block, shard.rows // block
    h_blocks = ceil_div(spec.hidden, block)
    out = {}
    for layer in range(spec.num_layers):
        n = len(shard.experts)
        w13 = torch.empty(n, 2 * shard.rows, spec.hidden, dtype=FP8, device=device)
        s13 = torch.empty(n, 2 * b_rows, h_blocks, dtype=torch.float32, device=device)
        w2 = torch.empty(n, spec.hidden, shard.rows, dtype=FP8, device=device)
        s2 = torch.empty(n, h_blocks, b_rows, dtype=torch.float32, device=device)
        for slot, expert in enumerate(shard.slot_experts(layer)):
            for p in PROJECTIONS:
                n_rows, n_cols = spec.hf_shape(p)
                x = source_block(spec, block, version, layer, expert, p,
                                 torch.arange(n_rows, device=device),
                                 torch.arange(n_cols, device=device), seed)
                q, s = quantize(x, block)
                if p == "down":
                    w2[slot] = q[:, shard.row_start:shard.row_start + shard.rows]
                    s2[slot] = s[:, b_start:b_start + b_rows]
                else:
                    off = shard.half_offset(p, topo.order)
                    w13[slot, off:off + shard.rows] = q[shard.row_start:shard.row_start + shard.rows]
                    boff = off // block
                    s13[slot, boff:boff + b_rows] = s[b_start:b_start + b_rows]
        out[fused_name(layer, "w13")] = w13
        out[scale_name(layer, "w13")] = s13
        out[fused_name(layer, "w2")] = w2
        out[scale_name(layer, "w2")] = s2
    return out
