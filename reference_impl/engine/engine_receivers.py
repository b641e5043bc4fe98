"""Reference receivers for engines that do not keep the checkpoint layout.

:class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` plans and copies the
checkpoint layout; each class here keeps that planning and adds what the engine does around
it, the way SGLang 0.5.23 does it (``docs/layout.md``):

* :class:`PostLoadReceiver` (``engine_layout="trtllm_block"``): ``begin_update`` restores the
  checkpoint layout (SGLang's ``begin_weight_update`` -> ``restore_weights_before_loading``),
  the buckets load as usual, ``end_update`` re-applies the engine layout to every parameter
  (``end_weight_update`` -> ``process_weights_after_loading``, all layers). A bucket loaded
  outside an update restores first, as SGLang's weight loader does before it writes.
* :class:`TransposedReceiver` (``engine_layout="transposed"``, triton_kernels): the
  parameters are ``[E, H, 2I]`` / ``[E, I, H]``; loading plans into their transposed views, a
  direct payload is the stored shape.
* :class:`RedundantExpertReceiver` (EPLB): ``num_experts + redundant_experts`` physical slots;
  every piece of logical expert ``e`` of layer ``L`` is written into every local slot the
  placement gives ``e`` in ``L`` (SGLang's ``FusedMoE.weight_loader`` over
  ``ExpertLocationMetadata.logical_to_all_physical``). Its update state records the placement
  and rank it was begun under, and a receiver of another placement cannot resume it
  (:class:`PlacementChangedError`): the buckets loaded so far went into the old placement's
  slots, so an update that went on under the new one would end "complete" with those experts
  in slots that now belong to others.

:func:`receiver_class` picks the class of a topology; :func:`make_receiver` builds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pytest_weightsync.reference_impl.model import engine_layout
from pytest_weightsync.reference_impl.model.layout import (
    PROJECTIONS,
    MoESpec,
    ReceiverTopology,
    fused_name,
)
from pytest_weightsync.reference_impl.engine.receiver import (
    IncompleteUpdateError,
    ReferenceReceiver,
    UpdateState,
)


class PostLoadReceiver(ReferenceReceiver):
    """A receiver whose engine rewrites its parameters after every update (see module)."""

    def _param_kinds(self):
        return [(name, "w13" if name.endswith("w13_weight") else "w2")
                for name in self.params]

    def restore(self) -> int:
        """Bring every parameter back to the checkpoint layout; returns how many were
        restored."""
        restored = 0
        for name, param in self._param_kinds():
            if engine_layout.held_layout(self.params[name]) is not None:
                engine_layout.restore_pre_load(self.params[name], param)
                restored += 1
        return restored

    def post_load(self) -> int:
        """Apply the engine layout to every parameter still in the checkpoint layout (all
        layers, as ``process_weights_after_loading`` does); returns how many."""
        applied = 0
        for name, param in self._param_kinds():
            if engine_layout.held_layout(self.params[name]) is None:
                engine_layout.apply_post_load(self.params[name], param, self.topo.engine_layout)
                applied += 1
        return applied

    def begin_update(self) -> None:
        self.restore()
        super().begin_update()

    def end_update(self) -> None:
        try:
            super().end_update()
        finally:  # SGLang post-processes at end_weight_update whatever the update carried
            self.post_load()

    def load(self, payload, load_format: Optional[str] = None, **checks):
        if not self.in_update:
            self.restore()
        return super().load(payload, load_format, **checks)


class TransposedReceiver(ReferenceReceiver):
    """triton_kernels' transposed parameters (see module): planning writes the checkpoint
    layout through transposed views of the stored tensors."""

    def __init__(self, spec: MoESpec, topo: ReceiverTopology, rank: int, device="cpu",
                 params=None):
        super().__init__(spec, topo, rank, device, params)
        self.stored = self.params
        self.params = {name: t.transpose(-2, -1) for name, t in self.stored.items()}

    def named_parameters(self):
        return self.stored.items()

    def _expected_shape(self, parsed, load_format):
        if load_format == "direct":
            param = fused_name(parsed.layer, parsed.projection)
            return (tuple(self.stored[param].shape),
                    f"receiver rank {self.rank}'s own {parsed.projection}_weight (stored "
                    f"transposed, triton_kernels)")
        return super()._expected_shape(parsed, load_format)

    def _plan_direct(self, plan, parsed, tensor) -> None:
        name = fused_name(parsed.layer, parsed.projection)
        plan.pairs.append((self.stored[name], tensor))
        plan.touched.add(name)


class PlacementChangedError(IncompleteUpdateError):
    """``resume_update`` of an EPLB receiver with an update begun under another placement (or
    by another rank, or by a receiver that records none): its buckets went into other slots."""


@dataclass
class PlacedUpdateState(UpdateState):
    """An EPLB receiver's open update, with the engine placement (``physical_to_logical``, one
    row per layer) and the receiver rank it was begun under."""

    placement: tuple = ()
    rank: Optional[int] = None


def _slots(row, lo: int, hi: int) -> str:
    held = list(row[lo:hi])
    return str(held) if len(held) <= 16 else f"{held[:16]}... ({len(held)} slots)"


class RedundantExpertReceiver(ReferenceReceiver):
    """EPLB physical slots (see module). ``shard.experts`` are physical slot ids; the slot ->
    logical expert map of each layer is ``shard.slot_experts(layer)``."""

    def _placement(self) -> tuple:
        return tuple(tuple(row) for row in self.topo.physical_to_logical(self.spec))

    def begin_update(self) -> None:
        """Open an update bound to this receiver's placement and rank."""
        self._update = PlacedUpdateState(placement=self._placement(), rank=self.rank)

    def resume_update(self, state) -> None:
        """Continue an update begun by a receiver of the same placement and rank; any other
        state is refused (:class:`PlacementChangedError`, naming the first layer whose slots
        moved) and this receiver's own state is left as it was."""
        if not isinstance(state, UpdateState):
            return super().resume_update(state)
        if not isinstance(state, PlacedUpdateState):
            raise PlacementChangedError(
                f"resume_update() of EPLB receiver rank {self.rank} got a state that records "
                f"no placement ({type(state).__name__}); only the state an EPLB receiver's "
                f"begin_update opened says which slots its buckets were written to")
        if state.rank != self.rank:
            raise PlacementChangedError(
                f"resume_update() of EPLB receiver rank {self.rank}: the update was begun by "
                f"receiver rank {state.rank}, whose slots hold other experts")
        mine = self._placement()
        if state.placement != mine:
            lo, hi = self.shard.experts.start, self.shard.experts.stop
            layers = range(max(len(mine), len(state.placement)))

            def row(placement, layer):
                return placement[layer] if layer < len(placement) else ()

            moved = [layer for layer in layers
                     if row(mine, layer) != row(state.placement, layer)]
            local = [layer for layer in moved
                     if row(mine, layer)[lo:hi] != row(state.placement, layer)[lo:hi]]
            layer = (local or moved)[0]
            then, now = row(state.placement, layer), row(mine, layer)
            here = (f"this rank's physical slots {lo}..{hi - 1} held logical experts "
                    f"{_slots(then, lo, hi)} then, {_slots(now, lo, hi)} now" if local else
                    f"this rank's slots are the same, other ranks' moved")
            raise PlacementChangedError(
                f"resume_update() of EPLB receiver rank {self.rank}: the update was begun "
                f"under another placement ({len(moved)} layer(s) differ, first layer "
                f"{layer}: {here}); the {state.offered} bucket(s) loaded so far went into "
                f"the old placement's slots: end the update (or begin a new one) before the "
                f"placement changes, not in the middle of one")
        self._update = state

    def _held(self, layer: int) -> list[int]:
        return sorted(set(self.shard.slot_experts(layer)))

    def _local_slot(self, expert: int) -> Optional[int]:
        """The logical expert itself when this rank holds a copy of it in some layer (the
        slots are chosen per layer by :meth:`_write_w13` / :meth:`_write_w2`)."""
        held = any(expert in self.shard.slot_experts(layer)
                   for layer in range(self.spec.num_layers))
        return expert if held else None

    def _write_w13(self, plan, layer, expert, projection, full) -> None:
        for slot in self.shard.slots_of(layer, expert):
            super()._write_w13(plan, layer, slot, projection, full)

    def _write_w2(self, plan, layer, expert, full) -> None:
        for slot in self.shard.slots_of(layer, expert):
            super()._write_w2(plan, layer, slot, full)

    def _planned_slots(self, layer: int) -> list[tuple[int, int]]:
        """Every logical expert this rank holds a copy of in ``layer``; the writers fan it out
        to each of its slots."""
        return [(expert, expert) for expert in self._held(layer)]

    def _units_of(self, parsed, load_format):
        if load_format != "direct":
            return super()._units_of(parsed, load_format)
        projections = ("down",) if parsed.projection == "w2" else ("gate", "up")
        return [(parsed.layer, e, p) for e in self._held(parsed.layer) for p in projections]

    def _owed_units(self):
        return [(layer, expert, projection)
                for layer in range(self.spec.num_layers)
                for expert in self._held(layer)
                for projection in PROJECTIONS]


def receiver_class(topo: ReceiverTopology) -> type:
    """The reference receiver class of ``topo``."""
    if topo.engine_layout in engine_layout.POST_LOAD:
        return PostLoadReceiver
    if topo.engine_layout == "transposed":
        return TransposedReceiver
    if topo.eplb:
        return RedundantExpertReceiver
    if topo.weight_quant != "none":
        from pytest_weightsync.reference_impl.engine.fp8_receiver import Fp8BlockReceiver

        return Fp8BlockReceiver
    return ReferenceReceiver


def make_receiver(spec: MoESpec, topo: ReceiverTopology, rank: int, device="cpu",
                  params=None) -> ReferenceReceiver:
    """The reference receiver of ``rank`` of ``topo`` (over ``params`` when given)."""
    return receiver_class(topo)(spec, topo, rank, device, params)
