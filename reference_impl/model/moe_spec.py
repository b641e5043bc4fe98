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
    "EtpGroupedExperts",
    "ExpertWeights",
    "FullWeights",
    "GATE_UP_ORDERS",
    "GroupedExperts",
    "MoESpec",
    "PROJECTIONS",
    "PROJECTION_INDEX",
    "RECEIVER_PARAMS",
    "TopologyError",
    "gate_up_halves",
    "grouped_buffers",
    "layer_device",
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


class GroupedExperts(tuple):
    """One layer's :class:`ExpertWeights`, all views of a grouped-GEMM trainer's two buffers:
    ``fc1 [E, 2I, H]`` (``[gate; up]`` per expert) and ``fc2 [E, H, I]``.

    A tuple like any other layer of :data:`FullWeights`, so every reader takes it; what it
    adds is that the layout is known by construction. An exporter that would otherwise prove,
    block by block, that 768 per-expert views lie at fixed steps in one storage (host work per
    expert, every update of a stateless sender) slices the buffers instead (:meth:`buffers`).
    The views are made here from the buffers, never accepted from outside, and every
    :meth:`buffers` call checks (O(1)) that they still lie in the buffers' memory, so a buffer
    given other memory underneath (``set_``) is never trusted."""

    def __new__(cls, fc1: torch.Tensor, fc2: torch.Tensor):
        if (not isinstance(fc1, torch.Tensor) or not isinstance(fc2, torch.Tensor)
                or fc1.dim() != 3 or fc2.dim() != 3 or fc1.shape[1] % 2):
            raise WeightSyncError("GroupedExperts takes fc1 [E, 2I, H] and fc2 [E, H, I]")
        n, two_i, hidden = fc1.shape
        size = two_i // 2
        if (tuple(fc2.shape) != (n, hidden, size) or fc1.dtype != fc2.dtype
                or fc1.device != fc2.device or not fc1.is_contiguous() or not fc2.is_contiguous()):
            raise WeightSyncError(f"GroupedExperts: fc1 {tuple(fc1.shape)} {fc1.dtype} and fc2 "
                                  f"{tuple(fc2.shape)} {fc2.dtype} must be contiguous [E, 2I, H] "
                                  f"and [E, H, I] of one dtype and device")
        # every expert's views in three native calls (a slice per expert and projection in
        # Python cost three times as much: a gather builds this every update)
        self = super().__new__(cls, map(ExpertWeights, fc1[:, :size].unbind(0),
                                        fc1[:, size:].unbind(0), fc2.unbind(0)))
        self._fc1, self._fc2 = fc1, fc2
        return self

    def __reduce__(self):
        return (GroupedExperts, (self._fc1, self._fc2))

    def buffers(self):
        """``(fc1, fc2)`` while the experts are still views of them, else ``None``: the first
        and last expert's tensors must start where the buffers say, in the buffers' storages
        (memory moved into shared memory moves the views with it; a buffer given new memory
        with ``set_`` leaves them behind)."""
        fc1, fc2 = self._fc1, self._fc2
        if not self:
            return None
        size, last = fc1.shape[1] // 2, len(self) - 1
        s1, s2 = fc1.untyped_storage().data_ptr(), fc2.untyped_storage().data_ptr()
        e1, e2 = fc1.element_size(), fc2.element_size()
        probes = ((self[0].gate, 0, self[0].down, 0),  # (fc1 view, its offset, fc2 view, its)
                  (self[last].up, last * fc1.stride(0) + size * fc1.stride(1),
                   self[last].down, last * fc2.stride(0)))
        for one, at1, two, at2 in probes:
            if (one.untyped_storage().data_ptr() != s1 or two.untyped_storage().data_ptr() != s2
                    or one.data_ptr() != fc1.data_ptr() + at1 * e1
                    or two.data_ptr() != fc2.data_ptr() + at2 * e2):
                return None
        return fc1, fc2


def grouped_buffers(experts, dtype=None, device=None):
    """``(fc1, fc2)`` of ``experts`` when it is an intact :class:`GroupedExperts` of ``dtype``
    on ``device`` (either ``None``: any), else ``None``."""
    if not isinstance(experts, GroupedExperts):
        return None
    found = experts.buffers()
    if found is None:
        return None
    fc1 = found[0]
    if dtype is not None and fc1.dtype != dtype:
        return None
    if device is not None:
        want = torch.device(device)
        if want.type != fc1.device.type or (want.index is not None and want != fc1.device):
            return None
    return found


