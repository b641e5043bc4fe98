"""Each SGLang engine rank's own non-expert parameter tensors, cut from full checkpoint tensors:
the ``direct`` whole-model payload (``load_format="direct"`` copies each tensor by name).

It is the loader's table (:mod:`.model_loader`: SGLang's ``stacked_params_mapping``, the
fused components' offsets, the vocabulary padding) read the other way: instead of copying a
checkpoint tensor into the engine parameters it belongs to, it builds each engine parameter
from the checkpoint tensors that fill it - fused ``qkv_proj`` / ``gate_up_proj`` /
``in_proj_qkvz`` / ``in_proj_ba`` / ``conv1d`` component by component, row-parallel layers as
columns, ``A_log`` / ``dt_bias`` as a contiguous ``1/tp``, ``embed_tokens`` / ``lm_head`` as the
rank's vocabulary rows with zero padding (a tied ``lm_head`` from ``embed_tokens``), everything
else whole. One table for both directions keeps the two halves of the example agreeing on
SGLang's sharding; the suite judges each against its own oracle.
"""

from __future__ import annotations

import torch

from weightsync_example_loader.model_loader import (
    _ROW_PARALLEL,
    _STACKED,
    ModelLoading,
    engine_name,
)

_LAYOUT = ModelLoading()


def _engine_part(spec, name: str):
    """``(engine parameter, component)`` a checkpoint tensor fills (component ``None``: the
    whole parameter; ``"qkv"``: ``[q; k; v]`` components 0-2 in one tensor)."""
    engine = engine_name(name)
    if spec.family == "qwen3_5_moe":
        engine = engine.replace(".self_attn.", ".")
    for part, fused, index in _STACKED:
        if part in engine:
            return engine.replace(part, fused), index
    if engine.endswith(".conv1d.weight"):
        return engine, "qkv"
    return engine, None


def _vocab_rows(spec, tensor, tp: int, rank: int) -> torch.Tensor:
    start, real, rows = _LAYOUT._vocab(spec, tp, rank)
    pad = tensor.new_zeros((rows - real, *tensor.shape[1:]))
    return torch.cat([tensor.narrow(0, start, real), pad], dim=0)


def engine_tensors(spec, dense: dict, tp: int, rank: int) -> list:
    """``[(engine name, tensor)]`` of engine rank ``rank`` (of ``tp``) for every checkpoint
    tensor in ``dense`` (full, unsharded, checkpoint names; no routed experts), in the order
    the checkpoint names them, each in its own dtype."""
    pieces: dict = {}  # engine name -> [(offset, tensor)]
    for name, tensor in dense.items():
        engine, component = _engine_part(spec, name)
        if component is not None:
            pieces.setdefault(engine, []).extend(
                _LAYOUT._component_rows(spec, engine, component, tensor, tp, rank))
        elif engine in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = _vocab_rows(spec, tensor, tp, rank)
            heads = [engine] + (["lm_head.weight"] if spec.tied else [])
            for head in heads:
                pieces[head] = [(0, rows)]
        elif any(part in engine for part in _ROW_PARALLEL):
            cols = tensor.shape[1] // tp
            pieces[engine] = [(0, tensor.narrow(1, rank * cols, cols))]
        elif engine.endswith((".A_log", ".dt_bias")):
            n = tensor.shape[0] // tp
            pieces[engine] = [(0, tensor.narrow(0, rank * n, n))]
        else:
            pieces[engine] = [(0, tensor)]
    out = []
    for engine, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        at = 0
        for offset, part in parts:
            if offset != at:
                raise ValueError(f"{engine}: components leave rows [{at}, {offset}) unfilled")
            at += part.shape[0]
        out.append((engine, parts[0][1] if len(parts) == 1
                    else torch.cat([p for _, p in parts], dim=0)))
    return out
