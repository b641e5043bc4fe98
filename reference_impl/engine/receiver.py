"""A reference receiver: SGLang ``FusedMoE`` placement, stricter than SGLang on bad input.

Per receiver rank and layer it pre-allocates ``w13_weight [E_local, 2 * I_buf, H]`` and
``w2_weight [E_local, H, I_buf]`` and loads payloads into them in place (``copy_``), never
reallocating, so addresses captured by CUDA graphs or IPC handles stay valid.

What it models of SGLang is the *placement*: which experts a rank keeps, which MoE-TP rows,
where gate and up land in ``w13`` (the receiver's order), how padded buffers are zeroed. On bad
input it is deliberately STRICTER than SGLang 0.5.23, which casts float32 silently, re-slices
short tensors, skips unknown names and out-of-range experts and lets duplicates overwrite: the
reference refuses all of these by name, so a sender bug surfaces at the sender's test, not as
a silently wrong model.

An update is a stream of buckets (what real senders send: slime cuts its export at
``update_weight_buffer_size``, so one layer's experts straddle buckets and one bucket can hold
several layers)::

    receiver.begin_update()
    for bucket in stream:
        receiver.load(bucket, load_format=...)
    receiver.end_update()

Payload formats (one ``load`` call = one bucket):

* ``load_format=None`` (SGLang's default ``load_weights``), one naming scheme per bucket:

  - ``compat``: per-expert ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight``
    (full tensors; the receiver narrows its MoE-TP rows, experts of other ranks are ignored);
  - ``hf_fused``: SGLang's fused-expert checkpoint names ``...experts.gate_up_proj``
    ``[E, 2I, H]`` (gate rows first whatever the receiver order, split with ``chunk(2, -2)``)
    and ``...experts.down_proj`` ``[E, H, I]``, every expert, unsharded;
  - ``packed``: ``...experts.{w13,w2}_weight`` of every expert, unsharded, in the receiver's
    gate/up order. Stock SGLang has NO code path for these names (they reach
    ``FusedMoE.weight_loader`` without shard or expert ids and raise); accepting them models
    an engine-side loader such as the one the fast path ships with.

  Mixing naming schemes in one bucket is refused: SGLang mis-routes per-expert names that
  follow a fused name in the same ``load_weights`` call.
* ``load_format="direct"``: the receiver's own parameter names with exactly their shapes,
  contiguous; copied whole.

Atomicity promise:

* a bucket is validated whole (types, names, ids, dtypes, shapes, devices, contiguity where
  the format needs it, duplicates across the WHOLE update, memory overlap between sources and
  the parameters the bucket writes, and that every tensor is a plain dense tensor over
  readable memory - no DTensor, FakeTensor or other subclass, nested tensor, lazy neg/conj
  view or freed storage, see :mod:`~pytest_weightsync.reference_impl.engine.tensor_checks`) before
  its first byte is written; a refused bucket raises a :class:`PayloadError` naming the entry
  index (and, inside an update, the sender's bucket number) and the reason, and writes
  nothing;
* buckets loaded before a refused one stay written (a stream cannot be rolled back without a
  second copy of the model);
* completeness is a property of the update, not of a bucket: :meth:`ReferenceReceiver.end_update`
  raises :class:`MissingExpertError` naming every (layer, expert, projection) no bucket
  carried (a bounded list and the count); those elements still hold the previous version;
* :meth:`ReferenceReceiver.load` without :meth:`~ReferenceReceiver.begin_update` is a one-bucket
  update whose completeness is not checked (a partial update on purpose, e.g. one layer).
"""

from __future__ import annotations

import bisect
import functools
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.engine import tensor_checks
from pytest_weightsync.reference_impl.engine.checked_memo import CheckedMemo
from pytest_weightsync.vocabulary import LOAD_FORMATS
from pytest_weightsync.reference_impl.errors import MAX_NAME_CHARS, PayloadError, shown
from pytest_weightsync.reference_impl.model.layout import (
    PROJECTIONS,
    MoESpec,
    ReceiverTopology,
    WeightSyncError,
    fused_name,
    gate_up_halves,
    name_problem,
    packed_shape,
    parse_receiver_name,
    receiver_param_shapes,
    receiver_shard,
)

