"""Copy plans a receiver reuses across updates: a bucket validated and planned once, replayed after.

Per bucket a receiver validates every entry, plans one ``(dst, src)`` pair per expert
projection and builds a copy plan (:func:`fastcopy.plan_copies`: runs, Triton tables) - host
work per entry that, for 30,720 per-expert entries, costs far more than the copy. When an
update carries a bucket an earlier update carried - the same names, dtypes, shapes, strides,
at the same addresses - all of that comes out the same, so :class:`LoadCache` keeps it, keyed
by exactly those facts, and replays the copy plan (a CUDA graph on a GPU, captured at its
second run: no host work or gaps between launches).

Two kinds of payload:

* a :class:`~pytest_weightsync.reference_impl.sharing.shared_payload.ReceivedPayload` carries its key
  (its table and its storages' addresses determine every tensor of it exactly), so a bucket
  whose key was seen skips validation and planning altogether;
* any other payload (a list of ``(name, tensor)``: SGLang's per-tensor wire, a third party's
  list) is recognised by its signature: per entry everything a check reads - the name, the
  tensor's exact type and flags (subclass, nested, lazy neg/conj, functional and functorch
  wrappers), layout, dtype, device, shape, strides, storage offset, storage address and size -
  plus the receiver's type, spec, topology and rank. An equal signature means every check
  would come out as it did when the bucket was validated, so the validated plan is replayed
  without validating again; a different one (or an entry that is no plain ``(str, Tensor)``
  pair, which the full path words) is validated and planned in full, and its copy plan is
  still reused when every pair's addresses, shapes, strides, dtype and device are the same.
  Computing the signature is host work per entry (about a microsecond), where validating and
  planning costs tens. A list that holds the very tensor objects of the list a slot last
  validated (the same names, each tensor the same Python object) is recognised without
  building its signature (:class:`_SameTensors`): a tensor object that is still alive and
  still has the type, address, shape, strides, storage offset, dtype and device it had can
  only have changed what the signature covers through private APIs (its storage cannot
  shrink in place without moving), so its row of the signature is what it was. That check is
  a handful of C-level passes over the list, against the signature's own rows the first time
  and then with one native guard (about a tenth of the signature's time); a list of new
  objects costs nothing more than its signature. A list of the very ``(name, tensor)``
  tuples a slot last recognised is found by the tuples' identity alone (a tuple cannot
  change), so neither its names nor its slot key are read again.

What does not change: a bucket is validated before its first byte is written (a key is stored
only after its bucket passed every check); duplicates across the open update are checked
against a cached bucket's pieces on every hit, and a duplicate takes the full path, which
names it; parameters are written in place, and a cached bucket whose destination parameters
were replaced or reshaped is planned again.

Memory: an entry keeps its sources alive (a CUDA graph reads their addresses), so the cache
holds one entry per slot - a bucket's names and load format - and replaces it when the same
bucket arrives at other addresses: a sender that allocates a fresh payload each update keeps
one of them alive on each receiver, never one per update.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter, is_, itemgetter
from typing import Any, Optional

import torch

from pytest_weightsync.reference_impl.engine.tensor_checks import PLAIN_TYPES
from pytest_weightsync.reference_impl.sharing.shared_payload import plain_pairs as _pairs
from pytest_weightsync.reference_impl.sharing.tensor_guard import PTRS_EQUAL, native_metadata_guard
from pytest_weightsync.reference_impl.kernels import fastcopy

#: Buckets a receiver remembers (least recently used dropped first).
MAX_SLOTS = 256


@dataclass
class CachedBucket:
    """One validated, planned bucket: what to zero, the copy plan, and what it was keyed by."""

    addresses: Any
    plan: Any  # the receiver's LoadPlan (pairs, zero views, touched parameters, pieces)
    copy: fastcopy.CopyPlan
    params: tuple  # (name, address, shape, strides) of every parameter the bucket writes
    hits: int = 0
    signature: Any = None  # a plain list's signature (see _list_signature), once validated
    objects: Any = None  # the tensor objects of that list
    items: Any = None  # the (name, tensor) tuples of the last list recognised, objects' order
    same: Any = None  # their _SameTensors, made when those objects first come back
    check_tag: Any = None  # the caller's check the bucket passed (see LoadCache.load)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    #: What the last bucket did: "hit", "miss" (new slot) or "replan" (known slot, changed key).
    last: Optional[str] = None
    counts: dict = field(default_factory=dict)


def _param_signature(params: dict, names) -> tuple:
    out = []
    for name in sorted(names):
        t = params[name]
        out.append((name, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device))
    return tuple(out)


_NAME, _TENSOR = itemgetter(0), itemgetter(1)
_SHAPE, _DTYPE, _DEVICE = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")
_PLAIN = frozenset(PLAIN_TYPES)
@dataclass
class _SameTensors:
    """The tensor objects of a validated list, with what its signature recorded of each that
    an object can change in place (see the module docstring), read off the signature's rows
    rather than off the tensors again.

    The first :meth:`holds` compares every object with those rows in Python; once the objects
    matched them, a native guard made from the objects as they are then
    (:func:`native_metadata_guard`) stands in for the type, dtype, device, shape and stride
    comparisons, about a fifth of the Python comparison's time, and the storage offsets are not
    compared again: the objects' addresses still are, and an address is where the
    cached copy reads (an object moved to another storage at the same address reads the
    validated bytes: the entry keeps the validated storage alive, so no other allocation can
    take its address)."""

    tensors: list
    ptrs: list
    shapes: list
    strides: list
    offsets: list
    dtypes: list
    devices: list
    indices: list
    guard: Any = None

    @classmethod
    def of(cls, tensors: list, rows: tuple) -> "_SameTensors":
        """``rows``: the signature's rows of ``tensors`` (name, dtype, device, shape, strides,
        storage offset, storage address, storage bytes)."""
        return cls(tensors, [row[6] + row[5] * row[1].itemsize for row in rows],
                   [row[3] for row in rows], [row[4] for row in rows],
                   [row[5] for row in rows], [row[1] for row in rows],
                   [row[2] for row in rows], list(range(len(rows))))

    def holds(self, tensors: list) -> bool:
        """Whether ``tensors`` are these objects, each as it was."""
        if tensors is not self.tensors and (len(tensors) != len(self.tensors)
                                            or not all(map(is_, tensors, self.tensors))):
            return False
        if PTRS_EQUAL is not None:
            same_ptrs = PTRS_EQUAL(tensors, self.ptrs, self.indices)
        else:
            same_ptrs = list(map(torch.Tensor.data_ptr, tensors)) == self.ptrs
        if not same_ptrs:
            return False
        if self.guard is not None:
            return self.guard.check(*tensors)
        same = (set(map(type, tensors)) <= _PLAIN
                and list(map(torch.Tensor.storage_offset, tensors)) == self.offsets
                and list(map(_SHAPE, tensors)) == self.shapes
                and list(map(torch.Tensor.stride, tensors)) == self.strides
                and list(map(_DTYPE, tensors)) == self.dtypes
                and list(map(_DEVICE, tensors)) == self.devices)
        if same:
            self.guard = native_metadata_guard(tensors)
        return same


def _list_signature(receiver, payload) -> Optional[tuple]:
    """Everything the receiver's validation reads from a list payload, or ``None`` when an
    entry is no plain ``(str, Tensor)`` pair of a dense, unwrapped tensor (the full path then
    raises the error that names it)."""
    rows = []
    functional = torch._is_functional_tensor
    functorch = torch._C._functorch.is_functorch_wrapped_tensor
    for item in payload:
        if type(item) is not tuple or len(item) != 2:
            return None
        name, tensor = item
        if type(name) is not str or type(tensor) not in PLAIN_TYPES:
            return None
        if (tensor.is_nested or tensor.layout is not torch.strided or tensor.is_neg()
                or tensor.is_conj() or functional(tensor) or functorch(tensor)):
            return None
        storage = tensor.untyped_storage()
        rows.append((name, tensor.dtype, tensor.device, tensor.shape, tensor.stride(),
                     tensor.storage_offset(), storage.data_ptr(), storage.nbytes()))
    return (type(receiver), receiver.spec, receiver.topo, receiver.rank, tuple(rows))


def _pairs_key(plan) -> tuple:
    pairs = tuple((d.data_ptr(), s.data_ptr(), tuple(d.shape), d.stride(), s.stride(), d.dtype,
                   str(d.device), str(s.device)) for d, s in plan.pairs)
    zero = tuple((z.data_ptr(), tuple(z.shape), z.stride()) for z in plan.zero)
    return pairs, zero


def _sized(payload) -> bool:
    """A list or tuple payload (anything else goes the full path, which refuses it by name)."""
    return isinstance(payload, (list, tuple))


class LoadCache:
    """The plan cache of one :class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver`
    (``plan_cache=True``); see the module docstring."""

    def __init__(self, max_slots: int = MAX_SLOTS):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._slots: OrderedDict = OrderedDict()
        self._by_first: dict = {}  # id of a slot's first kept (name, tensor) tuple -> slot
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        """Forget every bucket (releases the sources they kept alive)."""
        self._slots.clear()
        self._by_first.clear()

    def entry(self, slot) -> Optional[CachedBucket]:
        return self._slots.get(slot)

    def load(self, receiver, payload, load_format, seen: dict, bucket: int, *, check=None,
             check_tag=None):
        """Validate (or recognise) and write one bucket; returns the receiver's LoadPlan.

        ``check(payload)`` is a caller's own check, run before planning a bucket that is not
        recognised; a recognised one skips it only when its entry passed the check under the
        same ``check_tag``. A caller's check that reads only what the signature covers (the
        registered loader's format check reads each entry's type and name) then comes out as
        it did when the entry was stored, which was only after it passed."""
        key_of = getattr(payload, "cache_key", None)
        if callable(key_of):
            table, addresses = key_of()
            slot = ("shared", load_format, table)
            entry = self._slots.get(slot)
            if (entry is not None and entry.addresses == addresses
                    and self._replayable(receiver, entry, check_tag, seen)):
                return self._hit(slot, entry, bucket)
            if check is not None:
                check(payload)
            self._store(receiver, slot, addresses, receiver.plan(payload.items(), load_format))
            self._slots[slot].check_tag = check_tag
            return self._slots[slot].plan
        if isinstance(payload, Iterator):
            payload = list(payload)
        found = self._same_pairs(payload)
        if found is not None:  # the very tuples of a list recognised before
            slot, entry = found
            if (self._same_objects(receiver, entry, entry.objects)
                    and self._replayable(receiver, entry, check_tag, seen)):
                return self._hit(slot, entry, bucket)
        names = tensors = None
        if _sized(payload) and _pairs(payload):
            names, tensors = tuple(map(_NAME, payload)), list(map(_TENSOR, payload))
            slot = ("pairs", load_format, names)
            entry = self._slots.get(slot)
            if (entry is not None and self._same_objects(receiver, entry, tensors)
                    and self._replayable(receiver, entry, check_tag, seen)):
                self._keep_items(slot, entry, payload)
                return self._hit(slot, entry, bucket)
        signature = _list_signature(receiver, payload) if names is not None else None
        if signature is not None:
            slot = ("pairs", load_format, names)
            entry = self._slots.get(slot)
            if (entry is not None and entry.signature == signature
                    and self._replayable(receiver, entry, check_tag, seen)):
                entry.objects, entry.same = tensors, None
                self._keep_items(slot, entry, payload)
                return self._hit(slot, entry, bucket)
        if check is not None:
            check(payload)
        plan = receiver.plan(payload, load_format)  # every check
        slot = ("pairs", load_format, names if names is not None
                else tuple(item[0] for item in payload))
        addresses = _pairs_key(plan)
        entry = self._slots.get(slot)
        objects = tensors if signature is not None else None
        if entry is not None and entry.addresses == addresses:
            self._hit(slot, entry, bucket)
        else:
            self._store(receiver, slot, addresses, plan)
            entry = self._slots[slot]
        entry.signature, entry.check_tag = signature, check_tag
        entry.objects, entry.same = objects, None
        self._keep_items(slot, entry, payload if objects is not None else None)
        return plan

    def _same_pairs(self, payload):
        """``(slot, entry)`` when ``payload`` (a plain list or tuple) holds the very
        ``(name, tensor)`` tuples, in order, of the list an entry last recognised: a tuple
        cannot change, so its names and tensor objects are the ones recognised, and only what
        a tensor object can change in place is left to compare (:meth:`_same_objects`). The
        entry keeps those tuples alive, so an id found here is not one reused by another."""
        if (type(payload) is not list and type(payload) is not tuple) or not payload:
            return None
        slot = self._by_first.get(id(payload[0]))
        entry = self._slots.get(slot) if slot is not None else None
        if (entry is None or entry.items is None or len(entry.items) != len(payload)
                or not all(map(is_, payload, entry.items))):
            return None
        return slot, entry

    def _keep_items(self, slot, entry: CachedBucket, payload) -> None:
        """Remember the tuples of ``payload``, the list ``entry.objects`` were read from (a
        list of plain ``(name, tensor)`` tuples), or forget them (``None``)."""
        entry.items = list(payload) if payload else None
        if entry.items:
            self._by_first[id(entry.items[0])] = slot
            if len(self._by_first) > 2 * self.max_slots:  # drop ids of replaced tuples
                self._by_first = {id(e.items[0]): s for s, e in self._slots.items() if e.items}

    @staticmethod
    def _same_objects(receiver, entry: CachedBucket, tensors: list) -> bool:
        """Whether ``tensors`` are the very objects of the list ``entry`` validated, each as it
        was then, offered to a receiver like that one (see :class:`_SameTensors`)."""
        if entry.objects is None or not (
                type(receiver) is entry.signature[0]
                and entry.signature[1:4] == (receiver.spec, receiver.topo, receiver.rank)):
            return False
        if entry.same is None:
            if len(tensors) != len(entry.objects) or not all(map(is_, tensors, entry.objects)):
                return False
            entry.same = _SameTensors.of(entry.objects, entry.signature[-1])
        return entry.same.holds(tensors)

    def _usable(self, receiver, entry: CachedBucket) -> bool:
        return entry.params == _param_signature(receiver.params, entry.plan.touched)

    def _replayable(self, receiver, entry: CachedBucket, check_tag, seen: dict) -> bool:
        """Whether a recognised bucket may be replayed here: it passed the caller's check under
        ``check_tag``, the parameters it writes are where they were, and no piece of it came
        already in the open update (a duplicate takes the full path, which names it) - known
        without hashing its pieces when the receiver says the update so far repeats its last
        complete one and this is that one's next plan (``follows_last_update``)."""
        if entry.check_tag != check_tag or not self._usable(receiver, entry):
            return False
        if not seen:
            return True
        follows = getattr(receiver, "follows_last_update", None)  # a receiver's memo, if any
        return ((follows is not None and follows(entry.plan))
                or seen.keys().isdisjoint(entry.plan.units))

    def _run(self, entry: CachedBucket) -> None:
        with torch.no_grad():
            for view in entry.plan.zero:
                view.zero_()
            entry.copy.run()

    def _hit(self, slot, entry: CachedBucket, bucket: int):
        self._slots.move_to_end(slot)
        self._run(entry)
        entry.hits += 1
        self._count("hit")
        plan = entry.plan
        sample = next(iter(plan.units.values()), None)
        if sample is not None and sample[0] != bucket:  # the pieces say which bucket carried them
            plan = replace(plan, units={u: (bucket, i, n) for u, (_, i, n) in plan.units.items()})
            entry.plan = plan
        return plan

    def _store(self, receiver, slot, addresses, plan):
        copy = fastcopy.plan_copies(plan.pairs)  # validates the pairs before anything is written
        entry = CachedBucket(addresses, plan, copy, _param_signature(receiver.params, plan.touched))
        known = self._slots.pop(slot, None) is not None  # the old entry's sources are released
        self._run(entry)
        self._slots[slot] = entry
        while len(self._slots) > self.max_slots:
            self._slots.popitem(last=False)
        self._count("replan" if known else "miss")
        return plan

    def _count(self, what: str) -> None:
        self.stats.last = what
        self.stats.counts[what] = self.stats.counts.get(what, 0) + 1
        if what == "hit":
            self.stats.hits += 1
        else:
            self.stats.misses += 1
