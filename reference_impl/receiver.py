"""A reference receiver with SGLang ``FusedMoE`` loading semantics.

Per receiver rank and layer it pre-allocates ``w13_weight [E_local, 2 * I_buf, H]`` and
``w2_weight [E_local, H, I_buf]`` and loads payloads into them in place (``copy_``), never
reallocating, so addresses captured by CUDA graphs or IPC handles stay valid.

Payload kinds (one ``load`` call = one chunk):

* ``load_format=None`` (SGLang's default ``load_weights``): Hugging Face names, either
  per-expert ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (full tensors;
  the receiver narrows its MoE-TP rows, experts of other ranks are ignored) or packed
  ``model.layers.{L}.mlp.experts.{w13,w2}_weight`` with every expert, unsharded, in the
  receiver's native gate/up order. The two spellings must not be mixed in one chunk.
* ``load_format="direct"``: the receiver's own parameter names with exactly their shapes,
  contiguous; copied whole.

"Complete update" semantics: a chunk that touches a receiver parameter must carry all of it.
For per-expert names, touching ``w13`` of layer L (any gate/up of an expert this rank owns)
requires gate *and* up of *every* expert this rank owns in layer L; touching ``w2`` requires
down of every owned expert. So a layer's experts cannot be split across chunks: split buckets
at parameter boundaries. A packed or direct tensor is complete by construction. Across chunks,
:meth:`ReferenceReceiver.end_update` reports parameters that no chunk of the update touched.

Validation is all-or-nothing: every entry of the chunk is checked (name, layer, expert range,
duplicates, format mixing, dtype, device, shape, contiguity, completeness) before the first
byte is written; any problem raises a :class:`PayloadError` naming it and leaves every
parameter bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch

from reference_impl import fastcopy
from reference_impl.layout import (
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    gate_up_halves,
    packed_shape,
    parse_receiver_name,
    receiver_param_shapes,
    receiver_shard,
)

LOAD_FORMATS = (None, "direct")


class PayloadError(WeightSyncError):
    """A payload chunk the receiver refuses; nothing was written."""


class PayloadTypeError(PayloadError, TypeError):
    """An entry is not a ``(str, torch.Tensor)`` pair."""


class UnknownNameError(PayloadError):
    """A name that is no expert weight of this model (or not valid for the load format)."""


class ExpertOutOfRangeError(PayloadError):
    """An expert id ``>= num_experts`` (or a layer id ``>= num_layers``)."""


class DuplicateEntryError(PayloadError):
    """The same name (hence the same expert projection) appears twice in one chunk."""


class MixedFormatError(PayloadError):
    """Packed and per-expert names in one chunk."""


class PayloadDtypeError(PayloadError):
    """A tensor whose dtype differs from the receiver parameter's."""


class PayloadShapeError(PayloadError):
    """A tensor whose shape differs from what its name requires."""


class TensorLayoutError(PayloadError):
    """A tensor on the wrong device, or non-contiguous where the format needs contiguity."""


class MissingExpertError(PayloadError):
    """A chunk touches a receiver parameter without carrying all of it."""


class ReceiverParamsError(WeightSyncError):
    """Existing parameters handed to :class:`ReferenceReceiver` do not match its topology."""


class IncompleteUpdateError(WeightSyncError):
    """``end_update`` found receiver parameters that no chunk of the update wrote."""


@dataclass
class LoadPlan:
    """What one chunk will do: zero ``zero`` views, then copy each ``(dst, src)`` pair.
    ``touched`` names the receiver parameters written."""

    pairs: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    touched: set = field(default_factory=set)
    ignored: int = 0