#: Most missing pieces / entries listed in one message (the count is always given).
MAX_LISTED = 8
#: Owed pieces per (receiver class, spec, topology, rank): see ``ReferenceReceiver._owed_set``.
_OWED: dict = {}
#: Naming schemes of ``load_format=None``, by ``ParsedName.kind``, as format names.
_SCHEME = {"expert": "compat", "fused": "packed", "hf_fused": "hf_fused"}


class PayloadTypeError(PayloadError, TypeError):
    """The payload, or an entry of it, is not a ``(str, torch.Tensor)`` pair."""


class UnknownNameError(PayloadError):
    """A name that is no expert weight of this model (or not valid for the load format)."""


class ExpertOutOfRangeError(PayloadError):
    """An expert id ``>= num_experts`` (or a layer id ``>= num_layers``)."""


class DuplicateEntryError(PayloadError):
    """The same (layer, expert, projection) carried twice in one update."""


class MixedFormatError(PayloadError):
    """Names of two formats (per-expert, packed, hf_fused) in one bucket."""


class PayloadDtypeError(PayloadError):
    """A tensor whose dtype differs from the receiver parameter's."""


class PayloadShapeError(PayloadError):
    """A tensor whose shape differs from what its name requires."""


class TensorLayoutError(PayloadError):
    """A sparse tensor, a tensor on the wrong device, or a non-contiguous one where the format
    needs contiguity."""


class MemoryOverlapError(PayloadError):
    """A source tensor sharing memory with a receiver parameter the same bucket writes: copying
    would read bytes it has already overwritten."""


# Refusals of tensors that are no plain dense tensor over readable memory (subclasses such as
# DTensor and FakeTensor, nested tensors, lazy neg/conj views, freed storage); re-exported so
# every payload error of the receiver is reachable from this module.
UnloadableTensorError = tensor_checks.UnloadableTensorError
TensorSubclassError = tensor_checks.TensorSubclassError
NestedTensorError = tensor_checks.NestedTensorError
LazyViewError = tensor_checks.LazyViewError
TensorStorageError = tensor_checks.TensorStorageError


def _refuse(problem, where: str) -> None:
    """Raise the payload error of a :mod:`tensor_checks` problem, prefixed by the entry."""
    if problem is not None:
        cls, reason = problem
        raise cls(f"{where}: {reason}")


def entry_pair(index: int, item, where_of) -> tuple[str, "torch.Tensor", str]:
    """``(name, tensor, where)`` of payload entry ``index`` once it is a ``(str, Tensor)`` pair
    of a dense, readable kind (every receiver asks this first, before reading the name);
    ``where_of(index[, name])`` words the entry for messages."""
    if not (isinstance(item, tuple) and len(item) == 2):
        raise PayloadTypeError(f"{where_of(index)} is a {type(item).__name__}, not a "
                               f"(name, tensor) pair")
    name, tensor = item
    if not isinstance(name, str):
        raise PayloadTypeError(f"{where_of(index)}: the name is a {type(name).__name__} "
                               f"{shown(name)}, not a str")
    where = where_of(index, name)
    if not isinstance(tensor, torch.Tensor):
        raise PayloadTypeError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor")
    _refuse(tensor_checks.kind_problem(tensor), where)
    if tensor.layout != torch.strided:
        raise TensorLayoutError(f"{where}: {tensor.layout} tensor; only dense (strided) "
                                f"tensors can be loaded")
    return name, tensor, where


def entry_fits(tensor, shape, load_format: str, where: str, what: str = "") -> None:
    """Refuse an entry whose shape is not ``shape`` (``what`` says whose), or that is not
    contiguous where ``load_format='direct'`` copies it whole."""
    if tuple(tensor.shape) != tuple(shape):
        raise PayloadShapeError(f"{where}: shape {tuple(tensor.shape)}, expected "
                                f"{tuple(shape)}{what}")
    if load_format == "direct" and not tensor.is_contiguous():
        raise TensorLayoutError(f"{where}: non-contiguous tensor (strides {tensor.stride()}); "
                                f"load_format='direct' needs contiguous tensors")


