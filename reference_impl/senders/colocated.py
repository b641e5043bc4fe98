"""A colocated sync with everything that does not change built once per model.

What SGLang's ``update_weights_from_tensor`` path does every update - export (a staging copy
of every fused tensor), serialize (one IPC share per tensor), and in the engine deserialize,
validate and plan every entry before the first copy - comes out the same every update when
the trainer updates its weights in place. Measured on one H200 for 8 Qwen3.5-35B-A3B layers
(2026-12-01) that work cost 25 to 170 times the copy itself. Here it is done once:

* :class:`ColocatedSender` builds, per bucket and receiver rank, the payload from
  :func:`senders.layer_payload`: views of the trainer's memory where it already has the
  payload's layout (no staging copy: :mod:`zerocopy`), otherwise staging tensors in one arena
  that every bucket reuses (at most ``staging_bytes``), refreshed each update by a copy plan
  built once (a CUDA graph from its second run); and one
  :class:`~pytest_weightsync.reference_impl.sharing.shared_payload.SharedPayload` each (one IPC
  handle per storage, the table of entries pickled once);
* :class:`ColocatedSync` registers those payloads once with each engine rank
  (:meth:`ReceiverProcess.register`: mappings opened once) and per update stages what needs
  staging, waits for the device, and has every rank load its registered buckets: the
  receiver's plan cache (:mod:`plan_cache`) recognises each bucket by its table and addresses
  and replays its copy plan.

The same sender also drives SGLang's per-update protocol (``ColocatedSync(...,
per_update=True)``): nothing is registered, and every update sends each rank, per bucket,
freshly serialized bytes - every storage shared again (a new IPC handle, reference-counter slot
and CUDA event, as ``update_weights_from_tensor`` does), with the bucket's table, which does not
change, pickled once - and the engine rebuilds the payload, recognises it by its table and
addresses (the plan cache keeps the previous payload's storages alive, so reopening a handle
finds the same mapping), replays the validated plan and drops the payload. Host work per update
is then per storage (two per layer), not per entry.

A staged bucket is refilled only after every rank has answered for the previous one (one
arena, reused), so a sender never overwrites memory a receiver still reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch

from pytest_weightsync.reference_impl.kernels import fastcopy
from pytest_weightsync.reference_impl.senders import answers, formats as senders
from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.model.moe_spec import layer_device
from pytest_weightsync.reference_impl.sharing.shared_payload import SharedPayload, wait_for_writes

#: Alignment of staging tensors inside the arena (bytes): whole 16-byte vectors and cache lines.
ALIGN = 512


class StagingBudgetError(WeightSyncError):
    """One layer's staging tensors do not fit the staging budget."""


@dataclass
class Bucket:
    """Layers sent together: per receiver rank the payload (``entries``) and its shared form,
    the pairs that refill its staging tensors (``pairs``, planned once as ``plan``) and the
    staging views to zero first (padding)."""

    layers: list
    entries: dict
    shared: dict
    pairs: list
    plan: Optional[fastcopy.CopyPlan]
    zero: list
    staged_bytes: int
    arena: int = 0


class _Arena:
    """Staging tensors carved out of one buffer; every bucket starts again at offset 0."""

    def __init__(self, nbytes: int, device):
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.offset = 0
        self.zero: list = []

    def reset(self) -> None:
        self.offset = 0
        self.zero = []

    def __call__(self, shape, dtype, device, zero: bool) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = _aligned(self.offset)
        if start + nbytes > self.buffer.numel():
            raise StagingBudgetError(f"staging arena of {self.buffer.numel()} B exhausted")
        self.offset = start + nbytes
        view = self.buffer[start:start + nbytes].view(dtype).view(tuple(shape))
        if zero:
            self.zero.append(view)
        return view


def _measuring_alloc(sizes: list):
    def alloc(shape, dtype, device, zero):
        t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        sizes.append(t.numel() * t.element_size())
        return t
    return alloc