class EtpGroupedExperts:
    """One layer's routed experts as an expert-tensor-parallel (ETP) group of a grouped-GEMM
    trainer holds them: ETP rank ``r``'s ``fc1 [E, 2I/t, H]`` (``[gate_r; up_r]`` per expert,
    Megatron's layout: its rows of gate stacked on its rows of up) and ``fc2 [E, H, I/t]``
    (its columns of down), ``t`` ranks of equal rows (Megatron splits evenly).

    Why it exists: SGLang's ``load_format="direct"`` takes each engine rank's ``w13`` whole,
    ``[E_local, 2I/moe_tp, H]`` with ``[gate_r; up_r]`` rows. Out of a gathered ``[gate; up]``
    buffer those rows are two blocks, so a sender must stage them (a second copy of every fc1
    byte: at most 0.6 of the copy limit on one GPU). An ETP rank's own fc1 already is that
    tensor when the trainer's ETP size equals the engine's MoE-TP, so the direct payload is a
    view of the trainer's memory and every byte moves once - without a gather.

    A full expert's gate, up or down is no view of this memory, so this is not a layer of
    :data:`FullWeights`: only the direct format reads it (any ETP against any MoE-TP: views
    where the rows match, else strided copies from the shards); the other formats take
    :meth:`gather`'s copy. Rank ``r``'s buffers are :meth:`shard`."""

    def __init__(self, fc1_shards, fc2_shards):
        fc1s, fc2s = list(fc1_shards), list(fc2_shards)
        if not fc1s or len(fc1s) != len(fc2s) or not all(
                isinstance(t, torch.Tensor) and t.dim() == 3 for t in fc1s + fc2s):
            raise WeightSyncError("EtpGroupedExperts takes one fc1 [E, 2I/t, H] and one fc2 "
                                  "[E, H, I/t] per ETP rank, as two equally long lists of 3-D "
                                  "tensors")
        n, two_rows, hidden = fc1s[0].shape
        rows = two_rows // 2
        first = fc1s[0]
        for r, (fc1, fc2) in enumerate(zip(fc1s, fc2s)):
            if (two_rows % 2 or rows < 1 or tuple(fc1.shape) != (n, two_rows, hidden)
                    or tuple(fc2.shape) != (n, hidden, rows)
                    or {fc1.dtype, fc2.dtype} != {first.dtype}
                    or {fc1.device, fc2.device} != {first.device}
                    or not fc1.is_contiguous() or not fc2.is_contiguous()):
                raise WeightSyncError(
                    f"EtpGroupedExperts: ETP rank {r}'s fc1 {tuple(fc1.shape)} {fc1.dtype} and "
                    f"fc2 {tuple(fc2.shape)} {fc2.dtype} must be contiguous [E, 2I/t, H] and "
                    f"[E, H, I/t] of rank 0's shapes {tuple(first.shape)}, dtype and device")
        self._fc1, self._fc2 = tuple(fc1s), tuple(fc2s)
        self.etp, self.rows, self.hidden = len(fc1s), rows, hidden
        self.intermediate = rows * len(fc1s)
        self.dtype, self.device = first.dtype, first.device

    def __len__(self) -> int:
        return self._fc1[0].shape[0]

    def __reduce__(self):
        return (EtpGroupedExperts, (self._fc1, self._fc2))

    @classmethod
    def split(cls, layer: GroupedExperts, etp: int) -> "EtpGroupedExperts":
        """The shards an ETP group of ``etp`` ranks holds of a gathered layer (copies: the
        inverse of :meth:`gather`)."""
        found = layer.buffers() if isinstance(layer, GroupedExperts) else None
        if found is None:
            raise WeightSyncError("EtpGroupedExperts.split takes an intact GroupedExperts layer")
        fc1, fc2 = found
        n, two_i, hidden = fc1.shape
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 or (two_i // 2) % etp:
            raise WeightSyncError(f"etp must be an int >= 1 dividing the intermediate size "
                                  f"{two_i // 2}, got {etp!r}")
        rows = two_i // 2 // etp
        grid = fc1.view(n, 2, etp, rows, hidden)
        return cls([grid[:, :, r].contiguous().view(n, 2 * rows, hidden) for r in range(etp)],
                   [fc2[:, :, r * rows:(r + 1) * rows].contiguous() for r in range(etp)])

    def shard(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ETP rank ``rank``'s ``(fc1 [E, 2I/t, H], fc2 [E, H, I/t])``."""
        return self._fc1[rank], self._fc2[rank]

    def halves(self, rank: int) -> torch.Tensor:
        """ETP rank ``rank``'s fc1 as ``[E, 2, I/t, H]``: ``[:, 0]`` its gate rows, ``[:, 1]``
        its up rows (this layout's one home for grouped buffers; a Megatron state dict's
        per-expert shards are read the same way by ``trainer.merge_etp_shards`` and
        ``trainer.fc1_targets``, which the mutation suites replace)."""
        return self._fc1[rank].view(len(self), 2, self.rows, self.hidden)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer once (fc1 then fc2 of each rank)."""
        return tuple(t for pair in zip(self._fc1, self._fc2) for t in pair)

    def gather(self) -> GroupedExperts:
        """The full layer as a :class:`GroupedExperts` copy (an ETP all_gather on one device):
        what the formats other than direct read. A snapshot: it does not follow later
        in-place changes of the shards."""
        n, rows, hidden = len(self), self.rows, self.hidden
        fc1 = torch.empty((n, 2, self.etp, rows, hidden), dtype=self.dtype, device=self.device)
        for r in range(self.etp):
            fc1[:, :, r].copy_(self.halves(r))
        fc2 = torch.cat(self._fc2, dim=-1)
        return GroupedExperts(fc1.view(n, 2 * self.intermediate, hidden), fc2)


def layer_device(experts) -> torch.device:
    """The device one layer's experts (a tuple of :class:`ExpertWeights` or an
    :class:`EtpGroupedExperts`) live on."""
    if isinstance(experts, EtpGroupedExperts):
        return experts.device
    return experts[0].gate.device


#: Full (unsharded) expert weights, as every sender path takes them:
#: ``{global_layer: (ExpertWeights of expert 0, of expert 1, ...)}``.
FullWeights = dict[int, tuple[ExpertWeights, ...]]
