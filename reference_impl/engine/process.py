"""One receiver rank in its own spawned process, driven over a pipe like an engine.

The trainer side of a test talks to :class:`ReceiverProcess` as a trainer talks to an SGLang
engine: a serialized payload (:mod:`pytest_weightsync.reference_impl.sharing.ipc`) per
update, or payloads registered once (:mod:`~pytest_weightsync.reference_impl.sharing.shared_payload`)
and loaded by a message of a few bytes. The process holds a
:class:`~pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` and answers each
update with what it saw (:class:`UpdateReport`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch

from pytest_weightsync.reference_impl.model.layout import MoESpec, ReceiverTopology, WeightSyncError
from pytest_weightsync.reference_impl.sharing.ipc import (
    MemoryStats,
    deserialize,
    memory_stats,
    payload_bytes,
    serialize,
)


class ReceiverProcessError(WeightSyncError):
    """The receiver process refused a request, died, or did not answer in time."""


@dataclass(frozen=True)
class UpdateReport:
    """What the receiver saw in one update: entries and bytes received, the address of every
    parameter after loading, and its memory afterwards (rebuilt tensors already dropped;
    ``None`` when not asked for). ``seconds``: host time of each stage in the receiver -
    ``receive`` (deserializing, or finding registered payloads), ``load`` (begin / load / end:
    validation or a plan-cache hit, and queuing the copies), ``synchronize`` (waiting for the
    device to finish them and every earlier bucket's; nothing for a bucket sent with
    ``sync=False``, whose ``memory`` is ``None`` too). ``cache``: what the plan cache did per
    bucket (``hit``, ``miss``, ``replan``), empty without one. ``clock``: when the stages
    began and the answer was ready - ``(taken, rebuilt, queued, done)`` on ``time.perf_counter``,
    the machine's monotonic clock that every process reads alike on Linux - so a bucket's
    timeline can be laid beside the trainer's (``SyncTiming.clock``)."""

    rank: int
    entries: int
    nbytes: int
    param_ptrs: tuple
    memory: Optional[MemoryStats]
    seconds: dict = field(default_factory=dict)
    cache: tuple = ()
    clock: tuple = ()


@dataclass(frozen=True)
class Registration:
    """A payload a receiver keeps (mappings open) to load in later updates by ``id``."""

    id: int
    entries: int
    nbytes: int
    storages: int