class ReferenceReceiver:
    """One receiver rank's expert parameters and its loader.

    Without ``params`` the receiver allocates zeroed parameters on ``device``. With ``params``
    (a mapping holding at least every expert parameter of this rank, e.g. a model's own
    tensors) it loads into those tensors in place, after checking each one's shape, dtype and
    that they share one device (which replaces ``device``); other entries are ignored."""

    def __init__(self, spec: MoESpec, topo: ReceiverTopology, rank: int, device="cpu",
                 params: Optional[Mapping[str, torch.Tensor]] = None):
        self.spec = spec
        self.topo = topo
        self.rank = rank
        self.shard = receiver_shard(spec, topo, rank)
        shapes = receiver_param_shapes(spec, topo, rank)
        if params is None:
            self.params: dict[str, torch.Tensor] = {
                name: torch.zeros(shape, dtype=spec.dtype, device=device)
                for name, shape in shapes.items()
            }
        else:
            self.params = _checked_params(params, shapes, spec.dtype, rank)
        # The device the parameters really live on: "cuda" means the current GPU, and a payload
        # tensor reports "cuda:0", so compare against the resolved device, not the request.
        first = next(iter(self.params.values()), None)
        self.device = first.device if first is not None else torch.device(device)
        self._in_update: Optional[set] = None

    # -- the hooks a loader variant would change ----------------------------------------------

    def _local_slot(self, expert: int) -> Optional[int]:
        """Global expert id -> local slot, ``None`` when another rank owns it."""
        return self.shard.local_expert(expert)

    def _half_offset(self, projection: str) -> int:
        return self.shard.half_offset(projection, self.topo.order)

    def _tp_rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's MoE-TP slice of a full tensor along ``dim``."""
        return loaded.narrow(dim, self.shard.row_start, self.shard.rows)

    def _apply(self, plan: LoadPlan) -> None:
        for view in plan.zero:
            view.zero_()
        fastcopy.copy_pairs(plan.pairs)

    # -- public API --------------------------------------------------------------------------

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.params.items()

    def begin_update(self) -> None:
        self._in_update = set()

    def end_update(self) -> None:
        """Close an update; raise :class:`IncompleteUpdateError` naming every parameter no chunk
        of it wrote (those still hold the previous version)."""
        touched, self._in_update = self._in_update, None
        if touched is None:
            raise IncompleteUpdateError("end_update() without begin_update()")
        missing = [n for n in self.params if n not in touched]
        if missing:
            raise IncompleteUpdateError(
                f"receiver rank {self.rank}: {len(missing)} parameter(s) not updated in this "
                f"update, e.g. {missing[:4]}; they still hold the previous version")

    def load(self, payload, load_format: Optional[str] = None) -> LoadPlan:
        """Validate the whole chunk, then write it in place. Returns the executed plan."""
        plan = self.plan(payload, load_format)
        self._apply(plan)
        if self._in_update is not None:
            self._in_update |= plan.touched
        return plan

    # -- validation and planning ---------------------------------------------------------------

    def plan(self, payload, load_format: Optional[str] = None) -> LoadPlan:
        if load_format not in LOAD_FORMATS:
            raise PayloadError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
        entries = self._check_entries(payload)
        kinds = {}
        for name, parsed, _ in entries:
            kinds.setdefault(parsed.kind, name)
        if load_format == "direct":
            if "expert" in kinds:
                raise UnknownNameError(f"load_format='direct' takes the receiver's own parameter "
                                       f"names; got per-expert name {kinds['expert']!r}")
            return self._plan_direct(entries)
        if len(kinds) > 1:
            raise MixedFormatError(
                f"packed and per-expert names mixed in one chunk (packed {kinds['fused']!r}, "
                f"per-expert {kinds['expert']!r}): send them in separate chunks")
        if "fused" in kinds:
            return self._plan_packed(entries)
        return self._plan_per_expert(entries)

    def _check_entries(self, payload):
        spec = self.spec
        entries, seen = [], set()
        for i, item in enumerate(payload):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise PayloadTypeError(f"payload entry {i} is not a (name, tensor) pair: {item!r:.80}")
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise PayloadTypeError(f"payload entry {name!r} is a {type(tensor).__name__}, "
                                       f"not a torch.Tensor")
            if name in seen:
                raise DuplicateEntryError(f"duplicate payload entry {name!r} in one chunk")
            seen.add(name)
            parsed = parse_receiver_name(name)
            if parsed is None:
                raise UnknownNameError(f"unknown name {name!r}: not an expert weight of this model")
            if parsed.layer >= spec.num_layers:
                raise ExpertOutOfRangeError(f"{name!r}: layer {parsed.layer} out of range "
                                            f"(num_layers={spec.num_layers})")
            if parsed.expert is not None and parsed.expert >= spec.num_experts:
                raise ExpertOutOfRangeError(f"{name!r}: expert {parsed.expert} out of range "
                                            f"(num_experts={spec.num_experts})")
            if tensor.dtype != spec.dtype:
                raise PayloadDtypeError(f"{name!r}: dtype {tensor.dtype}, receiver holds {spec.dtype}")
            if tensor.device != self.device:
                raise TensorLayoutError(f"{name!r}: tensor on device {tensor.device}, receiver "
                                        f"rank {self.rank} parameters are on {self.device}")
            entries.append((name, parsed, tensor))
        return entries

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, shape: tuple, what: str) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise PayloadShapeError(f"{name!r}: shape {tuple(tensor.shape)}, expected "
                                    f"{tuple(shape)} ({what})")

    def _write_w13(self, plan: LoadPlan, layer: int, slot: int, projection: str,
                   full: torch.Tensor) -> None:
        name = fused_name(layer, "w13")
        buf, rows = self.shard.buffer_rows, self.shard.rows
        off = self._half_offset(projection)
        dst = self.params[name][slot]
        plan.pairs.append((dst.narrow(0, off, rows), self._tp_rows(full, 0)))
        if buf > rows:
            plan.zero.append(dst.narrow(0, off + rows, buf - rows))
        plan.touched.add(name)

    def _write_w2(self, plan: LoadPlan, layer: int, slot: int, full: torch.Tensor) -> None:
        name = fused_name(layer, "w2")
        buf, rows = self.shard.buffer_rows, self.shard.rows
        dst = self.params[name][slot]
        plan.pairs.append((dst.narrow(1, 0, rows), self._tp_rows(full, 1)))
        if buf > rows:
            plan.zero.append(dst.narrow(1, rows, buf - rows))
        plan.touched.add(name)

    def _plan_per_expert(self, entries) -> LoadPlan:
        spec, plan = self.spec, LoadPlan()
        found: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
        for name, parsed, tensor in entries:
            self._check_shape(name, tensor, spec.hf_shape(parsed.projection),
                              f"full {parsed.projection}_proj of one expert")
            slot = self._local_slot(parsed.expert)
            if slot is None:
                plan.ignored += 1
                continue
            param = "w2" if parsed.projection == "down" else "w13"
            found.setdefault((parsed.layer, param), {}).setdefault(parsed.expert, {})[
                parsed.projection] = tensor
        for (layer, param), by_expert in sorted(found.items()):
            needed = ("down",) if param == "w2" else ("gate", "up")
            missing = [(e, p) for e in self.shard.experts for p in needed
                       if p not in by_expert.get(e, {})]
            if missing:
                shown = ", ".join(f"expert {e} {p}_proj" for e, p in missing[:6])
                raise MissingExpertError(
                    f"layer {layer} {param}_weight on receiver rank {self.rank}: the chunk updates "
                    f"it but lacks {len(missing)} projection(s) this rank owns ({shown}); a chunk "
                    f"must carry every owned expert (experts {self.shard.experts.start}.."
                    f"{self.shard.experts.stop - 1}) of a parameter it touches")
        for (layer, param), by_expert in sorted(found.items()):
            for expert, projections in sorted(by_expert.items()):
                slot = self._local_slot(expert)
                if param == "w13":
                    self._write_w13(plan, layer, slot, "gate", projections["gate"])
                    self._write_w13(plan, layer, slot, "up", projections["up"])
                else:
                    self._write_w2(plan, layer, slot, projections["down"])
        return plan

    def _plan_packed(self, entries) -> LoadPlan:
        spec, plan = self.spec, LoadPlan()
        size = spec.intermediate
        first, _ = gate_up_halves(self.topo.order)
        for name, parsed, tensor in entries:
            self._check_shape(name, tensor, packed_shape(spec, parsed.projection),
                              f"packed {parsed.projection}_weight of all {spec.num_experts} "
                              f"experts, unsharded, {self.topo.order} order")
        for name, parsed, tensor in entries:
            for expert in range(spec.num_experts):
                slot = self._local_slot(expert)
                if slot is None:
                    continue
                if parsed.projection == "w13":
                    for projection in ("gate", "up"):
                        start = 0 if projection == first else size
                        self._write_w13(plan, parsed.layer, slot, projection,
                                        tensor[expert].narrow(0, start, size))
                else:
                    self._write_w2(plan, parsed.layer, slot, tensor[expert])
        return plan

    def _plan_direct(self, entries) -> LoadPlan:
        plan = LoadPlan()
        for name, parsed, tensor in entries:
            param = self.params[name]
            self._check_shape(name, tensor, param.shape,
                              f"receiver rank {self.rank}'s own {parsed.projection}_weight")
            if not tensor.is_contiguous():
                raise TensorLayoutError(f"{name!r}: non-contiguous tensor (strides "
                                        f"{tensor.stride()}); load_format='direct' needs "
                                        f"contiguous tensors")
            plan.pairs.append((param, tensor))
            plan.touched.add(name)
        return plan


