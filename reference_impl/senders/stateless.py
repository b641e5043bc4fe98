"""A stateless sender: every update exported, shared and loaded anew, bucket by bucket.

Most clients keep nothing between updates: per update they call an exporter
(:func:`senders.export`), serialize what it returns and hand it to SGLang's
``update_weights_from_tensor``, one bucket after another. Done as one bucket of the whole
model, every piece of host work (export, sharing, the engine's rebuild and recognition)
stands in front of the copy, and the device idles while the host works. Done as a stream of
buckets, bucket ``b + 1`` is exported, serialized and sent while the engines copy bucket
``b``: the engine answers a bucket that is not the update's last as soon as its copies are
queued (``ReceiverProcess.post_update(sync=False)``) and the sender holds that bucket's
tensors until the update ends, so only the first bucket's host work and the last bucket's
copy are not overlapped.

On a GPU no side waits for the other on the host either (``end_on_device``): a bucket whose
export staged tensors (direct at MoE-TP > 1 from a gathered trainer: each rank's
``[gate_r; up_r]``) carries, per rank, an interprocess event recorded right after that
rank's staging copies, which that rank's copies wait for on the device (rank 0 starts while
rank 1's rows are still being staged), and the engines answer the last bucket once its
copies are queued, each recording an event the sender then waits for
(:mod:`~pytest_weightsync.reference_impl.sharing.ipc_events`). Where the sender waited for
its staging copies before sending each bucket, the device ran one context's burst at a time.

Nothing is kept between updates: each bucket's payload is built from the trainer's current
tensors, and the engines recognise a bucket by its signature or table and addresses (the plan
cache, :mod:`~pytest_weightsync.reference_impl.engine.plan_cache`), which a stateless sender's
views of the same trainer memory give every update. :data:`WIRES` are the two ways to send a
bucket: SGLang's per-tensor wire (one IPC share per tensor) and one share per storage
(:func:`~pytest_weightsync.reference_impl.sharing.shared_payload.serialize_storages`, the default:
for a payload of views of a few trainer buffers it shares 2 storages per layer where the
per-tensor wire shares 768 tensors per layer for ``compat``).
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pytest_weightsync.reference_impl.errors import WeightSyncError
from pytest_weightsync.reference_impl.senders import answers, formats as senders

#: Wire name -> what it is; the serializers are imported on first use (torch).
WIRES = {"storages": "one IPC share per storage, the table of entries alongside",
         "tensors": "SGLang's per-tensor wire: one IPC share per tensor"}


def _serializer(wire: str):
    """The wire's serializer of one rank's payload, and whether one built form of a payload
    serializes for every rank (a table made once, a share per rank and message)."""
    if wire == "storages":
        from pytest_weightsync.reference_impl.sharing.shared_payload import SharedPayload

        return SharedPayload, True
    from pytest_weightsync.reference_impl.sharing.ipc import serialize

    return serialize, False


def _staging_pool():
    from pytest_weightsync.reference_impl.senders.zerocopy import StagingPool  # torch

    return StagingPool()


def _wait_for_writes(payloads: list) -> None:
    """Wait until the writes queued on the payloads' GPUs are done (a staging copy, the
    trainer's own step). An engine that still maps a storage from an earlier message (views of
    the same trainer memory, the sender's staging pool) reopens nothing, so torch's per-share
    CUDA event is never waited for there: the per-tensor wire must be ready before it is sent,
    as a per-storage payload is (``SharedPayload.ready``)."""
    from pytest_weightsync.reference_impl.sharing.shared_payload import wait_for_writes

    device_of = operator.attrgetter("device")
    wait_for_writes(itertools.chain.from_iterable(
        map(device_of, map(operator.itemgetter(1), payload)) for payload in payloads))


@dataclass
class StatelessTiming:
    """Seconds of one update: ``export`` and ``serialize`` (the sender, summed over buckets),
    the engines' reports per bucket, ``device_wait`` (for the engines' last copies, after
    their answers) and ``wall`` (until the update is over)."""

    export: float = 0.0
    serialize: float = 0.0
    device_wait: float = 0.0
    wall: float = 0.0
    reports: list = field(default_factory=list)

    def stage(self, name: str) -> float:
        """An engine stage summed over buckets, the slowest rank's."""
        per_rank: dict = {}
        for bucket in self.reports:
            for report in bucket:
                per_rank[report.rank] = per_rank.get(report.rank, 0.0) + report.seconds.get(name, 0.0)
        return max(per_rank.values(), default=0.0)


