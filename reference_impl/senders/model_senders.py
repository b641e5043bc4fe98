"""The whole-model payload an engine rank gets, in each wire format.

Every format carries the routed experts the way the expert senders do
(:func:`pytest_weightsync.reference_impl.senders.formats.export`: per-expert HF names, fused
``gate_up_proj``/``down_proj``, packed ``w13``/``w2``, or each rank's own ``w13``/``w2``) and
every other tensor as follows:

* ``compat``, ``hf_fused``, ``packed``: the checkpoint tensors, full and unsharded, under
  their checkpoint names (the draft's under ``mtp.``; a tied model carries ``embed_tokens``
  once and no ``lm_head``) - every rank gets the same tensors and narrows its rows;
* ``direct``: each engine parameter of the rank under its engine name (the draft's prefixed
  ``draft.``), built from the layout's segments with zero padding - a tied model's
  ``lm_head`` is an engine parameter here, filled from the one embedding.

Only the tensors of ``targets`` are sent (default: every target of the model), so a frozen
draft gets nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from pytest_weightsync.reference_impl.senders import formats as senders
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology
from pytest_weightsync.reference_impl.model.model_layout import DRAFT_PREFIX, engine_params
from pytest_weightsync.reference_impl.model.model_spec import MTP_PREFIX, ModelSpec, expert_spec_of, hf_params
from pytest_weightsync.reference_impl.model.model_spec import ModelWeights


def engine_tensor(param, dense: dict, device=None) -> torch.Tensor:
    """Engine parameter ``param`` (an ``EngineParam`` with segments) built from the full
    checkpoint tensors ``dense``: each segment's run narrowed out, zeros in padding."""
    first = next(iter(dense.values()))
    out = torch.empty(param.shape, dtype=param.dtype,
                      device=first.device if device is None else device)
    offset = 0
    for seg in param.segments:
        dst = out.narrow(param.axis, offset, seg.size)
        if seg.source is None:
            dst.zero_()
        elif seg.size:
            dst.copy_(dense[seg.source].narrow(param.axis, seg.start, seg.size))
        offset += seg.size
    return out


def _draft_names(pairs, fmt):
    if fmt == "direct":
        return [(DRAFT_PREFIX + name, t) for name, t in pairs]
    return [(MTP_PREFIX + name[len("model."):], t) for name, t in pairs]


def expert_payload(fmt: str, spec: ModelSpec, receiver: ReceiverTopology, rank: int,
                   weights: ModelWeights, target: str) -> list:
    """The ``fmt`` payload of ``target``'s routed experts for engine ``rank``."""
    pairs = senders.export(fmt, expert_spec_of(spec, target), receiver, rank,
                           weights.experts[target])
    return pairs if target == "target" else _draft_names(pairs, fmt)


def dense_payload(fmt: str, spec: ModelSpec, receiver: ReceiverTopology, rank: int,
                  weights: ModelWeights, targets) -> list:
    """The ``fmt`` payload of every non-expert tensor of ``targets`` for engine ``rank``."""
    if fmt == "direct":
        return [(name, engine_tensor(p, weights.dense))
                for name, p in engine_params(spec, receiver, rank).items()
                if p.part != "experts" and p.target in targets]
    catalogue = hf_params(spec)
    return [(name, weights.dense[name]) for name, p in catalogue.items() if p.target in targets]


def export(fmt: str, spec: ModelSpec, receiver: ReceiverTopology, rank: int,
           weights: ModelWeights, targets: Optional[tuple] = None) -> list:
    """The whole-model ``fmt`` payload for engine ``rank`` (one bucket of ``(name, tensor)``):
    every non-expert tensor of ``targets``, then their routed experts."""
    senders.check_format(fmt)
    targets = spec.targets if targets is None else tuple(targets)
    out = dense_payload(fmt, spec, receiver, rank, weights, targets)
    for target in targets:
        out += expert_payload(fmt, spec, receiver, rank, weights, target)
    return out