def _receivers(receivers, world_size: int) -> tuple:
    """The receiver ranks a sender feeds: every rank, or distinct ranks of the topology."""
    if receivers is None:
        return tuple(range(world_size))
    try:
        chosen = tuple(receivers)
    except TypeError:
        chosen = None
    if (not chosen or any(isinstance(r, bool) or not isinstance(r, int) for r in chosen)
            or len(set(chosen)) != len(chosen) or not all(0 <= r < world_size for r in chosen)):
        raise WeightSyncError(f"receivers must be distinct receiver ranks in [0, {world_size}), "
                              f"at least one, got {receivers!r}")
    return chosen


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _aligned_total(sizes: Iterable[int]) -> int:
    """Bytes of consecutive arena allocations of ``sizes``, each starting aligned."""
    total = 0
    for n in sizes:
        total = _aligned(total) + n
    return total


class ColocatedSender:
    """The trainer side, built once per model (see the module docstring).

    ``full``: the trainer's expert weights (``{layer: (ExpertWeights, ...)}``), updated in
    place between updates. ``staging_bytes``: the most staging memory to hold at once (None:
    every bucket's staging at once, i.e. one bucket); layers are grouped into buckets that fit
    it, a layer alone too big for it is an error. When the staging takes several buckets and
    a layer fits half the budget, the buckets alternate between two arenas of half the budget
    each, so :class:`ColocatedSync` stages one bucket while the engines read the previous.
    ``bucket_bytes``: the most payload bytes one rank gets in one bucket (None: no limit), what
    a real sender's bucket size (slime's ``update_weight_buffer_size``) is; a layer is never
    split, a layer alone larger than the limit is a bucket of its own. Several buckets let the
    engine copy one while the next is prepared and sent (:class:`ColocatedSync`).
    ``bucket_ramp``: the first bucket holds one layer and each next one at most twice the
    previous one's payload (up to ``bucket_bytes``), so the device starts copying after one
    layer's host work instead of a whole bucket's, and each bucket's host work fits under the
    previous bucket's copy.
    ``receivers``: the receiver ranks this sender feeds (None: every rank), in the order of
    :class:`ColocatedSync`'s engines - a colocated trainer rank sends its own GPU's engine rank
    only, building (and staging) nothing for the others."""

    def __init__(self, fmt: str, spec, topo, full: Mapping[int, Sequence], *,
                 layers: Optional[Iterable[int]] = None, staging_bytes: Optional[int] = None,
                 device=None, bucket_bytes: Optional[int] = None, bucket_ramp: bool = False,
                 receivers: Optional[Iterable[int]] = None):
        senders.check_format(fmt)
        self.fmt, self.spec, self.topo = fmt, spec, topo
        self.load_format = "direct" if fmt == "direct" else None
        self.receivers = _receivers(receivers, topo.world_size)
        self._one_payload = senders.rank_independent(fmt)  # every rank gets payload 0
        self.ranks = (0,) if self._one_payload else self.receivers
        layers = sorted(full) if layers is None else list(layers)
        if not layers:
            raise WeightSyncError("ColocatedSender needs at least one layer")
        device = torch.device(device) if device is not None else layer_device(full[layers[0]])
        self.device = device
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool)
                                         or not isinstance(bucket_bytes, int) or bucket_bytes < 0):
            raise WeightSyncError(f"bucket_bytes must be None or an int >= 0, got {bucket_bytes!r}")
        need, carried = {}, {}
        for layer in layers:
            sizes: list = []
            most = 0
            for rank in self.ranks:
                entries, _ = senders.layer_payload(fmt, spec, topo, rank, full, layer,
                                                   _measuring_alloc(sizes))
                most = max(most, sum(t.numel() * t.element_size() for _, t in entries))
            need[layer], carried[layer] = _aligned_total(sizes), most
        if not isinstance(bucket_ramp, bool):
            raise WeightSyncError(f"bucket_ramp must be a bool, got {bucket_ramp!r}")
        limits = (carried, bucket_bytes, bucket_ramp)
        groups = self._group(layers, need, staging_bytes, limits)
        count = 1
        if staging_bytes is not None and len(groups) > 1 and any(need.values()):
            try:  # two arenas of half the budget each: bucket b + 1 is staged while b is read
                groups, count = self._group(layers, need, staging_bytes // 2, limits), 2
            except StagingBudgetError:
                pass
        sizes = [0] * count
        for index, group in enumerate(groups):
            used = 0
            for layer in group:  # the arena's allocations, layer after layer (see _Arena)
                used = _aligned(used) + need[layer]
            sizes[index % count] = max(sizes[index % count], used)
        self.arenas = [_Arena(n, device) for n in sizes]
        self.buckets = [self._bucket(group, full, index % count) for index, group in enumerate(groups)]

    @staticmethod
    def _group(layers, need, budget, limits=({}, None, False)) -> list:
        """Consecutive layers whose staging fits ``budget`` (None: any) and whose payload per
        rank fits ``limits`` = (bytes per layer, the most per bucket or None, ramp: the first
        bucket one layer, each next at most twice the previous's payload)."""
        carried, ceiling, ramp = limits
        if budget is None and ceiling is None and not ramp:
            return [list(layers)]
        most = ceiling
        if ramp and layers:
            most = max(1, carried.get(layers[0], 0))  # the first bucket: one layer
        groups, current, used, size = [], [], 0, 0
        for layer in layers:
            if budget is not None and need[layer] > budget:
                raise StagingBudgetError(
                    f"layer {layer} needs {need[layer]} B of staging tensors, more than "
                    f"staging_bytes={budget}: raise the budget (a layer is never split)")
            start = _aligned(used)
            full = budget is not None and start + need[layer] > budget
            full = full or (most is not None and size + carried[layer] > most)
            if current and full:
                groups.append(current)
                if ramp:
                    most = size * 2 if ceiling is None else min(ceiling, size * 2)
                current, start, size = [], 0, 0
            current.append(layer)
            used = start + need[layer]
            size += carried.get(layer, 0)
        groups.append(current)
        return groups

    def _bucket(self, layers, full, arena_index: int) -> Bucket:
        arena = self.arenas[arena_index]
        arena.reset()
        entries = {rank: [] for rank in self.ranks}
        pairs: list = []
        for layer in layers:
            for rank in self.ranks:
                layer_entries, layer_pairs = senders.layer_payload(
                    self.fmt, self.spec, self.topo, rank, full, layer, arena)
                entries[rank].extend(layer_entries)
                pairs.extend(layer_pairs)
        plan = fastcopy.plan_copies(pairs) if pairs else None
        staged = sum(d.numel() * d.element_size() for d, _ in pairs)
        shared = {rank: SharedPayload(entries[rank]) for rank in self.ranks}
        return Bucket(list(layers), entries, shared, pairs, plan, list(arena.zero), staged,
                      arena_index)

    # -- per update -----------------------------------------------------------------------

    def stage(self, index: int, *, after=(), signal=None) -> None:
        """Refill bucket ``index``'s staging tensors from the trainer's current weights (a
        no-op for a bucket of views) and wait until the device has written them.

        With ``signal`` (a CUDA event) nothing is waited for on the host: the refill is
        queued after the events in ``after`` (the engines' copies that last read this arena)
        and ``signal`` is recorded after it, for the engines' streams to wait for."""
        bucket = self.buckets[index]
        stream = torch.cuda.current_stream(self.device) if signal is not None else None
        for event in after:
            stream.wait_event(event)
        with torch.no_grad():
            for view in bucket.zero:
                view.zero_()
            if bucket.plan is not None:
                bucket.plan.run()
        if signal is not None:
            signal.record(stream)
            return
        # Once per device, not per rank: the ranks' payloads share the trainer's streams.
        wait_for_writes({w.device for shared in bucket.shared.values() for w in shared.wholes})

    def payload(self, index: int, rank: int) -> list:
        """Bucket ``index`` for receiver ``rank`` as ``[(name, tensor), ...]``."""
        return self.buckets[index].entries[self._rank(rank)]

    def serialize(self, index: int, rank: int, *, wait: bool = True) -> bytes:
        """Bucket ``index`` for receiver ``rank``, serialized for registration or for one
        update of the per-update protocol (one serialization per engine rank and message:
        torch counts references per serialization): one IPC share per storage, the table
        pickled once. ``wait=False``: queued writes are not waited for (an event the engine
        waits for on the device orders them)."""
        return self.buckets[index].shared[self._rank(rank)].serialize(wait=wait)

    def _rank(self, rank: int) -> int:
        if rank not in self.receivers:
            raise WeightSyncError(f"this sender feeds receiver rank(s) {list(self.receivers)}, "
                                  f"not {rank!r}")
        return 0 if self._one_payload else rank

    @property
    def staged_bytes(self) -> int:
        """Bytes the sender copies per update (0: every payload tensor is a view)."""
        return sum(b.staged_bytes for b in self.buckets)

    @property
    def entries(self) -> int:
        return sum(len(b.entries[r]) for b in self.buckets for r in b.entries)


@dataclass
class SyncTiming:
    """Seconds of one update: ``export`` (refilling staging tensors, device included),
    ``serialize`` (the update messages), per receiver rank the stages its reports give
    (``receive``, ``load``, ``synchronize``, summed over buckets), ``device_wait`` (the
    trainer waiting for the engines' last copies on the device after their answers), and
    ``wall`` (the whole update as the trainer sees it, until every rank answered and, with
    ``end_on_device``, its last copies are done). ``clock``: the trainer's side of the
    update's timeline, ``(what, bucket, time.perf_counter())`` for ``start``, each bucket's
    ``staged`` / ``posted`` / ``answered`` and the update's ``done``; laid beside the engines'
    ``UpdateReport.clock`` it shows which side each bucket waited for
    (``bench_e2e.py --timeline``)."""

    export: float = 0.0
    serialize: float = 0.0
    device_wait: float = 0.0
    wall: float = 0.0
    ranks: dict = field(default_factory=dict)
    cache: list = field(default_factory=list)
    reports: list = field(default_factory=list)
    clock: list = field(default_factory=list)

    def stage(self, name: str) -> float:
        """A receiver stage, the slowest rank's."""
        return max((r.get(name, 0.0) for r in self.ranks.values()), default=0.0)


def _on_gpu(engine, device: torch.device) -> bool:
    """Whether ``engine`` (a receiver process: its ``device``) copies on GPU ``device``."""
    where = getattr(engine, "device", None)
    if where is None:
        return False
    where = torch.device(where)

    def index(d: torch.device) -> int:
        return torch.cuda.current_device() if d.index is None else d.index

    return where.type == device.type == "cuda" and index(where) == index(device)


class ColocatedSync:
    """A :class:`ColocatedSender` and one engine process per receiver rank it feeds, in the
    order of its ``receivers``
    (:class:`~pytest_weightsync.reference_impl.engine.process.ReceiverProcess`, configured): payloads
    registered once, then :meth:`update` per training step.

    ``per_update=True``: SGLang's ``update_weights_from_tensor`` protocol instead - nothing is
    registered; every update serializes every bucket for every rank again (each storage shared
    anew, the table pickled once per bucket) and the engine rebuilds, recognises and loads it,
    then drops it."""

    def __init__(self, sender: ColocatedSender, engines: Sequence, *, per_update: bool = False,
                 end_on_device: bool = True, serialize_ahead: bool = True,
                 ranks_in_turn: Optional[bool] = None):
        if len(engines) != len(sender.receivers):
            raise WeightSyncError(f"{len(engines)} engine process(es) for a sender that feeds "
                                  f"{len(sender.receivers)} receiver rank(s) "
                                  f"{list(sender.receivers)}")
        self.sender, self.engines = sender, list(engines)
        self.per_update = bool(per_update)
        self.registrations: list = []
        gpu = sender.device.type == "cuda"
        #: ``ranks_in_turn``: on one GPU, engine rank ``r`` is sent the update's buckets once
        #: rank ``r - 1`` has queued all of its own, and its copies wait on the device for
        #: rank ``r - 1``'s last (an IPC event recorded before that answer): the GPU switches
        #: contexts once per rank and update, not at every time slice while two contexts have
        #: copies queued. Two processes copying halves of 12 GiB at once reach 0.90 of one
        #: plain copy on an H100, one after the other 0.98 (docs/performance.md, "Two
        #: contexts on one GPU"); every row of the whole sync at MoE-TP 2 gained with it
        #: ("The engine ranks in turn by default"). ``None`` (the default): in turn where
        #: every engine rank copies on the sender's GPU; ``True`` also elsewhere (off a GPU
        #: the ranks simply load one after the other), ``False`` never. Only for buckets of
        #: views (a staged bucket's arena is refilled for every rank at once).
        if ranks_in_turn is None:
            ranks_in_turn = gpu and all(_on_gpu(engine, sender.device) for engine in engines)
        self.ranks_in_turn = (bool(ranks_in_turn) and len(self.engines) > 1
                              and not any(b.staged_bytes for b in sender.buckets))
        #: Staged buckets on a GPU are ordered by CUDA IPC events, not host waits (see
        #: :meth:`update`): ("staged", bucket) recorded here, ("copied", bucket, rank) by the
        #: engine rank.
        #: ``end_on_device``: on a GPU the engines answer the last bucket once its copies are
        #: queued, each records an IPC event after them, and the trainer waits for those
        #: events: the update ends when the device has copied, where an engine waiting for
        #: its device and then answering added a wake-up of each process (0.3-0.6 ms per
        #: update on an H100 host, 2026-12-06) to every update.
        self.end_on_device = bool(end_on_device) and gpu
        #: ``serialize_ahead`` (per-update only): every later bucket's bytes are made in one
        #: burst right after the first bucket is posted, instead of each bucket's while the
        #: engines copy the one before. Each share makes torch record a CUDA event in the
        #: trainer's context; made while an engine's copy holds the GPU, those records slowed
        #: the update: at MoE-TP 1 the per-update path went from 0.87 to 0.91 of the copy
        #: limit with it (one H200, 8 layers, docs/performance.md, "Serializing ahead").
        self.serialize_ahead = bool(serialize_ahead) and self.per_update
        self.events = None
        if gpu and (self.end_on_device or self.ranks_in_turn
                    or any(b.staged_bytes for b in sender.buckets)):
            from pytest_weightsync.reference_impl.sharing.ipc_events import EventPool

            self.events = EventPool(sender.device)

    def register(self) -> float:
        """Share every bucket with every rank once; returns the seconds it took (none in the
        per-update protocol: every update shares again)."""
        if self.per_update:
            return 0.0
        t0 = time.perf_counter()
        for index in range(len(self.sender.buckets)):
            self.registrations.append([engine.register(self.sender.serialize(index, rank))
                                       for rank, engine in zip(self.sender.receivers,
                                                               self.engines)])
        return time.perf_counter() - t0

    def update(self, memory: bool = False) -> SyncTiming:
        """One complete update of every rank; raises what a rank raised.

        Buckets are pipelined: bucket ``b + 1`` is staged while the engines load bucket ``b``
        unless it refills the arena ``b`` is read from (then the engines' answers come
        first); a bucket of views is answered once its copies are queued, so bucket ``b + 1``
        is serialized, sent, rebuilt and recognised while the device copies bucket ``b``.

        On a GPU a staged bucket is not waited for on the host either: its refill is queued
        behind the engines' copies of the bucket that last used its arena (their IPC events,
        recorded before they answered), an event recorded after it travels with the bucket,
        and the engines' copies wait for that event on the device and answer once queued.
        Every context then keeps work queued, where a host wait per bucket on each side left
        the device idle between them."""
        if not self.registrations and not self.per_update:
            self.register()
        if self.ranks_in_turn:
            return self._update_in_turn(memory)
        timing = SyncTiming()
        buckets = self.sender.buckets
        last = len(buckets) - 1
        pending = None  # the bucket posted to the engines, answers not yet collected
        ahead: dict = {}  # per later bucket, each rank's bytes (serialize_ahead)
        start = time.perf_counter()
        clock = timing.clock
        clock.append(("start", None, start))
        try:
            for index in range(last + 1):
                staged = bool(buckets[index].staged_bytes)
                if (pending is not None and staged
                        and buckets[pending].arena == buckets[index].arena):
                    self._collect(timing)
                    pending = None
                evented = staged and self.events is not None
                t0 = time.perf_counter()
                if evented:
                    self.sender.stage(index, after=self._readers(index),
                                      signal=self.events.get(("staged", index)))
                else:
                    self.sender.stage(index)
                t1 = time.perf_counter()
                clock.append(("staged", index, t1))
                # SGLang's bytes for every rank are made while the engines still load the
                # previous bucket: the trainer's serialization is off the path between their
                # answer and this bucket's arrival. The first bucket has nothing to hide
                # behind: each rank's bytes are made just before they are sent, so rank 0
                # starts loading while rank 1's are made.
                # stage() waited for every write already (or an event orders them): the
                # shares need no second wait
                datas = ahead.pop(index, None)
                if datas is None and self.per_update and pending is not None:
                    datas = self._messages(index)
                made = time.perf_counter() - t1
                if pending is not None:
                    self._collect(timing)
                t2 = time.perf_counter()
                pending = index
                # A staged bucket without events is waited for before its answer (its arena
                # is refilled later); a bucket of views, or one ordered by events, is not:
                # the engine answers once its copies are queued and copies it while the next
                # bucket is prepared and sent. The update's last bucket is waited for: by the
                # trainer on its engines' events (``end_on_device``), else by the engines.
                sync = staged and not evented
                ends = index == last and self.end_on_device
                wait = self.events.handle(("staged", index)) if evented else None
                for rank, engine in enumerate(self.engines):
                    if self.per_update:  # the bytes SGLang's update_weights_from_tensor gets
                        data = (datas[rank] if datas is not None else
                                self.sender.serialize(index, self.sender.receivers[rank],
                                                      wait=False))
                        registered = ()
                    else:
                        data, registered = None, [self.registrations[index][rank]]
                    signal = (self.events.handle(("copied", index, rank))
                              if evented or ends else None)
                    engine.post_update(data, self.sender.load_format, registered,
                                       begin=index == 0, end=index == last, memory=memory,
                                       sync=(sync or index == last) and not ends,
                                       wait=wait, signal=signal)
                clock.append(("posted", index, time.perf_counter()))
                if index == 0 and self.serialize_ahead:
                    ahead = self._serialize_later()
                timing.export += t1 - t0
                timing.serialize += made + time.perf_counter() - t2
            self._collect(timing)
            pending = None
            self._wait_for_last_copies(timing)
        finally:
            if pending is not None:  # something failed mid-bucket: take every answer still due
                answers.drain(self.engines)
        end = time.perf_counter()
        clock.append(("done", last, end))
        timing.wall = end - start
        return timing

    def _update_in_turn(self, memory: bool) -> SyncTiming:
        """:meth:`update` with the engine ranks in turn (``ranks_in_turn``): every bucket to
        rank 0, pipelined as :meth:`update` pipelines them, then every bucket to rank 1, whose
        first copies wait on the device for rank 0's last, and so on. The timing's reports
        and marks are per (rank, bucket) in that order: rank ``r``'s bucket ``b`` is entry
        ``r * buckets + b``."""
        timing = SyncTiming()
        sender, buckets = self.sender, self.sender.buckets
        last = len(buckets) - 1
        clock = timing.clock
        start = time.perf_counter()
        clock.append(("start", None, start))
        ahead: dict = {}  # (rank position, bucket): that rank's bytes (per-update)
        try:
            for pos, (rank, engine) in enumerate(zip(sender.receivers, self.engines)):
                for index in range(last + 1):
                    slot = pos * (last + 1) + index
                    t0 = time.perf_counter()
                    if pos == 0:  # views: waits for the trainer's writes, once per bucket
                        sender.stage(index)
                    t1 = time.perf_counter()
                    clock.append(("staged", slot, t1))
                    data, registered = None, ()
                    if self.per_update:  # the bytes SGLang's update_weights_from_tensor gets
                        data = ahead.pop((pos, index), None)
                        if data is None:
                            data = sender.serialize(index, rank, wait=False)
                    else:
                        registered = [self.registrations[index][pos]]
                    made = time.perf_counter() - t1
                    if slot:  # this rank's previous bucket, or the last of the rank before
                        self._collect(timing)  # (its event recorded before it answered)
                    t2 = time.perf_counter()
                    wait = signal = None
                    if self.events is not None and index == 0 and pos:
                        wait = self.events.handle(("copied", last, pos - 1))
                    if self.events is not None and index == last:
                        signal = self.events.handle(("copied", last, pos))
                    engine.post_update(data, sender.load_format, registered, begin=index == 0,
                                       end=index == last, memory=memory,
                                       sync=index == last and not self.end_on_device,
                                       wait=wait, signal=signal)
                    clock.append(("posted", slot, time.perf_counter()))
                    if self.serialize_ahead:  # in bursts the device's copies hide
                        ahead.update(self._ahead_in_turn(pos, index))
                    timing.export += t1 - t0
                    timing.serialize += made + time.perf_counter() - t2
            self._collect(timing)
            self._wait_for_last_copies(timing)
        finally:
            answers.drain(self.engines)  # something failed mid-bucket: take every answer due
        end = time.perf_counter()
        clock.append(("done", len(timing.reports) - 1, end))
        timing.wall = end - start
        return timing

    def _wait_for_last_copies(self, timing: SyncTiming) -> None:
        """``end_on_device``: wait for every engine's last copies, on the IPC event each
        recorded after them before it answered its last bucket."""
        if self.end_on_device:
            t0 = time.perf_counter()
            last = len(self.sender.buckets) - 1
            self.events.synchronize(("copied", last, pos) for pos in range(len(self.engines)))
            timing.device_wait = time.perf_counter() - t0

    def _ahead_in_turn(self, pos: int, index: int) -> dict:
        """``serialize_ahead`` with the ranks in turn: rank ``pos``'s later buckets once its
        first is posted (while the engine takes it and the device copies the rank before's
        last), and rank ``pos + 1``'s first bucket once rank ``pos``'s last is posted (while
        it is queued and answered). One burst of every rank's bytes after the first post held
        bucket 1 back by all of them (1.9 ms for compat at MoE-TP 2 on an H100), where only
        rank 0's first bucket's copy - half a layer - stood under it; a burst of every bucket
        of rank ``pos + 1`` after rank ``pos``'s last post stood between that post's answer
        and rank ``pos + 1``'s first copy, under nothing but one bucket's copy."""
        sender, last = self.sender, len(self.sender.buckets) - 1
        rank = sender.receivers[pos]
        made = {}
        if index == 0:
            made.update({(pos, i): sender.serialize(i, rank, wait=False)
                         for i in range(1, last + 1)})
        if index == last and pos + 1 < len(self.engines):
            made[(pos + 1, 0)] = sender.serialize(0, sender.receivers[pos + 1], wait=False)
        return made

    def _messages(self, index: int) -> list:
        """Bucket ``index``'s per-update bytes for every rank, in the engines' order. No
        share waits for the trainer's writes: the receiver's reads are ordered after them by
        the bucket's host wait in :meth:`ColocatedSender.stage` or its ("staged", bucket)
        event, both before the bucket is posted."""
        return [self.sender.serialize(index, rank, wait=False) for rank in self.sender.receivers]

    def _serialize_later(self) -> dict:
        """Every later bucket's bytes for every rank, made at once while the engines take the
        first bucket (``serialize_ahead``)."""
        return {index: self._messages(index) for index in range(1, len(self.sender.buckets))}

    def _readers(self, index: int) -> list:
        """The engines' events of the bucket that last read ``index``'s arena in this update
        (answered already, so recorded): the refill must wait for their copies."""
        buckets = self.sender.buckets
        for earlier in range(index - 1, -1, -1):
            if buckets[earlier].staged_bytes and buckets[earlier].arena == buckets[index].arena:
                return [self.events.get(("copied", earlier, rank))
                        for rank in range(len(self.engines))]
        return []

    def _collect(self, timing: SyncTiming) -> None:
        """Every engine's answer to the posted bucket (all of them, then the first error)."""
        reports = answers.collect(self.engines)
        timing.clock.append(("answered", len(timing.reports), time.perf_counter()))
        timing.reports.append(reports)
        for report in reports:
            stages = timing.ranks.setdefault(report.rank, {})
            for name, seconds in report.seconds.items():
                stages[name] = stages.get(name, 0.0) + seconds
            timing.cache.extend(report.cache)

    def close(self) -> None:
        """Unregister every payload (the engines close their mappings)."""
        for per_rank in self.registrations:
            for engine, registration in zip(self.engines, per_rank):
                engine.unregister(registration)
        self.registrations = []