class StatelessSync:
    """Send ``full`` (the trainer's expert weights, ``{layer: (ExpertWeights, ...)}``) in
    ``fmt`` to ``engines`` (one configured
    :class:`~pytest_weightsync.reference_impl.engine.process.ReceiverProcess` per receiver
    rank) with nothing kept between updates: ``bucket_layers`` layers per bucket, ``wire``
    one of :data:`WIRES`. See the module docstring."""

    def __init__(self, fmt: str, spec, topo, engines: Sequence, *, wire: str = "storages",
                 bucket_layers: int = 1, end_on_device: bool = True):
        senders.check_format(fmt)
        if wire not in WIRES:
            raise WeightSyncError(f"unknown wire {wire!r}; expected one of {sorted(WIRES)}")
        if isinstance(bucket_layers, bool) or not isinstance(bucket_layers, int) or bucket_layers < 1:
            raise WeightSyncError(f"bucket_layers must be an int >= 1, got {bucket_layers!r}")
        if len(engines) != topo.world_size:
            raise WeightSyncError(f"{len(engines)} engine process(es) for a receiver of "
                                  f"{topo.world_size} rank(s)")
        self.fmt, self.spec, self.topo, self.engines = fmt, spec, topo, list(engines)
        self.wire, self.bucket_layers = wire, bucket_layers
        self.load_format = "direct" if fmt == "direct" else None
        #: What must be staged goes to the same memory every update (see StagingPool).
        self._staging = _staging_pool()
        self._serializer, self._built = _serializer(wire)
        self.end_on_device = bool(end_on_device)
        self._events = None  # an EventPool, made at the first update on a GPU

    def buckets(self, layers: Iterable[int]) -> list[list[int]]:
        """``layers`` in order, ``bucket_layers`` at a time: what one update sends."""
        layers = list(layers)
        step = self.bucket_layers
        return [layers[i:i + step] for i in range(0, len(layers), step)]

    def update(self, full, layers: Optional[Iterable[int]] = None) -> StatelessTiming:
        """One complete update of every rank from the trainer's current ``full``; raises what
        a rank raised (after every rank's answer is in)."""
        timing = StatelessTiming()
        groups = self.buckets(sorted(full) if layers is None else layers)
        if not groups:
            raise WeightSyncError("a stateless update needs at least one layer")
        shared = senders.rank_independent(self.fmt)
        ranks = range(len(self.engines))
        events = self._event_pool(full, groups[0][0])
        held = []  # every bucket's payload and bytes, alive until the update's last answer
        start = time.perf_counter()
        self._staging.rewind()  # the last update ended with every engine's copies done
        try:
            for index, group in enumerate(groups):
                t0 = time.perf_counter()
                # Staging copies are queued, not waited for: each rank's copies wait on the
                # device for an event recorded right after that rank's own staging (so rank
                # 0's copies need not wait for rank 1's staging), unless there is no pool.
                if shared:
                    one, wait = self._export(0, full, group, events, ("staged", index))
                    payloads, waits = [one] * len(self.engines), [wait] * len(self.engines)
                else:
                    exported = [self._export(r, full, group, events, ("staged", index, r))
                                for r in ranks]
                    payloads, waits = [p for p, _ in exported], [w for _, w in exported]
                first = next((w for w in waits if w is not None), None)
                if first is not None:
                    # a rank with nothing staged still reads trainer memory the host does not
                    # wait for (wait=False below): any event of this bucket follows those writes
                    waits = [first if w is None else w for w in waits]
                t1 = time.perf_counter()
                data = self._serialized(payloads, shared, wait=first is None)
                t2 = time.perf_counter()
                self._collect(timing)
                last = index == len(groups) - 1
                ends = last and events is not None
                for rank, engine in enumerate(self.engines):
                    signal = events.handle(("copied", rank)) if ends else None
                    engine.post_update(data[rank], self.load_format, begin=index == 0, end=last,
                                       memory=False, sync=last and not ends, wait=waits[rank],
                                       signal=signal)
                held.append((payloads, data))
                timing.export += t1 - t0
                timing.serialize += t2 - t1
            self._collect(timing)
            if events is not None:  # every engine's last copies, recorded before it answered
                t3 = time.perf_counter()
                events.synchronize(("copied", rank) for rank in ranks)
                timing.device_wait = time.perf_counter() - t3
        except BaseException:
            # an engine may still be copying a posted bucket: never stage into its memory again
            self._staging = _staging_pool()
            raise
        finally:
            answers.drain(self.engines)
        timing.wall = time.perf_counter() - start
        return timing

    def _export(self, rank: int, full, group, events, key):
        """Rank ``rank``'s payload of the layers ``group``, and the handle of ``key``'s event
        recorded after the staging copies it queued (``None`` when it staged nothing or there
        are no events)."""
        handed = self._staging.handed
        payload = senders.export(self.fmt, self.spec, self.topo, rank, full, group,
                                 alloc=self._staging)
        if events is None or self._staging.handed == handed:
            return payload, None
        events.get(key).record()
        return payload, events.handle(key)

    def _serialized(self, payloads: list, shared: bool, wait: bool = True) -> list:
        """Each rank's bytes of its payload. Where every rank gets the same payload the
        storages wire builds its table once and serializes it per rank (torch counts its
        shares per message), so a rank-independent format's host work does not grow with
        MoE-TP. ``wait=False``: queued writes are not waited for (an event the engines wait
        for orders them)."""
        if not self._built:
            if wait:
                _wait_for_writes(payloads)
            return [self._serializer(p) for p in payloads]
        if shared:
            built = self._serializer(payloads[0])
            return [built.serialize(wait=wait) for _ in payloads]
        return [self._serializer(p).serialize(wait=wait) for p in payloads]

    def _event_pool(self, full, layer):
        """The sender's interprocess events where the trainer's weights are on a GPU and
        ``end_on_device`` holds, else ``None`` (host waits)."""
        if not self.end_on_device or layer not in full:
            return None
        if self._events is None:
            from pytest_weightsync.reference_impl.model.moe_spec import layer_device

            device = layer_device(full[layer])
            if device.type != "cuda":
                return None
            from pytest_weightsync.reference_impl.sharing.ipc_events import EventPool

            self._events = EventPool(device)
        return self._events

    def _collect(self, timing: StatelessTiming) -> None:
        reports = answers.collect(self.engines)
        if reports:
            timing.reports.append(reports)
