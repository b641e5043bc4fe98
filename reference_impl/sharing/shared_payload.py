"""A payload shared once per model: one IPC handle per storage, its table of entries built once.

SGLang's wire format (:func:`pytest_weightsync.reference_impl.sharing.ipc.serialize`) pickles every
tensor on its own, and every update again: per tensor torch shares its storage (a new
reference-counter slot and a new CUDA event, kept inside the storage's data pointer for as
long as the storage lives) and the receiver rebuilds it. For a payload made of the same
tensors every update - views of the trainer's parameters (:mod:`zerocopy`) or staging buffers
the sender reuses - that per-entry work is the cost of the update: 30,720 per-expert entries
for the experts of Qwen3.5-35B-A3B.

:class:`SharedPayload` is built once from a ``[(name, tensor), ...]`` payload: the distinct
storages its tensors live in (one per trainer buffer) and a table - name, storage, dtype,
offset, shape and strides of every entry - pickled once. :meth:`SharedPayload.serialize`
shares each storage and embeds the table's bytes. The receiver gets a :class:`ReceivedPayload`:
the storages rebuilt (CUDA IPC handles opened, or shared memory mapped, once), the tensors made
from the table when first asked for, and :meth:`ReceivedPayload.cache_key`: the table and the
storages' addresses, which determine every tensor exactly - what the receiver's plan cache
(:mod:`plan_cache`) keys a validated, planned bucket by.

A receiver that keeps a :class:`ReceivedPayload` keeps the mappings open, so a payload
registered once (``ReceiverProcess.register``) is updated every step with a message of a few
bytes and no IPC work at all; the trainer must then have finished writing before it sends
that message (:meth:`SharedPayload.ready` synchronizes its streams), since no CUDA event
travels with it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import operator
import pickle
from typing import Iterable, Optional

import torch

from pytest_weightsync.reference_impl.errors import WeightSyncError, shown
from pytest_weightsync.reference_impl.sharing import known_tables


class SharedPayloadError(WeightSyncError):
    """A payload that cannot be shared as one (an entry that is no (name, tensor) pair, a
    tensor that requires grad, a sparse or conjugated tensor), or a table that does not fit
    the storages it came with."""


_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NAME = operator.itemgetter(0)
_TENSOR = operator.itemgetter(1)


def plain_pairs(items) -> bool:
    """Whether every entry of a sized payload is a plain 2-tuple, read in C: the bulk test
    both a sender's table and a receiver's plan cache take before their per-entry paths."""
    return set(map(type, items)) <= {tuple} and set(map(len, items)) <= {2}


def _check_items(items: list, pairs: bool) -> None:
    """Refuse anything but ``(str, dense tensor without grad or lazy bits)`` pairs, naming the
    first bad entry; the common all-good case is checked in bulk, in C (``pairs``: what
    :func:`plain_pairs` said of ``items``)."""
    if (pairs and set(map(type, map(_NAME, items))) <= {str}
            and all(map(isinstance, map(_TENSOR, items), itertools.repeat(torch.Tensor)))):
        tensors = list(map(_TENSOR, items))
        if (not any(map(operator.attrgetter("requires_grad"), tensors))
                and set(map(operator.attrgetter("layout"), tensors)) <= {torch.strided}
                and not any(map(torch.Tensor.is_conj, tensors))
                and not any(map(torch.Tensor.is_neg, tensors))):
            return
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise SharedPayloadError(f"payload entry {i} is not a (name, tensor) pair: "
                                     f"{item!r:.80}")
        name, tensor = item
        if tensor.requires_grad:
            raise SharedPayloadError(f"payload entry {i} {shown(name)} requires grad; "
                                     f"share tensor.detach()")
        if tensor.layout != torch.strided or tensor.is_conj() or tensor.is_neg():
            raise SharedPayloadError(f"payload entry {i} {shown(name)}: only dense tensors "
                                     f"without lazy conjugate/negative bits can be shared")


def wait_for_writes(devices: Iterable) -> None:
    """Wait until every write queued on the current stream of each CUDA device among
    ``devices`` is done (other devices have nothing queued)."""
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class SharedPayload:
    """Sender side: a payload's storages and table, built once (see the module docstring).

    The tensors must keep their storages and places while the payload is in use (a trainer
    that updates its parameters in place does); the payload holds their storages alive."""

    def __init__(self, named_tensors: Iterable):
        items = list(named_tensors)
        pairs = plain_pairs(items)
        if pairs:
            names, tensors = list(map(_NAME, items)), list(map(_TENSOR, items))
            known = known_tables.recall(names, tensors)
            if known is not None:  # tabled before: only the storages are taken again
                self._adopt(known, tensors)
                return
        _check_items(items, pairs)
        if not pairs:  # (str, tensor) pairs of a tuple subclass passed the check
            names, tensors = list(map(_NAME, items)), list(map(_TENSOR, items))
        # Every attribute of every entry read in C, one ``map`` per attribute: a payload built
        # every update (a stateless sender's 768 per-expert views per layer) costs per entry
        # what a few dict lookups cost, not a Python frame per attribute.
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        ptrs = list(map(torch.UntypedStorage.data_ptr, storages))
        sizes = list(map(torch.UntypedStorage.nbytes, storages))
        devices = list(map(_DEVICE, tensors))
        names_of = {device: str(device) for device in set(devices)}
        keys = list(zip(devices, ptrs))
        wholes, index = [], {}
        # Distinct storages in order of first use (a dict keeps its keys' first order).
        for key, (storage, size) in dict(zip(keys, zip(storages, sizes))).items():
            if size:
                index[key] = len(wholes)
                whole = torch.empty(0, dtype=torch.uint8, device=key[0])
                wholes.append(whole.set_(storage, 0, (size,), (1,)))
        if 0 in sizes:  # an empty tensor has no storage to share
            slots = [index[key] if size else -1 for key, size in zip(keys, sizes)]
        else:
            slots = list(map(index.__getitem__, keys))
        rows = tuple(zip(slots, map(_DTYPE, tensors), [names_of[d] for d in devices],
                         map(torch.Tensor.storage_offset, tensors), map(tuple, map(_SHAPE, tensors)),
                         map(torch.Tensor.stride, tensors)))
        self.wholes = wholes
        self.entries = len(names)
        self.nbytes = sum(map(operator.attrgetter("nbytes"), tensors))
        #: The table, pickled once: the same bytes go out with every serialization.
        self.table = pickle.dumps((tuple(names), rows), protocol=pickle.HIGHEST_PROTOCOL)
        firsts = dict(zip(reversed(slots), range(len(slots) - 1, -1, -1)))  # first use of each
        known_tables.remember(names, tensors, [row[3] for row in rows],
                              [firsts[i] for i in range(len(wholes))],
                              [w.untyped_storage().data_ptr() for w in wholes],
                              [w.numel() for w in wholes], self.table, self.nbytes)

    def _adopt(self, known, tensors: list) -> None:
        """This payload from a table built before for entries with every fact of these
        (:func:`known_tables.recall`): the same table bytes, the storages taken again."""
        wholes = []
        for first, size in zip(known.firsts, known.storage_sizes):
            tensor = tensors[first]
            whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            wholes.append(whole.set_(tensor.untyped_storage(), 0, (size,), (1,)))
        self.wholes, self.entries, self.nbytes = wholes, len(tensors), known.nbytes
        self.table = known.table

    @property
    def storages(self) -> int:
        return len(self.wholes)

    def ready(self) -> None:
        """Wait until every write queued on the payload's GPUs is done: a receiver that kept
        its mappings may read as soon as it hears from the trainer."""
        wait_for_writes(w.device for w in self.wholes)

    def serialize(self, wait: bool = True) -> bytes:
        """The payload as bytes holding one handle per storage and the table (call once per
        receiver rank and message: torch's reference counting is per serialization).

        Every queued write is waited for first (:meth:`ready`); the shares are then made on a
        side stream, so the CUDA event torch records per share lands there, not on the
        trainer's stream: while an engine's copy holds the GPU, a record on the trainer's
        stream would not run until the engine's time slice ends, and the next wait for that
        stream (the next bucket's :meth:`ready`) would wait for it - 12 ms per update of 8
        buckets on an H200 (2026-12-03). The receiver is told not to wait for that event
        (``ipc._reduce_storage``): the wait above, or the sender's own interprocess event,
        orders its reads. ``wait=False`` skips that wait, for a sender that orders the
        receiver's reads after its writes itself (an interprocess event the receiver's stream
        waits for: :mod:`~pytest_weightsync.reference_impl.sharing.ipc_events`)."""
        from pytest_weightsync.reference_impl.sharing import ipc

        if wait:
            self.ready()
        buf = io.BytesIO()
        with _side_streams(self.wholes):
            wire = _Wire(self.wholes, self.table, self.entries, self.nbytes)
            ipc.tensor_pickler(buf, storages=True).dump(wire)
        return buf.getvalue()


def serialize_storages(named_tensors) -> bytes:
    """One receiver rank's payload ``[(name, tensor), ...]`` as bytes holding one handle per
    distinct storage (not per tensor, as :func:`ipc.serialize` does) and a table of the
    entries: a :class:`SharedPayload` built for this one message. It unpickles
    (``ipc.deserialize``) into a :class:`ReceivedPayload`, a sequence of ``(name, tensor)``
    whose :meth:`~ReceivedPayload.cache_key` lets a receiver recognise a bucket it validated
    before without rebuilding or checking its tensors. 30,720 per-expert views of 80 trainer
    buffers are 80 shares instead of 30,720; the table still costs host time per entry - a
    sender whose payload does not change between updates builds the ``SharedPayload`` once and
    calls its ``serialize()`` per update (host work per storage only).

    The caller must keep the tensors alive (and unmodified) until the receiver has loaded
    them; queued writes to them are waited for before the handles are made."""
    return SharedPayload(named_tensors).serialize()


#: One side stream per GPU index for the shares of :meth:`SharedPayload.serialize`.
_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def _side_streams(wholes):
    """Each CUDA device's side stream current while the shares are made. Switched through
    torch's own setter, not ``torch.cuda.stream()``: that context manager resolves the
    device and builds stream objects in Python, 17 us per switch on an H100 host against 2
    for the setter (2026-12-07), once per rank and bucket on the update's critical thread."""
    devices = {w.device for w in wholes if w.is_cuda}
    if not devices:
        yield
        return
    get, put = torch._C._cuda_getCurrentStream, torch._C._cuda_setStream
    here = torch.cuda.current_device()
    before = []
    try:
        for device in devices:
            index = here if device.index is None else device.index
            stream = _SIDE_STREAMS.get(index)
            if stream is None:
                stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
            before.append(get(index))
            put(stream_id=stream.stream_id, device_index=stream.device_index,
                device_type=stream.device_type)
        yield
    finally:
        for stream_id, index, device_type in reversed(before):
            put(stream_id=stream_id, device_index=index, device_type=device_type)
        if torch.cuda.current_device() != here:  # the setter also selects the stream's device
            torch.cuda.set_device(here)


class _Wire:
    """What travels: the storages (as whole-storage byte tensors) and the table."""

    def __init__(self, wholes, table, entries, nbytes):
        self.args = (list(wholes), table, entries, nbytes)

    def __reduce__(self):
        return (_received, self.args)


def _received(wholes, table, entries, nbytes) -> "ReceivedPayload":
    return ReceivedPayload(wholes, table, entries, nbytes)


class ReceivedPayload:
    """Receiver side: a sequence of ``(name, tensor)`` whose tensors are views of the shared
    storages, made from the table on first use; :meth:`cache_key` without making them."""

    def __init__(self, wholes, table: bytes, entries: int, nbytes: int):
        self.wholes = list(wholes)
        self.table = table
        self.entries = entries
        self.nbytes = nbytes
        self._items: Optional[list] = None

    def cache_key(self) -> tuple:
        """``(table bytes, storage addresses)``: equal keys mean tensor for tensor the same
        names, dtypes, devices, shapes, strides and addresses."""
        return (self.table, tuple((str(w.device), w.data_ptr(), w.numel()) for w in self.wholes))

    @property
    def devices(self) -> set:
        return {w.device for w in self.wholes}

    def items(self) -> list:
        if self._items is None:
            self._items = self._build()
        return self._items

    def _build(self) -> list:
        try:
            names, rows = pickle.loads(self.table)
        except Exception as exc:
            raise SharedPayloadError(f"unreadable payload table: {type(exc).__name__}: {exc}") from exc
        items = []
        for name, (slot, dtype, device, offset, shape, stride) in zip(names, rows):
            if slot < 0:  # an empty tensor has no storage to share
                where = self.wholes[0].device if self.wholes else device
                items.append((name, torch.empty_strided(shape, stride, dtype=dtype, device=where)))
                continue
            whole = self.wholes[slot]
            try:
                tensor = torch.empty(0, dtype=dtype, device=whole.device).set_(
                    whole.untyped_storage(), offset, shape, stride)
            except RuntimeError as exc:
                raise SharedPayloadError(f"payload entry {shown(name)} does not fit its shared "
                                         f"storage: {exc}") from exc
            items.append((name, tensor))
        return items

    def __iter__(self):
        return iter(self.items())

    def __len__(self) -> int:
        return self.entries

    def __getitem__(self, index):
        return self.items()[index]

    def release(self) -> None:
        """Drop the tensors and storages (closes the mappings once nothing else holds them)."""
        self._items = None
        self.wholes = []