def entry_readable_on(tensor, device, rank: int, where: str) -> None:
    """Refuse an entry on another device than receiver ``rank``'s parameters, or whose storage
    cannot be read (freed, too small): asked after the device, since a meta tensor is a wrong
    device and not a freed one."""
    if tensor.device != device:
        raise TensorLayoutError(f"{where}: tensor on device {tensor.device}, receiver rank "
                                f"{rank} parameters are on {device}")
    _refuse(tensor_checks.storage_problem(tensor), where)


@functools.lru_cache(maxsize=64)
def _cached_layout(spec: MoESpec, topo: ReceiverTopology, rank: int, shard_of,
                   shapes_of) -> tuple:
    # the layout functions are part of the key: a self-test that plants a mutant in one of
    # them gets the mutant's layout, and later tests the real one
    return shard_of(spec, topo, rank), tuple(shapes_of(spec, topo, rank).items())


def rank_layout(spec: MoESpec, topo: ReceiverTopology, rank: int) -> tuple:
    """``(shard, ((name, shape), ...))`` of receiver ``rank``: what a receiver owns and the
    parameters it holds, a pure function of its arguments, kept for the next receiver of the
    same rank (a loader that builds a receiver per call pays it once, not per bucket)."""
    try:
        return _cached_layout(spec, topo, rank, receiver_shard, receiver_param_shapes)
    except TypeError:  # an unhashable spec or topology: computed every time
        return (receiver_shard(spec, topo, rank),
                tuple(receiver_param_shapes(spec, topo, rank).items()))


class ReceiverParamsError(WeightSyncError):
    """Existing parameters handed to :class:`ReferenceReceiver` do not match its topology."""


class IncompleteUpdateError(WeightSyncError):
    """``end_update`` found an update that did not carry every piece, or no update was open."""


class MissingExpertError(IncompleteUpdateError):
    """``end_update``: (layer, expert, projection) pieces this rank owns that no bucket of the
    update carried; they still hold the previous version."""


