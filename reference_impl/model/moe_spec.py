"""What a routed-expert model is made of, before anyone shards it.

The shape of the experts (:class:`MoESpec`), the three projections of a gated expert and the
two fused parameters SGLang holds them in, one expert's full tensors (:class:`ExpertWeights`),
the gate/up order of ``w13`` (:func:`gate_up_halves`) and :class:`TopologyError`, which every
layout question raises for a combination that cannot exist. The trainer, receiver and naming
modules of this room build on these; :mod:`.layout` re-exports them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.vocabulary import ORDERS

__all__ = [
    "ExpertWeights",
    "FullWeights",
    "GATE_UP_ORDERS",
    "MoESpec",
    "PROJECTIONS",
    "PROJECTION_INDEX",
    "RECEIVER_PARAMS",
    "TopologyError",
    "gate_up_halves",
]

#: Projections of one gated expert, in Hugging Face terms.
PROJECTIONS = ("gate", "up", "down")
#: A projection's position in :data:`PROJECTIONS` (the order checkpoints list them in).
PROJECTION_INDEX = {p: i for i, p in enumerate(PROJECTIONS)}
#: Receiver orders of the two halves of ``w13_weight``; how padded buffers slice the
#: intermediate dimension (see ``ReceiverTopology``); trainer expert modules.
GATE_UP_ORDERS = ORDERS
#: The two fused receiver parameters of one layer.
RECEIVER_PARAMS = ("w13", "w2")


class TopologyError(WeightSyncError):
    """A model shape / parallel layout combination that cannot exist."""


def _require(ok: bool, constraint: str, **values) -> None:
    if not ok:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise TopologyError(f"{constraint} (got {shown})")


def gate_up_halves(order: str) -> tuple[str, str]:
    """The projections held by the first and second half of ``w13``, in that order:
    ``("gate", "up")`` for ``"gate_up"``, ``("up", "gate")`` for ``"up_gate"``."""
    _require(order in GATE_UP_ORDERS, f"gate/up order must be one of {GATE_UP_ORDERS}",
             order=order)
    return ("gate", "up") if order == "gate_up" else ("up", "gate")


@dataclass(frozen=True)
class MoESpec:
    """Shape of the routed experts of a model: ``num_layers`` MoE layers of ``num_experts``
    gated experts each, ``gate_proj``/``up_proj`` ``[intermediate, hidden]`` and
    ``down_proj`` ``[hidden, intermediate]``."""

    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype = torch.bfloat16
    gated: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "hidden", "intermediate"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"MoESpec.{name} must be an int >= 1",
                     **{name: value})
        _require(isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point,
                 "MoESpec.dtype must be a floating torch.dtype", dtype=self.dtype)
        _require(self.gated, "only gated (SwiGLU: gate_proj + up_proj) experts are modelled; "
                 "MoESpec.gated must be True", gated=self.gated)

    def hf_shape(self, projection: str) -> tuple[int, int]:
        """Shape of one unsharded Hugging Face expert projection."""
        if projection in ("gate", "up"):
            return (self.intermediate, self.hidden)
        if projection == "down":
            return (self.hidden, self.intermediate)
        raise WeightSyncError(f"unknown projection {projection!r}; expected one of {PROJECTIONS}")


@dataclass(frozen=True)
class ExpertWeights:
    """The three unsharded Hugging Face tensors of one expert."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __getitem__(self, projection: str) -> torch.Tensor:
        return getattr(self, projection)


#: Full (unsharded) expert weights, as every sender path takes them:
#: ``{global_layer: (ExpertWeights of expert 0, of expert 1, ...)}``.
FullWeights = dict[int, tuple[ExpertWeights, ...]]
