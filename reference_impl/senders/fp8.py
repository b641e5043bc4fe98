"""The reference's FP8 payloads: per-expert checkpoint names, or each engine rank's own tensors.

Both take what :func:`pytest_weightsync.reference_impl.model.fp8.quantize_full` made of the
trainer's weights; the weight of a projection travels before its ``weight_scale_inv``.
"""

from __future__ import annotations

import torch

from pytest_weightsync.reference_impl.model.fp8 import (
    SCALE_SUFFIX,
    plain_topology,
    scale_spec,
    weight_spec,
)
from pytest_weightsync.reference_impl.model.layout import (
    PROJECTION_INDEX,
    PROJECTIONS,
    ExpertWeights,
    MoESpec,
    ReceiverTopology,
)


def export_compat(quantized: dict) -> list[tuple[str, torch.Tensor]]:
    """Per-expert FP8 checkpoint names: ``...experts.{e}.{p}_proj.weight`` and
    ``...weight_scale_inv`` of every (layer, expert, projection), weight first."""
    from pytest_weightsync.reference_impl.model.layout import hf_expert_name

    out = []
    for (layer, e, p), qt in sorted(quantized.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                       PROJECTION_INDEX[kv[0][2]])):
        name = hf_expert_name(layer, e, p)
        out.append((name, qt.weight.clone()))
        out.append((name + SCALE_SUFFIX, qt.scale_inv.clone()))
    return out


def export_direct(spec: MoESpec, topo: ReceiverTopology, rank: int, quantized: dict
                  ) -> list[tuple[str, torch.Tensor]]:
    """Receiver ``rank``'s own four parameters per layer, exact shapes, contiguous."""
    from pytest_weightsync.reference_impl.senders import direct

    plain = plain_topology(topo)
    weights = {layer: tuple(ExpertWeights(*(quantized[(layer, e, p)].weight for p in PROJECTIONS))
                            for e in range(spec.num_experts))
               for layer in range(spec.num_layers)}
    scales = {layer: tuple(ExpertWeights(*(quantized[(layer, e, p)].scale_inv
                                           for p in PROJECTIONS))
                           for e in range(spec.num_experts))
              for layer in range(spec.num_layers)}
    out = []
    w = direct.export(weight_spec(spec), plain, rank, weights)
    s = direct.export(scale_spec(spec, topo), plain, rank, scales)
    for (wn, wt), (sn, st) in zip(w, s):
        out.append((wn, wt))
        out.append((sn + SCALE_SUFFIX, st))
    return out
