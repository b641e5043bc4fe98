"""The compatible path: one full Hugging Face tensor per expert projection.

Every receiver accepts it (it is what a checkpoint looks like); every receiver rank gets the
same payload and keeps what it owns, slicing its MoE-TP rows and ignoring other ranks'
experts. It is the baseline the faster paths must match bit for bit.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.model.layout import PROJECTIONS, ExpertWeights, hf_expert_name


def export(full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           experts: Iterable[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Payload ``[(model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight, tensor)]`` for
    ``layers`` (default all) and ``experts`` (default all). Tensors are the full ones, not
    copies: this path moves no bytes on the sender."""
    out = []
    for layer in (sorted(full) if layers is None else layers):
        chosen = range(len(full[layer])) if experts is None else experts
        for expert in chosen:
            weights = full[layer][expert]
            for projection in PROJECTIONS:
                out.append((hf_expert_name(layer, expert, projection), weights[projection]))
    return out