def _extent(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """Byte range ``[start, end)`` the elements of ``tensor`` can occupy; ``None`` if empty."""
    if tensor.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    start = tensor.data_ptr()
    return start, start + span * tensor.element_size()


@dataclass
class LoadPlan:
    """What one bucket will do: zero ``zero`` views, then copy each ``(dst, src)`` pair.
    ``touched`` names the receiver parameters written, ``units`` the (layer, expert,
    projection) pieces the bucket carries (global expert ids, other ranks' included)."""

    pairs: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    touched: set = field(default_factory=set)
    ignored: int = 0
    units: dict = field(default_factory=dict)
    #: ``(owed, whether units cover it)`` for the last ``owed`` asked (see :meth:`covers`).
    covering: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def covers(self, owed: frozenset) -> bool:
        """Whether this bucket alone carried every piece of ``owed``; answered once per
        ``owed`` set, so a cached bucket replayed every update (the same plan object) closes
        its update without comparing every piece again."""
        memo = self.covering
        if memo is None or memo[0] is not owed:
            memo = self.covering = (owed, owed <= self.units.keys())
        return memo[1]


@dataclass
class UpdateState:
    """State of an open update: which pieces earlier buckets carried, and where. Buckets are
    numbered the way the sender numbers them: every bucket offered counts, refused ones
    included, so after a refused bucket 1 the next one is bucket 2 in every message."""

    seen: dict = field(default_factory=dict)  # (layer, expert, projection) -> (bucket, entry, name)
    offered: int = 0  # buckets offered so far; the next one is bucket number `offered`
    refused: int = 0
    #: Weak references to the plans whose pieces ``seen`` took (``end_update`` asks each
    #: plan still alive - a plan cache keeps its buckets' - whether it alone covered the
    #: update; ``seen`` decides when none did). Weak: a plan holds views of its bucket's
    #: tensors, which must not outlive the bucket's load because an update is open.
    carried: list = field(default_factory=list)

    def carry(self, plan: "LoadPlan") -> None:
        """One more bucket offered, written: its pieces are seen."""
        self.seen.update(plan.units)
        self.carried.append(weakref.ref(plan))
        self.offered += 1

    def covered(self, owed: frozenset) -> bool:
        """Whether one plan this update carried, still alive, covered ``owed`` alone."""
        return any(plan is not None and plan.covers(owed)
                   for plan in (ref() for ref in self.carried))

    def count_refused(self) -> None:
        """One more bucket offered, and refused."""
        self.offered += 1
        self.refused += 1


class ReferenceReceiver:
    """One receiver rank's expert parameters and its loader.

    Without ``params`` the receiver allocates zeroed parameters on ``device``. With ``params``
    (a mapping holding at least every expert parameter of this rank, e.g. a model's own
    tensors, ``nn.Parameter`` with ``requires_grad`` included) it loads into those tensors in
    place, after checking each one's shape, dtype and that they share one device (which
    replaces ``device``); other entries are ignored."""

    def __init__(self, spec: MoESpec, topo: ReceiverTopology, rank: int, device="cpu",
                 params: Optional[Mapping[str, torch.Tensor]] = None, plan_cache: bool = False):
        self.spec = spec
        self.topo = topo
        self.rank = rank
        self.shard, shapes = rank_layout(spec, topo, rank)
        if params is None:
            self.params: dict[str, torch.Tensor] = {
                name: torch.zeros(shape, dtype=spec.dtype, device=device)
                for name, shape in shapes
            }
        else:
            self.params = CHECKED.checked(checked_params, params,
                                          {n: (s, spec.dtype) for n, s in shapes}, rank,
                                          "the topology")
        # The device the parameters really live on: "cuda" means the current GPU, and a payload
        # tensor reports "cuda:0", so compare against the resolved device, not the request.
        first = next(iter(self.params.values()), None)
        self.device = first.device if first is not None else torch.device(device)
        self._update: Optional[UpdateState] = None
        #: With ``plan_cache``: buckets validated and planned once, replayed when they come
        #: again at the same addresses (:mod:`pytest_weightsync.reference_impl.engine.plan_cache`).
        self.plan_cache = None
        if plan_cache:
            from pytest_weightsync.reference_impl.engine.plan_cache import LoadCache

            self.plan_cache = LoadCache()

    # -- the hooks a loader variant would change ----------------------------------------------

    def _local_slot(self, expert: int) -> Optional[int]:
        """Global expert id -> local slot, ``None`` when another rank owns it."""
        return self.shard.local_expert(expert)

    def _half_offset(self, projection: str) -> int:
        return self.shard.half_offset(projection, self.topo.order)

    def _owed_units(self) -> list[tuple[int, int, str]]:
        """Every (layer, expert, projection) a complete update must carry to this rank."""
        return [(layer, expert, projection)
                for layer in range(self.spec.num_layers)
                for expert in self.shard.experts
                for projection in PROJECTIONS]

    def _owed_set(self) -> frozenset:
        """:meth:`_owed_units` as a set, kept per receiver class, spec, topology and rank (a
        complete update is then one set comparison, not a loop over every piece)."""
        if not type(self)._owed_units.__module__.startswith(__package__ or __name__):
            return frozenset(self._owed_units())  # a variant's own pieces: not kept
        key = (type(self), self.spec, self.topo, self.rank, receiver_shard,
               receiver_param_shapes)
        try:
            owed = _OWED.get(key)
        except TypeError:  # unhashable spec or topology
            return frozenset(self._owed_units())
        if owed is None:
            owed = _OWED[key] = frozenset(self._owed_units())
            while len(_OWED) > 64:
                _OWED.pop(next(iter(_OWED)))
        return owed

    def _tp_rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's MoE-TP slice of a full tensor along ``dim``."""
        return loaded.narrow(dim, self.shard.row_start, self.shard.rows)

    def _apply(self, plan: LoadPlan) -> None:
        # no_grad: parameters may be nn.Parameter(requires_grad=True), whose views refuse
        # in-place writes under autograd.
        with torch.no_grad():
            for view in plan.zero:
                view.zero_()
            fastcopy.copy_pairs(plan.pairs)

    # -- public API --------------------------------------------------------------------------

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.params.items()

    @property
    def in_update(self) -> bool:
        return self._update is not None

    def begin_update(self) -> None:
        """Open an update (a stream of buckets); one still open is discarded."""
        self._update = UpdateState()

    @property
    def update_state(self) -> Optional[UpdateState]:
        """The open update's state (``None`` outside an update), for :meth:`resume_update`."""
        return self._update

    def resume_update(self, state: UpdateState) -> None:
        """Continue an update that another receiver over the same parameters (same spec,
        topology and rank) opened: a loader that keeps only the update's state between calls,
        not the receiver and its parameters, hands it back here."""
        if not isinstance(state, UpdateState):
            raise IncompleteUpdateError(f"resume_update() needs an UpdateState, got "
                                        f"{type(state).__name__}")
        self._update = state

    def refuse_bucket(self) -> None:
        """Count a bucket refused before it reached :meth:`load` (e.g. by a format check of
        the caller's), so the next bucket keeps the sender's number."""
        if self._update is not None:
            self._update.count_refused()

    def end_update(self) -> None:
        """Close the update; raise :class:`MissingExpertError` naming every (layer, expert,
        projection) of this rank that no bucket carried (those still hold the previous
        version)."""
        update, self._update = self._update, None
        if update is None:
            raise IncompleteUpdateError("end_update() without begin_update()")
        owed = self._owed_set()
        if update.covered(owed) or owed <= update.seen.keys():
            return
        missing = [unit for unit in self._owed_units() if unit not in update.seen]
        if missing:
            listed = ", ".join(f"layer {l} expert {e} {p}_proj" for l, e, p in missing[:MAX_LISTED])
            more = f", ... ({len(missing) - MAX_LISTED} more)" if len(missing) > MAX_LISTED else ""
            refused = f", {update.refused} refused" if update.refused else ""
            raise MissingExpertError(
                f"receiver rank {self.rank}: incomplete update ({update.offered} bucket(s)"
                f"{refused}): "
                f"{len(missing)} expert projection(s) this rank owns were never loaded: "
                f"{listed}{more}; they still hold the previous version")

    def load(self, payload, load_format: Optional[str] = None, *, check=None,
             check_tag=None) -> LoadPlan:
        """Validate the whole bucket, then write it in place. Returns the executed plan.

        ``check(payload)``, when given, is a caller's own check of the bucket (the registered
        loader's format check), run before planning; with a plan cache, a bucket recognised by
        its signature under the same ``check_tag`` skips it as it skips planning (see
        :meth:`~pytest_weightsync.reference_impl.engine.plan_cache.LoadCache.load`)."""
        update = self._update
        try:
            if self.plan_cache is not None:
                plan = self.plan_cache.load(self, payload, load_format,
                                            update.seen if update is not None else {},
                                            update.offered if update is not None else 0,
                                            check=check, check_tag=check_tag)
            else:
                if check is not None:
                    check(payload)
                plan = self.plan(payload, load_format)
        except BaseException:
            self.refuse_bucket()
            raise
        if self.plan_cache is None:
            self.commit(plan)
        elif update is not None:  # the cache wrote it
            update.carry(plan)
        return plan

    def commit(self, plan: LoadPlan) -> None:
        """Write a plan :meth:`plan` made (for the bucket being offered) and count the bucket
        in the open update. :meth:`load` is ``plan`` + ``commit``; a caller that plans
        several receivers' parts of one bucket first (the whole-model receiver) commits them
        only once every part was validated."""
        self._apply(plan)
        if self._update is not None:
            self._update.carry(plan)

    # -- validation and planning ---------------------------------------------------------------

    def describe_entry(self, index: int, name=None) -> str:
        """``payload entry I of bucket B 'name'``: how messages name an entry of the bucket
        being offered (the bucket number only inside an update)."""
        bucket = f" of bucket {self._update.offered}" if self._update is not None else ""
        return f"payload entry {index}{bucket}" + ("" if name is None else f" {shown(name)}")

    _where = describe_entry

    def plan(self, payload, load_format: Optional[str] = None) -> LoadPlan:
        """Everything a bucket will write, after every check; raises :class:`PayloadError`."""
        if load_format not in LOAD_FORMATS:
            raise PayloadError(f"unknown load_format {shown(load_format)}; expected one of "
                               f"{LOAD_FORMATS}")
        entries = self._check_entries(payload, load_format)
        if load_format is None:
            kinds = {}
            for index, name, parsed, _ in entries:
                kinds.setdefault(parsed.kind, (index, name))
            if len(kinds) > 1:
                shown_kinds = ", ".join(f"{_SCHEME[k]} ({self._where(i, n)})"
                                        for k, (i, n) in kinds.items())
                raise MixedFormatError(
                    f"names of different formats mixed in one bucket: {shown_kinds}; SGLang "
                    f"mis-routes per-expert names after a fused one in the same call: send "
                    f"each format in its own bucket")
        units = self._check_units(entries, load_format)
        plan = LoadPlan(units=units)
        for index, name, parsed, tensor in entries:
            if load_format == "direct":
                self._plan_direct(plan, parsed, tensor)
            elif parsed.kind == "expert":
                self._plan_per_expert(plan, parsed, tensor)
            elif parsed.kind == "fused":
                self._plan_packed(plan, parsed, tensor)
            else:
                self._plan_hf_fused(plan, parsed, tensor)
        self._check_overlap(entries, plan)
        return plan

    def _check_entries(self, payload, load_format):
        if payload is None:
            raise PayloadTypeError("payload is None; expected a list of (name, tensor) pairs")
        if isinstance(payload, (str, bytes, Mapping, torch.Tensor)) or not hasattr(payload, "__iter__"):
            raise PayloadTypeError(f"payload is a {type(payload).__name__}; expected a list of "
                                   f"(name, tensor) pairs")
        entries = []
        for index, item in enumerate(payload):
            entries.append(self._check_entry(index, item, load_format))
        return entries

    def _check_entry(self, index, item, load_format):
        spec = self.spec
        name, tensor, where = entry_pair(index, item, self._where)
        parsed = parse_receiver_name(name)
        if parsed is None:
            raise UnknownNameError(f"{where}: unknown name: {name_problem(name)}")
        if load_format == "direct" and parsed.kind != "fused":
            raise UnknownNameError(f"{where}: load_format='direct' takes the receiver's own "
                                   f"parameter names (...experts.w13_weight / w2_weight), not "
                                   f"{_SCHEME[parsed.kind]} names")
        if parsed.layer >= spec.num_layers:
            raise ExpertOutOfRangeError(f"{where}: layer {parsed.layer} out of range "
                                        f"(num_layers={spec.num_layers})")
        if parsed.expert is not None and parsed.expert >= spec.num_experts:
            raise ExpertOutOfRangeError(f"{where}: expert {parsed.expert} out of range "
                                        f"(num_experts={spec.num_experts})")
        if tensor.dtype != spec.dtype:
            raise PayloadDtypeError(f"{where}: dtype {tensor.dtype}, receiver holds {spec.dtype}")
        entry_readable_on(tensor, self.device, self.rank, where)
        shape, what = self._expected_shape(parsed, load_format)
        entry_fits(tensor, shape, load_format, where, f" ({what})")
        return index, name, parsed, tensor

    def _expected_shape(self, parsed, load_format) -> tuple[tuple, str]:
        spec = self.spec
        if load_format == "direct":
            param = fused_name(parsed.layer, parsed.projection)
            return (tuple(self.params[param].shape),
                    f"receiver rank {self.rank}'s own {parsed.projection}_weight")
        if parsed.kind == "expert":
            return (spec.hf_shape(parsed.projection),
                    f"full {parsed.projection}_proj of one expert")
        if parsed.kind == "fused":
            return (packed_shape(spec, parsed.projection),
                    f"packed {parsed.projection}_weight of all {spec.num_experts} experts, "
                    f"unsharded, {self.topo.order} order")
        if parsed.projection == "gate_up":
            return ((spec.num_experts, 2 * spec.intermediate, spec.hidden),
                    f"gate_up_proj of all {spec.num_experts} experts, gate rows first")
        return ((spec.num_experts, spec.hidden, spec.intermediate),
                f"down_proj of all {spec.num_experts} experts")

    def _units_of(self, parsed, load_format) -> list[tuple[int, int, str]]:
        """The (layer, global expert, projection) pieces one entry carries."""
        layer = parsed.layer
        if parsed.kind == "expert":
            return [(layer, parsed.expert, parsed.projection)]
        projections = ("down",) if parsed.projection in ("w2", "down") else ("gate", "up")
        experts = self.shard.experts if load_format == "direct" else range(self.spec.num_experts)
        return [(layer, e, p) for e in experts for p in projections]

    def _check_units(self, entries, load_format) -> dict:
        """Pieces of the bucket; a piece carried twice (in this bucket, or by an earlier bucket
        of the open update) is refused, whatever spelling carried it."""
        seen = self._update.seen if self._update is not None else {}
        units = {}
        for index, name, parsed, _ in entries:
            for unit in self._units_of(parsed, load_format):
                earlier = units.get(unit) or seen.get(unit)
                if earlier is not None:
                    bucket, first_index, first_name = earlier
                    first = (f"entry {first_index} {shown(first_name)}" if bucket is None else
                             f"entry {first_index} {shown(first_name)} of bucket {bucket}")
                    layer, expert, projection = unit
                    raise DuplicateEntryError(
                        f"{self._where(index, name)}: duplicate: layer {layer} expert {expert} "
                        f"{projection}_proj was already carried by {first} in this "
                        f"{'bucket' if bucket is None else 'update'}")
                units[unit] = (None, index, name)
        bucket = self._update.offered if self._update is not None else 0
        return {unit: (bucket, index, name) for unit, (_, index, name) in units.items()}

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

    def _plan_per_expert(self, plan: LoadPlan, parsed, tensor) -> None:
        slot = self._local_slot(parsed.expert)
        if slot is None:
            plan.ignored += 1
        elif parsed.projection == "down":
            self._write_w2(plan, parsed.layer, slot, tensor)
        else:
            self._write_w13(plan, parsed.layer, slot, parsed.projection, tensor)

    def _plan_packed(self, plan: LoadPlan, parsed, tensor) -> None:
        """Receiver-order halves: ``w13[e]`` is ``[first; second]`` of ``self.topo.order``."""
        size = self.spec.intermediate
        first, _ = gate_up_halves(self.topo.order)
        for expert, slot in self._planned_slots(parsed.layer):
            if parsed.projection == "w13":
                for projection in ("gate", "up"):
                    start = 0 if projection == first else size
                    self._write_w13(plan, parsed.layer, slot, projection,
                                    tensor[expert].narrow(0, start, size))
            else:
                self._write_w2(plan, parsed.layer, slot, tensor[expert])

    def _plan_hf_fused(self, plan: LoadPlan, parsed, tensor) -> None:
        """Gate rows first whatever the receiver order (SGLang splits with ``chunk(2, -2)``)."""
        size = self.spec.intermediate
        for expert, slot in self._planned_slots(parsed.layer):
            if parsed.projection == "gate_up":
                self._write_w13(plan, parsed.layer, slot, "gate", tensor[expert].narrow(0, 0, size))
                self._write_w13(plan, parsed.layer, slot, "up", tensor[expert].narrow(0, size, size))
            else:
                self._write_w2(plan, parsed.layer, slot, tensor[expert])

    def _planned_slots(self, layer: int) -> list[tuple[int, int]]:
        """``(expert, slot)`` of every expert of ``layer`` an all-expert tensor (packed,
        hf_fused) is read for, and the slot :meth:`_write_w13` / :meth:`_write_w2` get."""
        return [(expert, slot) for expert in self.shard.experts
                if (slot := self._local_slot(expert)) is not None]

    def _plan_direct(self, plan: LoadPlan, parsed, tensor) -> None:
        name = fused_name(parsed.layer, parsed.projection)
        plan.pairs.append((self.params[name], tensor))
        plan.touched.add(name)

    def _check_overlap(self, entries, plan: LoadPlan) -> None:
        """Refuse a source that shares bytes with a parameter this bucket writes (itself
        included): the copy order would decide what lands."""
        spans = []
        for name in plan.touched:
            span = _extent(self.params[name])
            if span is not None:
                spans.append((span[0], span[1], name))
        if not spans:
            return
        spans.sort()
        starts = [start for start, _, _ in spans]
        reach, furthest = [], 0  # reach[k]: the furthest end among spans[0..k]
        for _, end, _ in spans:
            furthest = max(furthest, end)
            reach.append(furthest)
        for index, name, _, tensor in entries:
            src = _extent(tensor)
            if src is None:
                continue
            k = bisect.bisect_left(starts, src[1]) - 1
            while k >= 0 and reach[k] > src[0]:
                start, end, param = spans[k]
                if end > src[0]:
                    raise MemoryOverlapError(
                        f"{self._where(index, name)}: its memory overlaps receiver parameter "
                        f"{param!r}, which this bucket writes; send a copy")
                k -= 1


#: Receivers built per call over the same parameters check them once
#: (:mod:`~pytest_weightsync.reference_impl.engine.checked_memo`).
CHECKED = CheckedMemo()


def checked_params(params: Mapping[str, torch.Tensor], wants: Mapping[str, tuple],
                   rank: int, needs: str) -> dict[str, torch.Tensor]:
    """``params`` restricted to the names of ``wants`` (``{name: (shape, dtype)}``), each a
    dense, readable tensor of its shape and dtype, all on one device (``needs`` words what asks
    for them). Raises :class:`ReceiverParamsError` naming the first misfit."""
    if type(params) is not dict and not isinstance(params, Mapping):
        raise ReceiverParamsError(f"receiver rank {rank} params is a {type(params).__name__}, "
                                  f"not a mapping of name -> tensor")
    checked = {}
    for name, (shape, dtype) in wants.items():
        if name not in params:
            raise ReceiverParamsError(f"receiver rank {rank} has no parameter {name!r}")
        tensor = params[name]
        if not isinstance(tensor, torch.Tensor):
            raise ReceiverParamsError(f"receiver rank {rank} parameter {name!r} is a "
                                      f"{type(tensor).__name__}, not a torch.Tensor")
        problem = tensor_checks.kind_problem(tensor)
        if problem is None and tensor.layout != torch.strided:
            problem = (None, f"a {tensor.layout} tensor; parameters must be dense (strided)")
        if problem is None and not tensor.is_meta:
            problem = tensor_checks.storage_problem(tensor)
        if problem is not None:
            raise ReceiverParamsError(f"receiver rank {rank} parameter {name!r}: {problem[1]}")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ReceiverParamsError(
                f"receiver rank {rank} parameter {name!r} is {tuple(tensor.shape)} "
                f"{tensor.dtype}; {needs} needs {tuple(shape)} {dtype}")
        checked[name] = tensor
    devices = {t.device for t in checked.values()} if len(checked) > 1 else ()
    if len(devices) > 1:
        raise ReceiverParamsError(f"receiver rank {rank} parameters are spread over devices "
                                  f"{sorted(map(str, devices))}; they must share one")
    return checked


def make_receivers(spec: MoESpec, topo: ReceiverTopology, device="cpu") -> list[ReferenceReceiver]:
    """One receiver per rank of the engine, in rank order."""
    return [ReferenceReceiver(spec, topo, r, device) for r in range(topo.world_size)]
