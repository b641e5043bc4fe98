"""The reference receiver of a whole model: every engine parameter, SGLang's slicing, strict.

One engine rank's whole parameter tree (:func:`~pytest_weightsync.reference_impl.model.model_layout.engine_params`:
the served model and its draft, SGLang names and TP shapes) loaded in place from buckets. The
routed experts go through the expert receiver
(:class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver`, one per target, over
the same tensors); every other tensor through the layout's segments. Like the expert receiver
it is stricter than SGLang, which skips unknown names and casts dtypes silently:

* a bucket is validated whole - names, dtypes (a float32 router or ``A_log`` must arrive as
  float32), shapes, devices, tensor kinds, duplicates across the whole update, memory overlap,
  the expert parts - before its first byte is written; a refused bucket writes nothing;
* HF formats (``load_format=None``): checkpoint names (``model.layers.{L}...``, ``mtp...``,
  the expert formats' names); the receiver narrows its rank's rows. A tied model's checkpoint
  has no ``lm_head.weight``: ``model.embed_tokens.weight`` is the one source of both engine
  tensors, and an ``lm_head.weight`` is refused as a second source. Tensors of a target the
  update does not reach (a frozen draft's ``mtp.*``) are refused;
* ``load_format="direct"``: engine names (the draft's with the ``draft.`` prefix) and exact
  shapes, copied whole; a tied model's ``lm_head.weight`` is an engine parameter of its own
  here, so direct carries it (filled from the one embedding);
* :meth:`ModelReceiver.end_update` raises :class:`MissingParameterError` naming every tensor
  of the updated targets no bucket carried (and the expert receivers' missing pieces).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.errors import PayloadError, WeightSyncError, shown
from pytest_weightsync.reference_impl.model.layout import ReceiverTopology, parse_receiver_name
from pytest_weightsync.reference_impl.model.model_layout import (
    DRAFT_PREFIX,
    engine_params,
    padding_of,
    source_uses,
    split_engine_name,
)
from pytest_weightsync.reference_impl.model.model_spec import MTP_PREFIX, ModelSpec, expert_spec_of, hf_params
from pytest_weightsync.reference_impl.engine.payload_checks import (
    CHECKED,
    DuplicateEntryError,
    MemoryOverlapError,
    PayloadDtypeError,
    PayloadTypeError,
    UnknownNameError,
    checked_params,
    entry_fits,
    entry_pair,
    entry_readable_on,
    extent,
)
from pytest_weightsync.reference_impl.engine.receiver import (
    MAX_LISTED,
    IncompleteUpdateError,
    ReferenceReceiver,
)
from pytest_weightsync.vocabulary import LOAD_FORMATS


class MissingParameterError(IncompleteUpdateError):
    """``end_update``: tensors of the updated targets that no bucket carried; the engine
    parameters they feed still hold the previous version."""


class FrozenTargetError(UnknownNameError):
    """A tensor of a target (the draft) that this update does not reach."""


class TiedSourceError(UnknownNameError):
    """``lm_head.weight`` in a checkpoint-format update of a tied model: a second source."""


class MixedLoadFormatError(PayloadError):
    """Buckets of one update in two load formats (checkpoint names and direct names)."""


@dataclass
class ModelUpdateState:
    """An open whole-model update: the dense units carried (checkpoint or engine names ->
    ``(bucket, entry, name)``), the bucket count, the load format, and each target's expert
    update state."""

    targets: tuple
    seen: dict = field(default_factory=dict)
    offered: int = 0
    refused: int = 0
    load_format: object = "unset"
    experts: dict = field(default_factory=dict)  # target -> receiver.UpdateState

    def count_refused(self) -> None:
        """One more bucket offered, and refused (in every expert receiver too)."""
        self.offered += 1
        self.refused += 1
        for sub in self.experts.values():
            sub.count_refused()


def _expert_name(name: str, load_format) -> tuple[Optional[str], Optional[str]]:
    """``(target, name as the expert receiver reads it)`` of an expert tensor name, else
    ``(None, None)``: engine names under ``load_format="direct"`` (the draft's prefixed
    ``draft.``), checkpoint names otherwise (the draft's under ``mtp.``)."""
    if load_format == "direct":
        target, own = split_engine_name(name)
    elif name.startswith(MTP_PREFIX):
        target, own = "draft", "model." + name[len(MTP_PREFIX):]
    else:
        target, own = "target", name
    return (target, own) if parse_receiver_name(own) is not None else (None, None)


class ModelReceiver:
    """One engine rank of a whole model. Without ``params`` it allocates zeroed parameters
    on ``device``; with ``params`` (a mapping holding at least every engine parameter of this
    rank) it loads into those tensors in place after checking each one's shape and dtype.
    ``targets`` (default: every target of ``spec``) are the models updates reach."""

    def __init__(self, spec: ModelSpec, topo: ReceiverTopology, rank: int, device="cpu",
                 params: Optional[Mapping] = None, targets=None):
        self.spec, self.topo, self.rank = spec, topo, rank
        self.layout = engine_params(spec, topo, rank)
        self.targets = tuple(spec.targets if targets is None else targets)
        unknown = [t for t in self.targets if t not in spec.targets]
        if unknown or not self.targets:
            raise WeightSyncError(f"targets {self.targets!r}: an update reaches some of this "
                                  f"model's {spec.targets}")
        if params is None:
            self.params = {name: torch.zeros(p.shape, dtype=p.dtype, device=device)
                           for name, p in self.layout.items()}
        else:
            self.params = CHECKED.checked(
                checked_params, params, {n: (p.shape, p.dtype) for n, p in self.layout.items()},
                rank, "the engine layout")
        first = next(iter(self.params.values()))
        self.device = first.device
        self.catalogue = hf_params(spec)
        self.uses = source_uses(spec, topo, rank)
        # checkpoint name -> engine params whose zero padding its arrival writes (a direct
        # tensor carries its padding rows itself)
        self.zeroed_by = {}
        for p in self.layout.values():
            first_source = next((s.source for s in p.segments if s.source is not None), None)
            if padding_of(p) and first_source is not None:
                self.zeroed_by.setdefault(first_source, []).append(p.name)
        self.experts = {}
        for target in spec.targets:
            prefix = "" if target == "target" else DRAFT_PREFIX
            own = {name[len(prefix):]: self.params[name] for name, p in self.layout.items()
                   if p.part == "experts" and p.target == target}
            self.experts[target] = ReferenceReceiver(expert_spec_of(spec, target), topo, rank,
                                                     params=own)
        self._update: Optional[ModelUpdateState] = None

    # -- update framing ----------------------------------------------------------------------

    def named_parameters(self):
        """``(name, tensor)`` of every engine parameter this receiver writes into."""
        return self.params.items()

    @property
    def update_state(self) -> Optional[ModelUpdateState]:
        return self._update

    def begin_update(self) -> None:
        self._update = ModelUpdateState(self.targets)
        for target in self.targets:
            self.experts[target].begin_update()
            self._update.experts[target] = self.experts[target].update_state

    def resume_update(self, state: ModelUpdateState) -> None:
        if not isinstance(state, ModelUpdateState):
            raise IncompleteUpdateError(f"resume_update() needs a ModelUpdateState, got "
                                        f"{type(state).__name__}")
        self._update = state
        for target, sub in state.experts.items():
            self.experts[target].resume_update(sub)

    def refuse_bucket(self) -> None:
        """Count a bucket refused before it reached :meth:`load`."""
        if self._update is not None:
            self._update.count_refused()

    def owed(self, load_format) -> list[str]:
        """The dense units an update of :attr:`targets` in ``load_format`` must carry."""
        if load_format == "direct":
            return [n for n, p in self.layout.items()
                    if p.part != "experts" and p.target in self.targets]
        return [n for n, p in self.catalogue.items() if p.target in self.targets]

    def end_update(self) -> None:
        update, self._update = self._update, None
        if update is None:
            raise IncompleteUpdateError("end_update() without begin_update()")
        fmt = None if update.load_format == "unset" else update.load_format
        missing = [n for n in self.owed(fmt) if n not in update.seen]
        problems = []
        if missing:
            listed = ", ".join(missing[:MAX_LISTED])
            more = f", ... ({len(missing) - MAX_LISTED} more)" if len(missing) > MAX_LISTED else ""
            problems.append(f"{len(missing)} tensor(s) of the updated targets {list(update.targets)} "
                            f"were never loaded: {listed}{more}")
        for target in update.targets:
            try:
                self.experts[target].end_update()
            except IncompleteUpdateError as error:
                problems.append(f"{target} experts: {error}")
        if problems:
            refused = f", {update.refused} refused" if update.refused else ""
            raise MissingParameterError(
                f"receiver rank {self.rank}: incomplete update ({update.offered} bucket(s)"
                f"{refused}): " + "; ".join(problems) + "; they still hold the previous version")

    # -- loading -----------------------------------------------------------------------------

    def describe_entry(self, index: int, name=None) -> str:
        bucket = f" of bucket {self._update.offered}" if self._update is not None else ""
        return f"payload entry {index}{bucket}" + ("" if name is None else f" {shown(name)}")

    def load(self, payload, load_format: Optional[str] = None) -> None:
        """Validate the whole bucket, then write it in place."""
        try:
            dense, expert_plans = self.plan(payload, load_format)
        except BaseException:
            self.refuse_bucket()
            raise
        with torch.no_grad():
            for view in dense.zero:
                view.zero_()
            fastcopy.copy_pairs(dense.pairs)
        for target, plan in expert_plans.items():
            self.experts[target].commit(plan)
        update = self._update
        if update is not None:
            update.seen.update(dense.units)
            update.offered += 1
            if update.load_format == "unset":
                update.load_format = load_format

    def plan(self, payload, load_format=None):
        """``(dense plan, {target: expert plan})`` of a bucket, after every check."""
        from pytest_weightsync.reference_impl.engine.load_plan import LoadPlan

        if load_format not in LOAD_FORMATS:
            raise PayloadError(f"unknown load_format {shown(load_format)}; expected one of "
                               f"{LOAD_FORMATS}")
        update = self._update
        if update is not None and update.load_format not in ("unset", load_format):
            raise MixedLoadFormatError(
                f"bucket {update.offered} has load_format={load_format!r}, earlier buckets of "
                f"this update {update.load_format!r}: one update is one format")
        if payload is None or isinstance(payload, (str, bytes, Mapping, torch.Tensor)) \
                or not hasattr(payload, "__iter__"):
            raise PayloadTypeError(f"payload is a {type(payload).__name__}; expected a list of "
                                   f"(name, tensor) pairs")
        dense = LoadPlan()
        expert_parts: dict = {t: [] for t in self.spec.targets}
        seen = update.seen if update is not None else {}
        sources = []
        for index, item in enumerate(payload):
            name, tensor = self._check_item(index, item)
            target, own = _expert_name(name, load_format)
            if target is not None:
                if target not in self.targets:
                    raise FrozenTargetError(f"{self.describe_entry(index, name)}: a {target} "
                                            f"tensor, but this update reaches {list(self.targets)}")
                expert_parts[target].append((own, tensor))
                continue
            unit, shape, dtype = self._dense_entry(index, name, load_format)
            where = self.describe_entry(index, name)
            if unit in dense.units or unit in seen:
                earlier = dense.units.get(unit) or seen.get(unit)
                raise DuplicateEntryError(f"{where}: duplicate: {unit} was already carried by "
                                          f"entry {earlier[1]} {shown(earlier[2])} of bucket "
                                          f"{earlier[0]}")
            if tensor.dtype != dtype:
                raise PayloadDtypeError(f"{where}: dtype {tensor.dtype}, the engine holds "
                                        f"{dtype}")
            entry_fits(tensor, shape, load_format, where)
            bucket = update.offered if update is not None else 0
            dense.units[unit] = (bucket, index, name)
            self._plan_dense(dense, name, tensor, load_format)
            sources.append((index, name, tensor))
        expert_plans = {}
        for target in self.targets:
            sub = self.experts[target]
            try:
                expert_plans[target] = sub.plan(expert_parts[target], load_format)
            except PayloadError as error:
                raise type(error)(f"{target} experts: {error}") from None
            sources += [(i, n, t) for i, (n, t) in enumerate(expert_parts[target])]
        touched = set(dense.touched)
        for target, plan in expert_plans.items():
            prefix = "" if target == "target" else DRAFT_PREFIX
            touched |= {prefix + n for n in plan.touched}
        self._check_overlap(sources, touched)
        return dense, expert_plans

    def _check_item(self, index, item):
        name, tensor, where = entry_pair(index, item, self.describe_entry)
        entry_readable_on(tensor, self.device, self.rank, where)
        return name, tensor

    def _dense_entry(self, index, name, load_format):
        """``(unit, shape, dtype)`` of a non-expert entry, or the reason it is refused."""
        where = self.describe_entry(index, name)
        if load_format == "direct":
            p = self.layout.get(name)
            if p is None:
                raise UnknownNameError(f"{where}: not a parameter of engine rank {self.rank} "
                                       f"(load_format='direct' takes the engine's own names; the "
                                       f"draft's carry the prefix {DRAFT_PREFIX!r})")
            if p.target not in self.targets:
                raise FrozenTargetError(f"{where}: a {p.target} parameter, but this update "
                                        f"reaches {list(self.targets)}")
            return name, p.shape, p.dtype
        p = self.catalogue.get(name)
        if p is None:
            if name == "lm_head.weight" and self.spec.tied:
                raise TiedSourceError(f"{where}: the model ties lm_head to embed_tokens: "
                                      f"model.embed_tokens.weight is the one source of both; a "
                                      f"checkpoint of it carries no lm_head.weight")
            engine = " (an engine name: send it with load_format='direct')" \
                if name in self.layout else ""
            raise UnknownNameError(f"{where}: not a tensor of this model's checkpoint{engine}")
        if p.target not in self.targets:
            raise FrozenTargetError(f"{where}: a {p.target} tensor, but this update reaches "
                                    f"{list(self.targets)}")
        return name, p.shape, p.dtype

    def _plan_dense(self, plan, name, tensor, load_format) -> None:
        if load_format == "direct":
            plan.pairs.append((self.params[name], tensor))
            plan.touched.add(name)
            return
        for use in self.uses.get(name, ()):
            dst = self.params[use.engine].narrow(use.axis, use.dst, use.size)
            plan.pairs.append((dst, tensor.narrow(use.axis, use.src, use.size)))
            plan.touched.add(use.engine)
        for engine in self.zeroed_by.get(name, ()):
            p = self.layout[engine]
            for start, size in padding_of(p):
                plan.zero.append(self.params[engine].narrow(p.axis, start, size))
            plan.touched.add(engine)

    def _check_overlap(self, sources, touched) -> None:
        spans = sorted((*span, name) for name in touched
                       if (span := extent(self.params[name])) is not None)
        if not spans:
            return
        starts = [start for start, _, _ in spans]
        for index, name, tensor in sources:
            src = extent(tensor)
            if src is None:
                continue
            k = bisect.bisect_left(starts, src[1]) - 1
            while k >= 0:
                start, end, param = spans[k]
                if end > src[0]:
                    raise MemoryOverlapError(f"{self.describe_entry(index, name)}: its memory "
                                             f"overlaps engine parameter {param!r}, which this "
                                             f"bucket writes; send a copy")
                k -= 1




def make_model_receivers(spec: ModelSpec, topo: ReceiverTopology, device="cpu", targets=None):
    """One whole-model receiver per engine rank, in rank order."""
    return [ModelReceiver(spec, topo, r, device, targets=targets) for r in range(topo.tp)]