class ReceiverProcess:
    """A :class:`pytest_weightsync.reference_impl.engine.receiver.ReferenceReceiver` rank living in a spawned process.

    ``configure`` (re)creates the receiver's parameters for a model and topology; ``update``
    hands it serialized payload bytes; ``params`` reads its parameters back (CUDA: IPC views
    of the live parameters, to be dropped before the next update; CPU: copies). With
    ``keep_payloads`` the receiver never drops what it rebuilt - a deliberately leaking
    receiver, to prove that the leak checks can fail.
    """

    def __init__(self, device="cpu", *, timeout: float = 300.0, start_timeout: float = 300.0,
                 poll_s: float = 0.0):
        self.device = str(torch.device(device))
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        if not poll_s >= 0:  # also refuses NaN
            raise ReceiverProcessError(f"poll_s must be >= 0 seconds, got {poll_s!r}")
        #: Seconds each side polls its pipe before it blocks: the engine after each answer for
        #: the next request, the trainer side for an answer. A blocked process is woken by the
        #: kernel when a message arrives, 0.05-0.3 ms later (more under a sandboxed kernel),
        #: and an update waits for that at its first bucket (and at its last answer, unless
        #: it ends on the device); SGLang's scheduler polls its request socket without
        #: sleeping by default (its ``--sleep-on-idle`` turns that off). ``math.inf``: the
        #: engine never blocks. Polling burns a core per process: the suites leave it off.
        self.poll_s = float(poll_s)
        self._process = None
        self._conn = None
        self._pending = None

    def __enter__(self) -> "ReceiverProcess":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Spawn the process (non-blocking; the first request waits until it is ready)."""
        if self._process is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_receiver_main, args=(child, self.device, self.poll_s),
                                    name=f"weightsync-receiver-{self.device}", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        self._ready = False
        self._pending = None

    def close(self) -> None:
        """Stop the process, by force if it does not stop within a few seconds."""
        if self._process is None:
            return
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()
        self._process.close()
        self._process, self._conn, self._pending = None, None, None

    def configure(self, spec: MoESpec, topo: ReceiverTopology, rank: int, *,
                  keep_payloads: bool = False, poison: bool = True,
                  plan_cache: bool = True) -> dict:
        """Fresh receiver parameters for ``(spec, topo, rank)``; returns ``{name: data_ptr}``.
        ``plan_cache``: buckets that come again at the same addresses replay their validated
        plan (:mod:`pytest_weightsync.reference_impl.engine.plan_cache`)."""
        return self._request(("configure", spec, topo, rank, keep_payloads, poison, plan_cache))

    def update(self, data: bytes, load_format: Optional[str] = None) -> UpdateReport:
        """One complete update from one serialized payload (one ``load`` call)."""
        self.post_update(data, load_format)
        return self.result()

    def register(self, data: bytes) -> Registration:
        """Keep a serialized payload (mappings open) for :meth:`update_registered`: a payload
        shared once per model (:class:`~pytest_weightsync.reference_impl.sharing.shared_payload.SharedPayload`)
        is then updated with a message of a few bytes."""
        return self._request(("register", data))

    def unregister(self, registration) -> None:
        self._request(("unregister", getattr(registration, "id", registration)))

    def update_registered(self, registrations, load_format: Optional[str] = None, *,
                          begin: bool = True, end: bool = True,
                          memory: bool = True) -> UpdateReport:
        """Load registered payloads (one bucket each, in order) as one update, or with
        ``begin`` / ``end`` False as part of a longer one (a bucket stream)."""
        self.post_update(None, load_format, registrations, begin=begin, end=end, memory=memory)
        return self.result()

    def post_update(self, data: Optional[bytes], load_format: Optional[str] = None,
                    registrations=(), *, begin: bool = True, end: bool = True,
                    memory: bool = True, sync: bool = True, wait: Optional[bytes] = None,
                    signal: Optional[bytes] = None) -> None:
        """Send an update without waiting (so several receiver ranks load at once); collect
        its :class:`UpdateReport` with :meth:`result`. ``data`` (a serialized payload) is
        loaded first, then each registered payload.

        ``sync=False`` (a bucket that is not the last of its update, whose sources the sender
        leaves alone until the update ends): the engine answers as soon as the copies are
        queued, keeping what it rebuilt alive until it next waits for the device - at the
        update's end, at a bucket sent with ``sync=True``, or on an error - so the sender
        prepares the next bucket while this one is copied. A bucket with ``end`` is waited
        for, unless it comes with a ``signal`` and without ``memory``: the engine then answers
        once its copies are queued (as SGLang's ``update_weights_from_tensor`` does) and the
        trainer waits on the device for ``signal`` - the update is over when the copies are,
        not a wake-up of each process later. What it rebuilt is dropped at the next update
        whose copies it sees done, or at the next wait.

        ``wait`` / ``signal`` (CUDA IPC event handles, :mod:`~pytest_weightsync.reference_impl.sharing.ipc_events`):
        the engine's copies wait on the device for the trainer's record of ``wait`` (a staging
        copy the host did not wait for), and ``signal`` is recorded after them, so the trainer
        can refill what they read once its stream has waited for it - neither side blocks."""
        ids = tuple(getattr(r, "id", r) for r in registrations)
        self._post(("update", data, load_format, ids, begin, end, memory, sync, wait, signal))

    @property
    def pending(self) -> bool:
        """Whether a posted request still awaits :meth:`result`."""
        return self._pending is not None

    def result(self):
        """The answer to the request :meth:`post_update` sent."""
        if self._pending is None:
            raise ReceiverProcessError(f"receiver process ({self.device}): no request is pending")
        what, self._pending = self._pending, None
        return self._await(self.timeout, what)

    def reset(self, plan_cache: Optional[bool] = None) -> None:
        """Drop every registered payload and every cached plan (parameters stay); with
        ``plan_cache`` True / False, switch the plan cache on / off."""
        self._request(("reset", plan_cache))

    def check(self, version: int, seed: int = 0, xor: int = 0) -> Optional[str]:
        """Bit check of every parameter against the synthetic oracle in the receiver
        (:func:`pytest_weightsync.reference_impl.oracle.oracle_check.first_mismatch`): ``None``, or
        the first wrong element."""
        return self._request(("check", version, seed, xor))

    def params(self) -> dict:
        """The receiver's parameters as tensors readable here (see the class docstring)."""
        reply = self._request(("params",))
        return dict(deserialize(reply) if isinstance(reply, bytes) else reply)

    def memory(self) -> MemoryStats:
        return self._request(("memory",))

    def digest(self) -> tuple[int, int]:
        """:func:`bits_digest` of every parameter: a cheap exact check after each update (the
        sum over ranks equals the trainer's digest of the same elements when no element is
        padding or sent twice); :meth:`check` places a wrong element."""
        return self._request(("digest",))

    def _request(self, message):
        self._post(message)
        return self.result()

    def _post(self, message) -> None:
        if self._process is None:
            self.start()
        if self._pending is not None:
            raise ReceiverProcessError(f"receiver process ({self.device}): {self._pending!r} "
                                       f"is still pending; collect it with result() first")
        if not self._ready:
            self._await(self.start_timeout, "start")
            self._ready = True
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise self._fail(f"cannot send {message[0]!r}: {exc}") from exc
        self._pending = message[0]

    def _await(self, timeout: float, what: str):
        if self.poll_s:  # the time polled counts against the timeout
            t0 = time.perf_counter()
            _poll(self._conn, min(self.poll_s, timeout))
            timeout = max(0.0, timeout - (time.perf_counter() - t0))
        ready = multiprocessing.connection.wait([self._conn, self._process.sentinel], timeout)
        if self._conn in ready or self._conn.poll():
            try:
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise self._fail(f"lost the connection during {what!r}: {exc}") from exc
            if reply[0] == "error":
                raise ReceiverProcessError(f"receiver process ({self.device}) failed in "
                                           f"{what!r}: {reply[1]}\n{reply[2]}")
            return reply[1]
        if not ready:
            raise self._fail(f"no answer to {what!r} within {timeout:g} s")
        self._process.join(timeout=5)
        raise self._fail(f"died during {what!r} (exit code {self._process.exitcode})")

    def _fail(self, why: str) -> ReceiverProcessError:
        error = ReceiverProcessError(f"receiver process ({self.device}, pid {self.pid}) {why}")
        self.close()
        return error


#: Elements per step of :func:`bits_digest` (a 32-bit temporary of this many elements).
DIGEST_CHUNK = 1 << 25


def bits_digest(tensors) -> tuple[int, int]:
    """``(sum of x, sum of x * x)`` over every element of ``tensors``, ``x`` its bits as
    signed 16-bit integers (bytes for 1-byte types): exact, independent of element order and
    placement, so the engine ranks' digests add up to the trainer's for the same elements. An
    element an update missed holds another version's bits and changes both sums (a check
    that an update landed everywhere, not a proof: :meth:`ReceiverProcess.check` compares
    every element with the oracle)."""
    total, squares = 0, 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        # 16-bit pieces (bytes for 1-byte types): squares stay far below 2^63 in the sums
        width = torch.int8 if tensor.element_size() == 1 else torch.int16
        flat = tensor.detach().reshape(-1).view(width)
        s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
        s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
        for start in range(0, flat.numel(), DIGEST_CHUNK):
            x = flat[start:start + DIGEST_CHUNK].to(torch.int32)
            s1 += x.sum(dtype=torch.int64)
            s2 += x.mul_(x).sum(dtype=torch.int64)  # squares of 16-bit values fit 31 bits
        total += int(s1)
        squares += int(s2)
    return total, squares


def _poll(conn, seconds: float) -> bool:
    """Whether a message (or the end of the pipe) arrived within ``seconds``, polled without
    sleeping (see ``ReceiverProcess.poll_s``)."""
    deadline = time.perf_counter() + seconds
    while not conn.poll():
        if time.perf_counter() > deadline:
            return False
    return True


def _receiver_main(conn, device: str, poll_s: float = 0.0) -> None:
    """Serve requests until told to stop; every reply is ``("ok", value)`` or ``("error", ...)``.
    ``poll_s``: seconds to poll for the next request before blocking on the pipe."""
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    state = {"receiver": None, "keep": False, "kept": [], "registered": {}, "next_id": 0,
             "inflight": [], "inflight_done": None, "events": None}
    if dev.type == "cuda":
        from pytest_weightsync.reference_impl.sharing.ipc_events import OpenedEvents

        state["events"] = OpenedEvents(dev)
    conn.send(("ok", os.getpid()))
    while True:
        if poll_s:
            _poll(conn, poll_s)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            _settle(state, dev)
            return
        try:
            reply = ("ok", _serve(state, dev, message))
        except BaseException as exc:  # reported to the trainer side, which raises it
            reply = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
            try:
                _settle(state, dev)  # no copy of an earlier bucket outlives the answer
            except BaseException:
                pass
        conn.send(reply)


def _settle(state: dict, device: torch.device) -> None:
    """Wait for every queued copy, then drop the payloads they read (closing mappings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    state["inflight"].clear()
    state["inflight_done"] = None


def _on_device(rebuilt, device: torch.device):
    """A rebuilt payload as the receiver loads it: a shared payload as it is when its storages
    are on the receiver's device (its tensors are made lazily), else each tensor moved there
    (a no-op on the same device, as in SGLang's ``_unwrap_tensor``)."""
    from pytest_weightsync.reference_impl.sharing.shared_payload import ReceivedPayload

    if isinstance(rebuilt, ReceivedPayload) and rebuilt.devices <= {device}:
        return rebuilt
    return [(name, tensor.to(device)) for name, tensor in rebuilt]


def _size(payload) -> tuple[int, int]:
    entries = getattr(payload, "entries", None)
    if entries is not None:
        return entries, payload.nbytes
    return len(payload), payload_bytes(payload)


def _serve(state: dict, device: torch.device, message):
    from pytest_weightsync.reference_impl.oracle import synth
    from pytest_weightsync.reference_impl.engine.receiver import ReferenceReceiver

    kind = message[0]
    if kind != "update" and state["inflight"]:
        _settle(state, device)  # nothing else runs beside copies still in flight
    if kind in ("configure", "reset") and state["events"] is not None:
        state["events"].clear()  # a new sender's events come with new handles
    if kind == "configure":
        _, spec, topo, rank, keep, poison, *rest = message
        plan_cache = rest[0] if rest else True
        state["kept"].clear()
        state["registered"].clear()
        state["receiver"] = None
        if device.type == "cuda":  # the old parameters' memory back to the device first
            torch.cuda.empty_cache()
        receiver = ReferenceReceiver(spec, topo, rank, device, plan_cache=plan_cache)
        if poison:
            for tensor in receiver.params.values():
                synth.poison_(tensor)
        state["receiver"], state["keep"] = receiver, keep
        return {name: t.data_ptr() for name, t in receiver.params.items()}
    receiver = state["receiver"]
    if kind == "memory":
        return memory_stats(device)
    if kind == "digest" and receiver is not None:
        return bits_digest(receiver.params.values())
    if receiver is None:
        raise ReceiverProcessError(f"{kind!r} before 'configure'")
    if kind == "register":
        payload = _on_device(deserialize(message[1]), device)
        entries, nbytes = _size(payload)
        rid = state["next_id"] = state["next_id"] + 1
        state["registered"][rid] = payload
        return Registration(rid, entries, nbytes, len(getattr(payload, "wholes", ())))
    if kind == "unregister":
        if state["registered"].pop(message[1], None) is None:
            raise ReceiverProcessError(f"no registered payload {message[1]!r}")
        return None
    if kind == "reset":
        from pytest_weightsync.reference_impl.engine.plan_cache import LoadCache

        state["registered"].clear()
        state["kept"].clear()
        if receiver.plan_cache is not None:
            receiver.plan_cache.clear()
        if len(message) > 1 and message[1] is not None:
            receiver.plan_cache = LoadCache() if message[1] else None
        return None
    if kind == "check":
        from pytest_weightsync.reference_impl.oracle.oracle_check import first_mismatch

        _, version, seed, xor = message
        return first_mismatch(receiver.params, receiver.spec, receiver.topo, receiver.rank,
                              version, seed, xor)
    if kind == "update":
        _, data, load_format, *rest = message
        ids, begin, end, memory, *more = rest if rest else ((), True, True, True)
        wait, signal = (more[1], more[2]) if len(more) > 2 else (None, None)
        # The last bucket is waited for, unless the trainer waits on the device for the
        # ``signal`` recorded after its copies (and wants no memory figures, taken after them).
        sync = ((more[0] if more else True) or device.type != "cuda"
                or (end and (signal is None or memory)))
        events = state["events"]
        if events is None and (wait is not None or signal is not None):
            raise ReceiverProcessError("CUDA IPC events sent to a receiver that is not on a GPU")
        t0 = time.perf_counter()
        done = state["inflight_done"]
        if begin and done is not None and done.query():  # the last update's copies are done
            state["inflight"].clear()
            state["inflight_done"] = None
        payloads, rebuilt = [], None
        if data is not None:
            rebuilt = deserialize(data)
            payloads.append(_on_device(rebuilt, device))
        for rid in ids:
            if rid not in state["registered"]:
                raise ReceiverProcessError(f"no registered payload {rid!r}")
            payloads.append(state["registered"][rid])
        t1 = time.perf_counter()
        cache = []
        if events is not None:
            events.wait(wait)  # the trainer's staging of these sources, on the device
        if begin:
            receiver.begin_update()
        for payload in payloads:
            receiver.load(payload, load_format=load_format)
            if receiver.plan_cache is not None:
                cache.append(receiver.plan_cache.stats.last)
        if events is not None:
            events.record(signal)  # recorded before the answer: the trainer waits after it
        if end:
            receiver.end_update()
        t2 = time.perf_counter()
        sizes = [_size(p) for p in payloads]
        if state["keep"] and rebuilt is not None:
            state["kept"].append(rebuilt)
        if sync:
            _settle(state, device)  # every copy done before the mappings close
        else:
            if rebuilt is not None:  # read by queued copies: closed at the next wait
                state["inflight"].append(rebuilt)
            if end and state["inflight"]:  # an update that ended on the device alone
                state["inflight_done"] = torch.cuda.Event()
                state["inflight_done"].record()
        t3 = time.perf_counter()
        del payloads, rebuilt
        return UpdateReport(receiver.rank, sum(e for e, _ in sizes), sum(b for _, b in sizes),
                            tuple((n, t.data_ptr()) for n, t in receiver.params.items()),
                            memory_stats(device) if memory and sync else None,
                            {"receive": t1 - t0, "load": t2 - t1, "synchronize": t3 - t2},
                            tuple(cache), (t0, t1, t2, t3))
    if kind == "params":
        if device.type == "cuda":
            return serialize(list(receiver.params.items()))
        # Sharing CPU parameters would move them into shared memory (new addresses): send
        # copies, which the pipe's pickler shares instead.
        return [(name, tensor.clone()) for name, tensor in receiver.params.items()]
    raise ReceiverProcessError(f"unknown request {kind!r}")
