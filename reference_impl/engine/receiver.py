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
  any strides; copied whole (SGLang's ``default_weight_loader``: the shape checked, then
  ``param.copy_``).

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

This module is the placement; the entry checks and payload errors every receiver shares are
in :mod:`~pytest_weightsync.reference_impl.engine.payload_checks` and the records of a planned
bucket and an open update in :mod:`~pytest_weightsync.reference_impl.engine.load_plan`, both
re-exported here.
"""

from __future__ import annotations

import bisect
import functools
from typing import Iterable, Mapping, Optional

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
# The entry checks, payload errors and update records every receiver shares, re-exported so
# every payload error of the receiver is reachable from this module.
from pytest_weightsync.reference_impl.engine.load_plan import LoadPlan, UpdateState
from pytest_weightsync.reference_impl.engine.payload_checks import (
    CHECKED,
    DuplicateEntryError,
    ExpertOutOfRangeError,
    LazyViewError,
    MemoryOverlapError,
    MixedFormatError,
    NestedTensorError,
    PayloadDtypeError,
    PayloadShapeError,
    PayloadTypeError,
    ReceiverParamsError,
    TensorLayoutError,
    TensorStorageError,
    TensorSubclassError,
    UnknownNameError,
    UnloadableTensorError,
    checked_params,
    entry_fits,
    entry_pair,
    entry_readable_on,
    extent,
)
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


class IncompleteUpdateError(WeightSyncError):
    """``end_update`` found an update that did not carry every piece, or no update was open."""


class MissingExpertError(IncompleteUpdateError):
    """``end_update``: (layer, expert, projection) pieces this rank owns that no bucket of the
    update carried; they still hold the previous version."""


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
        #: ``(owed, [weakref to each plan, in order])`` of the last update whose buckets'
        #: plans together carried every piece this rank owes (see :meth:`end_update`).
        self._covered_by: Optional[tuple] = None
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
        if update.covered(owed) or self._covered_as_before(update, owed):
            return
        if owed <= update.seen.keys():
            if update.carried and update.offered == len(update.carried):
                self._covered_by = (owed, list(update.carried))
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

    def _repeated_plans(self, update: Optional[UpdateState]) -> Optional[list]:
        """The last complete update's plans (weak references, in order) when ``update``'s
        buckets so far were, plan for plan, its first ones: the same plan objects (a plan
        cache's, replayed), alive, in the same order, and nothing else offered - then their
        pieces are the same too. ``None`` otherwise."""
        memo = self._covered_by
        if memo is None or update is None or update.offered != len(update.carried):
            return None
        before, carried = memo[1], update.carried
        if len(carried) > len(before) or not all(
                old() is not None and old() is new() for old, new in zip(before, carried)):
            return None
        return before

    def _covered_as_before(self, update: UpdateState, owed: frozenset) -> bool:
        """Whether this update's buckets were, plan for plan, all those of the last update
        that carried every owed piece (:meth:`_repeated_plans`): the comparison of every owed
        piece with every piece seen (0.4-1.2 ms for 6,144 pieces, at the end of every update,
        before the last bucket is answered) is then not made again."""
        before = self._repeated_plans(update)
        return (before is not None and self._covered_by[0] is owed
                and len(before) == len(update.carried))

    def follows_last_update(self, plan: LoadPlan) -> bool:
        """Whether the open update's buckets so far were, plan for plan, the first ones of the
        last complete update (:meth:`_repeated_plans`) and ``plan`` is that update's next: its
        pieces then came in none of them, as in that update, where every bucket's pieces were
        checked against the ones before. The plan cache then replays it without hashing each
        of its pieces against the update's."""
        update = self._update
        before = self._repeated_plans(update)
        return (before is not None and len(update.carried) < len(before)
                and before[len(update.carried)]() is plan)

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
        self._place(plan, name, self.params[name][slot], 0, self._half_offset(projection),
                    self._tp_rows(full, 0))

    def _write_w2(self, plan: LoadPlan, layer: int, slot: int, full: torch.Tensor) -> None:
        name = fused_name(layer, "w2")
        self._place(plan, name, self.params[name][slot], 1, 0, self._tp_rows(full, 1))

    def _place(self, plan: LoadPlan, name: str, dst: torch.Tensor, dim: int, off: int,
               rows_of: torch.Tensor) -> None:
        """``rows_of`` (this rank's MoE-TP rows) into ``dst``'s rows ``[off, off + rows)``
        along ``dim``, the buffer's padding after them zeroed: one slot or a span of them."""
        buf, rows = self.shard.buffer_rows, self.shard.rows
        plan.pairs.append((dst.narrow(dim, off, rows), rows_of))
        if buf > rows:
            plan.zero.append(dst.narrow(dim, off + rows, buf - rows))
        plan.touched.add(name)

    def _plan_per_expert(self, plan: LoadPlan, parsed, tensor) -> None:
        slot = self._local_slot(parsed.expert)
        if slot is None:
            plan.ignored += 1
        elif parsed.projection == "down":
            self._write_w2(plan, parsed.layer, slot, tensor)
        else:
            self._write_w13(plan, parsed.layer, slot, parsed.projection, tensor)

    def _expert_span(self, layer: int) -> Optional[tuple[int, int]]:
        """``(first expert, count)`` when an all-expert tensor's experts of ``layer`` go to slots
        ``0..count-1`` in order through this class's own placement (:data:`_PLACEMENT`): one
        strided pair per projection half then writes what a pair per expert would, so a fresh
        payload is planned in a few pairs instead of 768 per layer."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(ReferenceReceiver, name) for name in _PLACEMENT):
            return None
        slots = self._planned_slots(layer)
        if not slots:
            return None
        start, count = slots[0][0], len(slots)
        return (start, count) if slots == [(start + k, k) for k in range(count)] else None

    def _plan_span(self, plan: LoadPlan, parsed, tensor, span, gate_start: int) -> None:
        """An all-expert tensor into slots ``0..count-1`` at once (:meth:`_expert_span`);
        ``gate_start``: where gate's rows start in each expert. One whole pair where the rank
        holds every row in the tensor's order (a contiguous copy), else a strided pair per half."""
        size, count = self.spec.intermediate, span[1]
        chosen = tensor[span[0]:span[0] + count]
        if parsed.projection in ("w2", "down"):
            return self._write_span(plan, parsed.layer, count, "down", chosen)
        if self.shard.rows == self.shard.buffer_rows == size and self._half_offset("gate") == gate_start:
            name = fused_name(parsed.layer, "w13")
            plan.pairs.append((self.params[name][:count], chosen))
            return plan.touched.add(name)
        for projection, start in (("gate", gate_start), ("up", size - gate_start)):
            self._write_span(plan, parsed.layer, count, projection, chosen.narrow(1, start, size))

    def _write_span(self, plan: LoadPlan, layer: int, count: int, projection: str,
                    full: torch.Tensor) -> None:
        """:meth:`_write_w13` / :meth:`_write_w2` for slots ``0..count-1`` at once (``full``:
        their experts' full ``projection``, ``[count, I, H]`` or ``[count, H, I]``)."""
        down = projection == "down"
        name, dim = fused_name(layer, "w2" if down else "w13"), 2 if down else 1
        self._place(plan, name, self.params[name][:count], dim,
                    0 if down else self._half_offset(projection), self._tp_rows(full, dim))

    def _plan_packed(self, plan: LoadPlan, parsed, tensor) -> None:
        """Receiver-order halves: ``w13[e]`` is ``[first; second]`` of ``self.topo.order``."""
        size = self.spec.intermediate
        first, _ = gate_up_halves(self.topo.order)
        span = self._expert_span(parsed.layer)
        if span is not None:
            return self._plan_span(plan, parsed, tensor, span, 0 if first == "gate" else size)
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
        span = self._expert_span(parsed.layer)
        if span is not None:
            return self._plan_span(plan, parsed, tensor, span, 0)
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
            span = extent(self.params[name])
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
            src = extent(tensor)
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


#: What places an all-expert tensor's experts, slots and rows: a subclass overriding any of
#: them (EPLB, a loader variant) is planned one expert at a time through its own methods.
_PLACEMENT = ("_write_w13", "_write_w2", "_planned_slots", "_local_slot", "_tp_rows",
              "_half_offset", "_plan_packed", "_plan_hf_fused")


def make_receivers(spec: MoESpec, topo: ReceiverTopology, device="cpu") -> list[ReferenceReceiver]:
    """One receiver per rank of the engine, in rank order."""
    return [ReferenceReceiver(spec, topo, r, device) for r in range(topo.world_size)]
