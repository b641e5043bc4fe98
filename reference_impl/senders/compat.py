"""The compatible path: one full Hugging Face tensor per expert projection.

Every receiver accepts it (it is what a checkpoint looks like); every receiver rank gets the
same payload and keeps what it owns, slicing its MoE-TP rows and ignoring other ranks'
experts. It is the baseline the faster paths must match bit for bit.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Iterable, Mapping, Sequence

import torch

from pytest_weightsync.reference_impl.model.layout import PROJECTIONS, ExpertWeights, hf_expert_name


def export(full: Mapping[int, Sequence[ExpertWeights]], layers: Iterable[int] | None = None,
           experts: Iterable[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Payload ``[(model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight, tensor)]`` for
    ``layers`` (default all) and ``experts`` (default all). Tensors are the full ones, not
    copies: this path moves no bytes on the sender. A stateless sender calls this every
    update, so a layer's names are made once per process (:func:`_layer_names`) and its
    tensors read in C."""
    out = []
    chosen = None if experts is None else tuple(experts)
    for layer in (sorted(full) if layers is None else layers):
        weights = full[layer]
        if chosen is None:
            names = _layer_names(layer, len(weights))
            tensors = map(_PROJECTION_TENSORS, weights)
        else:
            names = [hf_expert_name(layer, e, p) for e in chosen for p in PROJECTIONS]
            tensors = (_PROJECTION_TENSORS(weights[e]) for e in chosen)
        out.extend(zip(names, itertools.chain.from_iterable(tensors)))
    return out


#: One expert's tensors in :data:`PROJECTIONS` order, read in C.
_PROJECTION_TENSORS = operator.attrgetter(*PROJECTIONS)


@functools.lru_cache(maxsize=1024)
def _layer_names(layer: int, n_experts: int) -> tuple[str, ...]:
    """Every name of one layer's compat payload, expert-major in :data:`PROJECTIONS` order."""
    return tuple(hf_expert_name(layer, e, p) for e in range(n_experts) for p in PROJECTIONS)