def _checked_params(params: Mapping[str, torch.Tensor], shapes: dict[str, tuple],
                    dtype: torch.dtype, rank: int) -> dict[str, torch.Tensor]:
    """``params`` restricted to ``shapes``' names, each checked against its expected shape and
    ``dtype``; all on one device. Raises :class:`ReceiverParamsError` naming the first misfit."""
    checked = {}
    for name, shape in shapes.items():
        if name not in params:
            raise ReceiverParamsError(f"receiver rank {rank} has no parameter {name!r}")
        tensor = params[name]
        if not isinstance(tensor, torch.Tensor):
            raise ReceiverParamsError(f"receiver rank {rank} parameter {name!r} is a "
                                      f"{type(tensor).__name__}, not a torch.Tensor")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ReceiverParamsError(
                f"receiver rank {rank} parameter {name!r} is {tuple(tensor.shape)} "
                f"{tensor.dtype}; the topology needs {shape} {dtype}")
        checked[name] = tensor
    devices = {t.device for t in checked.values()}
    if len(devices) > 1:
        raise ReceiverParamsError(f"receiver rank {rank} parameters are spread over devices "
                                  f"{sorted(map(str, devices))}; they must share one")
    return checked


def make_receivers(spec: MoESpec, topo: ReceiverTopology, device="cpu") -> list[ReferenceReceiver]:
    """One receiver per rank of the engine, in rank order."""
    return [ReferenceReceiver(spec, topo, r, device) for r in range(topo.world_size)]
